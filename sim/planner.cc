#include "sim/planner.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace kvrelay::sim {

Status PlanOptions::Validate() const {
  RETURN_IF_ERROR(workload.Validate());
  if (!(ttft_slo_s > 0) || !(tpot_slo_s > 0)) return InvalidArgument("plan: SLOs must be > 0");
  if (max_nodes < 1) return InvalidArgument("plan: max_nodes must be >= 1");
  if (!include_colocated && !include_disaggregated) {
    return InvalidArgument("plan: nothing to search (colocated and disaggregated both off)");
  }
  if (!(heartbeat_s >= 0) || !std::isfinite(heartbeat_s)) {
    return InvalidArgument("plan: heartbeat_s must be >= 0");
  }
  if (requests_per_node < 1 || bisection_steps < 1 || curve_points < 1) {
    return InvalidArgument("plan: requests_per_node, bisection_steps, curve_points must be >= 1");
  }
  return Status::Ok();
}

ClusterConfig PlannedConfig(ClusterConfig c, const Profile& profile) {
  const int engines = c.colocated + c.prefill + c.decode;
  c.coordinator_max_running = std::max(1, engines * profile.max_running);
  c.coordinator_max_queue = std::numeric_limits<int>::max() / 2;
  return c;
}

namespace {

Result<SimResult> RunAt(const Profile& profile, const ClusterConfig& config,
                        const PlanOptions& options, double rate) {
  WorkloadOptions w = options.workload;
  w.rate = rate;
  w.num_requests = std::max<int64_t>(1000, options.requests_per_node * config.Nodes());
  ASSIGN_OR_RETURN(auto requests, GenerateWorkload(w));
  SimOptions so;
  so.keep_requests = false;
  so.ttft_slo_s = options.ttft_slo_s;
  so.tpot_slo_s = options.tpot_slo_s;
  return Simulate(profile, PlannedConfig(config, profile), requests, so);
}

bool Meets(const SimResult& r, const PlanOptions& o) {
  return r.rejected == 0 && r.ttft_ms.p90 <= o.ttft_slo_s * 1e3 &&
         r.tpot_ms.p90 <= o.tpot_slo_s * 1e3;
}

// A rate no configuration of this size can sustain: every node prefilling
// alone at the step model's best token rate.
double RateBound(const Profile& p, const ClusterConfig& c, const WorkloadOptions& w) {
  const double chunk = std::min<double>(p.max_step_tokens, static_cast<double>(w.prompt_tokens));
  const double step = p.step.Seconds(1, chunk, chunk * (chunk + 1) / 2);
  const double prompt_s = step * static_cast<double>(w.prompt_tokens) / chunk;
  return 2.0 * static_cast<double>(std::max(1, c.colocated + c.prefill)) / prompt_s;
}

}  // namespace

Result<double> MaxRate(const Profile& profile, const ClusterConfig& config,
                       const PlanOptions& options, int64_t* sims) {
  double lo = 0, hi = RateBound(profile, config, options.workload);
  // Is even the bound met? (Then the bound is the answer we can give.)
  ASSIGN_OR_RETURN(SimResult top, RunAt(profile, config, options, hi));
  ++*sims;
  if (Meets(top, options)) return hi;
  for (int i = 0; i < options.bisection_steps; ++i) {
    const double mid = (lo + hi) / 2;
    ASSIGN_OR_RETURN(SimResult r, RunAt(profile, config, options, mid));
    ++*sims;
    (Meets(r, options) ? lo : hi) = mid;
  }
  return lo;
}

Result<std::vector<CurvePoint>> GoodputCurve(const Profile& profile, const ClusterConfig& config,
                                             const PlanOptions& options,
                                             const std::vector<double>& rates, int64_t* sims) {
  std::vector<CurvePoint> out;
  for (double rate : rates) {
    ASSIGN_OR_RETURN(SimResult r, RunAt(profile, config, options, rate));
    ++*sims;
    // Goodput as offered load x the fraction of requests within both SLOs.
    const double n = static_cast<double>(r.completed + r.rejected);
    out.push_back({rate, n > 0 ? rate * static_cast<double>(r.good) / n : 0, r.ttft_ms.p90 / 1e3,
                   r.tpot_ms.p90 / 1e3});
  }
  return out;
}

Result<PlanResult> Plan(const Profile& profile, const PlanOptions& options,
                        const std::function<void(const PlanCandidate&)>& progress) {
  RETURN_IF_ERROR(profile.Validate());
  RETURN_IF_ERROR(options.Validate());
  std::vector<ClusterConfig> configs;
  if (options.include_colocated) {
    // prefix_aware scores colocated workers by queued prompt tokens only, so
    // it piles decodes onto the lowest-id idle worker; least_loaded also
    // looks at the running batch. The baseline gets both.
    std::vector<coordinator::RouterPolicy> policies = {options.router};
    if (options.router != coordinator::RouterPolicy::kLeastLoaded) {
      policies.push_back(coordinator::RouterPolicy::kLeastLoaded);
    }
    for (auto policy : policies) {
      for (int c = 1; c <= options.max_nodes; ++c) {
        ClusterConfig k;
        k.colocated = c;
        k.prefill = k.decode = 0;
        k.router = policy;
        configs.push_back(k);
      }
    }
  }
  if (options.include_disaggregated) {
    for (int t : options.tp_sizes) {
      if (t > 1 && !profile.tp.count(t)) continue;
      for (int d = 1; d * t < options.max_nodes; ++d) {
        for (int p = 1; p + d * t <= options.max_nodes; ++p) {
          ClusterConfig k;
          k.prefill = p;
          k.decode = d;
          k.tp = t;
          configs.push_back(k);
        }
      }
    }
  }
  PlanResult out;
  for (auto& k : configs) {
    if (k.colocated == 0) k.router = options.router;
    k.heartbeat_s = options.heartbeat_s;
    PlanCandidate c;
    c.config = k;
    ASSIGN_OR_RETURN(c.max_rate, MaxRate(profile, k, options, &out.simulations));
    c.per_node = c.max_rate / k.Nodes();
    if (progress) progress(c);
    out.ranked.push_back(c);
  }
  // Best per node first; ties: fewer nodes, then the order searched.
  std::stable_sort(out.ranked.begin(), out.ranked.end(),
                   [](const PlanCandidate& a, const PlanCandidate& b) {
                     if (a.per_node != b.per_node) return a.per_node > b.per_node;
                     return a.config.Nodes() < b.config.Nodes();
                   });
  // Curves for the best disaggregated and the best colocated configuration
  // (and the top three overall), over rates up to 1.5x the best max rate.
  double top_rate = 0;
  for (const auto& c : out.ranked) top_rate = std::max(top_rate, c.max_rate);
  if (top_rate <= 0) top_rate = RateBound(profile, out.ranked.front().config, options.workload);
  std::vector<double> rates;
  for (int i = 1; i <= options.curve_points; ++i) {
    rates.push_back(1.5 * top_rate * i / options.curve_points);
  }
  bool have_coloc = false, have_disagg = false;
  for (size_t i = 0; i < out.ranked.size(); ++i) {
    PlanCandidate& c = out.ranked[i];
    const bool coloc = c.config.colocated > 0;
    const bool want = i < 3 || (coloc && !have_coloc) || (!coloc && !have_disagg);
    if (!want) continue;
    (coloc ? have_coloc : have_disagg) = true;
    ASSIGN_OR_RETURN(c.curve, GoodputCurve(profile, c.config, options, rates, &out.simulations));
  }
  return out;
}

}  // namespace kvrelay::sim
