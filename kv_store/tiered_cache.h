// TieredCache: connects a live KvBlockPool to the tiers below it.
//
// Spill path (pool -> tiers): Attach() installs the pool's spill hook. When
// the pool is about to evict an unreferenced cached block, the hook encodes it
// (block_codec.h) and puts it in the host-RAM tier; with write_through (the
// default) it is also queued to the disk tier at once, so it survives a
// restart; without it, the disk tier receives a block only when the RAM tier
// evicts it (less disk traffic, but lost on a crash). With no RAM tier, blocks
// go straight to disk. The disk tier's queue is bounded and drops when full:
// the pool never waits for the disk.
//
// The pool's hook passes only (hash, block); encoding also needs the block's
// token ids, model and tenant. The cache learns them from NoteSequence() and
// RestorePrefix() (which notes every full block of the prompt it is given), in
// a bounded table (max_tracked_blocks, LRU). A block evicted without a note is
// not spilled (counted as spills_untracked).
//
// Restore path (tiers -> pool): RestorePrefix() takes the longest prefix the
// pool holds, then continues block by block through the tiers (RAM, then
// disk): each value must decode against the expected model, layout, tenant,
// chain hash and tokens, else it is a miss (counted by reason) and the
// restore stops there.
//
// Threading: methods that take a pool run on the pool's owner thread (the
// pool is thread-compatible and the spill hook runs there too). stats() may
// be called from any thread.
#pragma once

#include <array>
#include <cstdint>
#include <list>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "engine/kv_cache/kv_cache.h"
#include "kv_store/block_codec.h"
#include "kv_store/host_ram_tier.h"
#include "kv_store/kv_tier.h"

namespace kvrelay::kv_store {

class TieredCache {
 public:
  struct Options {
    bool write_through = true;             // spill to disk at once, not only on RAM eviction
    bool promote_disk_hits = true;         // a block restored from disk is also put in RAM
    int64_t max_tracked_blocks = 1 << 17;  // bound of the (hash -> tokens, tenant) table
  };

  struct Stats {
    int64_t restored_blocks_ram = 0;
    int64_t restored_blocks_disk = 0;
    int64_t restored_bytes = 0;
    int64_t pool_hit_blocks = 0;  // blocks RestorePrefix found already in the pool
    std::array<int64_t, static_cast<size_t>(MissReason::kCount)> misses{};  // by reason
    int64_t spills = 0;  // blocks encoded and handed to a tier
    int64_t spill_bytes = 0;
    int64_t spills_dropped = 0;    // refused by a full disk queue (or over capacity)
    int64_t spills_untracked = 0;  // evicted blocks with no noted tokens
    int64_t demotions = 0;         // RAM evictions forwarded to disk
    int64_t persisted_blocks = 0;  // written by PersistPrefix
  };

  // `ram` and `disk` may each be null; they are not owned and must outlive
  // this cache. When both are given and write_through is false, this installs
  // the RAM tier's eviction callback.
  TieredCache(const Options& options, HostRamTier* ram, KvTier* disk);
  ~TieredCache();
  TieredCache(const TieredCache&) = delete;
  TieredCache& operator=(const TieredCache&) = delete;

  // Installs the spill hook on `pool` (replacing any other). The pool must
  // stay alive until Detach() or this cache's destruction, which removes it.
  void Attach(engine::KvBlockPool* pool);
  void Detach();

  // Records tokens/tenant/model of every full block of `tokens` so their
  // eviction can be spilled.
  void NoteSequence(std::span<const int32_t> tokens, const engine::ModelFingerprint& model,
                    std::string_view tenant_salt);

  // Fills `table` (cleared first) with the longest prefix of `tokens`' full
  // blocks that is available: blocks already in the pool (MatchPrefix), then
  // blocks restored from the tiers into newly allocated, committed pool
  // blocks. Every returned block holds one reference for the caller (Release
  // them when done). Returns the number of tokens restored from the tiers
  // (not counting pool hits). Stops early, without error, when the pool has no
  // free block. Also notes the sequence (NoteSequence).
  Result<int> RestorePrefix(engine::KvBlockPool* pool, std::span<const int32_t> tokens,
                            const engine::ModelFingerprint& model, std::string_view tenant_salt,
                            std::vector<engine::BlockId>* table);

  // Encodes the blocks of `tokens`' prefix that are in the pool now and puts
  // them in the tiers (as a spill would), without evicting them; e.g. before a
  // planned shutdown. Returns the number of blocks handed to the tiers.
  Result<int> PersistPrefix(engine::KvBlockPool* pool, std::span<const int32_t> tokens,
                            const engine::ModelFingerprint& model, std::string_view tenant_salt);

  Stats stats() const;

 private:
  struct Note {
    engine::ModelFingerprint model;
    Sha256Digest salt_hash;
    std::vector<int32_t> tokens;
  };
  void OnSpill(const BlockHash& hash, engine::BlockId block);
  void NoteLocked(const BlockHash& hash, Note note);
  // Encodes and stores one block; returns true if some tier accepted it.
  bool Store(const BlockHash& hash, const Note& note, engine::KvBlockPool* pool,
             engine::BlockId block);
  void CountMiss(MissReason r);

  const Options options_;
  HostRamTier* const ram_;
  KvTier* const disk_;
  engine::KvBlockPool* pool_ = nullptr;  // attached pool, owner thread only

  mutable std::mutex mutex_;
  // LRU of notes, front = newest. Guarded by mutex_.
  std::list<std::pair<BlockHash, Note>> notes_;
  std::unordered_map<BlockHash, std::list<std::pair<BlockHash, Note>>::iterator, BlockHashHasher>
      note_index_;  // guarded by mutex_
  Stats stats_;     // guarded by mutex_
};

}  // namespace kvrelay::kv_store
