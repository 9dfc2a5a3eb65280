// Picks the prefill worker and the decode worker for a request.
//
// Prefill policies:
//   round_robin   cycles through healthy prefill workers (by id order);
//   least_loaded  fewest queued prompt tokens, then fewest running sequences;
//   prefix_aware  (default) the worker whose cache holds the longest leading
//                 run of the request's prefix blocks, minus its queued work:
//                 score = cached_blocks * block_tokens - queued_tokens.
//                 Ties: fewer queued tokens, then fewer running sequences.
// Decode placement (every policy): among healthy decode workers with enough
// free KV blocks for prompt + max_new_tokens and room in the running batch,
// the best free-block fraction minus running-batch fraction.
//
// Workers with role kColocated take both parts.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/status.h"
#include "coordinator/backend.h"

namespace kvrelay::coordinator {

enum class RouterPolicy { kRoundRobin, kLeastLoaded, kPrefixAware };
Result<RouterPolicy> ParseRouterPolicy(std::string_view name);  // "round_robin", ...
std::string_view RouterPolicyName(RouterPolicy p);

struct PrefixBlockHashHasher {
  size_t operator()(const PrefixBlockHash& h) const;
};

// Which worker caches which prefix block, fed by the workers' stored/evicted
// events. Thread-safe. Memory is bounded by the workers' own cache sizes.
class PrefixIndex {
 public:
  void OnStored(const std::string& worker, const PrefixBlockHash& hash);
  void OnEvicted(const std::string& worker, const PrefixBlockHash& hash);
  // Forgets everything about a worker (it died or re-registered).
  void RemoveWorker(const std::string& worker);
  // Length of the leading run of `chain` cached on `worker`.
  int64_t MatchedBlocks(const std::string& worker, std::span<const PrefixBlockHash> chain) const;
  int64_t BlockCount(const std::string& worker) const;

 private:
  mutable std::mutex mutex_;
  // guarded by mutex_
  std::unordered_map<std::string, std::unordered_set<PrefixBlockHash, PrefixBlockHashHasher>>
      by_worker_;
};

struct RouteRequest {
  std::span<const PrefixBlockHash> prefix_blocks;
  int64_t prompt_tokens = 0;
  int64_t max_new_tokens = 0;
};

// The workers Router::PickPrefill / PickDecode choose among: the healthy ones
// of `role` or kColocated, sorted by id. Exposed so that a caller routing many
// requests over a fixed worker set (the cluster simulator, sim/) can build the
// list once and call the *Among overloads.
std::vector<const WorkerInfo*> RoutingCandidates(const std::vector<WorkerInfo>& workers,
                                                 WorkerRole role);

struct RouterOptions {
  RouterPolicy policy = RouterPolicy::kPrefixAware;
};

// Thread-safe.
class Router {
 public:
  explicit Router(RouterOptions options) : options_(options) {}

  RouterPolicy policy() const { return options_.policy; }
  PrefixIndex& prefix_index() { return prefix_index_; }

  // Id of the chosen prefill worker; Unavailable when none is healthy.
  Result<std::string> PickPrefill(const RouteRequest& request,
                                  const std::vector<WorkerInfo>& workers);
  // Id of the chosen decode worker; Unavailable when none is healthy,
  // ResourceExhausted when none has room.
  Result<std::string> PickDecode(const RouteRequest& request,
                                 const std::vector<WorkerInfo>& workers);

  // The same choices over a candidate list built by RoutingCandidates (the
  // pointed-to infos may be updated in place between calls; keep the id order).
  Result<std::string> PickPrefillAmong(const RouteRequest& request,
                                       std::span<const WorkerInfo* const> candidates);
  Result<std::string> PickDecodeAmong(const RouteRequest& request,
                                      std::span<const WorkerInfo* const> candidates);

 private:
  const RouterOptions options_;
  PrefixIndex prefix_index_;
  std::mutex mutex_;
  uint64_t round_robin_next_ = 0;  // guarded by mutex_
};

}  // namespace kvrelay::coordinator
