// The prefix tiers with several KV cache groups (engine/kv_cache/kv_groups.h):
// one tier entry per group block (format version 2, only that group's
// layers), the longest hit every group can serve (TieredCache::
// LoadMissing), a mismatched or damaged group entry as a miss, and an
// engine that keeps its groups with a store in front of it giving the tokens
// of the engine alone after its pool is gone.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <random>

#include "engine/runtime/engine.h"
#include "engine/runtime/model.h"
#include "kv_store/rocksdb_tier.h"
#include "kv_store/tiered_cache.h"
#include "tests/testing/synthetic_model.h"
#include "tests/unit/kv_store/test_blocks.h"

namespace kvrelay::kv_store {
namespace {

namespace fs = std::filesystem;
using engine::BlockId;
using engine::GroupBlockHash;
using engine::kNoBlock;
using engine::KvBlockPool;
using engine::KvCacheGroups;

constexpr char kSalt[] = "tenant-g";
constexpr int kB = 4;       // tokens per block
constexpr int kWindow = 8;  // sliding window: 2 blocks

// 6 layers, layers 4 and 5 full attention: 1 full group and 2 sliding
// groups of 2 layers each.
KvCacheGroups Groups() {
  const std::vector<int> windows{kWindow, kWindow, kWindow, kWindow, 0, 0};
  return KvCacheGroups::FromLayerWindows(windows, /*split=*/true);
}

engine::KvLayout Layout() {
  engine::KvLayout l;
  l.layers = 2;
  l.kv_heads = 2;
  l.head_dim = 8;
  l.block_tokens = kB;
  l.dtype = engine::KvDtype::kF32;
  return l;
}

std::unique_ptr<KvBlockPool> MakePool(int blocks) {
  return KvBlockPool::Create({.layout = Layout(), .capacity_bytes = blocks * Layout().BlockBytes()})
      .value();
}

std::vector<int32_t> Tokens(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(rng() % 30000);
  return t;
}

using Bytes = std::vector<std::vector<uint8_t>>;  // per layer
// (group, block) -> the layer bytes written.
using Written = std::map<std::pair<int, int64_t>, Bytes>;

// Writes random K/V for every group's block of every full block of `tokens`,
// commits each under its group key and releases it (cached, unreferenced).
Written Prefill(KvBlockPool* pool, const KvCacheGroups& groups, std::span<const int32_t> tokens,
                const engine::ModelFingerprint& model) {
  const auto& l = pool->layout();
  const auto hashes = engine::HashPrefixBlocks(tokens, kB, model, kSalt);
  std::mt19937 rng(static_cast<uint32_t>(tokens[0]));
  std::normal_distribution<float> dist;
  std::vector<float> k(static_cast<size_t>(l.kv_heads * l.head_dim)), v(k.size());
  Written out;
  for (size_t i = 0; i < hashes.size(); ++i) {
    for (int g = 0; g < groups.size(); ++g) {
      const BlockId id = pool->Allocate().value();
      Bytes layers;
      for (int layer = 0; layer < l.layers; ++layer) {
        for (int off = 0; off < kB; ++off) {
          for (auto& x : k) x = dist(rng);
          for (auto& x : v) x = dist(rng);
          pool->WriteToken(id, layer, off, k.data(), v.data());
        }
      }
      pool->Commit(id, GroupBlockHash(hashes[i], g));
      for (int layer = 0; layer < l.layers; ++layer) {
        auto d = pool->LayerData(id, layer);
        layers.emplace_back(d.begin(), d.end());
      }
      out[{g, static_cast<int64_t>(i)}] = std::move(layers);
      pool->Release(id);
    }
  }
  return out;
}

// The first block of group g a hit of k blocks over `n` tokens needs.
int64_t NeededFrom(const KvCacheGroups& groups, int g, int64_t k, int64_t n) {
  return groups.DroppableBlocks(g, std::min<int64_t>(k * kB, n - 1), kB);
}

// Checks `tables` (from LoadMissing with first = 0) against what was
// written: holes exactly before each group's window, the bytes elsewhere.
void ExpectTables(KvBlockPool* pool, const KvCacheGroups& groups,
                  const std::vector<std::vector<BlockId>>& tables, int64_t hit, int64_t n,
                  const Written& want) {
  ASSERT_EQ(tables.size(), static_cast<size_t>(groups.size()));
  for (int g = 0; g < groups.size(); ++g) {
    ASSERT_EQ(static_cast<int64_t>(tables[static_cast<size_t>(g)].size()), hit) << "group " << g;
    const int64_t from = NeededFrom(groups, g, hit, n);
    for (int64_t i = 0; i < hit; ++i) {
      const BlockId b = tables[static_cast<size_t>(g)][static_cast<size_t>(i)];
      if (i < from) {
        EXPECT_EQ(b, kNoBlock) << "group " << g << " block " << i << " is before the window";
        continue;
      }
      ASSERT_NE(b, kNoBlock) << "group " << g << " block " << i;
      EXPECT_EQ(pool->refcount(b), 1);
      for (int layer = 0; layer < pool->layout().layers; ++layer) {
        auto d = pool->LayerData(b, layer);
        ASSERT_EQ(std::vector<uint8_t>(d.begin(), d.end()), want.at({g, i}).at(layer))
            << "group " << g << " block " << i << " layer " << layer;
      }
    }
  }
}

void ReleaseTables(KvBlockPool* pool, const std::vector<std::vector<BlockId>>& tables) {
  for (const auto& t : tables) {
    for (BlockId b : t) {
      if (b != kNoBlock) pool->Release(b);
    }
  }
}

class GroupedTierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("kvstore_grouped_" + std::to_string(::getpid()));
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

TEST(GroupBlockCodecTest, GroupBlocksCarryTheirGroupAndOthersAreALayoutMiss) {
  const KvCacheGroups groups = Groups();
  ASSERT_EQ(groups.size(), 3);
  testing::TestBlock b = testing::MakeBlock(7, Layout());
  const std::string one_group = b.Encoded();  // version 1
  b.meta.group = MakeBlockGroup(groups, 1);
  const std::string grouped = b.Encoded();
  ASSERT_FALSE(grouped.empty());
  EXPECT_EQ(grouped.size(), EncodedBlockBytes(Layout(), /*grouped=*/true));
  EXPECT_EQ(grouped.size(), one_group.size() + kGroupExtBytes);
  DecodedBlock d = DecodeBlock(grouped, b.meta);
  ASSERT_TRUE(d.ok()) << MissReasonName(d.reason);
  EXPECT_EQ(std::vector<uint8_t>(d.payload.begin(), d.payload.end()), b.Payload());
  // Another group of the same grouping, a one-group reader, another
  // grouping: never this block's KV.
  BlockMeta other = b.meta;
  other.group = MakeBlockGroup(groups, 2);
  EXPECT_EQ(DecodeBlock(grouped, other).reason, MissReason::kLayout);
  other.group = BlockGroup{};
  EXPECT_EQ(DecodeBlock(grouped, other).reason, MissReason::kLayout);
  EXPECT_EQ(DecodeBlock(one_group, b.meta).reason, MissReason::kLayout);
  const std::vector<int> windows{16, 16, 16, 16, 0, 0};
  other.group = MakeBlockGroup(KvCacheGroups::FromLayerWindows(windows, true), 1);
  EXPECT_EQ(DecodeBlock(grouped, other).reason, MissReason::kLayout);
  // Damage in the group extension is caught by the checksum; a cut block is truncated.
  std::string flipped = grouped;
  flipped[kFixedHeaderBytes + 1] ^= 0x01;
  EXPECT_EQ(DecodeBlock(flipped, b.meta).reason, MissReason::kChecksum);
  EXPECT_EQ(DecodeBlock(grouped.substr(0, kFixedHeaderBytes + 10), b.meta).reason,
            MissReason::kTruncated);
  // One group: the version-1 block, byte for byte as before.
  EXPECT_FALSE(MakeBlockGroup(KvCacheGroups::One(6), 0).grouped());
}

TEST_F(GroupedTierTest, EveryGroupsBlocksRoundTripThroughDiskAcrossARestart) {
  const KvCacheGroups groups = Groups();
  const auto model = testing::Fingerprint(5);
  const auto tokens = Tokens(6 * kB + 1, 21);  // 6 full blocks + the token computed next
  const int64_t n = static_cast<int64_t>(tokens.size());
  Written want;
  {
    auto disk = RocksDbTier::Open(DiskOpts()).value();
    TieredCache cache({}, nullptr, disk.get());
    auto pool = MakePool(24);
    testing::AttachScope attached(cache, pool.get());
    cache.SetKvGroups(groups);
    cache.NoteSequence(tokens, model, kSalt);
    want = Prefill(pool.get(), groups, tokens, model);
    ASSERT_TRUE(cache.Drain(Deadline::After(std::chrono::seconds(20))).ok());
    EXPECT_EQ(cache.stats().write_through_blocks, 6 * groups.size());
    cache.Detach();
  }
  auto disk = RocksDbTier::Open(DiskOpts()).value();
  EXPECT_EQ(disk->stats().entries, 6 * groups.size());
  TieredCache cache({}, nullptr, disk.get());
  auto pool = MakePool(24);
  testing::AttachScope attached(cache, pool.get());
  cache.SetKvGroups(groups);
  const auto hashes = engine::HashPrefixBlocks(tokens, kB, model, kSalt);
  std::vector<std::vector<BlockId>> tables;
  auto hit = cache.LoadMissing({tokens, hashes, 0, kB}, model, kSalt, &tables);
  ASSERT_TRUE(hit.ok()) << hit.status().ToString();
  EXPECT_EQ(*hit, 6);
  ExpectTables(pool.get(), groups, tables, *hit, n, want);
  // Only what the hit needs was read: the full group's 6 blocks, each
  // sliding group's window of position 24 (blocks 4 and 5).
  int64_t needed = 0;
  for (int g = 0; g < groups.size(); ++g) needed += 6 - NeededFrom(groups, g, 6, n);
  EXPECT_EQ(needed, 6 + 2 + 2);
  EXPECT_EQ(cache.stats().restored_blocks_disk, needed);
  // The loaded blocks are committed under their group keys.
  for (int g = 0; g < groups.size(); ++g) {
    EXPECT_TRUE(pool->IsCached(GroupBlockHash(hashes[5], g))) << "group " << g;
  }
  ReleaseTables(pool.get(), tables);
  // RestorePrefix, which fills one table of every layer, refuses a grouped
  // cache.
  std::vector<BlockId> flat;
  EXPECT_EQ(cache.RestorePrefix(pool.get(), tokens, model, kSalt, &flat).status().code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool->available_blocks(), pool->total_blocks());
  cache.Detach();
}

TEST_F(GroupedTierTest, TheHitIsTheLongestEveryGroupCanServe) {
  const KvCacheGroups groups = Groups();
  const auto model = testing::Fingerprint(6);
  const auto tokens = Tokens(8 * kB + 2, 33);  // 8 full blocks
  const int64_t n = static_cast<int64_t>(tokens.size());
  const auto hashes = engine::HashPrefixBlocks(tokens, kB, model, kSalt);
  auto ram = HostRamTier::Create({.capacity_bytes = 64 << 20}).value();
  TieredCache cache({}, ram.get(), nullptr);
  auto pool = MakePool(32);
  testing::AttachScope attached(cache, pool.get());
  cache.SetKvGroups(groups);
  cache.NoteSequence(tokens, model, kSalt);
  const Written want = Prefill(pool.get(), groups, tokens, model);
  ASSERT_EQ(cache.PersistPrefix(pool.get(), tokens, model, kSalt).value(), 8 * groups.size());
  cache.Detach();
  auto load = [&](int64_t first, std::vector<std::vector<BlockId>>* tables, KvBlockPool* p) {
    cache.Attach(p);
    cache.SetKvGroups(groups);
    auto hit = cache.LoadMissing({tokens, hashes, first, kB}, model, kSalt, tables);
    EXPECT_TRUE(hit.ok()) << hit.status().ToString();
    return hit.ok() ? *hit : -1;
  };
  {
    auto p = MakePool(32);
    std::vector<std::vector<BlockId>> t;
    EXPECT_EQ(load(0, &t, p.get()), 8);  // everything there
    ExpectTables(p.get(), groups, t, 8, n, want);
    ReleaseTables(p.get(), t);
    cache.Detach();
  }
  // Sliding group 1 lacks block 7, which the window of position 32 reads:
  // the hit of 7 blocks (window of position 28: blocks 5, 6) is the longest.
  ASSERT_TRUE(ram->Erase(GroupBlockHash(hashes[7], 1)).ok());
  {
    auto p = MakePool(32);
    std::vector<std::vector<BlockId>> t;
    EXPECT_EQ(load(0, &t, p.get()), 7);
    ExpectTables(p.get(), groups, t, 7, n, want);
    ReleaseTables(p.get(), t);
    EXPECT_EQ(p->available_blocks(), p->total_blocks());
    cache.Detach();
  }
  // A sliding block before every candidate's window is never needed: group
  // 2's block 0 gone changes nothing.
  ASSERT_TRUE(ram->Erase(GroupBlockHash(hashes[0], 2)).ok());
  {
    auto p = MakePool(32);
    std::vector<std::vector<BlockId>> t;
    EXPECT_EQ(load(0, &t, p.get()), 7);
    ReleaseTables(p.get(), t);
    cache.Detach();
  }
  // The full group lacks block 3: at most 3 blocks, and their windows are there.
  ASSERT_TRUE(ram->Erase(hashes[3]).ok());
  {
    auto p = MakePool(32);
    std::vector<std::vector<BlockId>> t;
    EXPECT_EQ(load(0, &t, p.get()), 3);
    ExpectTables(p.get(), groups, t, 3, n, want);
    ReleaseTables(p.get(), t);
    EXPECT_EQ(p->available_blocks(), p->total_blocks());
    cache.Detach();
  }
  // Asked from block 3 on (the engine holds 0..2): nothing to give.
  {
    auto p = MakePool(32);
    std::vector<std::vector<BlockId>> t;
    EXPECT_EQ(load(3, &t, p.get()), 0);
    for (const auto& g : t) EXPECT_TRUE(g.empty());
    cache.Detach();
  }
}

TEST_F(GroupedTierTest, AMismatchedOrDamagedGroupEntryIsAMissNeverKv) {
  const KvCacheGroups groups = Groups();
  const auto model = testing::Fingerprint(7);
  const auto tokens = Tokens(6 * kB + 1, 44);
  const int64_t n = static_cast<int64_t>(tokens.size());
  const auto hashes = engine::HashPrefixBlocks(tokens, kB, model, kSalt);
  auto ram = HostRamTier::Create({.capacity_bytes = 64 << 20}).value();
  TieredCache cache({}, ram.get(), nullptr);
  auto pool = MakePool(24);
  testing::AttachScope attached(cache, pool.get());
  cache.SetKvGroups(groups);
  cache.NoteSequence(tokens, model, kSalt);
  const Written want = Prefill(pool.get(), groups, tokens, model);
  ASSERT_EQ(cache.PersistPrefix(pool.get(), tokens, model, kSalt).value(), 6 * groups.size());
  cache.Detach();
  auto load = [&](std::vector<std::vector<BlockId>>* t, KvBlockPool* p) {
    cache.Attach(p);
    cache.SetKvGroups(groups);
    auto hit = cache.LoadMissing({tokens, hashes, 0, kB}, model, kSalt, t);
    EXPECT_TRUE(hit.ok()) << hit.status().ToString();
    return hit.ok() ? *hit : -1;
  };
  auto misses = [&](MissReason r) { return cache.stats().misses[static_cast<size_t>(r)]; };
  // Group 1's block 5 replaced by group 2's (another group's layers under
  // its key): block 5 of the sliding groups is in the window of every hit
  // past 5 blocks, so the hit is 5 (window of position 20: blocks 3, 4).
  const std::string g2 = ram->Get(GroupBlockHash(hashes[5], 2)).value();
  ASSERT_TRUE(ram->Put(GroupBlockHash(hashes[5], 1), g2).ok());
  {
    auto p = MakePool(24);
    std::vector<std::vector<BlockId>> t;
    EXPECT_EQ(load(&t, p.get()), 5);
    ExpectTables(p.get(), groups, t, 5, n, want);
    ReleaseTables(p.get(), t);
    EXPECT_EQ(p->available_blocks(), p->total_blocks());
    cache.Detach();
  }
  EXPECT_EQ(misses(MissReason::kLayout), 1);
  EXPECT_FALSE(ram->Contains(GroupBlockHash(hashes[5], 1)));  // it would never verify
  // Group 2's block 4 damaged: found only when read (the windows of hits 5
  // and 6 need it), then a hit of 4 blocks, whose sliding windows (blocks 2
  // and 3) are read in a second round.
  std::string g24 = ram->Get(GroupBlockHash(hashes[4], 2)).value();
  g24[g24.size() - 3] ^= 0x40;
  ASSERT_TRUE(ram->Put(GroupBlockHash(hashes[4], 2), g24).ok());
  {
    auto p = MakePool(24);
    std::vector<std::vector<BlockId>> t;
    EXPECT_EQ(load(&t, p.get()), 4);
    ExpectTables(p.get(), groups, t, 4, n, want);
    ReleaseTables(p.get(), t);
    EXPECT_EQ(p->available_blocks(), p->total_blocks());
    cache.Detach();
  }
  EXPECT_EQ(misses(MissReason::kChecksum), 1);
  // A pool too small for the hit: a shorter one that fits, never a failure.
  {
    auto p = MakePool(5);
    std::vector<std::vector<BlockId>> t;
    const int64_t hit = load(&t, p.get());
    EXPECT_GE(hit, 0);
    EXPECT_LT(hit, 4);
    ExpectTables(p.get(), groups, t, hit, n, want);
    ReleaseTables(p.get(), t);
    EXPECT_EQ(p->available_blocks(), p->total_blocks());
    cache.Detach();
  }
}

// --- the engine: groups kept with a prefix store in front of it ---

constexpr int kModelWindow = 12;

std::shared_ptr<const engine::Model> MixedModel() {
  static std::shared_ptr<const engine::Model> model = [] {
    kvrelay::testing::SyntheticModelOptions o;
    o.arch = "gemma3";
    o.layers = 6;
    o.sliding_window = kModelWindow;
    o.sliding_window_pattern = 3;  // layers 2 and 5 global
    o.kv_heads = 1;
    o.matrix_type = engine::GgmlType::kQ8_0;
    auto path = kvrelay::testing::WriteTempSyntheticModel(o);
    EXPECT_TRUE(path.ok());
    auto m = engine::Model::Load(*path);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    std::remove(path->c_str());
    return m.ok() ? std::shared_ptr<const engine::Model>(std::move(m).value()) : nullptr;
  }();
  return model;
}

// The store half of a worker's connector: prefix loads from the tiers.
class StoreConnector : public engine::KvConnector {
 public:
  explicit StoreConnector(TieredCache* cache, const engine::Model* model)
      : cache_(cache), model_(model) {}
  void LoadPrefix(const engine::RequestSpec& r, const engine::PrefixLookup& prefix,
                  const KvCacheGroups& groups, std::span<engine::BlockTable> tables) override {
    std::vector<std::vector<BlockId>> got;
    auto n = cache_->LoadMissing(prefix, model_->fingerprint(), r.tenant_salt, &got);
    EXPECT_TRUE(n.ok()) << n.status().ToString();
    EXPECT_EQ(got.size(), static_cast<size_t>(groups.size()));
    for (size_t g = 0; g < got.size(); ++g) tables[g].Adopt(got[g]);
    ++calls;
  }
  int calls = 0;

 private:
  TieredCache* cache_;
  const engine::Model* model_;
};

struct GenRun {
  std::vector<int32_t> tokens;
  int64_t cached = 0;
  std::vector<int64_t> peaks;
};

GenRun Generate(engine::Engine& e, std::vector<int32_t> prompt, int max_tokens,
                TieredCache* cache) {
  engine::RequestSpec s;
  s.id = 1;
  s.prompt = std::move(prompt);
  s.sampling.max_tokens = max_tokens;
  s.sampling.ignore_eos = true;
  s.tenant_salt = kSalt;
  EXPECT_TRUE(e.Submit(s).ok());
  GenRun r;
  for (int guard = 0; e.HasWork() && guard < 10000; ++guard) {
    auto events = e.Step();
    EXPECT_TRUE(events.ok()) << events.status().ToString();
    if (!events.ok()) break;
    if (cache != nullptr) cache->Pump();
    for (const auto& ev : *events) {
      if (ev.token >= 0) r.tokens.push_back(ev.token);
      r.cached = ev.cached_prompt_tokens;
    }
  }
  r.peaks = e.stats().peak_group_blocks;
  return r;
}

std::unique_ptr<engine::Engine> MakeEngine(bool split) {
  engine::EngineOptions o;
  o.block_tokens = 4;
  o.threads = 2;
  o.max_step_tokens = 8;
  o.split_kv_groups = split;
  o.kv_capacity_bytes = 256 * MixedModel()->MakeKvLayout(engine::KvDtype::kF32, 4).BlockBytes();
  auto e = engine::Engine::Create(o, MixedModel());
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(e).value() : nullptr;
}

TEST_F(GroupedTierTest, AGroupedEngineWithAStoreGivesTheEnginesTokensFromTheTier) {
  ASSERT_NE(MixedModel(), nullptr);
  std::mt19937 rng(5);
  std::vector<int32_t> prompt(45);
  for (auto& t : prompt) t = static_cast<int32_t>(rng() % 256);  // byte tokens: never EOS
  constexpr int kTokens = 20;
  // The engine alone, and with one group.
  auto alone = MakeEngine(/*split=*/true);
  ASSERT_NE(alone, nullptr);
  ASSERT_EQ(alone->kv_groups().size(), 3);
  const GenRun want = Generate(*alone, prompt, kTokens, nullptr);
  ASSERT_EQ(want.tokens.size(), static_cast<size_t>(kTokens));
  for (int cycle = 0; cycle < 2; ++cycle) {
    // 1. A worker with a store computes it; the store writes every group
    //    block through to disk. 2. After a restart (new pool, reopened
    //    store) the same prompt is loaded from disk, not computed.
    for (int pass = 0; pass < 2; ++pass) {
      auto disk = RocksDbTier::Open(DiskOpts()).value();
      TieredCache cache({}, nullptr, disk.get());
      auto e = MakeEngine(/*split=*/true);
      ASSERT_NE(e, nullptr);
      cache.Attach(e->pool());
      cache.SetKvGroups(e->kv_groups());
      StoreConnector connector(&cache, &e->model());
      e->SetKvConnector(&connector);
      const GenRun got = Generate(*e, prompt, kTokens, &cache);
      EXPECT_EQ(got.tokens, want.tokens) << "cycle " << cycle << " pass " << pass;
      EXPECT_EQ(got.peaks, want.peaks) << "cycle " << cycle << " pass " << pass;
      if (pass == 0 && cycle == 0) {
        EXPECT_EQ(got.cached, 0);
        EXPECT_EQ(cache.stats().restored_blocks_disk, 0);
      } else {
        // 11 full prompt blocks: a hit of all 11 (position 44 computed again).
        EXPECT_EQ(got.cached, 44) << "cycle " << cycle << " pass " << pass;
        EXPECT_GT(cache.stats().restored_blocks_disk, 0);
      }
      EXPECT_EQ(connector.calls, 1);
      ASSERT_TRUE(cache.Drain(Deadline::After(std::chrono::seconds(20))).ok());
      e->SetKvConnector(nullptr);
      cache.Detach();
      EXPECT_EQ(e->pool()->available_blocks(), e->pool()->total_blocks());
    }
  }
}

TEST_F(GroupedTierTest, ASharedPrefixIsLoadedAndTheRestComputed) {
  ASSERT_NE(MixedModel(), nullptr);
  std::mt19937 rng(9);
  std::vector<int32_t> a(45), b(45);
  for (auto& t : a) t = static_cast<int32_t>(rng() % 256);
  for (auto& t : b) t = static_cast<int32_t>(rng() % 256);
  std::copy(a.begin(), a.begin() + 30, b.begin());  // 7 full blocks shared
  constexpr int kTokens = 16;
  auto alone = MakeEngine(/*split=*/true);
  ASSERT_NE(alone, nullptr);
  const GenRun want = Generate(*alone, b, kTokens, nullptr);
  auto ram = HostRamTier::Create({.capacity_bytes = 64 << 20}).value();
  auto disk = RocksDbTier::Open(DiskOpts()).value();
  TieredCache cache({}, ram.get(), disk.get());
  {
    auto e = MakeEngine(/*split=*/true);
    cache.Attach(e->pool());
    cache.SetKvGroups(e->kv_groups());
    StoreConnector connector(&cache, &e->model());
    e->SetKvConnector(&connector);
    (void)Generate(*e, a, 4, &cache);
    ASSERT_TRUE(cache.Drain(Deadline::After(std::chrono::seconds(20))).ok());
    e->SetKvConnector(nullptr);
    cache.Detach();
  }
  auto e = MakeEngine(/*split=*/true);
  cache.Attach(e->pool());
  cache.SetKvGroups(e->kv_groups());
  StoreConnector connector(&cache, &e->model());
  e->SetKvConnector(&connector);
  const GenRun got = Generate(*e, b, kTokens, &cache);
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(got.cached, 28);
  // The full group's 7 blocks and each sliding group's window of position
  // 28 (blocks 4..6), written through to disk by the first engine.
  EXPECT_EQ(cache.stats().restored_blocks_ram + cache.stats().restored_blocks_disk, 7 + 3 + 3);
  e->SetKvConnector(nullptr);
  cache.Detach();
  EXPECT_EQ(e->pool()->available_blocks(), e->pool()->total_blocks());
}

// A connector whose grouped prefix leaves a hole where a step reads: the
// engine refuses it (computes the prompt) rather than read a missing block.
class HoleConnector : public engine::KvConnector {
 public:
  void LoadPrefix(const engine::RequestSpec&, const engine::PrefixLookup& prefix,
                  const KvCacheGroups& groups, std::span<engine::BlockTable> tables) override {
    for (int g = 0; g < groups.size(); ++g) {
      for (int i = 0; i < 3; ++i) {
        auto& t = tables[static_cast<size_t>(g)];
        if (g == 1 && i == 2) {
          t.Adopt(kNoBlock);  // block 2 of a sliding group: inside the window of position 12
        } else {
          t.Adopt(t.pool()->Allocate().value());
        }
      }
    }
    (void)prefix;
  }
};

TEST(GroupedConnectorTest, AHoleWhereAStepReadsIsRefusedAndThePromptComputed) {
  ASSERT_NE(MixedModel(), nullptr);
  std::mt19937 rng(11);
  std::vector<int32_t> prompt(20);
  for (auto& t : prompt) t = static_cast<int32_t>(rng() % 256);
  auto alone = MakeEngine(/*split=*/true);
  const GenRun want = Generate(*alone, prompt, 8, nullptr);
  auto e = MakeEngine(/*split=*/true);
  HoleConnector connector;
  e->SetKvConnector(&connector);
  const GenRun got = Generate(*e, prompt, 8, nullptr);
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(got.cached, 0);
  e->SetKvConnector(nullptr);
  EXPECT_EQ(e->pool()->available_blocks(), e->pool()->total_blocks());
}

}  // namespace
}  // namespace kvrelay::kv_store
