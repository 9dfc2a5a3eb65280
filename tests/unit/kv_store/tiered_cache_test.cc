#include "kv_store/tiered_cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <random>

#include "kv_store/rocksdb_tier.h"
#include "tests/unit/kv_store/test_blocks.h"

namespace kvrelay::kv_store {
namespace {

namespace fs = std::filesystem;
using engine::BlockId;
using engine::KvBlockPool;

using testing::AttachScope;

constexpr char kSalt[] = "tenant-a";

engine::KvLayout Layout(engine::KvDtype dtype) {
  engine::KvLayout l;
  l.layers = 4;
  l.kv_heads = 2;
  l.head_dim = 16;
  l.block_tokens = 8;
  l.dtype = dtype;
  return l;
}

std::unique_ptr<KvBlockPool> MakePool(const engine::KvLayout& l, int blocks) {
  return KvBlockPool::Create({.layout = l, .capacity_bytes = blocks * l.BlockBytes()}).value();
}

std::vector<int32_t> Tokens(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(rng() % 49152);
  return t;
}

// "Prefills" tokens into the pool: writes deterministic K/V for every full
// block, commits it under its chain hash and releases it (cached, unreferenced).
// Returns a copy of every block's layer bytes.
std::vector<std::vector<std::vector<uint8_t>>> Prefill(KvBlockPool* pool,
                                                       std::span<const int32_t> tokens,
                                                       const engine::ModelFingerprint& model,
                                                       std::string_view salt) {
  const auto& l = pool->layout();
  auto hashes = engine::HashPrefixBlocks(tokens, l.block_tokens, model, salt);
  std::vector<std::vector<std::vector<uint8_t>>> bytes;
  std::mt19937 rng(tokens.empty() ? 0 : static_cast<uint32_t>(tokens[0]));
  std::normal_distribution<float> dist;
  std::vector<float> k(static_cast<size_t>(l.kv_heads * l.head_dim)), v(k.size());
  for (size_t b = 0; b < hashes.size(); ++b) {
    BlockId id = pool->Allocate().value();
    for (int layer = 0; layer < l.layers; ++layer) {
      for (int off = 0; off < l.block_tokens; ++off) {
        for (auto& x : k) x = dist(rng);
        for (auto& x : v) x = dist(rng);
        pool->WriteToken(id, layer, off, k.data(), v.data());
      }
    }
    pool->Commit(id, hashes[b]);
    std::vector<std::vector<uint8_t>> layers;
    for (int layer = 0; layer < l.layers; ++layer) {
      auto d = pool->LayerData(id, layer);
      layers.emplace_back(d.begin(), d.end());
    }
    bytes.push_back(std::move(layers));
    pool->Release(id);
  }
  return bytes;
}

// Allocates (and frees) every block, so every cached block is evicted.
void EvictAll(KvBlockPool* pool) {
  std::vector<BlockId> ids;
  while (true) {
    auto r = pool->Allocate();
    if (!r.ok()) break;
    ids.push_back(*r);
  }
  for (BlockId id : ids) pool->Release(id);
}

// Prefills `tokens` into a pool of `blocks` blocks whose cache writes
// through to `disk`, then waits for the disk to hold them (*drained: it did).
// Returns every block's layer bytes, as Prefill.
std::vector<std::vector<std::vector<uint8_t>>> PrefillToDisk(
    KvTier* disk, const engine::KvLayout& layout, int blocks, std::span<const int32_t> tokens,
    const engine::ModelFingerprint& model, bool* drained) {
  TieredCache cache({}, nullptr, disk);
  auto pool = MakePool(layout, blocks);
  AttachScope attached(cache, pool.get());
  (void)cache.Match(tokens, model, kSalt);
  auto bytes = Prefill(pool.get(), tokens, model, kSalt);
  *drained = cache.Drain(Deadline::AfterMs(10000)).ok();
  return bytes;
}

class TieredCacheTest : public ::testing::TestWithParam<engine::KvDtype> {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("kvstore_tiered_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  RocksDbTier::Options DiskOpts() {
    RocksDbTier::Options o;
    o.path = dir_.string();
    o.write_buffer_bytes = 1 << 20;
    return o;
  }
  fs::path dir_;
};

TEST_P(TieredCacheTest, LoadMissingTakesTheEnginesHashesFromTheFirstMissingBlock) {
  const auto layout = Layout(GetParam());
  const auto model = testing::Fingerprint(3);
  auto ram = HostRamTier::Create({.capacity_bytes = 64 << 20}).value();
  TieredCache cache({}, ram.get(), nullptr);
  auto pool = MakePool(layout, 6);
  AttachScope attached(cache, pool.get());
  const auto tokens = Tokens(5 * 8, 12);
  cache.NoteSequence(tokens, model, kSalt);
  const auto want = Prefill(pool.get(), tokens, model, kSalt);
  ASSERT_EQ(want.size(), 5u);
  EvictAll(pool.get());
  cache.Detach();

  auto pool2 = MakePool(layout, 8);
  AttachScope attached_pool2(cache, pool2.get());
  const auto hashes = engine::HashPrefixBlocks(tokens, 8, model, kSalt);
  // The engine holds blocks 0 and 1 already: only 2..4 are asked for.
  std::vector<std::vector<BlockId>> tables;  // one KV cache group: tables[0]
  auto n = cache.LoadMissing({tokens, hashes, 2, 8}, model, kSalt, &tables);
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_EQ(*n, 3);
  ASSERT_EQ(tables.size(), 1u);
  const std::vector<BlockId> got = tables[0];
  ASSERT_EQ(got.size(), 3u);
  for (size_t b = 0; b < got.size(); ++b) {
    for (int layer = 0; layer < layout.layers; ++layer) {
      auto bytes = pool2->LayerData(got[b], layer);
      ASSERT_EQ(std::vector<uint8_t>(bytes.begin(), bytes.end()), want[b + 2][layer])
          << "block " << b + 2 << " layer " << layer;
    }
    EXPECT_EQ(pool2->refcount(got[b]), 1);
  }
  for (BlockId id : got) pool2->Release(id);
  EXPECT_EQ(cache.stats().restored_blocks_ram, 3);

  // Hashes that do not belong to the tokens given: the stored block's
  // recorded tokens disagree, so nothing is read from a tier (verified, not
  // trusted). The pool's own blocks are matched by hash, as the engine's
  // prefix cache matches them: evicted first, so the tier is asked.
  EvictAll(pool2.get());
  auto other = tokens;
  other[2 * 8] ^= 1;
  auto none = cache.LoadMissing({other, hashes, 2, 8}, model, kSalt, &tables);
  EXPECT_TRUE(none.ok() && *none == 0)
      << (none.ok() ? std::to_string(*none) : none.status().ToString());
  ASSERT_EQ(tables.size(), 1u);
  EXPECT_TRUE(tables[0].empty());
  // A lookup in another block size is refused, not misread.
  auto bad = cache.LoadMissing({tokens, hashes, 2, 16}, model, kSalt, &tables);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(pool2->available_blocks(), 8);  // every block back (some cached)
  cache.Detach();
}

TEST_P(TieredCacheTest, SpilledBlocksRestoreWithIdenticalLayerBytes) {
  const auto layout = Layout(GetParam());
  const auto model = testing::Fingerprint(3);
  auto ram = HostRamTier::Create({.capacity_bytes = 64 << 20}).value();
  TieredCache cache({}, ram.get(), nullptr);
  auto pool = MakePool(layout, 6);
  AttachScope attached(cache, pool.get());
  const auto tokens = Tokens(5 * 8 + 3, 11);  // 5 full blocks + a partial one
  cache.NoteSequence(tokens, model, kSalt);
  const auto want = Prefill(pool.get(), tokens, model, kSalt);
  ASSERT_EQ(want.size(), 5u);
  EvictAll(pool.get());
  EXPECT_EQ(cache.stats().spills, 5);
  EXPECT_EQ(ram->stats().entries, 5);

  // A fresh pool (another process, say) restores all 5 blocks from RAM.
  auto pool2 = MakePool(layout, 8);
  std::vector<BlockId> table;
  auto restored = cache.RestorePrefix(pool2.get(), tokens, model, kSalt, &table);
  ASSERT_TRUE(restored.ok()) << restored.status().ToString();
  EXPECT_EQ(*restored, 40);
  ASSERT_EQ(table.size(), 5u);
  for (size_t b = 0; b < table.size(); ++b) {
    for (int layer = 0; layer < layout.layers; ++layer) {
      auto got = pool2->LayerData(table[b], layer);
      ASSERT_EQ(std::vector<uint8_t>(got.begin(), got.end()), want[b][layer])
          << "block " << b << " layer " << layer;
    }
    EXPECT_EQ(pool2->refcount(table[b]), 1);
  }
  // Restored blocks are now in pool2's prefix cache: a second restore is all pool hits.
  for (BlockId id : table) pool2->Release(id);
  auto again = cache.RestorePrefix(pool2.get(), tokens, model, kSalt, &table);
  EXPECT_EQ(*again, 0);
  EXPECT_EQ(table.size(), 5u);
  for (BlockId id : table) pool2->Release(id);
  EXPECT_EQ(cache.stats().restored_blocks_ram, 5);
  EXPECT_EQ(cache.stats().pool_hit_blocks, 5);
  cache.Detach();
}

TEST_P(TieredCacheTest, OtherTenantModelOrTokensGetNothing) {
  const auto layout = Layout(GetParam());
  const auto model = testing::Fingerprint(3);
  auto ram = HostRamTier::Create({.capacity_bytes = 64 << 20}).value();
  TieredCache cache({}, ram.get(), nullptr);
  auto pool = MakePool(layout, 4);
  AttachScope attached(cache, pool.get());
  const auto tokens = Tokens(32, 12);
  cache.NoteSequence(tokens, model, kSalt);
  Prefill(pool.get(), tokens, model, kSalt);
  EvictAll(pool.get());
  auto pool2 = MakePool(layout, 8);
  std::vector<BlockId> table;
  EXPECT_EQ(*cache.RestorePrefix(pool2.get(), tokens, model, "tenant-b", &table), 0);
  EXPECT_EQ(*cache.RestorePrefix(pool2.get(), tokens, testing::Fingerprint(4), kSalt, &table), 0);
  auto other = tokens;
  other[3] += 1;  // first block differs, so every chain hash differs
  EXPECT_EQ(*cache.RestorePrefix(pool2.get(), other, model, kSalt, &table), 0);
  EXPECT_TRUE(table.empty());
  EXPECT_EQ(cache.stats().misses[static_cast<size_t>(MissReason::kNotFound)], 3);
  // A diverging later block: the common prefix is restored, the rest is not.
  auto tail = tokens;
  tail[20] += 1;  // block 2 of 4
  EXPECT_EQ(*cache.RestorePrefix(pool2.get(), tail, model, kSalt, &table), 16);
  for (BlockId id : table) pool2->Release(id);
  cache.Detach();
}

TEST_P(TieredCacheTest, DamagedRamCopyIsAMissAndDiskCopyIsUsed) {
  const auto layout = Layout(GetParam());
  const auto model = testing::Fingerprint(5);
  auto ram = HostRamTier::Create({.capacity_bytes = 64 << 20}).value();
  auto disk = RocksDbTier::Open(DiskOpts()).value();
  TieredCache cache({}, ram.get(), disk.get());  // write-through
  auto pool = MakePool(layout, 4);
  AttachScope attached(cache, pool.get());
  const auto tokens = Tokens(24, 13);
  cache.NoteSequence(tokens, model, kSalt);
  const auto want = Prefill(pool.get(), tokens, model, kSalt);
  EvictAll(pool.get());
  ASSERT_TRUE(disk->WaitDurable(Deadline::AfterMs(10000)).ok());
  EXPECT_EQ(disk->stats().entries, 3);
  // Damage block 1 in RAM.
  auto hashes = engine::HashPrefixBlocks(tokens, layout.block_tokens, model, kSalt);
  std::string v = *ram->Get(hashes[1]);
  v[v.size() / 2] ^= 0x10;
  ASSERT_TRUE(ram->Put(hashes[1], v).ok());

  auto pool2 = MakePool(layout, 8);
  std::vector<BlockId> table;
  EXPECT_EQ(*cache.RestorePrefix(pool2.get(), tokens, model, kSalt, &table), 24);
  auto s = cache.stats();
  EXPECT_EQ(s.misses[static_cast<size_t>(MissReason::kChecksum)], 1);
  EXPECT_EQ(s.restored_blocks_ram, 2);
  EXPECT_EQ(s.restored_blocks_disk, 1);
  auto got = pool2->LayerData(table[1], 2);
  EXPECT_EQ(std::vector<uint8_t>(got.begin(), got.end()), want[1][2]);
  for (BlockId id : table) pool2->Release(id);
  cache.Detach();
}

TEST_P(TieredCacheTest, RestoresFromDiskAfterReopenAndStopsWhenThePoolIsFull) {
  const auto layout = Layout(GetParam());
  const auto model = testing::Fingerprint(6);
  const auto tokens = Tokens(6 * 8, 14);
  std::vector<std::vector<std::vector<uint8_t>>> want;
  {
    auto disk = RocksDbTier::Open(DiskOpts()).value();
    TieredCache cache({}, nullptr, disk.get());
    auto pool = MakePool(layout, 8);
    AttachScope attached(cache, pool.get());
    want = Prefill(pool.get(), tokens, model, kSalt);
    // Nothing noted and nothing evicted yet: persist explicitly, as at shutdown.
    EXPECT_EQ(*cache.PersistPrefix(pool.get(), tokens, model, kSalt), 6);
    ASSERT_TRUE(disk->WaitDurable(Deadline::AfterMs(10000)).ok());
    cache.Detach();
  }
  auto disk = RocksDbTier::Open(DiskOpts()).value();
  EXPECT_EQ(disk->open_report().entries, 6);
  TieredCache cache({}, nullptr, disk.get());
  auto pool = MakePool(layout, 4);  // room for 4 of the 6 blocks
  std::vector<BlockId> table;
  EXPECT_EQ(*cache.RestorePrefix(pool.get(), tokens, model, kSalt, &table), 32);
  ASSERT_EQ(table.size(), 4u);
  for (size_t b = 0; b < 4; ++b) {
    auto got = pool->LayerData(table[b], 3);
    EXPECT_EQ(std::vector<uint8_t>(got.begin(), got.end()), want[b][3]);
  }
  EXPECT_EQ(cache.stats().restored_blocks_disk, 4);
  for (BlockId id : table) pool->Release(id);
}

TEST_P(TieredCacheTest, WithoutWriteThroughRamEvictionsAreDemotedToDisk) {
  const auto layout = Layout(GetParam());
  const auto model = testing::Fingerprint(7);
  const int64_t enc_bytes = static_cast<int64_t>(kFixedHeaderBytes) + 4 * 8 + layout.BlockBytes();
  auto ram = HostRamTier::Create({.capacity_bytes = 2 * enc_bytes}).value();
  auto disk = RocksDbTier::Open(DiskOpts()).value();
  TieredCache cache({.write_through = false}, ram.get(), disk.get());
  auto pool = MakePool(layout, 4);
  AttachScope attached(cache, pool.get());
  const auto tokens = Tokens(32, 15);
  cache.NoteSequence(tokens, model, kSalt);
  Prefill(pool.get(), tokens, model, kSalt);
  EvictAll(pool.get());
  EXPECT_EQ(ram->stats().entries, 2);
  EXPECT_EQ(cache.stats().demotions, 2);
  EXPECT_EQ(disk->stats().entries, 2);
  auto pool2 = MakePool(layout, 8);
  std::vector<BlockId> table;
  EXPECT_EQ(*cache.RestorePrefix(pool2.get(), tokens, model, kSalt, &table), 32);
  for (BlockId id : table) pool2->Release(id);
  cache.Detach();
}

// The defect of issue 15: a prompt served before a clean restart was
// recomputed after it, because only evicted blocks were written. Now every
// committed block is written through (Pump) and Drain makes it durable.
TEST_P(TieredCacheTest, CommittedBlocksAreWrittenThroughAndSurviveACleanRestart) {
  const auto layout = Layout(GetParam());
  const auto model = testing::Fingerprint(8);
  const auto tokens = Tokens(7 * 8 + 5, 21);  // 7 full blocks
  std::vector<std::vector<std::vector<uint8_t>>> want;
  std::vector<TierEvent> events;
  {
    auto ram = HostRamTier::Create({.capacity_bytes = 64 << 20}).value();
    auto disk = RocksDbTier::Open(DiskOpts()).value();
    TieredCache cache({}, ram.get(), disk.get());
    auto pool = MakePool(layout, 16);
    AttachScope attached(cache, pool.get(), [&](const TierEvent& e) { events.push_back(e); });
    PrefixMatch m = cache.Match(tokens, model, kSalt);  // admission notes the prompt
    EXPECT_EQ(m.pool_blocks, 0);
    EXPECT_EQ(m.external_blocks, 0);
    want = Prefill(pool.get(), tokens, model, kSalt);  // commits 7 blocks, evicts none
    cache.Pump();
    ASSERT_TRUE(cache.Drain(Deadline::AfterMs(10000)).ok());
    const auto s = cache.stats();
    EXPECT_EQ(s.write_through_blocks, 7);
    EXPECT_EQ(s.write_backlog, 0);
    EXPECT_EQ(disk->stats().entries, 7);
    // Eviction from the pool now only copies to RAM: the disk is not written again.
    const int64_t written = disk->stats().written;
    EvictAll(pool.get());
    EXPECT_EQ(ram->stats().entries, 7);
    cache.Pump();
    ASSERT_TRUE(disk->Flush(Deadline::AfterMs(10000)).ok());
    EXPECT_EQ(disk->stats().written, written);
    cache.Detach();
  }
  // Events name the tier: 7 stored in the pool, 7 stored on disk, 7 evicted
  // from the pool while still held (RAM and disk).
  int pool_stored = 0, disk_stored = 0, pool_evicted_held = 0;
  for (const TierEvent& e : events) {
    if (e.kind == TierEvent::Kind::kStored && e.tier == BlockTier::kPool) ++pool_stored;
    if (e.kind == TierEvent::Kind::kStored && e.tier == BlockTier::kDisk) ++disk_stored;
    if (e.kind == TierEvent::Kind::kEvicted && e.tier == BlockTier::kPool && e.held_anywhere) {
      ++pool_evicted_held;
    }
  }
  EXPECT_EQ(pool_stored, 7);
  EXPECT_EQ(disk_stored, 7);
  EXPECT_EQ(pool_evicted_held, 7);

  // The restart: a new process (new tiers, new pool) loads all 7 blocks from disk.
  auto disk = RocksDbTier::Open(DiskOpts()).value();
  EXPECT_EQ(disk->open_report().entries, 7);
  TieredCache cache({}, nullptr, disk.get());
  auto pool = MakePool(layout, 16);
  std::vector<TierEvent> announced;
  AttachScope attached(cache, pool.get(), [&](const TierEvent& e) { announced.push_back(e); });
  cache.AnnounceAll();
  cache.Pump();
  EXPECT_EQ(announced.size(), 7u);  // the router learns what the disk holds
  PrefixMatch m = cache.Match(tokens, model, kSalt);
  EXPECT_EQ(m.pool_blocks, 0);
  EXPECT_EQ(m.external_blocks, 7);
  EXPECT_EQ(m.loadable_tokens(), 56);
  std::vector<BlockId> dst;
  for (int i = 0; i < 7; ++i) dst.push_back(pool->Allocate().value());
  auto load = cache.StartLoad(m, tokens, model, kSalt, dst);
  auto n = cache.FinishLoad(*load, Deadline::AfterMs(10000));
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_EQ(*n, 7);
  EXPECT_EQ(disk->stats().get_batches, 1) << "one MultiGet for a prefix of up to 8 blocks";
  for (size_t b = 0; b < dst.size(); ++b) {
    for (int layer = 0; layer < layout.layers; ++layer) {
      auto got = pool->LayerData(dst[b], layer);
      ASSERT_EQ(std::vector<uint8_t>(got.begin(), got.end()), want[b][layer]);
    }
  }
  // Committed: the engine's own prefix lookup finds them.
  auto hashes = engine::HashPrefixBlocks(tokens, layout.block_tokens, model, kSalt);
  std::vector<BlockId> hit = pool->MatchPrefix(hashes);
  EXPECT_EQ(hit.size(), 7u);
  for (BlockId b : hit) pool->Release(b);
  for (BlockId b : dst) pool->Release(b);
  // Loaded from disk, so nothing is written back.
  cache.Pump();
  EXPECT_EQ(cache.stats().write_through_blocks, 0);
  cache.Detach();
}

// A value damaged on disk in a way RocksDB does not notice (a flipped byte
// written back through the tier) is a checksum miss: never KV in the pool.
TEST_P(TieredCacheTest, AByteFlippedOnDiskIsAMissNeverLoaded) {
  const auto layout = Layout(GetParam());
  const auto model = testing::Fingerprint(9);
  const auto tokens = Tokens(4 * 8, 22);
  auto disk = RocksDbTier::Open(DiskOpts()).value();
  bool drained = false;
  PrefillToDisk(disk.get(), layout, 16, tokens, model, &drained);
  ASSERT_TRUE(drained);
  auto hashes = engine::HashPrefixBlocks(tokens, layout.block_tokens, model, kSalt);
  std::string v = *disk->Get(hashes[2]);
  v[v.size() - 7] ^= 0x01;
  ASSERT_TRUE(disk->Put(hashes[2], v).ok());
  ASSERT_TRUE(disk->Flush(Deadline::AfterMs(10000)).ok());

  auto pool2 = MakePool(layout, 16);
  TieredCache cache2({}, nullptr, disk.get());
  AttachScope attached2(cache2, pool2.get());
  PrefixMatch m = cache2.Match(tokens, model, kSalt);
  EXPECT_EQ(m.external_blocks, 4);  // the index cannot know
  std::vector<BlockId> dst;
  for (int i = 0; i < 4; ++i) dst.push_back(pool2->Allocate().value());
  auto load = cache2.StartLoad(m, tokens, model, kSalt, dst);
  EXPECT_EQ(*cache2.FinishLoad(*load, Deadline::AfterMs(10000)), 2);
  EXPECT_EQ(cache2.stats().misses[static_cast<size_t>(MissReason::kChecksum)], 1);
  EXPECT_FALSE(pool2->IsCached(hashes[2]));
  EXPECT_FALSE(disk->Contains(hashes[2])) << "a value that never verifies is erased";
  for (BlockId b : dst) pool2->Release(b);
  cache2.Detach();
}

// A disk whose reads wait at a gate the test opens: a stalled device. The
// rest is the real tier underneath.
class StalledTier : public KvTier {
 public:
  explicit StalledTier(KvTier* inner) : inner_(inner) {}
  void Open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  std::string_view name() const override { return "stalled"; }
  Status Put(const BlockHash& hash, std::string value) override {
    return inner_->Put(hash, std::move(value));
  }
  Result<std::string> Get(const BlockHash& hash) override {
    Wait();
    return inner_->Get(hash);
  }
  std::vector<Result<std::string>> GetBatch(std::span<const BlockHash> hashes) override {
    Wait();
    return inner_->GetBatch(hashes);
  }
  bool Contains(const BlockHash& hash) override { return inner_->Contains(hash); }
  Status Erase(const BlockHash& hash) override { return inner_->Erase(hash); }
  int64_t capacity_bytes() const override { return inner_->capacity_bytes(); }
  int64_t used_bytes() const override { return inner_->used_bytes(); }
  TierStats stats() const override { return inner_->stats(); }

 private:
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(30), [&] { return open_; });
  }
  KvTier* const inner_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

// The loader writes a restored block straight into the caller's pool block.
// When FinishLoad gives up at its deadline (a stalled disk), the blocks are
// the caller's again at once: a read that completes later writes nothing
// into them and commits nothing.
TEST_P(TieredCacheTest, AnAbandonedLoadNeverWritesIntoTheCallersBlocks) {
  const auto layout = Layout(GetParam());
  const auto model = testing::Fingerprint(9);
  const auto tokens = Tokens(4 * 8, 24);
  auto disk = RocksDbTier::Open(DiskOpts()).value();
  bool drained = false;
  PrefillToDisk(disk.get(), layout, 16, tokens, model, &drained);
  ASSERT_TRUE(drained);
  StalledTier stalled(disk.get());
  auto pool = MakePool(layout, 16);
  std::vector<BlockId> dst;
  {
    TieredCache cache({}, nullptr, &stalled);
    AttachScope attached(cache, pool.get());
    PrefixMatch m = cache.Match(tokens, model, kSalt);
    ASSERT_EQ(m.external_blocks, 4);
    for (int i = 0; i < 4; ++i) dst.push_back(pool->Allocate().value());
    auto load = cache.StartLoad(m, tokens, model, kSalt, dst);
    Result<int> n = cache.FinishLoad(*load, Deadline::AfterMs(100));
    ASSERT_EQ(n.status().code(), StatusCode::kDeadlineExceeded) << n.status().ToString();
    // The caller uses its blocks for something else; then the disk wakes up
    // and the loader finishes its read (the cache joins it when it goes).
    for (BlockId b : dst) {
      for (int l = 0; l < layout.layers; ++l) {
        auto d = pool->LayerData(b, l);
        std::fill(d.begin(), d.end(), uint8_t{0xA5});
      }
    }
    stalled.Open();
  }
  for (BlockId b : dst) {
    for (int l = 0; l < layout.layers; ++l) {
      auto d = pool->LayerData(b, l);
      ASSERT_TRUE(std::all_of(d.begin(), d.end(), [](uint8_t x) { return x == 0xA5; }))
          << "block " << b << " layer " << l << " was written after FinishLoad gave it back";
    }
  }
  auto hashes = engine::HashPrefixBlocks(tokens, layout.block_tokens, model, kSalt);
  for (const BlockHash& h : hashes) EXPECT_FALSE(pool->IsCached(h));
  for (BlockId b : dst) pool->Release(b);
}

// A long load is read in parts by several threads (ReadLoad); what it
// returns is still the prefix up to the first block that does not verify,
// byte for byte, whichever part that block falls in.
TEST_P(TieredCacheTest, ALoadReadInPartsEndsAtItsFirstBadBlock) {
  const auto layout = Layout(GetParam());
  const auto model = testing::Fingerprint(9);
  constexpr int kBlocks = 48;
  const auto tokens = Tokens(kBlocks * layout.block_tokens, 23);
  auto disk = RocksDbTier::Open(DiskOpts()).value();
  auto hashes = engine::HashPrefixBlocks(tokens, layout.block_tokens, model, kSalt);
  bool drained = false;
  const auto want = PrefillToDisk(disk.get(), layout, kBlocks, tokens, model, &drained);
  ASSERT_TRUE(drained);
  for (const int bad : {kBlocks, 37, 5}) {  // none, in a later part, in the first
    SCOPED_TRACE("bad block " + std::to_string(bad));
    if (bad < kBlocks) {
      std::string v = *disk->Get(hashes[static_cast<size_t>(bad)]);
      v[v.size() / 2] ^= 0x01;
      ASSERT_TRUE(disk->Put(hashes[static_cast<size_t>(bad)], v).ok());
      ASSERT_TRUE(disk->Flush(Deadline::AfterMs(10000)).ok());
    }
    auto pool = MakePool(layout, kBlocks);
    TieredCache cache({}, nullptr, disk.get());
    AttachScope attached(cache, pool.get());
    PrefixMatch m = cache.Match(tokens, model, kSalt);
    std::vector<BlockId> dst;
    for (int i = 0; i < m.external_blocks; ++i) dst.push_back(pool->Allocate().value());
    auto load = cache.StartLoad(m, tokens, model, kSalt, dst);
    Result<int> n = cache.FinishLoad(*load, Deadline::AfterMs(30000));
    ASSERT_TRUE(n.ok()) << n.status().ToString();
    EXPECT_EQ(*n, bad);
    for (int b = 0; b < *n; ++b) {
      for (int layer = 0; layer < layout.layers; ++layer) {
        auto d = pool->LayerData(dst[static_cast<size_t>(b)], layer);
        ASSERT_TRUE(std::equal(d.begin(), d.end(), want[static_cast<size_t>(b)][layer].begin()))
            << "block " << b << " layer " << layer;
      }
    }
    for (BlockId b : dst) pool->Release(b);
    cache.Detach();
  }
}

// A burst of commits larger than the disk queue waits in the backlog (the
// request path never blocks), and Drain writes all of it.
TEST_P(TieredCacheTest, WriteThroughToAFullQueueWaitsAndDrainFinishesIt) {
  const auto layout = Layout(GetParam());
  const auto model = testing::Fingerprint(10);
  const auto tokens = Tokens(12 * 8, 23);
  RocksDbTier::Options o = DiskOpts();
  o.max_queue_blocks = 2;  // far fewer than the 12 blocks committed at once
  auto disk = RocksDbTier::Open(o).value();
  TieredCache cache({}, nullptr, disk.get());
  auto pool = MakePool(layout, 16);
  AttachScope attached(cache, pool.get());
  (void)cache.Match(tokens, model, kSalt);
  disk->SetWriterPausedForTesting(true);
  Prefill(pool.get(), tokens, model, kSalt);
  cache.Pump();
  EXPECT_EQ(cache.stats().write_through_blocks, 2);
  EXPECT_EQ(cache.stats().write_backlog, 10) << "the rest waits; nothing is dropped";
  disk->SetWriterPausedForTesting(false);
  ASSERT_TRUE(cache.Drain(Deadline::AfterMs(10000)).ok());
  EXPECT_EQ(cache.stats().write_through_blocks, 12);
  EXPECT_EQ(cache.stats().write_through_dropped, 0);
  EXPECT_EQ(disk->stats().entries, 12);
  cache.Detach();
}

// What a worker's heartbeat carries (kvrelay_worker_kvstore_* on the
// coordinator's /metrics): the cache's write-through counts and its disk
// tier's, which agree once the disk has written what it accepted; a cache
// without a disk tier has all-zero disk figures.
TEST_P(TieredCacheTest, DiskStatsFollowWriteThrough) {
  const auto layout = Layout(GetParam());
  const auto model = testing::Fingerprint(11);
  const auto tokens = Tokens(3 * 8, 24);
  auto disk = RocksDbTier::Open(DiskOpts()).value();
  TieredCache cache({}, nullptr, disk.get());
  auto pool = MakePool(layout, 8);
  AttachScope attached(cache, pool.get());
  EXPECT_EQ(cache.disk_stats().entries, 0);
  (void)cache.Match(tokens, model, kSalt);
  Prefill(pool.get(), tokens, model, kSalt);
  ASSERT_TRUE(cache.Drain(Deadline::AfterMs(10000)).ok());
  EXPECT_EQ(cache.stats().write_through_blocks, 3);
  const TierStats d = cache.disk_stats();
  EXPECT_EQ(d.written, 3);
  EXPECT_EQ(d.entries, 3);
  EXPECT_GT(d.used_bytes, 0);
  EXPECT_EQ(d.write_failures, 0);
  cache.Detach();

  auto ram = HostRamTier::Create({.capacity_bytes = 64 << 20}).value();
  TieredCache ram_only({}, ram.get(), nullptr);
  EXPECT_EQ(ram_only.disk_stats().written, 0);
  EXPECT_EQ(ram_only.disk_stats().entries, 0);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, TieredCacheTest,
                         ::testing::Values(engine::KvDtype::kF32, engine::KvDtype::kF16),
                         [](const auto& info) {
                           return std::string(engine::KvDtypeName(info.param));
                         });

}  // namespace
}  // namespace kvrelay::kv_store
