#include "kv_store/host_ram_tier.h"

#include <vector>

namespace kvrelay::kv_store {

std::string_view BlockTierName(BlockTier t) {
  switch (t) {
    case BlockTier::kPool:
      return "pool";
    case BlockTier::kHostRam:
      return "ram";
    case BlockTier::kDisk:
      return "disk";
  }
  return "unknown";
}

std::vector<Status> KvTier::PutBatch(std::vector<std::pair<BlockHash, std::string>> items) {
  std::vector<Status> out;
  out.reserve(items.size());
  for (auto& [hash, value] : items) out.push_back(Put(hash, std::move(value)));
  return out;
}

std::vector<Result<std::string>> KvTier::GetBatch(std::span<const BlockHash> hashes) {
  std::vector<Result<std::string>> out;
  out.reserve(hashes.size());
  for (const BlockHash& h : hashes) out.push_back(Get(h));
  return out;
}

Result<std::unique_ptr<HostRamTier>> HostRamTier::Create(const Options& options) {
  if (options.capacity_bytes <= 0) {
    return InvalidArgument("HostRamTier: capacity_bytes must be > 0");
  }
  return std::unique_ptr<HostRamTier>(new HostRamTier(options));
}

void HostRamTier::SetEvictionCallback(EvictionCallback cb) { on_evict_ = std::move(cb); }

Status HostRamTier::Put(const BlockHash& hash, std::string value) {
  const int64_t size = static_cast<int64_t>(value.size());
  std::vector<Entry> evicted;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (size > options_.capacity_bytes) {
      ++stats_.puts_dropped;
      return ResourceExhausted("HostRamTier: value of " + std::to_string(size) +
                               " bytes exceeds capacity " +
                               std::to_string(options_.capacity_bytes));
    }
    auto it = index_.find(hash);
    if (it != index_.end()) {
      used_ -= static_cast<int64_t>(it->second->value.size());
      lru_.erase(it->second);
      index_.erase(it);
    }
    while (used_ + size > options_.capacity_bytes && !lru_.empty()) {
      Entry& victim = lru_.back();
      used_ -= static_cast<int64_t>(victim.value.size());
      ++stats_.evictions;
      stats_.evicted_bytes += static_cast<int64_t>(victim.value.size());
      index_.erase(victim.hash);
      evicted.push_back(std::move(victim));
      lru_.pop_back();
    }
    lru_.push_front(Entry{hash, std::move(value)});
    index_[hash] = lru_.begin();
    used_ += size;
    ++stats_.puts;
    stats_.put_bytes += size;
  }
  if (on_evict_) {
    for (Entry& e : evicted) on_evict_(e.hash, std::move(e.value));
  }
  return Status::Ok();
}

Result<std::string> HostRamTier::Get(const BlockHash& hash) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = index_.find(hash);
  if (it == index_.end()) {
    ++stats_.misses;
    return NotFound("block not in ram tier");
  }
  lru_.splice(lru_.begin(), lru_, it->second);
  ++stats_.hits;
  return std::string(it->second->value);
}

bool HostRamTier::Contains(const BlockHash& hash) {
  std::lock_guard<std::mutex> lock(mutex_);
  return index_.count(hash) > 0;
}

Status HostRamTier::Erase(const BlockHash& hash) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = index_.find(hash);
  if (it == index_.end()) return Status::Ok();
  used_ -= static_cast<int64_t>(it->second->value.size());
  lru_.erase(it->second);
  index_.erase(it);
  return Status::Ok();
}

int64_t HostRamTier::used_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return used_;
}

TierStats HostRamTier::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  TierStats s = stats_;
  s.entries = static_cast<int64_t>(index_.size());
  s.used_bytes = used_;
  return s;
}

}  // namespace kvrelay::kv_store
