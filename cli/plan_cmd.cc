// kvrelay plan: the P:D planner (sim/planner.h). Given a profile, a workload
// shape and SLOs on TTFT p90 and TPOT p90, searches colocated C and
// disaggregated P prefill + D decode groups of TP T within --max-nodes, prints
// the top configurations by goodput per node and the goodput-vs-rate curves,
// and (with --plots DIR) writes the data as JSON plus PNG plots drawn by
// sim/plot/plot_plan.py (matplotlib in the venv sim/plot/setup_venv.sh makes):
// disaggregated vs colocated goodput, and goodput scaling with nodes.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "cli/command.h"
#include "common/clock.h"
#include "common/flags.h"
#include "deploy/process_group.h"
#include "sim/planner.h"
#include "sim/profile.h"

namespace kvrelay::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

json CandidateJson(const sim::PlanCandidate& c) {
  json curve = json::array();
  for (const auto& p : c.curve) {
    curve.push_back({{"rate", p.rate},
                     {"goodput", p.goodput},
                     {"ttft_p90_s", p.ttft_p90_s},
                     {"tpot_p90_s", p.tpot_p90_s}});
  }
  return {{"config", c.config.NameWithRouter()},
          {"colocated", c.config.colocated},
          {"prefill", c.config.prefill},
          {"decode", c.config.decode},
          {"tp", c.config.tp},
          {"nodes", c.config.Nodes()},
          {"max_rate", c.max_rate},
          {"per_node", c.per_node},
          {"curve", curve}};
}

// The planner's source tree (for the plot script): from the binary's
// location (<src>/build/cli/kvrelay) or the working directory.
std::string FindPlotScript() {
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  for (fs::path base : {fs::current_path(), exe.parent_path().parent_path().parent_path()}) {
    if (fs::exists(base / "sim/plot/plot_plan.py"))
      return (base / "sim/plot/plot_plan.py").string();
  }
  return "";
}

constexpr char kPlanUsage[] =
    "plan --profile P [--input-len 128 --output-len 32] [--shared-prefix L "
    "--prefix-groups G] [--ttft-slo-ms 1000 --tpot-slo-ms 50] [--max-nodes 8] "
    "[--tp 1,2,4,8] [--heartbeat-ms 500 (0 = exact router inputs)] [--plots DIR] "
    "[--scale-nodes 8,16,32,64] [--json OUT]";

int RunPlan(const std::vector<std::string>& args) {
  if (PrintHelpIfAsked(args, kPlanUsage)) return 0;
  auto f = Flags::Parse(
      args,
      {"profile", "input-len", "output-len", "shared-prefix", "prefix-groups", "ttft-slo-ms",
       "tpot-slo-ms", "max-nodes", "tp", "router", "seed", "requests-per-node", "top", "plots",
       "scale-nodes", "python", "json", "heartbeat-ms"},
      {"no-colocated", "help"});
  if (!f.ok()) {
    std::fprintf(stderr, "plan: %s\n", f.status().message().c_str());
    return 2;
  }
  auto fail = [](const Status& s, int code) {
    std::fprintf(stderr, "plan: %s\n", s.ToString().c_str());
    return code;
  };
  if (!f->Has("profile")) return fail(InvalidArgument("--profile PATH is required"), 2);
  auto profile = sim::LoadProfile(f->Get("profile"));
  if (!profile.ok()) return fail(profile.status(), 2);
  sim::PlanOptions o;
  auto in = f->GetInt("input-len", 128);
  auto out = f->GetInt("output-len", 32);
  auto shared = f->GetInt("shared-prefix", 0);
  auto groups = f->GetInt("prefix-groups", 1);
  auto ttft = f->GetDouble("ttft-slo-ms", 1000);
  auto tpot = f->GetDouble("tpot-slo-ms", 50);
  auto max_nodes = f->GetInt("max-nodes", 8);
  auto seed = f->GetInt("seed", 1);
  auto rpn = f->GetInt("requests-per-node", 300);
  auto top = f->GetInt("top", 10);
  auto heartbeat_ms = f->GetDouble("heartbeat-ms", sim::kDefaultHeartbeatS * 1e3);
  for (const Status& s :
       {in.status(), out.status(), shared.status(), groups.status(), ttft.status(), tpot.status(),
        max_nodes.status(), seed.status(), rpn.status(), top.status(), heartbeat_ms.status()}) {
    if (!s.ok()) return fail(s, 2);
  }
  o.workload.prompt_tokens = *in;
  o.workload.output_tokens = *out;
  o.workload.shared_prefix = *shared;
  o.workload.prefix_groups = *groups;
  o.workload.seed = static_cast<uint64_t>(*seed);
  o.ttft_slo_s = *ttft / 1e3;
  o.tpot_slo_s = *tpot / 1e3;
  o.max_nodes = static_cast<int>(*max_nodes);
  o.requests_per_node = *rpn;
  o.heartbeat_s = *heartbeat_ms / 1e3;
  o.include_colocated = !f->Has("no-colocated");
  auto router = coordinator::ParseRouterPolicy(f->Get("router", "prefix_aware"));
  if (!router.ok()) return fail(router.status(), 2);
  o.router = *router;
  o.tp_sizes.clear();
  {
    std::stringstream ss(f->Get("tp", "1,2,4,8"));
    std::string tok;
    while (std::getline(ss, tok, ',')) o.tp_sizes.push_back(std::atoi(tok.c_str()));
  }
  if (Status s = o.Validate(); !s.ok()) return fail(s, 2);

  std::printf(
      "plan: profile '%s' (%s), workload %lld in / %lld out, shared prefix %lld x %lld "
      "groups; SLO TTFT p90 <= %.0f ms, TPOT p90 <= %.1f ms; up to %d nodes; router inputs: %s\n",
      profile->name.c_str(), profile->hardware.c_str(), static_cast<long long>(*in),
      static_cast<long long>(*out), static_cast<long long>(*shared),
      static_cast<long long>(*groups), *ttft, *tpot, o.max_nodes,
      o.heartbeat_s > 0
          ? ("heartbeats every " + std::to_string(std::lround(*heartbeat_ms)) + " ms").c_str()
          : "exact (--heartbeat-ms 0)");
  const TimePoint t0 = Clock::now();
  auto plan = sim::Plan(*profile, o);
  if (!plan.ok()) return fail(plan.status(), 1);
  const double wall = SecondsSince(t0);
  std::printf("%lld simulations in %.1f s\n\n", static_cast<long long>(plan->simulations), wall);
  std::printf("%4s  %-30s %6s %14s %16s\n", "rank", "configuration", "nodes", "max rate req/s",
              "goodput/node");
  const size_t shown = std::min<size_t>(plan->ranked.size(), static_cast<size_t>(*top));
  for (size_t i = 0; i < shown; ++i) {
    const auto& c = plan->ranked[i];
    std::printf("%4zu  %-30s %6d %14.3f %16.3f\n", i + 1, c.config.NameWithRouter().c_str(),
                c.config.Nodes(), c.max_rate, c.per_node);
  }
  const sim::PlanCandidate* best_coloc = nullptr;
  const sim::PlanCandidate* best_disagg = nullptr;
  for (const auto& c : plan->ranked) {
    if (c.config.colocated > 0 && !best_coloc) best_coloc = &c;
    if (c.config.colocated == 0 && !best_disagg) best_disagg = &c;
  }
  std::printf("\ngoodput vs offered rate (req/s within both SLOs):\n");
  for (const auto& c : plan->ranked) {
    if (c.curve.empty()) continue;
    std::printf("  %-30s", c.config.NameWithRouter().c_str());
    for (const auto& p : c.curve) std::printf(" %.2f:%.2f", p.rate, p.goodput);
    std::printf("\n");
  }
  if (best_coloc && best_disagg) {
    std::printf("\nbest disaggregated %s: %.3f req/s per node; best colocated %s: %.3f (%.2fx)\n",
                best_disagg->config.NameWithRouter().c_str(), best_disagg->per_node,
                best_coloc->config.NameWithRouter().c_str(), best_coloc->per_node,
                best_coloc->per_node > 0 ? best_disagg->per_node / best_coloc->per_node : 0.0);
  }

  // Scaling with nodes: the best per-node configurations' shapes, multiplied.
  json scaling = json::array();
  std::vector<int> scale_nodes;
  {
    std::stringstream ss(f->Get("scale-nodes", "8,16,32,64"));
    std::string tok;
    while (std::getline(ss, tok, ',')) scale_nodes.push_back(std::atoi(tok.c_str()));
  }
  if (f->Has("plots") || f->Has("json")) {
    std::printf("\nscaling (max rate meeting the SLOs):\n");
    for (const sim::PlanCandidate* base : {best_disagg, best_coloc}) {
      if (!base) continue;
      for (int nodes : scale_nodes) {
        const int k = std::max(1, nodes / base->config.Nodes());
        sim::ClusterConfig c = base->config;
        c.colocated *= k;
        c.prefill *= k;
        c.decode *= k;
        int64_t sims = 0;
        auto rate = sim::MaxRate(*profile, c, o, &sims);
        if (!rate.ok()) return fail(rate.status(), 1);
        std::printf("  %-30s %5d nodes: %10.2f req/s (%.3f per node)\n", c.NameWithRouter().c_str(),
                    c.Nodes(), *rate, *rate / c.Nodes());
        scaling.push_back({{"family", base->config.NameWithRouter()},
                           {"config", c.NameWithRouter()},
                           {"colocated", c.colocated > 0},
                           {"nodes", c.Nodes()},
                           {"max_rate", *rate}});
      }
    }
  }
  json j = {{"profile", profile->name},
            {"hardware", profile->hardware},
            {"workload",
             {{"input_len", *in},
              {"output_len", *out},
              {"shared_prefix", *shared},
              {"prefix_groups", *groups}}},
            {"slo", {{"ttft_p90_ms", *ttft}, {"tpot_p90_ms", *tpot}}},
            {"heartbeat_ms", *heartbeat_ms},
            {"ranked", json::array()},
            {"scaling", scaling}};
  for (const auto& c : plan->ranked) j["ranked"].push_back(CandidateJson(c));
  std::string json_path = f->Get("json");
  if (f->Has("plots")) {
    fs::create_directories(f->Get("plots"));
    if (json_path.empty()) json_path = (fs::path(f->Get("plots")) / "plan.json").string();
  }
  if (!json_path.empty()) {
    std::ofstream out_f(json_path);
    out_f << j.dump(2) << "\n";
    if (!out_f) return fail(InvalidArgument("cannot write " + json_path), 1);
    std::printf("wrote %s\n", json_path.c_str());
  }
  if (f->Has("plots")) {
    const std::string script = FindPlotScript();
    std::string python = f->Get("python", "");
    if (python.empty()) {
      const fs::path venv =
          fs::path(script).parent_path().parent_path().parent_path() / ".venv-sim/bin/python";
      python = fs::exists(venv) ? venv.string() : "python3";
    }
    if (script.empty()) return fail(NotFound("sim/plot/plot_plan.py not found"), 1);
    deploy::ProcessGroup g;
    Status s = g.Spawn({"plot", {python, script, json_path, f->Get("plots")}, {}});
    if (s.ok()) {
      auto done = g.WaitAny(Deadline::AfterMs(120'000));
      if (!done.ok() || done->find("status 0") == std::string::npos) {
        s = Internal("plot script: " + (done.ok() ? *done : done.status().ToString()) +
                     " (run sim/plot/setup_venv.sh for matplotlib)");
      }
    }
    g.Stop();
    if (!s.ok()) return fail(s, 1);
  }
  return 0;
}

}  // namespace

KVRELAY_COMMAND(plan, "plan", kPlanUsage, RunPlan);

}  // namespace kvrelay::cli
