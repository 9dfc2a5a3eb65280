// KV cache groups (kv_groups.h): how layers split into groups, which blocks a
// sliding-window table may drop, and block tables with holes.
#include "engine/kv_cache/kv_groups.h"

#include <gtest/gtest.h>

#include "engine/kv_cache/block_table.h"

namespace kvrelay::engine {
namespace {

TEST(KvCacheGroupsTest, OneAttentionTypeIsOneGroup) {
  for (const std::vector<int>& w :
       {std::vector<int>{0, 0, 0, 0}, std::vector<int>{64, 64, 64}, std::vector<int>{8, 16, 0}}) {
    const KvCacheGroups g = KvCacheGroups::FromLayerWindows(w, /*split=*/true);
    ASSERT_EQ(g.size(), 1);
    EXPECT_EQ(g.layers_per_block(), static_cast<int>(w.size()));
    EXPECT_FALSE(g.sliding(0));
    for (int l = 0; l < g.n_layers(); ++l) {
      EXPECT_EQ(g.group_of[l], 0);
      EXPECT_EQ(g.slot_of[l], l);
    }
    EXPECT_EQ(g.DroppableBlocks(0, 1000, 16), 0);
  }
  // A mixed model stays one group unless asked to split.
  const KvCacheGroups off = KvCacheGroups::FromLayerWindows(std::vector<int>{8, 0}, false);
  EXPECT_EQ(off.size(), 1);
}

TEST(KvCacheGroupsTest, Gemma3PatternSplitsIntoGroupsOfEqualSize) {
  // gemma3 270M: 18 layers, every 6th global, window 512.
  std::vector<int> w;
  for (int l = 0; l < 18; ++l) w.push_back(l % 6 == 5 ? 0 : 512);
  const KvCacheGroups g = KvCacheGroups::FromLayerWindows(w, true);
  ASSERT_EQ(g.size(), 6);  // gcd(3, 15) = 3 layers per block: 1 full + 5 sliding groups
  EXPECT_EQ(g.layers_per_block(), 3);
  EXPECT_EQ(g.layers[0], (std::vector<int>{5, 11, 17}));
  EXPECT_FALSE(g.sliding(0));
  EXPECT_EQ(g.sliding_groups(), 5);
  EXPECT_EQ(g.layers[1], (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(g.layers[5], (std::vector<int>{14, 15, 16}));
  for (int l = 0; l < 18; ++l) {
    const int grp = g.group_of[l];
    EXPECT_EQ(g.layers[grp][g.slot_of[l]], l);
    EXPECT_EQ(g.sliding(grp), w[l] > 0);
  }
  // The first read position of a query at p is p - 511: blocks wholly before it drop.
  EXPECT_EQ(g.DroppableBlocks(1, 100, 16), 0);
  EXPECT_EQ(g.DroppableBlocks(1, 526, 16), 0);  // first read 15: block 0 still read
  EXPECT_EQ(g.DroppableBlocks(1, 527, 16), 1);  // first read 16
  EXPECT_EQ(g.DroppableBlocks(0, 5000, 16), 0);
  // Decode (one token a step): at most ceil(512 / 16) + 1 blocks are ever read.
  EXPECT_EQ(g.WindowBlocksBound(1, 1, 16), 34);
  for (int64_t p = 0; p < 2000; ++p) {
    const int64_t held = p / 16 + 1 - g.DroppableBlocks(1, p, 16);
    ASSERT_LE(held, 512 / 16 + 1) << p;
  }
  EXPECT_NE(g.DebugString().find("6 KV cache groups"), std::string::npos) << g.DebugString();
}

TEST(KvCacheGroupsTest, GroupKeysDifferAndGroupZeroKeepsTheChainHash) {
  BlockHash h{};
  h[0] = 7;
  EXPECT_EQ(GroupBlockHash(h, 0), h);
  EXPECT_NE(GroupBlockHash(h, 1), h);
  EXPECT_NE(GroupBlockHash(h, 1), GroupBlockHash(h, 2));
  EXPECT_EQ(GroupBlockHash(h, 3), GroupBlockHash(h, 3));
}

TEST(BlockTableTest, HolesHoldNoReference) {
  KvBlockPool::Options o;
  o.layout = {2, 1, 8, 4, KvDtype::kF32};
  o.capacity_bytes = 8 * o.layout.BlockBytes();
  auto pool = KvBlockPool::Create(o);
  ASSERT_TRUE(pool.ok());
  KvBlockPool* p = pool->get();
  {
    auto t = BlockTable::Allocate(p, 5);
    ASSERT_TRUE(t.ok());
    EXPECT_EQ(t->held(), 5);
    EXPECT_EQ(t->DropLeading(2), 2);
    EXPECT_EQ(t->DropLeading(3), 1);  // entries 0, 1 are holes already
    EXPECT_EQ(t->size(), 5);
    EXPECT_EQ(t->held(), 2);
    EXPECT_EQ((*t)[0], kNoBlock);
    EXPECT_EQ(p->free_blocks(), 6);
    t->Adopt(kNoBlock);
    t->Truncate(4);  // drops a hole and one reference
    EXPECT_EQ(t->held(), 1);
    EXPECT_EQ(p->free_blocks(), 7);
  }  // the destructor skips the holes
  EXPECT_EQ(p->free_blocks(), 8);
}

}  // namespace
}  // namespace kvrelay::engine
