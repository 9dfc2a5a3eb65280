// kvrelay sim calibrate's probes: each measures one part of this machine into
// a simulator profile (sim/profile.h) by running the kvrelay binary's own
// `bench engine`, `bench transfer`, `bench prefix` and `bench serve` as child
// processes (the measurements are theirs, not re-implemented here) and
// fitting their --json reports or printed tables. Each probe prints its
// progress and fit tables to ProbeOptions::log as it goes (minutes each).
//
// The calling process must be the kvrelay binary (serve_harness.h).
// Layering: sim/calibrate depends on engine (the model's KV layout), deploy
// (the launched topologies) and the simulator core (the fits that simulate).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "sim/busy_fit.h"
#include "sim/calibrate/serve_harness.h"
#include "sim/profile.h"

namespace kvrelay::sim::calibrate {

// What every probe needs.
struct ProbeOptions {
  std::string model;  // GGUF path
  int threads = 1;    // per engine / worker
  int reps = 3;       // bench engine --reps
  std::string kv_dtype = "f16";
  bool quick = false;                        // fewer and shorter runs
  int64_t input_len = 128, output_len = 32;  // the serving probes' requests
  int colocated = 2;                         // workers of the colocated topology
  int rounds = 4;                            // the serving probes' rounds, in [1, 16]
  std::string date;                          // UtcNow(), for the source lines
  std::string hardware;                      // "CPU model, N cores"
  std::FILE* log = stdout;                   // progress; not null
};

// The profile's shape from the model (layers, KV bytes per token, a pool of
// kv_capacity_mb), with opt's hardware, model file name and date.
Result<Profile> BaseProfile(const ProbeOptions& opt, int64_t kv_capacity_mb);

// 1. Engine steps: bench engine's prefill (tokens x cached context) and
// decode (batch x context) runs, fitted into the step model and the
// decode-only step by batch size.
Result<StepCost> RunEngineSweep(const ProbeOptions& opt);

// 1b. Two engine processes at once (each with a core of its own): how much a
// step slows down while another process computes next to it. Needs 2 cores.
Result<HostContention> RunContentionProbe(const ProbeOptions& opt);

// 2. KV transfer over the cluster's transport (tcp): bytes -> seconds.
Result<LinkCost> RunTransferProbe(const ProbeOptions& opt);

// 3. Prefix store: RocksDB restore bytes -> seconds (after a restart, cold
// page cache).
Result<LinkCost> RunStoreRestoreProbe(const ProbeOptions& opt, int64_t kv_bytes_per_token);

// 4. The serving path around the engine, from low-load bench serve runs (one
// request at a time) on each real topology and the slowdown probes beside
// them (TP sharing, the roles' busy probes, the pairs, the short prompts of
// ttft_s): what the step model does not explain.
struct ServingFigures {
  double prefill_s = 0, decode_s = 0;  // the step model's (LowLoadModel)
  std::vector<ServePoint> pts;         // per topology: the low-load p50s
  std::vector<double> decode_cores;    // per topology: decode CPU / decode wall
  double tp_busy_slowdown = 0;         // TP 2 TPOT next to the busy prefill worker / alone
  double tp_engine_slowdown = 0;       // TP 2 TPOT next to a bench engine prefill / alone
  double tp_prefill_slowdown =
      0;                      // 1P+1D TP2: the pairs probe's (queued prefill next to the group)
  double short_ttft_s = 0;    // 1P+1D: the median TTFT of short prompts, alone
  double ttft_outside_s = 0;  // 1P+1D: what of an alone TTFT does not hold the prefill worker
  std::pair<double, double> role_slowdown{0, 0};  // 1P+1D: prefill TTFT, decode TPOT
  BusyProbe pre_probe, dec_probe;                 // the roles' probes, as run
};
// Needs profile's step model; sets its roles' busy_source and the colocated
// and 1P+1D topologies' request-to-request variation (FitJitter).
Result<ServingFigures> RunServingPathProbes(const ProbeOptions& opt, Profile* profile);

// Profile assembly, part 1: the colocated, prefill and decode serving terms
// from the low-load runs, and the TP 2 group's sharing fit (returned for
// part 2).
TpSharing FitServingPathTerms(const ProbeOptions& opt, const ServingFigures& fig, Profile* profile);

// 4b. The serving path's own CPU: the coordinator's and the bench serve
// client's, per request and per output token.
Result<ServingCpu> RunServingCpuProbe(const ProbeOptions& opt);

// Profile assembly, part 2: the TP 2 group's terms, and the roles'
// busy_alpha fitted by simulating their probes now that every other term is
// known.
Status FitTpAndRoleTerms(const ProbeOptions& opt, const ServingFigures& fig,
                         const TpSharing& sharing, Profile* profile);

}  // namespace kvrelay::sim::calibrate
