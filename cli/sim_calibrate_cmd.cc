// kvrelay sim calibrate --model M --out P: measures this machine into a simulator
// profile (sim/profile.h) by running this binary's own `bench engine`,
// `bench transfer`, `bench prefix` and `bench serve` as child processes (the
// measurements are theirs, not re-implemented here) and reading their --json
// reports or their printed tables. The probes are sim/calibrate/'s; this
// file parses the flags, calls them in order and prints.

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "cli/command.h"
#include "common/flags.h"
#include "sim/calibrate/probes.h"
#include "sim/calibrate/serve_harness.h"
#include "sim/profile.h"

namespace kvrelay::cli {
namespace {

namespace fs = std::filesystem;
using namespace sim::calibrate;  // NOLINT(build/namespaces): the command's library

int Fail(const Status& s) {
  std::fprintf(stderr, "sim calibrate: %s\n", s.ToString().c_str());
  return 1;
}

// 4. The serving path (low-load runs and slowdown probes on each topology),
// its own CPU, and the profile's serving terms from them.
Status CalibrateServingPath(const ProbeOptions& opt, sim::Profile* p) {
  ASSIGN_OR_RETURN(const ServingFigures fig, RunServingPathProbes(opt, p));
  const sim::TpSharing sharing = FitServingPathTerms(opt, fig, p);
  ASSIGN_OR_RETURN(p->serving_cpu, RunServingCpuProbe(opt));
  return FitTpAndRoleTerms(opt, fig, sharing, p);
}

constexpr char kSimCalibrateUsage[] =
    "sim calibrate --model M [--out sim-profile.json] [--threads 1] [--kv-dtype f16] "
    "[--probe-rounds 4] [--quick] [--skip-serve] [--skip-store] [--skip-contention]";

int RunCalibrate(const std::vector<std::string>& args) {
  if (PrintHelpIfAsked(args, kSimCalibrateUsage)) return 0;
  auto f = Flags::Parse(args,
                        {"model", "out", "threads", "kv-dtype", "kv-capacity-mb", "reps",
                         "input-len", "output-len", "colocated", "name", "probe-rounds"},
                        {"quick", "skip-serve", "skip-store", "skip-contention", "help"});
  if (!f.ok()) {
    std::fprintf(stderr, "sim calibrate: %s\n", f.status().message().c_str());
    return 2;
  }
  auto threads = f->GetInt("threads", 1);
  auto reps = f->GetInt("reps", f->Has("quick") ? 2 : 3);
  auto cap_mb = f->GetInt("kv-capacity-mb", 256);
  auto input_len = f->GetInt("input-len", 128);
  auto output_len = f->GetInt("output-len", 32);
  auto colocated = f->GetInt("colocated", 2);
  // The serving probes' rounds (each busy run between two alone runs; the
  // pairs trace): one calibration's figures moved by +-10 % from the next
  // with 2 rounds on a 2-vCPU VM (docs/BENCHMARKS.md, validation round 11).
  auto probe_rounds = f->GetInt("probe-rounds", f->Has("quick") ? 2 : 4);
  for (const Status& s : {threads.status(), reps.status(), cap_mb.status(), input_len.status(),
                          output_len.status(), colocated.status(), probe_rounds.status()}) {
    if (!s.ok()) {
      std::fprintf(stderr, "sim calibrate: %s\n", s.ToString().c_str());
      return 2;
    }
  }
  if (*probe_rounds < 1 || *probe_rounds > 16) {
    std::fprintf(stderr, "sim calibrate: --probe-rounds is in [1, 16]\n");
    return 2;
  }
  ProbeOptions opt;
  opt.model = f->Get("model", "models/SmolLM2-135M-Instruct.Q4_1.gguf");
  opt.kv_dtype = f->Get("kv-dtype", "f16");
  opt.threads = static_cast<int>(*threads);
  opt.reps = static_cast<int>(*reps);
  opt.quick = f->Has("quick");
  opt.input_len = *input_len;
  opt.output_len = *output_len;
  opt.colocated = static_cast<int>(*colocated);
  opt.rounds = static_cast<int>(*probe_rounds);
  opt.hardware = CpuModel() + ", " + std::to_string(UsableCores()) + " cores";
  opt.date = UtcNow();
  const std::string out_path = f->Get("out", "sim-profile.json");
  auto base = BaseProfile(opt, *cap_mb);
  if (!base.ok()) return Fail(base.status());
  sim::Profile& p = *base;
  p.name = f->Get("name", "calibrated");
  std::printf("calibrating at %s, %s\n", opt.date.c_str(), LoadLine().c_str());
  auto step = RunEngineSweep(opt);
  if (!step.ok()) return Fail(step.status());
  p.step = std::move(*step);
  p.contention = {0, 0, "not measured (--skip-contention or fewer than 2 cores): none"};
  if (UsableCores() >= 2 && !f->Has("skip-contention")) {
    auto c = RunContentionProbe(opt);
    if (!c.ok()) return Fail(c.status());
    p.contention = std::move(*c);
  }
  auto tcp = RunTransferProbe(opt);
  if (!tcp.ok()) return Fail(tcp.status());
  p.transports["tcp"] = std::move(*tcp);
  p.store_restore = {0, 1e9, "not measured (--skip-store): placeholder, do not use"};
  if (!f->Has("skip-store")) {
    auto store = RunStoreRestoreProbe(opt, p.kv_bytes_per_token);
    if (!store.ok()) return Fail(store.status());
    p.store_restore = std::move(*store);
  }
  p.colocated.source = p.prefill.source = p.decode.source = "not measured (--skip-serve)";
  p.serving_cpu.source = "not measured (--skip-serve): none";
  if (!f->Has("skip-serve")) {
    if (Status s = CalibrateServingPath(opt, &p); !s.ok()) return Fail(s);
  } else {
    p.tp[2].source = "not measured (--skip-serve): placeholder";
  }
  fs::remove(TempPath("pairs.csv"));
  if (Status s = sim::SaveProfile(out_path, p); !s.ok()) return Fail(s);
  std::printf("wrote %s (%s at the end)\n", out_path.c_str(), LoadLine().c_str());
  return 0;
}

}  // namespace

KVRELAY_COMMAND(sim_calibrate, "sim calibrate", kSimCalibrateUsage, RunCalibrate);

}  // namespace kvrelay::cli
