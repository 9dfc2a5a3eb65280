// The P:D planner (`kvrelay plan`): for a profile, a workload shape and SLOs
// on TTFT p90 and TPOT p90, searches colocated C and disaggregated P prefill
// workers + D decode groups of TP T within a node budget, and ranks them by
// goodput per node: the highest request rate whose simulated TTFT p90 and
// TPOT p90 both meet the SLOs (DistServe's per-GPU goodput, with p90 as the
// attainment target), divided by the nodes the configuration occupies.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"
#include "sim/cluster_sim.h"
#include "sim/profile.h"
#include "sim/workload.h"

namespace kvrelay::sim {

struct PlanOptions {
  WorkloadOptions workload;  // its rate is what the search varies
  double ttft_slo_s = 1.0;
  double tpot_slo_s = 0.05;
  int max_nodes = 8;
  std::vector<int> tp_sizes = {1, 2};  // those with a profile entry are searched
  bool include_colocated = true;
  bool include_disaggregated = true;
  coordinator::RouterPolicy router = coordinator::RouterPolicy::kPrefixAware;
  // What the router sees: the workers' heartbeats every heartbeat_s (the real
  // coordinator's default), or exact state at every decision (0). Exact
  // inputs flatter colocated routing (prefix_aware sees every queued prompt).
  double heartbeat_s = kDefaultHeartbeatS;
  int64_t requests_per_node = 400;  // workload size at each simulated point (min 1000)
  int bisection_steps = 12;
  int curve_points = 12;  // goodput-vs-rate points for the top configurations

  Status Validate() const;
};

struct CurvePoint {
  double rate = 0;     // offered req/s
  double goodput = 0;  // req/s completed within both SLOs (per-request)
  double ttft_p90_s = 0;
  double tpot_p90_s = 0;
};

struct PlanCandidate {
  ClusterConfig config;
  double max_rate = 0;  // highest rate meeting both p90 SLOs (0: none)
  double per_node = 0;  // max_rate / nodes
  std::vector<CurvePoint> curve;
};

struct PlanResult {
  std::vector<PlanCandidate> ranked;  // best per-node goodput first
  int64_t simulations = 0;
};

// The coordinator-side settings a planned cluster runs with: admission never
// binds (one slot per engine sequence) and nothing is refused, so overload
// shows as latency, as it would with a queue sized for the cluster.
ClusterConfig PlannedConfig(ClusterConfig c, const Profile& profile);

// Highest rate (req/s) at which `config` meets both p90 SLOs, by bisection
// between 0 and an upper bound from the profile; `sims` counts simulations.
Result<double> MaxRate(const Profile& profile, const ClusterConfig& config,
                       const PlanOptions& options, int64_t* sims);

Result<std::vector<CurvePoint>> GoodputCurve(const Profile& profile, const ClusterConfig& config,
                                             const PlanOptions& options,
                                             const std::vector<double>& rates, int64_t* sims);

// `progress` (may be empty) is called after each configuration.
Result<PlanResult> Plan(const Profile& profile, const PlanOptions& options,
                        const std::function<void(const PlanCandidate&)>& progress = {});

}  // namespace kvrelay::sim
