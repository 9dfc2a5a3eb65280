// BlockManager: the bookkeeping half of the paged KV cache — block ids, free
// list, reference counts, the prefix cache (chain hash -> block), the LRU of
// unreferenced cached blocks, eviction and its events. It holds no KV bytes
// and knows no backend: the bytes live in a KvStorage (kv_storage.h), host
// slabs today, device slabs for a CUDA worker; KvBlockPool (kv_cache.h) puts
// the two together. Like llama.cpp's llama_kv_cells beside its KV tensors, or
// vLLM's BlockPool beside the model runner's KV caches.
//
// Thread-compatible: one owner thread. The const methods only read.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "engine/kv_cache/kv_cache.h"

namespace kvrelay::engine {

class BlockManager {
 public:
  explicit BlockManager(int64_t blocks);

  int64_t total_blocks() const { return total_; }
  // Blocks with refcount 0 that are not in the prefix cache.
  int64_t free_blocks() const { return static_cast<int64_t>(free_.size()); }
  // free_blocks() + unreferenced cached blocks (reclaimable by LRU eviction).
  int64_t available_blocks() const { return free_blocks() + lru_size_; }

  // Takes a free block (evicting the least recently used unreferenced cached
  // block when none is free: the spill hook sees it first, then kEvicted is
  // emitted), refcount 1. ResourceExhausted when none can be had.
  Result<BlockId> Allocate();
  void Ref(BlockId id);
  // Drops one reference. True when the block went back to the free list (its
  // storage may forget it); a cached block at 0 stays in the prefix cache (LRU).
  bool Release(BlockId id);
  int refcount(BlockId id) const { return Valid(id) ? refcount_[static_cast<size_t>(id)] : 0; }

  // True when Commit(id, hash) would register the block: it is referenced,
  // not cached yet, and no other block holds `hash`.
  bool WouldCommit(BlockId id, const BlockHash& hash) const;
  // Registers a referenced block under `hash` (emits kStored); a no-op unless
  // WouldCommit.
  void Commit(BlockId id, const BlockHash& hash);
  // Longest run of leading hashes present in the cache; each returned block is
  // Ref'ed for the caller and marked recently used.
  std::vector<BlockId> MatchPrefix(std::span<const BlockHash> hashes);
  bool IsCached(const BlockHash& hash) const { return index_.count(hash) != 0; }

  void SetSpillHook(std::function<void(const BlockHash&, BlockId)> hook) {
    spill_hook_ = std::move(hook);
  }
  void SetEventListener(std::function<void(const KvEvent&)> listener) {
    listener_ = std::move(listener);
  }

 private:
  struct HashHasher {
    size_t operator()(const BlockHash& h) const;
  };
  bool Valid(BlockId id) const { return id >= 0 && id < total_; }
  void Emit(KvEvent::Kind kind, const BlockHash& hash) {
    if (listener_) listener_(KvEvent{kind, hash});
  }
  // The LRU of unreferenced cached blocks: head = least recently used.
  void LruPushBack(BlockId id);
  void LruRemove(BlockId id);

  const int64_t total_;
  std::vector<int32_t> refcount_;
  std::vector<BlockId> free_;    // refcount 0, not cached
  std::vector<uint8_t> cached_;  // block is in index_
  std::vector<BlockHash> hash_;  // valid where cached_
  std::unordered_map<BlockHash, BlockId, HashHasher> index_;
  std::vector<BlockId> lru_prev_, lru_next_;
  BlockId lru_head_ = kNoBlock, lru_tail_ = kNoBlock;
  int64_t lru_size_ = 0;
  std::function<void(const BlockHash&, BlockId)> spill_hook_;
  std::function<void(const KvEvent&)> listener_;
};

}  // namespace kvrelay::engine
