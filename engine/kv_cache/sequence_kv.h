// SequenceKv: one sequence's view of the paged KV pool — its block table and
// length — with fork (shared blocks, refcounted) and copy-on-write.
//
// Ownership: a SequenceKv holds one reference on every block in its table and
// drops them in Release() or its destructor. Thread-compatible, like the pool:
// use it only on the pool's owner thread. The pool must outlive it.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "engine/kv_cache/kv_cache.h"

namespace kvrelay::engine {

class SequenceKv {
 public:
  struct Slot {
    BlockId block;
    int offset;  // slot within the block
  };

  explicit SequenceKv(KvBlockPool* pool);
  ~SequenceKv();
  SequenceKv(SequenceKv&& other) noexcept;
  SequenceKv& operator=(SequenceKv&& other) noexcept;
  SequenceKv(const SequenceKv&) = delete;
  SequenceKv& operator=(const SequenceKv&) = delete;

  int64_t length() const { return length_; }
  const std::vector<BlockId>& blocks() const { return blocks_; }
  int block_tokens() const { return pool_->layout().block_tokens; }
  // Number of leading blocks that are full (length / block_tokens).
  int64_t full_blocks() const { return length_ / block_tokens(); }

  // Pool blocks Append(n) would need now (new blocks plus a copy-on-write of
  // the shared tail block).
  int64_t BlocksNeededToAppend(int64_t n) const;

  // Extends the sequence by n slots [length, length + n) and returns the first
  // new position. Allocates blocks as needed, and makes every block holding a
  // new slot exclusively owned: a shared tail (refcount > 1 after Fork or a
  // prefix match of a partial block) is copied into a fresh block first.
  // All or nothing: ResourceExhausted (and no change) if the pool cannot supply.
  Result<int64_t> Append(int64_t n);

  // Where position pos (< length) lives.
  Slot SlotOf(int64_t pos) const {
    const int bt = block_tokens();
    return Slot{blocks_[pos / bt], static_cast<int>(pos % bt)};
  }

  // A new sequence sharing every block (each Ref'ed once more); the next write
  // of either into a shared block copies it (CoW).
  SequenceKv Fork() const;

  // Adopts blocks returned by KvBlockPool::MatchPrefix (the references pass to
  // this sequence) as its leading full blocks. FailedPrecondition unless the
  // sequence is empty.
  Status AdoptPrefix(std::span<const BlockId> matched);

  // Commits full blocks to the prefix cache: hashes[i] is the chain hash of
  // block i (HashPrefixBlocks of the sequence's tokens). Only blocks that are
  // full (i < full_blocks()) and have a hash are committed.
  void CommitFullBlocks(std::span<const BlockHash> hashes);

  // Drops to `new_length` (<= length), releasing blocks no longer needed.
  void Truncate(int64_t new_length);

  // Drops every reference; the sequence becomes empty. Idempotent.
  void Release();

 private:
  KvBlockPool* pool_;  // not owned; null after move
  std::vector<BlockId> blocks_;
  int64_t length_ = 0;
};

}  // namespace kvrelay::engine
