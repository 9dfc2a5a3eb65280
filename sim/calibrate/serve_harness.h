// What calibration (sim/calibrate/) and validation (sim/validate/) share:
// running the calling binary's own `bench ...` commands as child processes,
// launching the single-host topologies they measure, and fitting a low-load
// run into a profile's serving-path terms.
//
// The calling process must be the `kvrelay` binary (/proc/self/exe is what
// RunSelf, StartBusy and ServeRuns start). Layering: sim/calibrate may depend
// on engine, kv_transfer, kv_store, coordinator and deploy; nothing below it
// depends on it.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "deploy/local_launcher.h"
#include "sim/profile.h"

namespace kvrelay::sim::calibrate {

using nlohmann::json;

std::string UtcNow();    // "2026-12-02T01:30:00Z"
std::string CpuModel();  // /proc/cpuinfo's model name
// The cores this process may run on (its affinity mask: taskset, cgroup
// cpusets), which the launched cluster inherits.
int UsableCores();
// "load average 0.52 (2 cores)": printed by calibrate and validate at their
// start and end, because their figures mean little on a busy machine.
std::string LoadLine();

// Runs this binary with `args`, stdout to a string (stderr passes through),
// killed at the deadline; *cpu_s (when given) receives the CPU seconds it
// used. Error unless it exits 0 (or, with allow_failure, unless it was
// killed: bench serve exits 1 when some requests failed and still writes its
// report).
Result<std::string> RunSelf(const std::vector<std::string>& args, int timeout_s,
                            bool allow_failure = false, double* cpu_s = nullptr);
Result<json> ReadJson(const std::string& path);
std::string TempPath(const std::string& name);  // per process, under the temp dir

// One low-load serving measurement: requests one at a time (closed loop).
struct ServePoint {
  double ttft_s = 0, tpot_s = 0;
};

struct Topology {
  std::string name;
  int colocated = 0, prefill = 0, decode = 0, tp = 1;
};
// colocated x N, 1P+1D, 1P+1D TP2: the single-host topologies measured.
const std::vector<Topology>& Topologies(int colocated);

// The serving-path terms one topology's low-load run fixes (sim::
// FitServingTerms); `refit_prefill` for a TP topology re-timed on its own.
void FitServingTerms(const Topology& t, const ServePoint& low, double prefill_s, double decode_s,
                     bool refit_prefill, sim::Profile* p);
// The request-to-request variation of a low-load run (ServingOverhead::
// ttft_jitter / tpot_jitter): its requests' TTFT and TPOT over their medians,
// into the colocated role, or the prefill (TTFT) and decode (TPOT) roles.
void FitJitter(const Topology& t, const json& low_report, sim::Profile* p);

// One request of a bench serve report: its TPOT in ms as bench serve computes
// it, (e2e - TTFT) / (output tokens - 1); 0 for one token.
double RequestTpotMs(const json& q);
// The step model's prefill pass of one `in`-token prompt and its decode step
// at the mean context of an `out`-token answer (what FitServingTerms fits
// the low-load runs against).
std::pair<double, double> LowLoadModel(const sim::Profile& p, int64_t in, int64_t out);

// One bench serve run on a launched topology, with the CPU each process
// spent during it (per process, and summed per kind of process).
struct ServeRun {
  json report;
  std::vector<std::pair<std::string, double>> cpu_per_process;
  std::map<std::string, double> cpu_s;
  double client_cpu_s = 0;  // the bench serve process itself (getrusage)
  double wall_s = 0;        // of the bench serve process
};

// A process of this binary that keeps a core busy during one of the runs.
struct Background {
  size_t run = SIZE_MAX;          // index into serve_args; SIZE_MAX = none
  std::vector<std::string> args;  // "{url}" stands for the cluster's URL
  // When set: the foreground starts once this process of the cluster (its
  // short name, e.g. "kvrelay-decode") has computed 0.3 s more than when the
  // background started (a load generator computes little itself).
  std::string busy_process;
};

// Starts `args` in the background and waits until it computes (0.5 s of CPU).
Result<pid_t> StartBusy(const std::vector<std::string>& args);
void StopBusy(pid_t pid);

// Starts `t`, warms it up, runs `bench serve` with `serve_args` once per
// entry (with the entry's Background, if any, running beside it), stops it.
// With idle_cpu_per_s, the cluster's CPU per second while it serves nothing
// (heartbeats, polling) is measured first, over idle_probe_s, per kind of
// process.
Result<std::vector<ServeRun>> ServeRuns(const Topology& t, const std::string& model, int threads,
                                        const std::string& kv_dtype, int64_t input_len,
                                        const std::vector<std::vector<std::string>>& serve_args,
                                        const std::vector<Background>& backgrounds = {},
                                        std::map<std::string, double>* idle_cpu_per_s = nullptr,
                                        double idle_probe_s = 3);

}  // namespace kvrelay::sim::calibrate
