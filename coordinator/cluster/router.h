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
//
// Optimistic prefixes (#42): workers report the blocks they cached with their
// heartbeats, so a request repeated right after the first would find nothing
// cached anywhere. NoteRouted counts a routed request's chain as cached on the
// worker it was sent to until a deadline, by when the worker's own stored or
// evicted events have corrected the index; an eviction it reports, or its
// removal, clears the optimistic entry at once.
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

#include "common/clock.h"
#include "common/status.h"
#include "coordinator/backend.h"

namespace kvrelay::coordinator {

enum class RouterPolicy { kRoundRobin, kLeastLoaded, kPrefixAware };
Result<RouterPolicy> ParseRouterPolicy(std::string_view name);  // "round_robin", ...
std::string_view RouterPolicyName(RouterPolicy p);

struct PrefixBlockHashHasher {
  size_t operator()(const PrefixBlockHash& h) const;
};

// One worker's match for a chain (PrefixIndex::MatchedBlocksAll).
struct PrefixMatch {
  std::string worker;
  int64_t blocks = 0;  // length of the leading run of the chain it caches, >= 1
};

// Which worker caches which prefix block, fed by the workers' stored/evicted
// events. Thread-safe. Memory is bounded by the workers' own cache sizes: one
// entry per (worker, block) held.
//
// Inverted: block hash -> the workers holding it, so that scoring a chain
// against every worker (MatchedBlocksAll) walks the chain once, narrowing the
// set of workers still matching, and never visits a worker that does not hold
// the chain's first block. The per-worker scan it replaced cost one hash-set
// probe per worker per block and was half the CPU of a 1,000-node simulation.
class PrefixIndex {
 public:
  void OnStored(const std::string& worker, const PrefixBlockHash& hash);
  void OnEvicted(const std::string& worker, const PrefixBlockHash& hash);
  // Forgets everything about a worker (it died or re-registered). Costs
  // O(blocks the worker held).
  void RemoveWorker(const std::string& worker);
  // Length of the leading run of `chain` cached on `worker`.
  int64_t MatchedBlocks(const std::string& worker, std::span<const PrefixBlockHash> chain) const;
  // MatchedBlocks for every worker at once: the workers with a match of at
  // least one block, sorted by worker id (every other worker matches 0).
  // Costs O(chain length + the sum over the chain of the workers still
  // matching), not O(workers).
  std::vector<PrefixMatch> MatchedBlocksAll(std::span<const PrefixBlockHash> chain) const;
  int64_t BlockCount(const std::string& worker) const;

 private:
  struct Holder {
    uint32_t slot;  // the worker (index into slots_)
    uint32_t pos;   // the block's index in slots_[slot].blocks
  };
  // The workers holding one block, sorted by slot: in place when there is
  // one (the common case: a request's own blocks), on the heap beyond.
  class Holders {
   public:
    Holders() = default;
    ~Holders();
    Holders(const Holders&) = delete;
    Holders& operator=(const Holders&) = delete;
    const Holder* begin() const { return cap_ > 1 ? heap_ : &one_; }
    const Holder* end() const { return begin() + size_; }
    bool empty() const { return size_ == 0; }
    const Holder* Find(uint32_t slot) const;  // nullptr when absent
    Holder* Find(uint32_t slot) {
      return const_cast<Holder*>(static_cast<const Holders&>(*this).Find(slot));
    }
    void Insert(Holder h);        // h.slot is absent
    void Erase(const Holder* h);  // h points into this list

   private:
    Holder* data() { return cap_ > 1 ? heap_ : &one_; }
    uint32_t size_ = 0;
    uint32_t cap_ = 1;
    union {
      Holder one_{};
      Holder* heap_;
    };
  };
  using BlockMap = std::unordered_map<PrefixBlockHash, Holders, PrefixBlockHashHasher>;
  using Block = BlockMap::value_type;  // node addresses are stable across rehashes
  struct Slot {
    std::string worker;
    // The blocks this worker holds. Each Holder records its position here, so
    // that an eviction is a swap-remove and RemoveWorker walks only this list.
    std::vector<Block*> blocks;
  };

  // Drops `slot` from `block`'s holders (erasing the block when it was the
  // last); `holder` is that slot's entry. mutex_ held.
  void EraseLocked(BlockMap::iterator block, Holder* holder);

  mutable std::mutex mutex_;
  // guarded by mutex_
  BlockMap blocks_;
  std::unordered_map<std::string, uint32_t> slot_of_;
  std::vector<Slot> slots_;
  std::vector<uint32_t> free_slots_;  // of removed workers, reused
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
  // What the workers reported. Feed evictions and removals through
  // OnEvicted / RemoveWorker below so that optimistic entries follow them.
  PrefixIndex& prefix_index() { return prefix_index_; }

  // Counts `chain` as cached on `worker` (for the prefix_aware policy) until
  // `until` or until the worker reports evicting a block of it: the router
  // just sent the request there, and the worker's stored events come with its
  // next heartbeat. An earlier `until` than a previous note of the same block
  // does not shorten it.
  void NoteRouted(const std::string& worker, std::span<const PrefixBlockHash> chain,
                  TimePoint until);
  // A worker's eviction event, and the removal of a worker (it died or
  // re-registered): both the reported and the optimistic entries go.
  void OnEvicted(const std::string& worker, const PrefixBlockHash& hash);
  void RemoveWorker(const std::string& worker);
  // Blocks of `chain` counted as cached on `worker`: the longer of the
  // reported and the optimistic leading runs.
  int64_t MatchedBlocks(const std::string& worker, std::span<const PrefixBlockHash> chain);

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
  struct Noted {
    std::string worker;
    std::vector<PrefixBlockHash> chain;
  };
  // MatchedBlocksAll over the reported and the optimistic index, the longer
  // run per worker; drops expired optimistic entries first.
  std::vector<PrefixMatch> Matches(std::span<const PrefixBlockHash> chain);
  void ExpireLocked(TimePoint now);  // mutex_ held

  const RouterOptions options_;
  PrefixIndex prefix_index_;
  PrefixIndex optimistic_;  // NoteRouted's entries, until they expire
  std::mutex mutex_;
  uint64_t round_robin_next_ = 0;  // guarded by mutex_
  // guarded by mutex_: the notes by deadline, and each (worker, block)'s
  // latest deadline (a note expires a block only when it set the latest).
  std::multimap<TimePoint, Noted> noted_;
  std::map<std::string, std::unordered_map<PrefixBlockHash, TimePoint, PrefixBlockHashHasher>>
      noted_until_;
};

}  // namespace kvrelay::coordinator
