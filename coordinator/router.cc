#include "coordinator/router.h"

#include <algorithm>
#include <cstring>
#include <limits>

namespace kvrelay::coordinator {

Result<RouterPolicy> ParseRouterPolicy(std::string_view name) {
  if (name == "round_robin") return RouterPolicy::kRoundRobin;
  if (name == "least_loaded") return RouterPolicy::kLeastLoaded;
  if (name == "prefix_aware") return RouterPolicy::kPrefixAware;
  return InvalidArgument("unknown router policy '" + std::string(name) +
                         "' (expected round_robin, least_loaded or prefix_aware)");
}

std::string_view RouterPolicyName(RouterPolicy p) {
  switch (p) {
    case RouterPolicy::kRoundRobin:
      return "round_robin";
    case RouterPolicy::kLeastLoaded:
      return "least_loaded";
    case RouterPolicy::kPrefixAware:
      return "prefix_aware";
  }
  return "?";
}

size_t PrefixBlockHashHasher::operator()(const PrefixBlockHash& h) const {
  size_t v;  // the hash is SHA-256: any 8 bytes are uniformly distributed
  std::memcpy(&v, h.data(), sizeof(v));
  return v;
}

void PrefixIndex::OnStored(const std::string& worker, const PrefixBlockHash& hash) {
  std::lock_guard<std::mutex> lock(mutex_);
  by_worker_[worker].insert(hash);
}

void PrefixIndex::OnEvicted(const std::string& worker, const PrefixBlockHash& hash) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = by_worker_.find(worker);
  if (it == by_worker_.end()) return;
  it->second.erase(hash);
}

void PrefixIndex::RemoveWorker(const std::string& worker) {
  std::lock_guard<std::mutex> lock(mutex_);
  by_worker_.erase(worker);
}

int64_t PrefixIndex::MatchedBlocks(const std::string& worker,
                                   std::span<const PrefixBlockHash> chain) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = by_worker_.find(worker);
  if (it == by_worker_.end()) return 0;
  int64_t n = 0;
  for (const auto& h : chain) {
    if (!it->second.count(h)) break;
    ++n;
  }
  return n;
}

int64_t PrefixIndex::BlockCount(const std::string& worker) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = by_worker_.find(worker);
  return it == by_worker_.end() ? 0 : static_cast<int64_t>(it->second.size());
}

std::vector<const WorkerInfo*> RoutingCandidates(const std::vector<WorkerInfo>& workers,
                                                 WorkerRole role) {
  std::vector<const WorkerInfo*> out;
  for (const auto& w : workers) {
    if (w.healthy && (w.role == role || w.role == WorkerRole::kColocated)) out.push_back(&w);
  }
  std::sort(out.begin(), out.end(),
            [](const WorkerInfo* a, const WorkerInfo* b) { return a->id < b->id; });
  return out;
}

Result<std::string> Router::PickPrefill(const RouteRequest& request,
                                        const std::vector<WorkerInfo>& workers) {
  return PickPrefillAmong(request, RoutingCandidates(workers, WorkerRole::kPrefill));
}

Result<std::string> Router::PickDecode(const RouteRequest& request,
                                       const std::vector<WorkerInfo>& workers) {
  return PickDecodeAmong(request, RoutingCandidates(workers, WorkerRole::kDecode));
}

Result<std::string> Router::PickPrefillAmong(const RouteRequest& request,
                                             std::span<const WorkerInfo* const> candidates) {
  if (candidates.empty()) return Unavailable("no healthy prefill worker");
  switch (options_.policy) {
    case RouterPolicy::kRoundRobin: {
      std::lock_guard<std::mutex> lock(mutex_);
      return candidates[round_robin_next_++ % candidates.size()]->id;
    }
    case RouterPolicy::kLeastLoaded: {
      auto best = std::min_element(candidates.begin(), candidates.end(),
                                   [](const WorkerInfo* a, const WorkerInfo* b) {
                                     if (a->queued_tokens != b->queued_tokens)
                                       return a->queued_tokens < b->queued_tokens;
                                     return a->running < b->running;
                                   });
      return (*best)->id;
    }
    case RouterPolicy::kPrefixAware: {
      const WorkerInfo* best = nullptr;
      int64_t best_score = std::numeric_limits<int64_t>::min();
      for (const WorkerInfo* w : candidates) {
        int64_t matched = prefix_index_.MatchedBlocks(w->id, request.prefix_blocks);
        int64_t score = matched * std::max<int64_t>(1, w->block_tokens) - w->queued_tokens;
        // Ties (every worker idle right after a heartbeat, nothing cached)
        // go to the worker with less queued work, then the smaller running
        // batch: without the second key every short prompt of a colocated
        // cluster went to the lowest id while the others' batches sat empty.
        const bool better_tie = score == best_score && (w->queued_tokens != best->queued_tokens
                                                            ? w->queued_tokens < best->queued_tokens
                                                            : w->running < best->running);
        if (best == nullptr || score > best_score || better_tie) {
          best = w;
          best_score = score;
        }
      }
      return best->id;
    }
  }
  return Internal("unknown router policy");
}

Result<std::string> Router::PickDecodeAmong(const RouteRequest& request,
                                            std::span<const WorkerInfo* const> candidates) {
  if (candidates.empty()) return Unavailable("no healthy decode worker");
  const WorkerInfo* best = nullptr;
  double best_score = 0;
  for (const WorkerInfo* w : candidates) {
    int64_t bt = std::max<int64_t>(1, w->block_tokens);
    int64_t needed = (request.prompt_tokens + request.max_new_tokens + bt - 1) / bt;
    if (w->total_kv_blocks > 0 && w->free_kv_blocks < needed) continue;
    if (w->max_batch > 0 && w->running >= w->max_batch) continue;
    double free_frac = w->total_kv_blocks > 0 ? static_cast<double>(w->free_kv_blocks) /
                                                    static_cast<double>(w->total_kv_blocks)
                                              : 1.0;
    double batch_frac = w->max_batch > 0
                            ? static_cast<double>(w->running) / static_cast<double>(w->max_batch)
                            : 0.0;
    double score = free_frac - batch_frac;
    if (best == nullptr || score > best_score) {
      best = w;
      best_score = score;
    }
  }
  if (best == nullptr) return ResourceExhausted("no decode worker has room for the request");
  return best->id;
}

}  // namespace kvrelay::coordinator
