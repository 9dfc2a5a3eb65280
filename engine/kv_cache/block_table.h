// BlockTable: a list of KV block ids that OWNS one pool reference per entry.
//
// Every holder of KV blocks (an engine sequence, a decode-side reservation, a
// prefill stream waiting for its sender, a restore in flight) keeps them in a
// BlockTable, so the references go back to the pool on every path — finish,
// cancel, error, preemption, peer death — by destruction, never by a hand-
// written release loop. Move-only. Thread-compatible, like the pool: use it
// only on the pool's owner thread. The pool must outlive the table.
//
// An entry may be a hole (kNoBlock): a sliding-window table (kv_groups.h)
// drops the blocks its sequence never reads again but keeps indexing by
// position / B. A hole holds no reference.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "engine/kv_cache/kv_cache.h"

namespace kvrelay::engine {

class BlockTable {
 public:
  BlockTable() = default;
  explicit BlockTable(KvBlockPool* pool) : pool_(pool) {}
  ~BlockTable() { Release(); }
  BlockTable(BlockTable&& other) noexcept;
  BlockTable& operator=(BlockTable&& other) noexcept;
  BlockTable(const BlockTable&) = delete;
  BlockTable& operator=(const BlockTable&) = delete;

  // `n` freshly allocated blocks, all or nothing (ResourceExhausted, nothing held).
  static Result<BlockTable> Allocate(KvBlockPool* pool, int64_t n);

  KvBlockPool* pool() const { return pool_; }
  const std::vector<BlockId>& ids() const { return ids_; }
  std::span<const BlockId> span() const { return ids_; }
  int64_t size() const { return static_cast<int64_t>(ids_.size()); }
  bool empty() const { return ids_.empty(); }
  BlockId operator[](int64_t i) const { return ids_[static_cast<size_t>(i)]; }

  // Takes over one reference the caller holds (from Allocate or MatchPrefix).
  void Adopt(BlockId id) { ids_.push_back(id); }
  void Adopt(std::span<const BlockId> ids) { ids_.insert(ids_.end(), ids.begin(), ids.end()); }
  // Moves every reference of `other` (same pool) to the end of this table.
  void Append(BlockTable&& other);
  // Entry i now names `id` (whose reference the caller hands over); the old
  // block's reference is dropped. Copy-on-write uses it.
  void Replace(int64_t i, BlockId id);
  // Keeps the first n entries, dropping the references of the rest.
  void Truncate(int64_t n);
  // Drops the references of entries [0, n) and makes them holes (kNoBlock).
  // Returns how many references it dropped.
  int64_t DropLeading(int64_t n);
  // Entries that are not holes (references held).
  int64_t held() const;
  // Drops every reference. Idempotent.
  void Release();

 private:
  KvBlockPool* pool_ = nullptr;  // not owned
  std::vector<BlockId> ids_;
};

}  // namespace kvrelay::engine
