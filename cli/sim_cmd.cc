// kvrelay sim: the cluster simulator (sim/cluster_sim.h) from the command line.
//   kvrelay sim --profile P [workload] [topology]      simulate and report like bench serve
// (calibrate and validate: sim_calibrate_cmd.cc, sim_validate_cmd.cc).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/command.h"
#include "common/clock.h"
#include "common/flags.h"
#include "sim/cluster_sim.h"
#include "sim/profile.h"
#include "sim/workload.h"

namespace kvrelay::cli {
namespace {

using nlohmann::json;

Result<sim::ClusterConfig> ParseTopology(const Flags& f) {
  sim::ClusterConfig c;
  ASSIGN_OR_RETURN(int64_t colocated, f.GetInt("colocated", 0));
  ASSIGN_OR_RETURN(int64_t prefill, f.GetInt("prefill", colocated > 0 ? 0 : 1));
  ASSIGN_OR_RETURN(int64_t decode, f.GetInt("decode", colocated > 0 ? 0 : 1));
  ASSIGN_OR_RETURN(int64_t tp, f.GetInt("tp", 1));
  ASSIGN_OR_RETURN(int64_t max_running, f.GetInt("max-running", 64));
  ASSIGN_OR_RETURN(int64_t max_queue, f.GetInt("max-queue", 256));
  ASSIGN_OR_RETURN(int64_t store, f.GetInt("store-blocks", 0));
  ASSIGN_OR_RETURN(int64_t host_cores, f.GetInt("shared-host-cores", 0));
  ASSIGN_OR_RETURN(double heartbeat_ms, f.GetDouble("heartbeat-ms", sim::kDefaultHeartbeatS * 1e3));
  c.heartbeat_s = heartbeat_ms / 1e3;
  c.shared_host_cores = static_cast<int>(std::clamp<int64_t>(host_cores, 0, 1 << 20));
  for (int64_t v : {colocated, prefill, decode, tp, max_running, max_queue}) {
    if (v < 0 || v > 1'000'000'000) return InvalidArgument("topology flags must be in [0, 1e9]");
  }
  c.colocated = static_cast<int>(colocated);
  c.prefill = static_cast<int>(prefill);
  c.decode = static_cast<int>(decode);
  c.tp = static_cast<int>(tp);
  c.coordinator_max_running = static_cast<int>(max_running);
  c.coordinator_max_queue = static_cast<int>(max_queue);
  c.store_blocks = store;
  ASSIGN_OR_RETURN(c.router, coordinator::ParseRouterPolicy(f.Get("router", "prefix_aware")));
  RETURN_IF_ERROR(c.Validate());
  return c;
}

Result<std::vector<sim::SimRequest>> ParseWorkload(const Flags& f) {
  if (f.Has("trace")) return sim::LoadTrace(f.Get("trace"));
  sim::WorkloadOptions w;
  ASSIGN_OR_RETURN(w.rate, f.GetDouble("rate", 1.0));
  ASSIGN_OR_RETURN(w.num_requests, f.GetInt("num-prompts", 1000));
  ASSIGN_OR_RETURN(w.prompt_tokens, f.GetInt("input-len", 128));
  ASSIGN_OR_RETURN(w.output_tokens, f.GetInt("output-len", 32));
  ASSIGN_OR_RETURN(w.shared_prefix, f.GetInt("shared-prefix", 0));
  ASSIGN_OR_RETURN(w.prefix_groups, f.GetInt("prefix-groups", 1));
  ASSIGN_OR_RETURN(int64_t seed, f.GetInt("seed", 0));
  w.seed = static_cast<uint64_t>(seed);
  if (f.Get("arrivals", "poisson") == "uniform") {
    w.arrivals = sim::WorkloadOptions::Arrivals::kUniform;
  } else if (f.Get("arrivals", "poisson") != "poisson") {
    return InvalidArgument("--arrivals must be poisson or uniform");
  }
  return sim::GenerateWorkload(w);
}

json SummaryJson(const sim::SimResult& r) {
  auto stats = [](const sim::Percentiles& p) {
    return json{{"mean", p.mean}, {"p50", p.p50}, {"p90", p.p90}, {"p99", p.p99}};
  };
  return {{"completed", r.completed},
          {"rejected", r.rejected},
          {"duration_s", r.duration_s},
          {"request_throughput", r.request_throughput},
          {"output_token_throughput", r.output_token_throughput},
          {"ttft_ms", stats(r.ttft_ms)},
          {"tpot_ms", stats(r.tpot_ms)},
          {"e2e_ms", stats(r.e2e_ms)},
          {"prefix_hit_rate", r.prefix_hit_rate()},
          {"good_requests", r.good},
          {"goodput_rps", r.goodput_rps},
          {"preemptions", r.preemptions},
          {"transfers", r.transfers},
          {"transfer_bytes", r.transfer_bytes},
          {"events", r.events}};
}

constexpr char kSimUsage[] =
    "sim --profile P [--trace CSV | --rate R --num-prompts N --input-len I "
    "--output-len O [--shared-prefix L --prefix-groups G] [--seed S]] "
    "[--colocated C | --prefill P --decode D --tp T] [--router R] [--shared-host-cores N] "
    "[--heartbeat-ms 500 (the router sees the workers' heartbeats, as the real coordinator; 0 = "
    "exact router inputs)] [--json OUT]";

int RunSim(const std::vector<std::string>& args) {
  if (PrintHelpIfAsked(args, kSimUsage)) return 0;
  auto f = Flags::Parse(args,
                        {"profile",
                         "trace",
                         "rate",
                         "num-prompts",
                         "input-len",
                         "output-len",
                         "shared-prefix",
                         "prefix-groups",
                         "seed",
                         "arrivals",
                         "colocated",
                         "prefill",
                         "decode",
                         "tp",
                         "router",
                         "max-running",
                         "max-queue",
                         "store-blocks",
                         "shared-host-cores",
                         "heartbeat-ms",
                         "ttft-slo-ms",
                         "tpot-slo-ms",
                         "json",
                         "save-trace"},
                        {"help"});
  if (!f.ok()) {
    std::fprintf(stderr, "sim: %s\n", f.status().message().c_str());
    return 2;
  }
  if (!f->Has("profile")) {
    std::fprintf(stderr,
                 "sim: --profile PATH is required (make one with `kvrelay sim calibrate`)\n");
    return 2;
  }
  auto profile = sim::LoadProfile(f->Get("profile"));
  if (!profile.ok()) {
    std::fprintf(stderr, "sim: %s\n", profile.status().ToString().c_str());
    return 2;
  }
  auto config = ParseTopology(*f);
  auto workload =
      config.ok() ? ParseWorkload(*f) : Result<std::vector<sim::SimRequest>>(config.status());
  auto ttft_slo = f->GetDouble("ttft-slo-ms", 0);
  auto tpot_slo = f->GetDouble("tpot-slo-ms", 0);
  for (const Status& s :
       {config.status(), workload.status(), ttft_slo.status(), tpot_slo.status()}) {
    if (!s.ok()) {
      std::fprintf(stderr, "sim: %s\n", s.ToString().c_str());
      return 2;
    }
  }
  if (f->Has("save-trace")) {
    if (Status s = sim::SaveTrace(f->Get("save-trace"), *workload); !s.ok()) {
      std::fprintf(stderr, "sim: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  sim::SimOptions so;
  so.keep_requests = false;
  so.ttft_slo_s = *ttft_slo / 1e3;
  so.tpot_slo_s = *tpot_slo / 1e3;
  const TimePoint t0 = Clock::now();
  const std::clock_t c0 = std::clock();
  auto r = sim::Simulate(*profile, *config, *workload, so);
  const double wall = SecondsSince(t0);
  const double cpu = static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC;
  if (!r.ok()) {
    std::fprintf(stderr, "sim: %s\n", r.status().ToString().c_str());
    return 1;
  }
  std::printf(
      "simulated %s (%d nodes), profile '%s': %zu requests; router inputs: %s\n",
      config->Name().c_str(), config->Nodes(), profile->name.c_str(), workload->size(),
      config->heartbeat_s > 0
          ? ("heartbeats every " + std::to_string(std::lround(config->heartbeat_s * 1e3)) + " ms")
                .c_str()
          : "exact (--heartbeat-ms 0)");
  std::printf("completed %lld, rejected %lld, in %.2f simulated s\n",
              static_cast<long long>(r->completed), static_cast<long long>(r->rejected),
              r->duration_s);
  std::printf("throughput: %.3f req/s, %.1f output tok/s; prefix hit %.1f%%; preemptions %lld\n",
              r->request_throughput, r->output_token_throughput, 100 * r->prefix_hit_rate(),
              static_cast<long long>(r->preemptions));
  auto line = [](const char* name, const sim::Percentiles& s) {
    std::printf("%-8s mean %9.2f  p50 %9.2f  p90 %9.2f  p99 %9.2f ms\n", name, s.mean, s.p50, s.p90,
                s.p99);
  };
  line("TTFT", r->ttft_ms);
  line("TPOT", r->tpot_ms);
  line("E2E", r->e2e_ms);
  if (so.ttft_slo_s > 0 || so.tpot_slo_s > 0) {
    std::printf("goodput: %.3f req/s (%lld within SLO)\n", r->goodput_rps,
                static_cast<long long>(r->good));
  }
  std::printf("simulator: %llu events in %.2f s wall, %.2f s CPU (%.2f M events per CPU s)\n",
              static_cast<unsigned long long>(r->events), wall, cpu,
              static_cast<double>(r->events) / cpu / 1e6);
  if (f->Has("json")) {
    json j = SummaryJson(*r);
    j["config"] = config->Name();
    j["nodes"] = config->Nodes();
    j["heartbeat_ms"] = config->heartbeat_s * 1e3;
    j["requests"] = workload->size();
    j["wall_s"] = wall;
    j["cpu_s"] = cpu;
    std::ofstream out(f->Get("json"));
    out << j.dump(2) << "\n";
    if (!out) {
      std::fprintf(stderr, "sim: cannot write %s\n", f->Get("json").c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace

KVRELAY_COMMAND(sim, "sim", kSimUsage, RunSim);

}  // namespace kvrelay::cli
