// The cluster simulator: a discrete-event model of one coordinator, P prefill
// workers, D decode groups of TP T (or C colocated workers), the KV links
// between them and each worker's prefix cache, driven by a workload and
// costed by a Profile.
//
// What is the real code and what is a model:
//  * Routing is coordinator::Router itself (the policies as implemented, its
//    PrefixIndex fed by the simulated workers' stored/evicted block events).
//  * Admission is coordinator::AdmissionQueue itself (max_running in the
//    backend, max_queue waiting, the rest refused).
//  * Each worker's engine is a model of engine::Engine's scheduler
//    (engine/runtime/engine.cc, Schedule): every step, decoding sequences
//    first (one token each), then prefill chunks oldest first, then FCFS
//    admission while budget (max_step_tokens) and max_running allow; blocks
//    reserved per chunk; youngest-first preemption with recompute when the
//    pool runs out; prefix reuse at admission (longest cached leading run of
//    full blocks, at least one prompt token computed). The step's duration is
//    the Profile's step model, not a forward pass.
//  * A KV transfer is a FIFO link per prefill worker (its NIC): with
//    layer-wise streaming, only the last layer's share is exposed after the
//    prefill unless the link is the bottleneck.
//  * Worker state the router sees is exact at every decision, or (with
//    ClusterConfig::heartbeat_s) what the workers' last heartbeats carried.
//
// Deterministic: the same inputs give the same outputs, bit for bit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "coordinator/cluster/router.h"
#include "sim/profile.h"
#include "sim/stats.h"
#include "sim/workload.h"

namespace kvrelay::sim {

// The coordinator's heartbeat period (kvrelay launch's default, 500 ms): what
// `kvrelay sim` and `kvrelay plan` use unless told otherwise (--heartbeat-ms 0
// = exact router inputs). ClusterConfig itself defaults to exact inputs, which
// the closed-form tests rely on.
inline constexpr double kDefaultHeartbeatS = 0.5;

struct ClusterConfig {
  int colocated = 0;  // colocated workers (prefill + decode in one engine)
  int prefill = 1;    // prefill workers (TP 1)
  int decode = 1;     // decode groups
  int tp = 1;         // ranks per decode group
  coordinator::RouterPolicy router = coordinator::RouterPolicy::kPrefixAware;
  int coordinator_max_running = 64;  // coordinator admission (the server's --max-running)
  int coordinator_max_queue = 256;   // (--max-queue)
  int64_t store_blocks = 0;          // prefix tier (RocksDB) per prefill/colocated worker; 0 = none
  // 0: every worker (every TP rank) has a machine of its own. N > 0: all of
  // them share one host of N cores (the single-node topologies `kvrelay sim
  // validate` compares with), as a fluid model: a stepping worker wants c
  // cores (1; a TP group profile.tp[T].cores) and a serving process of the
  // two (coordinator, client: profile.serving_cpu) with work 1; the N cores
  // are shared max-min fairly (FairLevel: each gets min(demand, L), L the
  // level that fills them), and a worker's step advances at rate
  //   min(1, L / c) / (1 + alpha x min(D - c, N - c))
  // of its solo speed, D the busy workers' cores, alpha the profile's
  // contention for the step's mix of decode and prefill work (a TP group:
  // profile.tp[T].busy_alpha; a disaggregated role: profile.prefill / decode
  // .busy_alpha when measured), and a busy serving process at min(1, L);
  // every start and end of a step or of a serving process's work re-rates
  // the others' remaining work.
  int shared_host_cores = 0;
  // 0: the router sees every worker's state exactly at each decision. > 0:
  // as the real coordinator, it sees what the workers' heartbeats carried
  // (every heartbeat_s, the real default 0.5 s): the
  // state each worker last published before the latest tick (after every
  // step; a prefill or colocated worker also during each step, with the
  // prompts it is computing), plus the prompt tokens (and decode blocks) the
  // coordinator itself routed there since that tick. A prompt leaves a
  // worker's queued count when its prefill ends, so after a tick the router
  // sees mostly empty queues and ties go to the smaller running batch, then
  // the lowest worker id.
  double heartbeat_s = 0;
  // Ticks at heartbeat_phase_s + k heartbeat_s (the real phase is each
  // worker's registration time, unknown to a replay).
  double heartbeat_phase_s = 0;

  Status Validate() const;
  // Machines (one per worker, one per TP rank) the configuration occupies.
  int Nodes() const { return colocated + prefill + decode * tp; }
  std::string Name() const;  // "colocated x4", "2P+3D TP2"
  // Name() plus the router when it is not the default prefix_aware.
  std::string NameWithRouter() const;
};

struct RequestTiming {
  double arrival_s = 0;
  double start_s = -1;          // admitted by the coordinator (routed)
  double prefill_start_s = -1;  // first chunk scheduled
  double first_token_s = -1;    // TTFT ends (client sees the first token)
  double kv_ready_s = -1;       // KV landed on the decode group (disaggregated)
  double finish_s = -1;         // last token seen by the client
  int64_t output_tokens = 0;
  int64_t cached_tokens = 0;  // prompt tokens reused (pool or store)
  int32_t prefill_worker = -1;
  int32_t decode_worker = -1;
  bool rejected = false;  // refused by admission or no room (429 / 503)

  double ttft_s() const { return first_token_s - arrival_s; }
  double e2e_s() const { return finish_s - arrival_s; }
  // (e2e - TTFT) / (output - 1), as bench serve computes it (0 for one token).
  double tpot_s() const {
    return output_tokens > 1 ? (finish_s - first_token_s) / static_cast<double>(output_tokens - 1)
                             : 0;
  }
};

struct SimOptions {
  bool keep_requests = true;  // fill SimResult::requests
  double ttft_slo_s = 0;      // for goodput (0 = no limit)
  double tpot_slo_s = 0;
  // The request-to-request variation's draws (ServingOverhead::ttft_jitter /
  // tpot_jitter) are hashed from (jitter_seed, request index): another seed
  // is another sample of the same distribution (sim validate averages over
  // several).
  uint64_t jitter_seed = 0;
};

struct SimResult {
  int64_t completed = 0;
  int64_t rejected = 0;
  double duration_s = 0;  // first arrival to last finish (bench serve's wall time)
  Percentiles ttft_ms, tpot_ms, e2e_ms;
  double request_throughput = 0;  // completed / duration
  double output_token_throughput = 0;
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;
  int64_t good = 0;  // completed within both SLOs
  double goodput_rps = 0;
  int64_t preemptions = 0;
  int64_t transfers = 0;
  double transfer_bytes = 0;
  uint64_t events = 0;
  // CPU seconds the workers' steps cost (solo seconds x the cores each keeps
  // busy; contention not included) and the serving path's (Profile::
  // serving_cpu, shared hosts only): to compare with the real processes' CPU.
  double worker_cpu_s = 0;
  double serving_cpu_s = 0;
  std::vector<RequestTiming> requests;  // in workload order (when keep_requests)

  double prefix_hit_rate() const {
    return prompt_tokens > 0 ? static_cast<double>(cached_tokens) / prompt_tokens : 0;
  }
};

// One process's claim on a shared host: the cores it wants and its weight.
struct CoreDemand {
  double cores = 1;
  double weight = 1;
};
// The water level of weighted max-min fair sharing: processes with `demands`
// (reordered) on `cores` cores each get min(cores wanted, weight x level);
// infinity when all of them fit. Not a proportional split: a TP 2 group whose
// ranks want 1.41 cores next to a prefill wanting 1, on 2 cores, measured
// x1.35 and the prefill x1.04 (the group got ~1.04 cores: weight 1.09), where
// scaling both by 2 / 2.41 slowed the prefill x1.2.
double FairLevel(std::vector<CoreDemand>& demands, double cores);

Result<SimResult> Simulate(const Profile& profile, const ClusterConfig& config,
                           const std::vector<SimRequest>& workload, const SimOptions& options = {});

}  // namespace kvrelay::sim
