#include "engine/kv_cache/sequence_kv.h"

#include <gtest/gtest.h>

#include <map>
#include <random>
#include <vector>

namespace kvrelay::engine {
namespace {

std::unique_ptr<KvBlockPool> MakePool(int64_t blocks, KvDtype dtype = KvDtype::kF32) {
  KvBlockPool::Options o;
  o.layout = KvLayout{2, 2, 8, 4, dtype};
  // KIVI: two staging slots (one per layer) for every block, so no write falls back.
  o.staging_bytes = dtype == KvDtype::kF32 ? 0 : 2 * blocks * (2LL * 2 * 4 * 8 * 4);
  o.capacity_bytes = blocks * o.layout.BlockBytes() + (o.staging_bytes > 0 ? o.staging_bytes : 0);
  auto pool = KvBlockPool::Create(o);
  EXPECT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_EQ((*pool)->total_blocks(), blocks);
  return std::move(pool).value();
}

// Writes token value `x` (all K = x, V = -x) at position pos of every layer.
void WriteAt(KvBlockPool& pool, const SequenceKv& seq, int64_t pos, float x) {
  const KvLayout& l = pool.layout();
  std::vector<float> k(l.kv_heads * l.head_dim, x), v(k.size(), -x);
  auto s = seq.SlotOf(pos);
  for (int layer = 0; layer < l.layers; ++layer)
    pool.WriteToken(s.block, layer, s.offset, k.data(), v.data());
}

float ReadAt(const KvBlockPool& pool, const SequenceKv& seq, int64_t pos) {
  const KvLayout& l = pool.layout();
  auto s = seq.SlotOf(pos);
  std::vector<float> k(l.block_tokens * l.head_dim), v(k.size());
  pool.ReadHead(s.block, 1, 1, s.offset + 1, k.data(), v.data());
  return k[s.offset * l.head_dim + 3];
}

TEST(SequenceKvTest, AppendAllocatesBlocksAndReleaseReturnsThem) {
  auto pool = MakePool(4);
  {
    SequenceKv seq(pool.get());
    auto first = seq.Append(5);
    ASSERT_TRUE(first.ok());
    EXPECT_EQ(*first, 0);
    EXPECT_EQ(seq.length(), 5);
    EXPECT_EQ(seq.blocks().size(), 2u);
    EXPECT_EQ(seq.full_blocks(), 1);
    EXPECT_EQ(*seq.Append(3), 5);
    EXPECT_EQ(seq.blocks().size(), 2u);
    EXPECT_EQ(pool->free_blocks(), 2);
    // 9 more tokens need 3 blocks; only 2 exist: refused with no change.
    auto r = seq.Append(9);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
    EXPECT_EQ(seq.length(), 8);
    EXPECT_EQ(pool->free_blocks(), 2);
    seq.Truncate(3);
    EXPECT_EQ(seq.blocks().size(), 1u);
    EXPECT_EQ(pool->free_blocks(), 3);
  }  // destructor releases
  EXPECT_EQ(pool->free_blocks(), 4);
}

TEST(SequenceKvTest, ForkSharesAndCopyOnWriteSeparates) {
  auto pool = MakePool(8);
  SequenceKv parent(pool.get());
  ASSERT_TRUE(parent.Append(6).ok());  // block 0 full, block 1 holds 2 of 4
  for (int64_t p = 0; p < 6; ++p) WriteAt(*pool, parent, p, static_cast<float>(p + 1));
  SequenceKv child = parent.Fork();
  EXPECT_EQ(child.blocks(), parent.blocks());
  for (BlockId id : parent.blocks()) EXPECT_EQ(pool->refcount(id), 2);
  const BlockId shared_tail = parent.blocks()[1];

  // The child writes position 6: its tail is shared, so it gets a copy.
  EXPECT_EQ(child.BlocksNeededToAppend(1), 1);
  ASSERT_EQ(*child.Append(1), 6);
  EXPECT_NE(child.blocks()[1], shared_tail);
  EXPECT_EQ(child.blocks()[0], parent.blocks()[0]);  // full block still shared
  EXPECT_EQ(pool->refcount(shared_tail), 1);
  EXPECT_EQ(pool->refcount(child.blocks()[1]), 1);
  WriteAt(*pool, child, 6, 70.0f);
  EXPECT_EQ(ReadAt(*pool, child, 5), 6.0f);  // copied contents
  // The parent writes its own position 6; neither sees the other's value.
  ASSERT_EQ(*parent.Append(1), 6);
  EXPECT_EQ(parent.blocks()[1], shared_tail);  // sole owner now: no copy
  WriteAt(*pool, parent, 6, 60.0f);
  EXPECT_EQ(ReadAt(*pool, child, 6), 70.0f);
  EXPECT_EQ(ReadAt(*pool, parent, 6), 60.0f);
  child.Release();
  parent.Release();
  EXPECT_EQ(pool->free_blocks(), 8);
}

TEST(SequenceKvTest, AdoptPrefixAndCommit) {
  auto pool = MakePool(6);
  ModelFingerprint model{};
  std::vector<int32_t> tokens = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  auto hashes = HashPrefixBlocks(tokens, 4, model, "t");
  ASSERT_EQ(hashes.size(), 2u);
  {
    SequenceKv a(pool.get());
    ASSERT_TRUE(a.Append(10).ok());
    a.CommitFullBlocks(hashes);
    EXPECT_TRUE(pool->IsCached(hashes[0]));
    EXPECT_TRUE(pool->IsCached(hashes[1]));
    EXPECT_FALSE(pool->IsCached(HashBlock(hashes[1], std::vector<int32_t>{9, 10}, model, "t")));
  }
  EXPECT_EQ(pool->free_blocks(), 4);  // two blocks stay in the prefix cache
  EXPECT_EQ(pool->available_blocks(), 6);
  SequenceKv b(pool.get());
  auto matched = pool->MatchPrefix(hashes);
  ASSERT_EQ(matched.size(), 2u);
  ASSERT_TRUE(b.AdoptPrefix(matched).ok());
  EXPECT_EQ(b.length(), 8);
  EXPECT_EQ(b.AdoptPrefix(matched).code(), StatusCode::kFailedPrecondition);
  ASSERT_EQ(*b.Append(2), 8);
  EXPECT_EQ(b.blocks().size(), 3u);
}

// 10,000 random admit / fork / append / finish / cancel / match operations over
// a small pool; at the end every block is back (free or reclaimable) and every
// refcount equals the number of live sequences holding the block.
void RandomOps(KvDtype dtype) {
  auto pool = MakePool(24, dtype);
  // KIVI: token values 0..15, so a full block's key channel spans at most 15 and
  // 4-bit codes are within 15/30 = 0.5; partial blocks are staged and exact.
  const bool kivi = dtype != KvDtype::kF32;
  auto value = [&](int32_t tok) { return static_cast<float>(kivi ? tok % 16 : tok); };
  const int64_t start_available = pool->available_blocks();
  ModelFingerprint model{};
  std::mt19937 rng(1234);
  std::vector<std::pair<SequenceKv, std::vector<int32_t>>> live;
  int evictions = 0, resource_errors = 0, hits = 0;
  pool->SetEventListener([&](const KvEvent& e) { evictions += e.kind == KvEvent::Kind::kEvicted; });
  for (int op = 0; op < 10000; ++op) {
    const int kind = std::uniform_int_distribution<int>(0, 9)(rng);
    if (kind <= 2 || live.empty()) {  // admit, reusing a cached prefix when possible
      std::vector<int32_t> tokens(std::uniform_int_distribution<int>(1, 14)(rng));
      const int32_t family = std::uniform_int_distribution<int32_t>(0, 3)(rng);
      for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = family * 100 + static_cast<int32_t>(i);
      auto hashes = HashPrefixBlocks(tokens, 4, model, "");
      SequenceKv seq(pool.get());
      auto matched = pool->MatchPrefix(hashes);
      hits += static_cast<int>(matched.size());
      ASSERT_TRUE(seq.AdoptPrefix(matched).ok());
      auto r = seq.Append(static_cast<int64_t>(tokens.size()) - seq.length());
      if (!r.ok()) {
        ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
        ++resource_errors;
        continue;  // seq's destructor releases the matched blocks
      }
      for (int64_t p = static_cast<int64_t>(matched.size()) * 4; p < seq.length(); ++p)
        WriteAt(*pool, seq, p, value(tokens[p]));
      seq.CommitFullBlocks(hashes);
      live.emplace_back(std::move(seq), std::move(tokens));
    } else if (kind <= 4) {  // decode step: append one token (copy-on-write if shared)
      auto& [seq, tokens] = live[rng() % live.size()];
      auto r = seq.Append(1);
      if (!r.ok()) {
        ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
        ++resource_errors;
        continue;
      }
      tokens.push_back(static_cast<int32_t>(tokens.size()) + 50000);
      WriteAt(*pool, seq, *r, value(tokens.back()));
    } else if (kind == 5) {  // fork (parallel sampling)
      const size_t i = rng() % live.size();
      SequenceKv child = live[i].first.Fork();
      live.emplace_back(std::move(child), live[i].second);
    } else if (kind == 6) {  // cancel mid-way: truncate then drop
      const size_t i = rng() % live.size();
      live[i].first.Truncate(live[i].first.length() / 2);
      live.erase(live.begin() + static_cast<ptrdiff_t>(i));
    } else {  // finish
      const size_t i = rng() % live.size();
      live.erase(live.begin() + static_cast<ptrdiff_t>(i));
    }
    if (op % 97 == 0) {
      // Every live sequence still reads back the values it wrote, and refcounts
      // match the number of tables that hold each block.
      std::map<BlockId, int> holders;
      for (auto& [seq, tokens] : live) {
        for (BlockId id : seq.blocks()) ++holders[id];
        for (int64_t p = 0; p < seq.length(); ++p)
          ASSERT_NEAR(ReadAt(*pool, seq, p), value(tokens[p]), kivi ? 0.5001 : 0.0) << "op " << op;
      }
      for (auto [id, n] : holders) ASSERT_EQ(pool->refcount(id), n);
    }
  }
  EXPECT_GT(resource_errors, 0);  // the pool was really driven to its limit
  EXPECT_GT(evictions, 0);
  EXPECT_GT(hits, 0);
  live.clear();
  EXPECT_EQ(pool->available_blocks(), start_available);
  EXPECT_EQ(pool->staging_slots_free(), kivi ? 2 * 24 : 0);
}

TEST(SequenceKvTest, NoBlockLeakedAfterRandomOperationsF32) { RandomOps(KvDtype::kF32); }
TEST(SequenceKvTest, NoBlockLeakedAfterRandomOperationsKivi4) { RandomOps(KvDtype::kKivi4); }

}  // namespace
}  // namespace kvrelay::engine
