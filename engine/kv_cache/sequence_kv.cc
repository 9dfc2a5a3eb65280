#include "engine/kv_cache/sequence_kv.h"

#include <utility>

namespace kvrelay::engine {

SequenceKv::SequenceKv(KvBlockPool* pool) : pool_(pool) {}

SequenceKv::~SequenceKv() { Release(); }

SequenceKv::SequenceKv(SequenceKv&& other) noexcept
    : pool_(other.pool_), blocks_(std::move(other.blocks_)), length_(other.length_) {
  other.blocks_.clear();
  other.length_ = 0;
}

SequenceKv& SequenceKv::operator=(SequenceKv&& other) noexcept {
  if (this != &other) {
    Release();
    pool_ = other.pool_;
    blocks_ = std::move(other.blocks_);
    length_ = other.length_;
    other.blocks_.clear();
    other.length_ = 0;
  }
  return *this;
}

int64_t SequenceKv::BlocksNeededToAppend(int64_t n) const {
  if (n <= 0) return 0;
  const int64_t bt = block_tokens();
  const int64_t needed_total = (length_ + n + bt - 1) / bt;
  int64_t need = needed_total - static_cast<int64_t>(blocks_.size());
  // The block holding position length_ gets written; copy it if shared.
  const int64_t idx = length_ / bt;
  if (idx < static_cast<int64_t>(blocks_.size()) && pool_->refcount(blocks_[idx]) > 1) ++need;
  return need;
}

Result<int64_t> SequenceKv::Append(int64_t n) {
  if (n < 0) return InvalidArgument("SequenceKv::Append of a negative count");
  const int64_t first = length_;
  if (n == 0) return first;
  const int64_t need = BlocksNeededToAppend(n);
  if (need > pool_->available_blocks()) {
    return ResourceExhausted("KV pool has " + std::to_string(pool_->available_blocks()) +
                             " blocks available, appending " + std::to_string(n) +
                             " tokens needs " + std::to_string(need));
  }
  const int64_t bt = block_tokens();
  // Copy-on-write of the (partially filled or shared) block that receives position length_.
  const int64_t idx = length_ / bt;
  if (idx < static_cast<int64_t>(blocks_.size()) && pool_->refcount(blocks_[idx]) > 1) {
    ASSIGN_OR_RETURN(BlockId fresh, pool_->Allocate());
    pool_->CopyBlock(blocks_[idx], fresh);
    pool_->Release(blocks_[idx]);
    blocks_[idx] = fresh;
  }
  const int64_t needed_total = (length_ + n + bt - 1) / bt;
  std::vector<BlockId> added;
  while (static_cast<int64_t>(blocks_.size() + added.size()) < needed_total) {
    Result<BlockId> b = pool_->Allocate();
    if (!b.ok()) {  // cannot happen after the availability check; undo to stay all-or-nothing
      for (BlockId id : added) pool_->Release(id);
      return b.status();
    }
    added.push_back(*b);
  }
  blocks_.insert(blocks_.end(), added.begin(), added.end());
  length_ += n;
  return first;
}

SequenceKv SequenceKv::Fork() const {
  SequenceKv child(pool_);
  child.blocks_ = blocks_;
  child.length_ = length_;
  for (BlockId id : blocks_) pool_->Ref(id);
  return child;
}

Status SequenceKv::AdoptPrefix(std::span<const BlockId> matched) {
  if (!blocks_.empty() || length_ != 0) {
    return FailedPrecondition("SequenceKv::AdoptPrefix on a non-empty sequence");
  }
  blocks_.assign(matched.begin(), matched.end());
  length_ = static_cast<int64_t>(matched.size()) * block_tokens();
  return Status::Ok();
}

void SequenceKv::CommitFullBlocks(std::span<const BlockHash> hashes) {
  const int64_t n = std::min<int64_t>(full_blocks(), static_cast<int64_t>(hashes.size()));
  for (int64_t i = 0; i < n; ++i) pool_->Commit(blocks_[i], hashes[i]);
}

void SequenceKv::Truncate(int64_t new_length) {
  if (new_length < 0 || new_length >= length_) return;
  const int64_t bt = block_tokens();
  const size_t keep = static_cast<size_t>((new_length + bt - 1) / bt);
  while (blocks_.size() > keep) {
    pool_->Release(blocks_.back());
    blocks_.pop_back();
  }
  length_ = new_length;
}

void SequenceKv::Release() {
  if (pool_ == nullptr) return;
  for (BlockId id : blocks_) pool_->Release(id);
  blocks_.clear();
  length_ = 0;
}

}  // namespace kvrelay::engine
