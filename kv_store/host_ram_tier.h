// HostRamTier: a KvTier in process memory with LRU eviction under a byte
// budget. Values are kept as immutable shared buffers, so Get copies out
// without holding the lock for long.
#pragma once

#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "kv_store/kv_tier.h"

namespace kvrelay::kv_store {

struct BlockHashHasher {
  size_t operator()(const BlockHash& h) const {
    size_t v;
    static_assert(sizeof(v) <= sizeof(BlockHash));
    __builtin_memcpy(&v, h.data(), sizeof(v));  // SHA-256 output: any 8 bytes are uniform
    return v;
  }
};

class HostRamTier final : public KvTier {
 public:
  struct Options {
    int64_t capacity_bytes = 1LL << 30;  // values only; bookkeeping is not counted
  };
  // Called (outside the tier's lock, on the thread whose Put caused it) with
  // each entry evicted to make room, least recently used first. Used by
  // TieredCache to demote blocks to the next tier. Must not call back into
  // this tier's Put (it may call Get/Contains/Erase).
  using EvictionCallback = std::function<void(const BlockHash&, std::string value)>;

  static Result<std::unique_ptr<HostRamTier>> Create(const Options& options);
  void SetEvictionCallback(EvictionCallback cb);

  std::string_view name() const override { return "ram"; }
  Status Put(const BlockHash& hash, std::string value) override;
  Result<std::string> Get(const BlockHash& hash) override;
  bool Contains(const BlockHash& hash) override;
  Status Erase(const BlockHash& hash) override;
  int64_t capacity_bytes() const override { return options_.capacity_bytes; }
  int64_t used_bytes() const override;
  TierStats stats() const override;

 private:
  explicit HostRamTier(const Options& options) : options_(options) {}

  struct Entry {
    BlockHash hash;
    std::string value;
  };
  const Options options_;
  EvictionCallback on_evict_;  // set before use; read without lock
  mutable std::mutex mutex_;
  // Front = most recently used. Guarded by mutex_.
  std::list<Entry> lru_;
  std::unordered_map<BlockHash, std::list<Entry>::iterator, BlockHashHasher>
      index_;         // guarded by mutex_
  int64_t used_ = 0;  // guarded by mutex_
  TierStats stats_;   // guarded by mutex_
};

}  // namespace kvrelay::kv_store
