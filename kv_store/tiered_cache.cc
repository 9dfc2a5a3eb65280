#include "kv_store/tiered_cache.h"

#include <algorithm>

#include "common/logging.h"

namespace kvrelay::kv_store {

TieredCache::TieredCache(const Options& options, HostRamTier* ram, KvTier* disk)
    : options_(options), ram_(ram), disk_(disk) {
  if (ram_ != nullptr && disk_ != nullptr && !options_.write_through) {
    ram_->SetEvictionCallback([this](const BlockHash& hash, std::string value) {
      const bool ok = disk_->Put(hash, std::move(value)).ok();
      std::lock_guard<std::mutex> lock(mutex_);
      ++stats_.demotions;
      if (!ok) ++stats_.spills_dropped;
    });
  }
}

TieredCache::~TieredCache() {
  Detach();
  if (ram_ != nullptr && disk_ != nullptr && !options_.write_through) {
    ram_->SetEvictionCallback(nullptr);
  }
}

void TieredCache::Attach(engine::KvBlockPool* pool) {
  Detach();
  pool_ = pool;
  pool_->SetSpillHook(
      [this](const BlockHash& hash, engine::BlockId block) { OnSpill(hash, block); });
}

void TieredCache::Detach() {
  if (pool_ != nullptr) pool_->SetSpillHook(nullptr);
  pool_ = nullptr;
}

void TieredCache::NoteLocked(const BlockHash& hash, Note note) {
  auto it = note_index_.find(hash);
  if (it != note_index_.end()) {
    notes_.splice(notes_.begin(), notes_, it->second);
    return;
  }
  notes_.emplace_front(hash, std::move(note));
  note_index_[hash] = notes_.begin();
  while (static_cast<int64_t>(notes_.size()) > options_.max_tracked_blocks) {
    note_index_.erase(notes_.back().first);
    notes_.pop_back();
  }
}

void TieredCache::NoteSequence(std::span<const int32_t> tokens,
                               const engine::ModelFingerprint& model,
                               std::string_view tenant_salt) {
  if (pool_ == nullptr) return;
  const int bt = pool_->layout().block_tokens;
  const std::vector<BlockHash> hashes = engine::HashPrefixBlocks(tokens, bt, model, tenant_salt);
  const Sha256Digest salt_hash = TenantSaltHash(tenant_salt);
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t i = 0; i < hashes.size(); ++i) {
    auto first = tokens.begin() + static_cast<std::ptrdiff_t>(i * bt);
    NoteLocked(hashes[i], Note{model, salt_hash, std::vector<int32_t>(first, first + bt)});
  }
}

bool TieredCache::Store(const BlockHash& hash, const Note& note, engine::KvBlockPool* pool,
                        engine::BlockId block) {
  BlockMeta meta{note.model, pool->layout(), note.salt_hash, hash, note.tokens};
  Result<std::string> encoded = EncodeBlock(meta, *pool, block);
  if (!encoded.ok()) {
    LOG_WARNING << "kv_store: cannot encode block for spill: " << encoded.status().ToString();
    return false;
  }
  const int64_t bytes = static_cast<int64_t>(encoded->size());
  bool stored = false;
  bool dropped = false;
  if (ram_ != nullptr && disk_ != nullptr && options_.write_through) {
    Status d = disk_->Put(hash, *encoded);
    dropped = !d.ok();
    stored = d.ok();
    stored = ram_->Put(hash, std::move(encoded).value()).ok() || stored;
  } else if (ram_ != nullptr) {
    stored = ram_->Put(hash, std::move(encoded).value()).ok();
  } else if (disk_ != nullptr) {
    stored = disk_->Put(hash, std::move(encoded).value()).ok();
    dropped = !stored;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (stored) {
    ++stats_.spills;
    stats_.spill_bytes += bytes;
  }
  if (dropped) ++stats_.spills_dropped;
  return stored;
}

void TieredCache::OnSpill(const BlockHash& hash, engine::BlockId block) {
  Note note;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = note_index_.find(hash);
    if (it == note_index_.end()) {
      ++stats_.spills_untracked;
      return;
    }
    note = it->second->second;
  }
  if (pool_ != nullptr) Store(hash, note, pool_, block);
}

void TieredCache::CountMiss(MissReason r) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++stats_.misses[static_cast<size_t>(r)];
}

Result<int> TieredCache::RestorePrefix(engine::KvBlockPool* pool, std::span<const int32_t> tokens,
                                       const engine::ModelFingerprint& model,
                                       std::string_view tenant_salt,
                                       std::vector<engine::BlockId>* table) {
  if (pool == nullptr || table == nullptr) {
    return InvalidArgument("RestorePrefix: pool and table must not be null");
  }
  table->clear();
  const engine::KvLayout& layout = pool->layout();
  const int bt = layout.block_tokens;
  const std::vector<BlockHash> hashes = engine::HashPrefixBlocks(tokens, bt, model, tenant_salt);
  const Sha256Digest salt_hash = TenantSaltHash(tenant_salt);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < hashes.size(); ++i) {
      auto first = tokens.begin() + static_cast<std::ptrdiff_t>(i * bt);
      NoteLocked(hashes[i], Note{model, salt_hash, std::vector<int32_t>(first, first + bt)});
    }
  }
  *table = pool->MatchPrefix(hashes);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.pool_hit_blocks += static_cast<int64_t>(table->size());
  }
  KvTier* tiers[2] = {ram_, disk_};
  int restored = 0;
  for (size_t i = table->size(); i < hashes.size(); ++i) {
    BlockMeta expected{
        model, layout, salt_hash, hashes[i],
        std::vector<int32_t>(tokens.begin() + static_cast<std::ptrdiff_t>(i * bt),
                             tokens.begin() + static_cast<std::ptrdiff_t>((i + 1) * bt))};
    std::string value;
    int from = -1;
    MissReason last = MissReason::kNotFound;
    for (int t = 0; t < 2 && from < 0; ++t) {
      if (tiers[t] == nullptr) continue;
      Result<std::string> got = tiers[t]->Get(hashes[i]);
      if (!got.ok()) {
        if (got.status().code() != StatusCode::kNotFound) last = MissReason::kStorageError;
        continue;
      }
      DecodedBlock d = DecodeBlock(*got, expected);
      if (!d.ok()) {
        last = d.reason;
        CountMiss(d.reason);
        (void)tiers[t]->Erase(hashes[i]);  // it will never verify
        continue;
      }
      value = std::move(got).value();
      from = t;
    }
    if (from < 0) {
      if (last == MissReason::kNotFound || last == MissReason::kStorageError) CountMiss(last);
      break;
    }
    Result<engine::BlockId> block = pool->Allocate();
    if (!block.ok()) break;                               // pool full: restore what fits
    const DecodedBlock d = DecodeBlock(value, expected);  // verified above; recompute the view
    for (int layer = 0; layer < layout.layers; ++layer) {
      std::span<const uint8_t> src = d.Layer(layout, layer);
      std::span<uint8_t> dst = pool->LayerData(*block, layer);
      std::copy(src.begin(), src.end(), dst.begin());
    }
    pool->Commit(*block, hashes[i]);
    table->push_back(*block);
    ++restored;
    if (from == 1 && ram_ != nullptr && options_.promote_disk_hits) {
      (void)ram_->Put(hashes[i], std::move(value));
    }
    std::lock_guard<std::mutex> lock(mutex_);
    (from == 0 ? stats_.restored_blocks_ram : stats_.restored_blocks_disk) += 1;
    stats_.restored_bytes += layout.BlockBytes();
  }
  return restored * bt;
}

Result<int> TieredCache::PersistPrefix(engine::KvBlockPool* pool, std::span<const int32_t> tokens,
                                       const engine::ModelFingerprint& model,
                                       std::string_view tenant_salt) {
  if (pool == nullptr) return InvalidArgument("PersistPrefix: pool must not be null");
  const int bt = pool->layout().block_tokens;
  const std::vector<BlockHash> hashes = engine::HashPrefixBlocks(tokens, bt, model, tenant_salt);
  const Sha256Digest salt_hash = TenantSaltHash(tenant_salt);
  std::vector<engine::BlockId> blocks = pool->MatchPrefix(hashes);
  int stored = 0;
  for (size_t i = 0; i < blocks.size(); ++i) {
    auto first = tokens.begin() + static_cast<std::ptrdiff_t>(i * bt);
    Note note{model, salt_hash, std::vector<int32_t>(first, first + bt)};
    if (Store(hashes[i], note, pool, blocks[i])) ++stored;
  }
  for (engine::BlockId b : blocks) pool->Release(b);
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.persisted_blocks += stored;
  return stored;
}

TieredCache::Stats TieredCache::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

}  // namespace kvrelay::kv_store
