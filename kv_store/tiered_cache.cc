#include "kv_store/tiered_cache.h"

#include <pthread.h>

#include <algorithm>
#include <cstring>
#include <system_error>
#include <thread>

#include "common/logging.h"
#include "kv_store/rocksdb_tier.h"

namespace kvrelay::kv_store {

bool LoadHandle::Ready() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

bool LoadHandle::BeginWrite() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (abandoned_) return false;
  ++writing_;
  return true;
}

void LoadHandle::EndWrite() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    --writing_;
  }
  done_cv_.notify_all();
}

std::span<const std::span<uint8_t>> LoadHandle::DstLayers(size_t k) const {
  return std::span<const std::span<uint8_t>>(dst_layers).subspan(k * layers, layers);
}

TieredCache::TieredCache(const Options& options, HostRamTier* ram, KvTier* disk)
    : options_(options), ram_(ram), disk_(disk) {
  if (ram_ != nullptr && disk_ != nullptr && !options_.write_through) {
    ram_->SetEvictionCallback([this](const BlockHash& hash, std::string value) {
      bool ok = false;
      if (!options_.sealer) {
        ok = disk_->Put(hash, std::move(value)).ok();
      } else if (Sha256Digest salt_hash; PeekTenantSaltHash(value, &salt_hash)) {
        Result<std::string> sealed = options_.sealer->Seal(hash, salt_hash, value);
        ok = sealed.ok() && disk_->Put(hash, std::move(sealed).value()).ok();
      }
      std::lock_guard<std::mutex> lock(mutex_);
      ++stats_.demotions;
      if (!ok) ++stats_.spills_dropped;
    });
  }
  loader_ = std::thread([this] { LoaderLoop(); });
  pthread_setname_np(loader_.native_handle(), "kvstore-loader");
}

TieredCache::~TieredCache() {
  {
    std::lock_guard<std::mutex> lock(load_mutex_);
    load_stop_ = true;
  }
  load_cv_.notify_all();
  if (loader_.joinable()) loader_.join();
  Detach();
  if (ram_ != nullptr && disk_ != nullptr && !options_.write_through) {
    ram_->SetEvictionCallback(nullptr);
  }
}

void TieredCache::Attach(engine::KvBlockPool* pool, EventListener listener,
                         bool own_pool_listener) {
  Detach();
  pool_ = pool;
  listener_ = std::move(listener);
  own_pool_listener_ = own_pool_listener;
  pool_->SetSpillHook(
      [this](const BlockHash& hash, engine::BlockId block) { OnSpill(hash, block); });
  if (own_pool_listener_) {
    pool_->SetEventListener([this](const engine::KvEvent& ev) { OnPoolEvent(ev); });
  }
}

void TieredCache::Detach() {
  if (pool_ != nullptr) {
    pool_->SetSpillHook(nullptr);
    if (own_pool_listener_) pool_->SetEventListener(nullptr);
  }
  pool_ = nullptr;
  listener_ = nullptr;
  backlog_.clear();
  backlog_set_.clear();
}

void TieredCache::Emit(const TierEvent& ev) {
  if (listener_) listener_(ev);
}

void TieredCache::SetKvGroups(const engine::KvCacheGroups& groups) {
  groups_ = groups.size() > 1 ? groups : engine::KvCacheGroups{};
}

void TieredCache::NoteBlocks(std::span<const BlockHash> hashes, size_t first,
                             std::span<const int32_t> tokens, const engine::ModelFingerprint& model,
                             const Sha256Digest& salt_hash) {
  if (pool_ == nullptr) return;
  const size_t bt = static_cast<size_t>(pool_->layout().block_tokens);
  const int n_groups = std::max(1, groups_.size());
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t i = first; i < hashes.size() && (i + 1) * bt <= tokens.size(); ++i) {
    auto begin = tokens.begin() + static_cast<std::ptrdiff_t>(i * bt);
    for (int g = 0; g < n_groups; ++g) {
      NoteLocked(engine::GroupBlockHash(hashes[i], g),
                 Note{model, salt_hash,
                      std::vector<int32_t>(begin, begin + static_cast<std::ptrdiff_t>(bt)), g});
    }
  }
}

void TieredCache::AnnounceAll() {
  auto announce = [this](BlockTier tier, const std::vector<BlockHash>& hashes) {
    for (const BlockHash& h : hashes) {
      TierEvent e;
      e.kind = TierEvent::Kind::kStored;
      e.tier = tier;
      e.hash = h;
      announce_.push_back(e);
    }
  };
  if (auto* rocks = dynamic_cast<RocksDbTier*>(disk_); rocks != nullptr) {
    announce(BlockTier::kDisk, rocks->KeysLruOrder());
  }
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
  NoteBlocks(hashes, 0, tokens, model, TenantSaltHash(tenant_salt));
}

bool TieredCache::Store(const BlockHash& hash, const Note& note, engine::KvBlockPool* pool,
                        engine::BlockId block) {
  BlockMeta meta{note.model, pool->layout(), note.salt_hash,
                 hash,       note.tokens,    MakeBlockGroup(groups_, note.group)};
  Result<std::string> encoded = EncodeBlock(meta, *pool, block);
  if (!encoded.ok()) {
    LOG_WARNING << "kv_store: cannot encode block for spill: " << encoded.status().ToString();
    return false;
  }
  const int64_t bytes = static_cast<int64_t>(encoded->size());
  bool stored = false;
  bool dropped = false;
  // A block written through at commit is on disk already: only RAM gets it.
  const bool disk_has = disk_ != nullptr && disk_->Contains(hash);
  if (ram_ != nullptr && disk_ != nullptr && options_.write_through) {
    if (!disk_has) {
      Result<std::string> value = ForDisk(hash, note.salt_hash, *encoded);
      const bool ok = value.ok() && disk_->Put(hash, std::move(value).value()).ok();
      dropped = !ok;
      stored = ok;
    }
    stored = ram_->Put(hash, std::move(encoded).value()).ok() || stored || disk_has;
  } else if (ram_ != nullptr) {
    stored = ram_->Put(hash, std::move(encoded).value()).ok();
  } else if (disk_ != nullptr) {
    if (!disk_has) {
      Result<std::string> value =
          options_.sealer ? ForDisk(hash, note.salt_hash, *encoded) : std::move(encoded);
      stored = value.ok() && disk_->Put(hash, std::move(value).value()).ok();
    }
    stored = stored || disk_has;
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
  backlog_set_.erase(hash);  // the spill writes it (if the disk lacks it)
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

void TieredCache::OnPoolEvent(const engine::KvEvent& ev) {
  TierEvent e;
  e.tier = BlockTier::kPool;
  e.hash = ev.hash;
  if (ev.kind == engine::KvEvent::Kind::kStored) {
    e.kind = TierEvent::Kind::kStored;
    e.held_anywhere = true;
    if (options_.write_through && disk_ != nullptr && !backlog_set_.count(ev.hash)) {
      bool noted;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        noted = note_index_.count(ev.hash) > 0;
      }
      if (noted) {
        if (static_cast<int64_t>(backlog_set_.size()) >= options_.max_write_backlog_blocks) {
          std::lock_guard<std::mutex> lock(mutex_);
          ++stats_.write_through_dropped;
        } else {
          backlog_.push_back(ev.hash);
          backlog_set_.insert(ev.hash);
        }
      }
    }
  } else {
    e.kind = TierEvent::Kind::kEvicted;
    e.held_anywhere = (ram_ != nullptr && ram_->Contains(ev.hash)) ||
                      (disk_ != nullptr && disk_->Contains(ev.hash));
  }
  Emit(e);
}

bool TieredCache::WriteThroughOne(const BlockHash& hash) {
  auto skipped = [this] {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.write_through_skipped;
    return true;
  };
  if (disk_->Contains(hash) || !pool_->IsCached(hash)) return skipped();
  Note note;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = note_index_.find(hash);
    if (it == note_index_.end()) {
      ++stats_.write_through_skipped;
      return true;
    }
    note = it->second->second;
  }
  const engine::KvLayout& layout = pool_->layout();
  const BlockGroup group = MakeBlockGroup(groups_, note.group);
  size_t disk_bytes = EncodedBlockBytes(layout, group.grouped());
  if (options_.sealer) disk_bytes = BlockSealer::SealedBytes(disk_bytes);
  if (!disk_->HasQueueRoom(static_cast<int64_t>(disk_bytes))) {
    return false;
  }
  std::vector<engine::BlockId> held = pool_->MatchPrefix(std::span<const BlockHash>(&hash, 1));
  if (held.empty()) return skipped();
  BlockMeta meta{note.model, layout, note.salt_hash, hash, note.tokens, group};
  Result<std::string> encoded = EncodeBlock(meta, *pool_, held[0]);
  pool_->Release(held[0]);
  if (encoded.ok() && options_.sealer) encoded = ForDisk(hash, note.salt_hash, *encoded);
  if (!encoded.ok()) {
    LOG_WARNING << "kv_store: cannot encode block for write-through: "
                << encoded.status().ToString();
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.write_through_dropped;
    return true;
  }
  const int64_t bytes = static_cast<int64_t>(encoded->size());
  Status s = disk_->Put(hash, std::move(encoded).value());
  if (s.code() == StatusCode::kResourceExhausted && disk_->HasQueueRoom(0) == false) {
    return false;  // the queue filled meanwhile: retry at the next Pump
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (s.ok()) {
    ++stats_.write_through_blocks;
    stats_.write_through_bytes += bytes;
  } else {
    ++stats_.write_through_dropped;  // read-only / suspended disk, or over capacity
  }
  return true;
}

void TieredCache::Pump() {
  if (pool_ != nullptr && disk_ != nullptr) {
    int budget = options_.max_encodes_per_pump;
    while (!backlog_.empty() && budget > 0) {
      const BlockHash h = backlog_.front();
      if (!backlog_set_.count(h)) {
        backlog_.pop_front();  // spilled (and written) meanwhile
        continue;
      }
      if (!WriteThroughOne(h)) break;  // no room in the disk queue: later
      backlog_.pop_front();
      backlog_set_.erase(h);
      --budget;
    }
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.write_backlog = static_cast<int64_t>(backlog_set_.size());
  }
  std::vector<TierEvent> announce;
  announce.swap(announce_);
  for (const TierEvent& e : announce) Emit(e);
  if (disk_ != nullptr) {
    bool overflowed = false;
    std::vector<TierEvent> events = disk_->TakeEvents(&overflowed);
    for (TierEvent& e : events) {
      if (e.kind == TierEvent::Kind::kEvicted) {
        e.held_anywhere = (pool_ != nullptr && pool_->IsCached(e.hash)) ||
                          (ram_ != nullptr && ram_->Contains(e.hash));
      }
      Emit(e);
    }
    if (overflowed) AnnounceAll();
  }
}

Status TieredCache::Drain(Deadline deadline) {
  if (disk_ == nullptr) return Status::Ok();
  while (true) {
    Pump();
    if (backlog_set_.empty()) break;
    if (deadline.Expired()) {
      return DeadlineExceeded("TieredCache::Drain: " + std::to_string(backlog_set_.size()) +
                              " blocks not written by the deadline");
    }
    // Let the writer make room in its queue.
    const auto slice = std::min<std::chrono::nanoseconds>(
        std::chrono::milliseconds(100),
        std::max<std::chrono::nanoseconds>(std::chrono::nanoseconds(0),
                                           deadline.at - Clock::now()));
    (void)disk_->Flush(Deadline::After(slice));
  }
  Status s = disk_->WaitDurable(deadline);
  Pump();  // deliver the stored events of what was just written
  return s;
}

Result<std::string> TieredCache::ForDisk(const BlockHash& hash, const Sha256Digest& salt_hash,
                                         std::string_view encoded) const {
  if (!options_.sealer) return std::string(encoded);
  Result<std::string> sealed = options_.sealer->Seal(hash, salt_hash, encoded);
  if (!sealed.ok()) LOG_WARNING << "kv_store: cannot seal a block: " << sealed.status().ToString();
  return sealed;
}

namespace {

// Copies a verified block's layers into `dst` (one span per layer).
void CopyLayers(const DecodedBlock& block, const engine::KvLayout& layout,
                std::span<const std::span<uint8_t>> dst) {
  for (size_t l = 0; l < dst.size(); ++l) {
    const std::span<const uint8_t> from = block.Layer(layout, static_cast<int>(l));
    std::memcpy(dst[l].data(), from.data(), from.size());
  }
}

}  // namespace

MissReason TieredCache::FromDisk(const BlockHash& hash, const BlockMeta& expected,
                                 std::string_view stored,
                                 std::span<const std::span<uint8_t>> dst) const {
  const engine::KvLayout& layout = expected.layout;
  auto verified_copy = [&](std::string_view encoded) {
    const DecodedBlock d = DecodeBlock(encoded, expected);
    if (d.ok()) CopyLayers(d, layout, dst);
    return d.reason;
  };
  if (!options_.sealer) return verified_copy(stored);
  const size_t head_bytes = EncodedPayloadOffset(layout, expected.group.grouped());
  if (stored.size() ==
      BlockSealer::SealedBytes(head_bytes + static_cast<size_t>(layout.BlockBytes()))) {
    // The size of the block wanted: decrypt the payload straight into the
    // pool's layers and verify it there.
    std::string head(head_bytes, '\0');
    std::vector<std::span<uint8_t>> parts;
    parts.reserve(dst.size() + 1);
    parts.emplace_back(reinterpret_cast<uint8_t*>(head.data()), head.size());
    parts.insert(parts.end(), dst.begin(), dst.end());
    const MissReason opened =
        options_.sealer->OpenInto(hash, expected.tenant_salt_hash, stored, parts);
    if (opened != MissReason::kNone) return opened;  // never decoded: it did not authenticate
    const std::vector<std::span<const uint8_t>> payload(dst.begin(), dst.end());
    return VerifyBlock(head, payload, expected);
  }
  // Another size (another layout's block, or damaged): opened whole, for the reason.
  std::string encoded;
  const MissReason opened =
      options_.sealer->Open(hash, expected.tenant_salt_hash, stored, &encoded);
  if (opened != MissReason::kNone) return opened;
  return verified_copy(encoded);
}

void TieredCache::CountMiss(MissReason r) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++stats_.misses[static_cast<size_t>(r)];
}

PrefixMatch TieredCache::Match(std::span<const int32_t> tokens,
                               const engine::ModelFingerprint& model,
                               std::string_view tenant_salt) {
  PrefixMatch m;
  if (pool_ == nullptr) return m;
  const int bt = pool_->layout().block_tokens;
  m.block_tokens = bt;
  m.hashes = engine::HashPrefixBlocks(tokens, bt, model, tenant_salt);
  NoteBlocks(m.hashes, 0, tokens, model, TenantSaltHash(tenant_salt));
  size_t i = 0;
  while (i < m.hashes.size() && pool_->IsCached(m.hashes[i])) ++i;
  m.pool_blocks = static_cast<int>(i);
  while (i < m.hashes.size() && ((ram_ != nullptr && ram_->Contains(m.hashes[i])) ||
                                 (disk_ != nullptr && disk_->Contains(m.hashes[i])))) {
    ++i;
  }
  m.external_blocks = static_cast<int>(i) - m.pool_blocks;
  if (i < m.hashes.size()) CountMiss(MissReason::kNotFound);  // the stored prefix ends here
  return m;
}

std::shared_ptr<LoadHandle> TieredCache::StartLoad(const PrefixMatch& match,
                                                   std::span<const int32_t> tokens,
                                                   const engine::ModelFingerprint& model,
                                                   std::string_view tenant_salt,
                                                   std::span<const engine::BlockId> dst) {
  auto load = std::make_shared<LoadHandle>();
  const engine::KvLayout layout = pool_ != nullptr ? pool_->layout() : engine::KvLayout{};
  const int n = std::min(match.external_blocks, static_cast<int>(dst.size()));
  const int bt = match.block_tokens;
  const Sha256Digest salt_hash = TenantSaltHash(tenant_salt);
  for (int k = 0; k < n && pool_ != nullptr; ++k) {
    const size_t i = static_cast<size_t>(match.pool_blocks) + static_cast<size_t>(k);
    if (i >= match.hashes.size() || (i + 1) * static_cast<size_t>(bt) > tokens.size()) break;
    load->hashes.push_back(match.hashes[i]);
    load->expected.push_back(
        BlockMeta{model, layout, salt_hash, match.hashes[i],
                  std::vector<int32_t>(tokens.begin() + static_cast<std::ptrdiff_t>(i * bt),
                                       tokens.begin() + static_cast<std::ptrdiff_t>((i + 1) * bt)),
                  BlockGroup{}});
  }
  return QueueLoad(std::move(load), dst);
}

std::shared_ptr<LoadHandle> TieredCache::QueueLoad(std::shared_ptr<LoadHandle> load,
                                                   std::span<const engine::BlockId> dst) {
  // The blocks' memory, taken here on the owner thread: the mutable
  // LayerData tells a device mirror that the host writes them.
  const size_t n = std::min(load->hashes.size(), dst.size());
  load->hashes.resize(n);
  load->expected.resize(n);
  load->dst.assign(dst.begin(), dst.begin() + static_cast<std::ptrdiff_t>(n));
  load->layers = pool_ != nullptr ? static_cast<size_t>(pool_->layout().layers) : 0;
  load->dst_layers.reserve(n * load->layers);
  for (engine::BlockId b : load->dst) {
    for (size_t l = 0; l < load->layers; ++l) {
      load->dst_layers.push_back(pool_->LayerData(b, static_cast<int>(l)));
    }
  }
  if (load->hashes.empty()) {
    std::lock_guard<std::mutex> lock(load->mutex_);
    load->done_ = true;
    return load;
  }
  load->queued_at = Clock::now();
  {
    std::lock_guard<std::mutex> lock(load_mutex_);
    load_queue_.push_back(load);
  }
  load_cv_.notify_one();
  return load;
}

void TieredCache::LoaderLoop() {
  std::unique_lock<std::mutex> lock(load_mutex_);
  while (true) {
    load_cv_.wait(lock, [&] { return load_stop_ || !load_queue_.empty(); });
    if (load_queue_.empty() && load_stop_) break;
    std::shared_ptr<LoadHandle> load = std::move(load_queue_.front());
    load_queue_.pop_front();
    lock.unlock();
    ReadLoad(*load);
    {
      std::lock_guard<std::mutex> done(load->mutex_);
      load->done_ = true;
    }
    load->done_cv_.notify_all();
    lock.lock();
  }
  // Stopping: settle what is still queued (nothing read).
  for (auto& load : load_queue_) {
    std::lock_guard<std::mutex> done(load->mutex_);
    load->done_ = true;
    load->done_cv_.notify_all();
  }
  load_queue_.clear();
}

void TieredCache::ReadLoad(LoadHandle& load) {
  const auto started = Clock::now();
  load.queued_ms = std::chrono::duration<double, std::milli>(started - load.queued_at).count();
  const size_t n = load.hashes.size();
  // Reading is CPU work as much as I/O (the tiers' checksums, unsealing,
  // verifying), and the disk serves several reads at once: a long load is
  // read in parts at once, each by its own thread. A part after a miss is
  // wasted work (rare: a prefix the index lists is normally all there).
  const size_t cpus = std::max(1u, std::thread::hardware_concurrency());
  const size_t parts = std::clamp<size_t>(n / kMinBlocksPerReadThread, 1,
                                          std::min<size_t>(kMaxReadThreads, 2 * cpus));
  std::vector<std::vector<int>> got(parts);
  std::vector<std::thread> helpers;
  auto bounds = [&](size_t p) { return std::pair{n * p / parts, n * (p + 1) / parts}; };
  for (size_t p = 1; p < parts; ++p) {
    try {
      helpers.emplace_back([&, p] {
        pthread_setname_np(pthread_self(), "kvstore-read");
        const auto [b, e] = bounds(p);
        got[p] = ReadRange(load, b, e);
      });
    } catch (const std::system_error& e) {  // no thread to be had: read that part here
      LOG_WARNING << "kv_store: reading a load with fewer threads: " << e.what();
      const auto [b, en] = bounds(p);
      got[p] = ReadRange(load, b, en);
    }
  }
  got[0] = ReadRange(load, bounds(0).first, bounds(0).second);
  for (std::thread& t : helpers) t.join();
  load.read_threads = static_cast<int>(helpers.size()) + 1;
  for (const std::vector<int>& part : got) {
    for (const int from : part) {
      if (from < 0) {
        load.read_ms = std::chrono::duration<double, std::milli>(Clock::now() - started).count();
        return;  // a prefix ends at its first miss
      }
      load.from_tier.push_back(from);
    }
  }
  load.read_ms = std::chrono::duration<double, std::milli>(Clock::now() - started).count();
}

std::vector<int> TieredCache::ReadRange(LoadHandle& load, size_t begin, size_t end) {
  std::vector<int> out;
  if (begin == end) return out;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.load_batches;
  }
  out.reserve(end - begin);
  for (size_t at = begin; at < end; at += kBlocksPerRead) {
    if (!ReadChunk(load, at, std::min(end, at + kBlocksPerRead), &out)) break;
  }
  return out;
}

bool TieredCache::ReadChunk(LoadHandle& load, size_t begin, size_t end, std::vector<int>* out) {
  const size_t n = end - begin;
  const std::span<const BlockHash> hashes(load.hashes.data() + begin, n);
  std::vector<Result<std::string>> from_ram;
  if (ram_ != nullptr) from_ram = ram_->GetBatch(hashes);
  // One batched disk read for every block RAM did not have.
  std::vector<size_t> want_disk;
  for (size_t i = 0; i < n; ++i) {
    if (ram_ == nullptr || !from_ram[i].ok()) want_disk.push_back(i);
  }
  std::vector<Result<std::string>> from_disk(n, NotFound("not read"));
  if (disk_ != nullptr && !want_disk.empty()) {
    std::vector<BlockHash> keys;
    keys.reserve(want_disk.size());
    for (size_t i : want_disk) keys.push_back(hashes[i]);
    std::vector<Result<std::string>> got = disk_->GetBatch(keys);
    for (size_t k = 0; k < want_disk.size(); ++k) from_disk[want_disk[k]] = std::move(got[k]);
  }
  for (size_t i = 0; i < n; ++i) {
    const BlockMeta& expected = load.expected[begin + i];
    const std::span<const std::span<uint8_t>> dst = load.DstLayers(begin + i);
    if (!load.BeginWrite()) {  // FinishLoad gave up: the blocks are the caller's again
      out->push_back(-1);
      return false;
    }
    int from = -1;
    MissReason last = MissReason::kNotFound;
    if (ram_ != nullptr && from_ram[i].ok()) {
      const DecodedBlock d = DecodeBlock(*from_ram[i], expected);
      if (d.ok()) {
        CopyLayers(d, expected.layout, dst);
        from = 0;
      } else {
        CountMiss(d.reason);
        last = d.reason;
        (void)ram_->Erase(hashes[i]);  // it will never verify
        if (disk_ != nullptr) from_disk[i] = disk_->Get(hashes[i]);
      }
    } else if (ram_ != nullptr && from_ram[i].status().code() != StatusCode::kNotFound) {
      last = MissReason::kStorageError;
    }
    if (from < 0 && disk_ != nullptr) {
      if (from_disk[i].ok()) {
        const MissReason r = FromDisk(hashes[i], expected, *from_disk[i], dst);
        from_disk[i] = NotFound("used");  // its memory goes now, not with the range
        if (r == MissReason::kNone) {
          from = 1;
        } else {
          CountMiss(r);
          last = r;
          (void)disk_->Erase(hashes[i]);
        }
      } else if (from_disk[i].status().code() != StatusCode::kNotFound) {
        last = MissReason::kStorageError;
      }
    }
    load.EndWrite();
    out->push_back(from);
    if (from < 0) {
      if (last == MissReason::kNotFound || last == MissReason::kStorageError) CountMiss(last);
      return false;  // a prefix ends at its first miss
    }
  }
  return true;
}

Result<int> TieredCache::FinishLoad(LoadHandle& load, Deadline deadline) {
  if (pool_ == nullptr) return FailedPrecondition("TieredCache::FinishLoad: no pool attached");
  {
    std::unique_lock<std::mutex> lock(load.mutex_);
    if (!load.done_cv_.wait_until(lock, deadline.at, [&] { return load.done_; })) {
      // The caller gets its blocks back: no write starts after this, and the
      // one in progress (a decrypt or copy of one block, CPU only: no I/O,
      // no other lock) ends first.
      load.abandoned_ = true;
      load.done_cv_.wait(lock, [&] { return load.writing_ == 0; });
      return DeadlineExceeded("TieredCache::FinishLoad: reads not done by the deadline");
    }
  }
  const auto commit_started = Clock::now();
  const size_t n = std::min(load.from_tier.size(), load.dst.size());
  int64_t from_ram = 0, from_disk = 0;
  for (size_t i = 0; i < n; ++i) {
    pool_->Commit(load.dst[i], load.hashes[i]);
    ++(load.from_tier[i] == 1 ? from_disk : from_ram);
  }
  load.commit_ms = std::chrono::duration<double, std::milli>(Clock::now() - commit_started).count();
  const engine::KvLayout& layout = pool_->layout();
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.restored_blocks_ram += from_ram;
  stats_.restored_blocks_disk += from_disk;
  stats_.restored_bytes += (from_ram + from_disk) * layout.BlockBytes();
  if (n > 0) ++stats_.restores;
  return static_cast<int>(n);
}

Result<int64_t> TieredCache::LoadMissing(const engine::PrefixLookup& prefix,
                                         const engine::ModelFingerprint& model,
                                         std::string_view tenant_salt,
                                         std::vector<std::vector<engine::BlockId>>* tables) {
  if (pool_ == nullptr || tables == nullptr) {
    return FailedPrecondition("LoadMissing: no pool attached or no output tables");
  }
  // SetKvGroups keeps only a split; otherwise one group of the pool's layers.
  const engine::KvCacheGroups groups =
      groups_.size() > 1 ? groups_ : engine::KvCacheGroups::One(pool_->layout().layers);
  const int bt = pool_->layout().block_tokens;
  const int64_t n = static_cast<int64_t>(prefix.tokens.size());
  const int64_t first = prefix.first;
  const int64_t total = static_cast<int64_t>(prefix.hashes.size());
  if (prefix.block_tokens != bt || first < 0 || first > total || total * bt > n ||
      pool_->layout().layers != groups.layers_per_block()) {
    return InvalidArgument("LoadMissing: prefix of " + std::to_string(total) + " blocks of " +
                           std::to_string(prefix.block_tokens) + " tokens over " +
                           std::to_string(n) + " tokens (pool blocks hold " + std::to_string(bt) +
                           " tokens of " + std::to_string(pool_->layout().layers) + " layers)");
  }
  const int n_groups = groups.size();
  tables->assign(static_cast<size_t>(n_groups), {});
  NoteBlocks(prefix.hashes, static_cast<size_t>(first), prefix.tokens, model,
             TenantSaltHash(tenant_salt));
  if (first == total) return 0;
  auto key = [&](int g, int64_t i) {
    return engine::GroupBlockHash(prefix.hashes[static_cast<size_t>(i)], g);
  };
  // The first block of group g a hit of k blocks needs (the engine's rule).
  auto needed_from = [&](int g, int64_t k) {
    return std::max(first, groups.DroppableBlocks(g, std::min<int64_t>(k * bt, n - 1), bt));
  };
  // held[g][i - first]: group g's block i is (or may be) ours.
  using Held = std::vector<std::vector<char>>;
  auto covered = [&](const Held& held, int64_t k) {
    for (int g = 0; g < n_groups; ++g) {
      for (int64_t i = needed_from(g, k); i < k; ++i) {
        if (!held[static_cast<size_t>(g)][static_cast<size_t>(i - first)]) return false;
      }
    }
    return true;
  };
  auto longest = [&](const Held& held, int64_t k) {
    while (k > first && !covered(held, k)) --k;
    return k;
  };
  // 1. Where each block is: the pool, or RAM / disk (index lookups only).
  auto in_pool = [&](int g, int64_t i) { return pool_->IsCached(key(g, i)); };
  auto in_tier = [&](int g, int64_t i) {
    const BlockHash h = key(g, i);
    return (ram_ != nullptr && ram_->Contains(h)) || (disk_ != nullptr && disk_->Contains(h));
  };
  int64_t end = first;  // group 0 needs every block
  while (end < total && (in_pool(0, end) || in_tier(0, end))) ++end;
  if (end < total) CountMiss(MissReason::kNotFound);  // group 0's stored prefix ends here
  Held avail(static_cast<size_t>(n_groups), std::vector<char>(static_cast<size_t>(end - first), 1));
  for (int g = 1; g < n_groups; ++g) {
    for (int64_t i = first; i < end; ++i) {
      avail[static_cast<size_t>(g)][static_cast<size_t>(i - first)] =
          in_pool(g, i) || in_tier(g, i);
    }
  }
  // 2. Rounds: the longest hit of what is (still) available; take the
  //    pool's blocks it needs (a reference each, before any allocation can
  //    evict them), read the rest into new blocks in block order. A read
  //    that fails (or no free block) makes that entry unavailable and the
  //    next round settles for a shorter hit, reading what that one needs
  //    (blocks that were before the longer hit's windows). Every round
  //    either completes or removes an entry, so this ends.
  Held held(static_cast<size_t>(n_groups), std::vector<char>(static_cast<size_t>(end - first), 0));
  std::vector<std::vector<engine::BlockId>> got(
      static_cast<size_t>(n_groups),
      std::vector<engine::BlockId>(static_cast<size_t>(end - first), engine::kNoBlock));
  auto at = [&](auto& m, int g, int64_t i) -> auto& {
    return m[static_cast<size_t>(g)][static_cast<size_t>(i - first)];
  };
  const Sha256Digest salt_hash = TenantSaltHash(tenant_salt);
  while (true) {
    const int64_t k = longest(avail, end);
    if (k == first) break;
    std::vector<std::pair<int, int64_t>> to_read;  // (group, block)
    for (int64_t i = first; i < k; ++i) {
      for (int g = 0; g < n_groups; ++g) {
        if (i < needed_from(g, k) || at(held, g, i)) continue;
        const BlockHash h = key(g, i);
        std::vector<engine::BlockId> b = pool_->MatchPrefix(std::span<const BlockHash>(&h, 1));
        if (!b.empty()) {
          at(got, g, i) = b[0];
          at(held, g, i) = 1;
        } else {
          to_read.emplace_back(g, i);
        }
      }
    }
    if (to_read.empty()) break;  // the hit of k blocks is complete
    std::vector<engine::BlockId> dst;
    for (size_t r = 0; r < to_read.size(); ++r) {
      Result<engine::BlockId> b = pool_->Allocate();
      if (!b.ok()) break;  // pool full: what does not fit is unavailable
      dst.push_back(*b);
    }
    for (size_t r = dst.size(); r < to_read.size(); ++r) {
      at(avail, to_read[r].first, to_read[r].second) = 0;
    }
    if (dst.empty()) continue;
    Result<int> filled = ReadIntoBlocks(prefix, model, groups, salt_hash, to_read, dst);
    if (!filled.ok()) {
      LOG_WARNING << "kv_store: prefix load: " << filled.status().ToString();
      for (engine::BlockId b : dst) pool_->Release(b);
      break;  // settle for what is held
    }
    const size_t ok = static_cast<size_t>(*filled);
    for (size_t r = 0; r < dst.size(); ++r) {
      const auto [g, i] = to_read[r];
      if (r < ok) {
        at(got, g, i) = dst[r];
        at(held, g, i) = 1;
      } else {
        pool_->Release(dst[r]);
      }
    }
    // The read that ended the run did not verify (the loader erased it);
    // the ones after it are retried if a shorter hit still needs them.
    if (ok < dst.size()) at(avail, to_read[ok].first, to_read[ok].second) = 0;
  }
  // 3. The longest hit what is held covers; everything else goes back.
  const int64_t hit = longest(held, end);
  for (int g = 0; g < n_groups; ++g) {
    auto& out = (*tables)[static_cast<size_t>(g)];
    const int64_t from = needed_from(g, hit);
    for (int64_t i = first; i < end; ++i) {
      const engine::BlockId b = at(got, g, i);
      const bool keep = i < hit && i >= from;
      if (!keep && b != engine::kNoBlock) pool_->Release(b);
      if (i < hit) out.push_back(keep ? b : engine::kNoBlock);
    }
  }
  return hit - first;
}

Result<int> TieredCache::ReadIntoBlocks(const engine::PrefixLookup& prefix,
                                        const engine::ModelFingerprint& model,
                                        const engine::KvCacheGroups& groups,
                                        const Sha256Digest& salt_hash,
                                        std::span<const std::pair<int, int64_t>> to_read,
                                        std::span<const engine::BlockId> dst) {
  const int bt = pool_->layout().block_tokens;
  auto load = std::make_shared<LoadHandle>();
  for (size_t r = 0; r < dst.size() && r < to_read.size(); ++r) {
    const auto [g, i] = to_read[r];
    const BlockHash key = engine::GroupBlockHash(prefix.hashes[static_cast<size_t>(i)], g);
    auto begin = prefix.tokens.begin() + static_cast<std::ptrdiff_t>(i * bt);
    load->hashes.push_back(key);
    load->expected.push_back(BlockMeta{model, pool_->layout(), salt_hash, key,
                                       std::vector<int32_t>(begin, begin + bt),
                                       MakeBlockGroup(groups, g)});
  }
  const auto queued = Clock::now();
  QueueLoad(load, dst);
  Result<int> filled = FinishLoad(*load, Deadline::After(std::chrono::seconds(60)));
  if (filled.ok() && *filled > 0) {
    const int disk =
        static_cast<int>(std::count(load->from_tier.begin(), load->from_tier.begin() + *filled, 1));
    LOG_INFO << "kv_store: restored " << *filled << " blocks (" << disk << " from disk, "
             << (*filled * pool_->layout().BlockBytes()) / (1 << 20) << " MiB) in "
             << std::chrono::duration<double, std::milli>(Clock::now() - queued).count()
             << " ms (read, unsealed and verified in " << load->read_ms << " ms by "
             << load->read_threads << " threads; " << load->queued_ms
             << " ms waiting for the loader, " << load->commit_ms << " ms committing)";
  }
  return filled;
}

void TieredCache::LoadPrefix(const engine::PrefixLookup& prefix,
                             const engine::ModelFingerprint& model, std::string_view tenant_salt,
                             std::span<engine::BlockTable> tables) {
  if (prefix.missing().empty() || tables.empty()) return;
  std::vector<std::vector<engine::BlockId>> got;  // one reference per block, handed to `tables`
  Result<int64_t> n = LoadMissing(prefix, model, tenant_salt, &got);
  if (!n.ok()) LOG_WARNING << "prefix load from the store failed: " << n.status().ToString();
  if (got.size() != tables.size()) {
    for (const auto& table : got) {
      for (engine::BlockId b : table) {
        if (b != engine::kNoBlock) pool_->Release(b);
      }
    }
    return;
  }
  for (size_t g = 0; g < got.size(); ++g) tables[g].Adopt(got[g]);
}

Result<int> TieredCache::LoadIntoNewBlocks(engine::KvBlockPool* pool, const PrefixMatch& m,
                                           std::span<const int32_t> tokens,
                                           const engine::ModelFingerprint& model,
                                           std::string_view tenant_salt,
                                           std::vector<engine::BlockId>* out) {
  std::vector<engine::BlockId> dst;
  for (int k = 0; k < m.external_blocks; ++k) {
    Result<engine::BlockId> b = pool->Allocate();
    if (!b.ok()) break;  // pool full: load what fits
    dst.push_back(*b);
  }
  std::shared_ptr<LoadHandle> load = StartLoad(m, tokens, model, tenant_salt, dst);
  Result<int> n = FinishLoad(*load, Deadline::After(std::chrono::seconds(60)));
  const size_t filled = n.ok() ? static_cast<size_t>(*n) : 0;
  for (size_t k = filled; k < dst.size(); ++k) pool->Release(dst[k]);
  out->insert(out->end(), dst.begin(), dst.begin() + static_cast<std::ptrdiff_t>(filled));
  if (!n.ok()) return n.status();
  return static_cast<int>(filled);
}

Result<int> TieredCache::RestorePrefix(engine::KvBlockPool* pool, std::span<const int32_t> tokens,
                                       const engine::ModelFingerprint& model,
                                       std::string_view tenant_salt,
                                       std::vector<engine::BlockId>* table) {
  if (pool == nullptr || table == nullptr) {
    return InvalidArgument("RestorePrefix: pool and table must not be null");
  }
  if (groups_.size() > 1) {
    return FailedPrecondition("RestorePrefix: the cache serves several KV cache groups");
  }
  table->clear();
  // Match, StartLoad and FinishLoad work on the attached pool; a caller may
  // restore into another one (tests, tools): attach it for the call.
  engine::KvBlockPool* const attached = pool_;
  EventListener saved_listener = listener_;
  const bool swap = attached != pool;
  if (swap) {
    if (attached != nullptr) {
      attached->SetSpillHook(nullptr);
      if (own_pool_listener_) attached->SetEventListener(nullptr);
    }
    pool_ = pool;
    listener_ = nullptr;
  }
  PrefixMatch m = Match(tokens, model, tenant_salt);
  *table = pool->MatchPrefix(m.hashes);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.pool_hit_blocks += static_cast<int64_t>(table->size());
  }
  // Pool blocks may have changed between Match and MatchPrefix only on this
  // thread; recount the external run from what MatchPrefix found.
  if (static_cast<int>(table->size()) != m.pool_blocks) {
    m.pool_blocks = static_cast<int>(table->size());
    size_t i = table->size();
    while (i < m.hashes.size() && ((ram_ != nullptr && ram_->Contains(m.hashes[i])) ||
                                   (disk_ != nullptr && disk_->Contains(m.hashes[i])))) {
      ++i;
    }
    m.external_blocks = static_cast<int>(i) - m.pool_blocks;
  }
  Result<int> out = 0;
  if (m.external_blocks > 0) {
    Result<int> n = LoadIntoNewBlocks(pool, m, tokens, model, tenant_salt, table);
    out = n.ok() ? Result<int>(*n * m.block_tokens) : n;
  }
  if (swap) {
    pool_ = attached;
    listener_ = std::move(saved_listener);
    if (attached != nullptr) {
      attached->SetSpillHook(
          [this](const BlockHash& hash, engine::BlockId block) { OnSpill(hash, block); });
      if (own_pool_listener_) {
        attached->SetEventListener([this](const engine::KvEvent& ev) { OnPoolEvent(ev); });
      }
    }
  }
  return out;
}

Result<int> TieredCache::PersistPrefix(engine::KvBlockPool* pool, std::span<const int32_t> tokens,
                                       const engine::ModelFingerprint& model,
                                       std::string_view tenant_salt) {
  if (pool == nullptr) return InvalidArgument("PersistPrefix: pool must not be null");
  const int bt = pool->layout().block_tokens;
  const std::vector<BlockHash> hashes = engine::HashPrefixBlocks(tokens, bt, model, tenant_salt);
  const Sha256Digest salt_hash = TenantSaltHash(tenant_salt);
  int stored = 0;
  if (groups_.size() > 1) {
    // Every group's block the pool still holds; a sliding group's block it
    // released (before some later window) has nothing to store.
    for (size_t i = 0; i < hashes.size(); ++i) {
      auto first = tokens.begin() + static_cast<std::ptrdiff_t>(i * bt);
      for (int g = 0; g < groups_.size(); ++g) {
        const BlockHash key = engine::GroupBlockHash(hashes[i], g);
        std::vector<engine::BlockId> b = pool->MatchPrefix(std::span<const BlockHash>(&key, 1));
        if (b.empty()) continue;
        Note note{model, salt_hash, std::vector<int32_t>(first, first + bt), g};
        if (Store(key, note, pool, b[0])) ++stored;
        pool->Release(b[0]);
      }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.persisted_blocks += stored;
    return stored;
  }
  std::vector<engine::BlockId> blocks = pool->MatchPrefix(hashes);
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

TierStats TieredCache::disk_stats() const {
  return disk_ != nullptr ? disk_->stats() : TierStats{};
}

}  // namespace kvrelay::kv_store
