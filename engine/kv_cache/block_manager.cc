#include "engine/kv_cache/block_manager.h"

#include <cstring>

#include "common/logging.h"

namespace kvrelay::engine {

size_t BlockManager::HashHasher::operator()(const BlockHash& h) const {
  size_t v;  // the key is already a uniformly distributed SHA-256 digest
  std::memcpy(&v, h.data(), sizeof(v));
  return v;
}

BlockManager::BlockManager(int64_t blocks)
    : total_(blocks),
      refcount_(static_cast<size_t>(blocks), 0),
      cached_(static_cast<size_t>(blocks), 0),
      hash_(static_cast<size_t>(blocks)),
      lru_prev_(static_cast<size_t>(blocks), kNoBlock),
      lru_next_(static_cast<size_t>(blocks), kNoBlock) {
  free_.reserve(static_cast<size_t>(blocks));
  for (int64_t i = blocks - 1; i >= 0; --i) free_.push_back(static_cast<BlockId>(i));
}

Result<BlockId> BlockManager::Allocate() {
  BlockId id = kNoBlock;
  if (!free_.empty()) {
    id = free_.back();
    free_.pop_back();
  } else if (lru_head_ != kNoBlock) {
    id = lru_head_;
    const BlockHash hash = hash_[static_cast<size_t>(id)];
    if (spill_hook_) spill_hook_(hash, id);  // the block's bytes are still intact here
    LruRemove(id);
    cached_[static_cast<size_t>(id)] = 0;
    index_.erase(hash);
    Emit(KvEvent::Kind::kEvicted, hash);
  } else {
    return ResourceExhausted("KV pool exhausted: all " + std::to_string(total_) +
                             " blocks are referenced");
  }
  refcount_[static_cast<size_t>(id)] = 1;
  return id;
}

void BlockManager::Ref(BlockId id) {
  if (!Valid(id) ||
      (refcount_[static_cast<size_t>(id)] == 0 && !cached_[static_cast<size_t>(id)])) {
    LOG_ERROR << "KvBlockPool::Ref on block " << id << " that is not allocated";
    return;
  }
  if (refcount_[static_cast<size_t>(id)]++ == 0) LruRemove(id);
}

bool BlockManager::Release(BlockId id) {
  if (!Valid(id) || refcount_[static_cast<size_t>(id)] <= 0) {
    LOG_ERROR << "KvBlockPool::Release on block " << id << " with no reference";
    return false;
  }
  if (--refcount_[static_cast<size_t>(id)] > 0) return false;
  if (cached_[static_cast<size_t>(id)]) {
    LruPushBack(id);
    return false;
  }
  free_.push_back(id);
  return true;
}

bool BlockManager::WouldCommit(BlockId id, const BlockHash& hash) const {
  return Valid(id) && refcount_[static_cast<size_t>(id)] > 0 && !cached_[static_cast<size_t>(id)] &&
         index_.count(hash) == 0;
}

void BlockManager::Commit(BlockId id, const BlockHash& hash) {
  if (!Valid(id) || refcount_[static_cast<size_t>(id)] <= 0) {
    LOG_ERROR << "KvBlockPool::Commit on block " << id << " with no reference";
    return;
  }
  if (!WouldCommit(id, hash)) return;
  cached_[static_cast<size_t>(id)] = 1;
  hash_[static_cast<size_t>(id)] = hash;
  index_.emplace(hash, id);
  Emit(KvEvent::Kind::kStored, hash);
}

std::vector<BlockId> BlockManager::MatchPrefix(std::span<const BlockHash> hashes) {
  std::vector<BlockId> out;
  for (const BlockHash& h : hashes) {
    auto it = index_.find(h);
    if (it == index_.end()) break;
    Ref(it->second);
    out.push_back(it->second);
  }
  return out;
}

void BlockManager::LruPushBack(BlockId id) {
  lru_prev_[static_cast<size_t>(id)] = lru_tail_;
  lru_next_[static_cast<size_t>(id)] = kNoBlock;
  if (lru_tail_ != kNoBlock) {
    lru_next_[static_cast<size_t>(lru_tail_)] = id;
  } else {
    lru_head_ = id;
  }
  lru_tail_ = id;
  ++lru_size_;
}

void BlockManager::LruRemove(BlockId id) {
  const BlockId p = lru_prev_[static_cast<size_t>(id)], n = lru_next_[static_cast<size_t>(id)];
  if (p != kNoBlock) {
    lru_next_[static_cast<size_t>(p)] = n;
  } else {
    lru_head_ = n;
  }
  if (n != kNoBlock) {
    lru_prev_[static_cast<size_t>(n)] = p;
  } else {
    lru_tail_ = p;
  }
  lru_prev_[static_cast<size_t>(id)] = lru_next_[static_cast<size_t>(id)] = kNoBlock;
  --lru_size_;
}

}  // namespace kvrelay::engine
