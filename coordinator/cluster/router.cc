#include "coordinator/cluster/router.h"

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

PrefixIndex::Holders::~Holders() {
  if (cap_ > 1) delete[] heap_;
}

const PrefixIndex::Holder* PrefixIndex::Holders::Find(uint32_t slot) const {
  const Holder* b = begin();
  const Holder* e = end();
  const Holder* it =
      std::lower_bound(b, e, slot, [](const Holder& h, uint32_t s) { return h.slot < s; });
  return it != e && it->slot == slot ? it : nullptr;
}

void PrefixIndex::Holders::Insert(Holder h) {
  if (size_ == cap_) {
    // Grows 1 -> 4 -> 8 -> ...; at most one entry per worker.
    const uint32_t cap = cap_ == 1 ? 4 : cap_ * 2;
    auto* grown = new Holder[cap];
    std::copy(data(), data() + size_, grown);
    if (cap_ > 1) delete[] heap_;
    heap_ = grown;
    cap_ = cap;
  }
  Holder* b = data();
  Holder* e = b + size_;
  Holder* at =
      std::lower_bound(b, e, h.slot, [](const Holder& x, uint32_t s) { return x.slot < s; });
  std::copy_backward(at, e, e + 1);
  *at = h;
  ++size_;
}

void PrefixIndex::Holders::Erase(const Holder* h) {
  Holder* b = data();
  Holder* at = b + (h - b);
  std::copy(at + 1, b + size_, at);
  --size_;
}

void PrefixIndex::OnStored(const std::string& worker, const PrefixBlockHash& hash) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto [named, is_new] = slot_of_.try_emplace(worker, 0);
  if (is_new) {
    if (free_slots_.empty()) {
      named->second = static_cast<uint32_t>(slots_.size());
      slots_.emplace_back();
    } else {
      named->second = free_slots_.back();
      free_slots_.pop_back();
    }
    slots_[named->second].worker = worker;
  }
  const uint32_t slot = named->second;
  Block& block = *blocks_.try_emplace(hash).first;
  if (block.second.Find(slot) != nullptr) return;  // already known
  std::vector<Block*>& held = slots_[slot].blocks;
  block.second.Insert({slot, static_cast<uint32_t>(held.size())});
  held.push_back(&block);
}

void PrefixIndex::EraseLocked(BlockMap::iterator block, Holder* holder) {
  std::vector<Block*>& held = slots_[holder->slot].blocks;
  // Swap-remove from the worker's list, re-pointing the block moved into the gap.
  Block* moved = held.back();
  held[holder->pos] = moved;
  if (moved != &*block) moved->second.Find(holder->slot)->pos = holder->pos;
  held.pop_back();
  block->second.Erase(holder);
  if (block->second.empty()) blocks_.erase(block);
}

void PrefixIndex::OnEvicted(const std::string& worker, const PrefixBlockHash& hash) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto named = slot_of_.find(worker);
  if (named == slot_of_.end()) return;
  auto block = blocks_.find(hash);
  if (block == blocks_.end()) return;
  Holder* holder = block->second.Find(named->second);
  if (holder == nullptr) return;
  EraseLocked(block, holder);
}

void PrefixIndex::RemoveWorker(const std::string& worker) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto named = slot_of_.find(worker);
  if (named == slot_of_.end()) return;
  const uint32_t slot = named->second;
  Slot& s = slots_[slot];
  for (Block* b : s.blocks) {
    b->second.Erase(b->second.Find(slot));
    if (b->second.empty()) {
      const PrefixBlockHash key = b->first;  // erase(key) destroys the node holding it
      blocks_.erase(key);
    }
  }
  s.blocks = {};  // returns the memory, not just the size
  s.worker.clear();
  free_slots_.push_back(slot);
  slot_of_.erase(named);
}

int64_t PrefixIndex::MatchedBlocks(const std::string& worker,
                                   std::span<const PrefixBlockHash> chain) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto named = slot_of_.find(worker);
  if (named == slot_of_.end()) return 0;
  int64_t n = 0;
  for (const auto& h : chain) {
    auto block = blocks_.find(h);
    if (block == blocks_.end()) break;
    if (block->second.Find(named->second) == nullptr) break;
    ++n;
  }
  return n;
}

std::vector<PrefixMatch> PrefixIndex::MatchedBlocksAll(
    std::span<const PrefixBlockHash> chain) const {
  std::vector<PrefixMatch> out;
  std::lock_guard<std::mutex> lock(mutex_);
  if (chain.empty()) return out;
  auto first = blocks_.find(chain[0]);
  if (first == blocks_.end()) return out;
  // The workers matching every block so far, in slot order (as Holders are).
  std::vector<uint32_t> alive;
  for (const Holder& h : first->second) alive.push_back(h.slot);
  const auto by_slot = [](const Holder& h, uint32_t s) { return h.slot < s; };
  size_t i = 1;
  for (; i < chain.size() && !alive.empty(); ++i) {
    auto block = blocks_.find(chain[i]);
    if (block == blocks_.end()) break;
    const Holder* at = block->second.begin();
    const Holder* end = block->second.end();
    size_t kept = 0;
    for (uint32_t slot : alive) {
      at = std::lower_bound(at, end, slot, by_slot);
      if (at != end && at->slot == slot) {
        alive[kept++] = slot;
      } else {
        out.push_back({slots_[slot].worker, static_cast<int64_t>(i)});  // first miss at i
      }
    }
    alive.resize(kept);
  }
  for (uint32_t slot : alive) out.push_back({slots_[slot].worker, static_cast<int64_t>(i)});
  std::sort(out.begin(), out.end(),
            [](const PrefixMatch& a, const PrefixMatch& b) { return a.worker < b.worker; });
  return out;
}

int64_t PrefixIndex::BlockCount(const std::string& worker) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto named = slot_of_.find(worker);
  return named == slot_of_.end() ? 0 : static_cast<int64_t>(slots_[named->second].blocks.size());
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

namespace {

// The lower bound of `id` in `matches` (sorted by worker id, ids unique),
// `from` being the lower bound of an earlier id: a step forward when ids come
// in order, a binary search when they do not.
size_t SeekMatch(const std::vector<PrefixMatch>& matches, size_t from, const std::string& id) {
  if (from > 0 && !(matches[from - 1].worker < id)) {
    return static_cast<size_t>(
        std::lower_bound(matches.begin(), matches.end(), id,
                         [](const PrefixMatch& m, const std::string& v) { return m.worker < v; }) -
        matches.begin());
  }
  while (from < matches.size() && matches[from].worker < id) ++from;
  return from;
}

}  // namespace

void Router::NoteRouted(const std::string& worker, std::span<const PrefixBlockHash> chain,
                        TimePoint until) {
  if (chain.empty()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  ExpireLocked(Clock::now());
  auto& latest = noted_until_[worker];
  for (const PrefixBlockHash& h : chain) {
    TimePoint& t = latest[h];
    t = std::max(t, until);
    optimistic_.OnStored(worker, h);
  }
  noted_.emplace(until, Noted{worker, std::vector<PrefixBlockHash>(chain.begin(), chain.end())});
}

void Router::ExpireLocked(TimePoint now) {
  while (!noted_.empty() && noted_.begin()->first <= now) {
    const Noted& n = noted_.begin()->second;
    if (auto w = noted_until_.find(n.worker); w != noted_until_.end()) {
      for (const PrefixBlockHash& h : n.chain) {
        auto it = w->second.find(h);
        if (it == w->second.end() || it->second > now) continue;  // noted again since
        w->second.erase(it);
        optimistic_.OnEvicted(n.worker, h);
      }
      if (w->second.empty()) noted_until_.erase(w);
    }
    noted_.erase(noted_.begin());
  }
}

void Router::OnEvicted(const std::string& worker, const PrefixBlockHash& hash) {
  prefix_index_.OnEvicted(worker, hash);
  std::lock_guard<std::mutex> lock(mutex_);
  if (auto w = noted_until_.find(worker); w != noted_until_.end()) {
    w->second.erase(hash);
    optimistic_.OnEvicted(worker, hash);
  }
}

void Router::RemoveWorker(const std::string& worker) {
  prefix_index_.RemoveWorker(worker);
  std::lock_guard<std::mutex> lock(mutex_);
  noted_until_.erase(worker);  // its notes in noted_ then expire as no-ops
  optimistic_.RemoveWorker(worker);
}

std::vector<PrefixMatch> Router::Matches(std::span<const PrefixBlockHash> chain) {
  std::vector<PrefixMatch> reported = prefix_index_.MatchedBlocksAll(chain);
  std::vector<PrefixMatch> noted;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (noted_.empty()) return reported;
    ExpireLocked(Clock::now());
    noted = optimistic_.MatchedBlocksAll(chain);
  }
  if (noted.empty()) return reported;
  // Merge the two id-sorted lists, keeping the longer run per worker.
  std::vector<PrefixMatch> out;
  out.reserve(reported.size() + noted.size());
  size_t i = 0, j = 0;
  while (i < reported.size() || j < noted.size()) {
    if (j == noted.size() || (i < reported.size() && reported[i].worker < noted[j].worker)) {
      out.push_back(std::move(reported[i++]));
    } else if (i == reported.size() || noted[j].worker < reported[i].worker) {
      out.push_back(std::move(noted[j++]));
    } else {
      PrefixMatch m = std::move(reported[i++]);
      m.blocks = std::max(m.blocks, noted[j++].blocks);
      out.push_back(std::move(m));
    }
  }
  return out;
}

int64_t Router::MatchedBlocks(const std::string& worker, std::span<const PrefixBlockHash> chain) {
  for (const PrefixMatch& m : Matches(chain)) {
    if (m.worker == worker) return m.blocks;
  }
  return 0;
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
      // One walk of the chain for every worker (the per-candidate lookup was
      // O(candidates x chain) hash probes); the candidates are matched to it
      // by id, merging when they come in id order as RoutingCandidates makes them.
      const std::vector<PrefixMatch> matches = Matches(request.prefix_blocks);
      size_t next = 0;  // lower bound of the previous candidate's id in matches
      const WorkerInfo* best = nullptr;
      int64_t best_score = std::numeric_limits<int64_t>::min();
      for (const WorkerInfo* w : candidates) {
        int64_t matched = 0;
        if (!matches.empty()) {
          next = SeekMatch(matches, next, w->id);
          if (next < matches.size() && matches[next].worker == w->id)
            matched = matches[next].blocks;
        }
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
