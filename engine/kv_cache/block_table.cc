#include "engine/kv_cache/block_table.h"

#include <algorithm>
#include <utility>

namespace kvrelay::engine {

BlockTable::BlockTable(BlockTable&& other) noexcept
    : pool_(other.pool_), ids_(std::exchange(other.ids_, {})) {}

BlockTable& BlockTable::operator=(BlockTable&& other) noexcept {
  if (this != &other) {
    Release();
    pool_ = other.pool_;
    ids_ = std::exchange(other.ids_, {});
  }
  return *this;
}

Result<BlockTable> BlockTable::Allocate(KvBlockPool* pool, int64_t n) {
  BlockTable table(pool);
  for (int64_t i = 0; i < n; ++i) {
    Result<BlockId> b = pool->Allocate();
    if (!b.ok()) {
      return ResourceExhausted("could not reserve " + std::to_string(n) + " KV blocks (" +
                               std::to_string(i) + " available): " + b.status().message());
    }
    table.Adopt(*b);
  }
  return table;
}

void BlockTable::Append(BlockTable&& other) {
  ids_.insert(ids_.end(), other.ids_.begin(), other.ids_.end());
  other.ids_.clear();
}

void BlockTable::Replace(int64_t i, BlockId id) {
  BlockId& slot = ids_[static_cast<size_t>(i)];
  if (slot != kNoBlock) pool_->Release(slot);
  slot = id;
}

void BlockTable::Truncate(int64_t n) {
  while (size() > n) {
    if (ids_.back() != kNoBlock) pool_->Release(ids_.back());
    ids_.pop_back();
  }
}

void BlockTable::Release() {
  if (pool_ != nullptr) {
    for (BlockId id : ids_) {
      if (id != kNoBlock) pool_->Release(id);
    }
  }
  ids_.clear();
}

int64_t BlockTable::DropLeading(int64_t n) {
  int64_t dropped = 0;
  for (int64_t i = 0; i < std::min(n, size()); ++i) {
    BlockId& slot = ids_[static_cast<size_t>(i)];
    if (slot == kNoBlock) continue;
    pool_->Release(slot);
    slot = kNoBlock;
    ++dropped;
  }
  return dropped;
}

int64_t BlockTable::held() const {
  return static_cast<int64_t>(
      std::count_if(ids_.begin(), ids_.end(), [](BlockId id) { return id != kNoBlock; }));
}

}  // namespace kvrelay::engine
