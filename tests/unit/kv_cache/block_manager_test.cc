// BlockManager alone: the bookkeeping of the paged KV cache with no bytes
// behind it (what the tiers and a device storage build on).
#include "engine/kv_cache/block_manager.h"

#include <gtest/gtest.h>

#include <vector>

namespace kvrelay::engine {
namespace {

BlockHash H(uint8_t v) {
  BlockHash h{};
  h[0] = v;
  h[31] = static_cast<uint8_t>(~v);
  return h;
}

TEST(BlockManagerTest, ReleaseSaysWhenABlockIsFreeAgain) {
  BlockManager m(2);
  EXPECT_EQ(m.total_blocks(), 2);
  auto a = m.Allocate();
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(m.free_blocks(), 1);
  m.Ref(*a);
  EXPECT_EQ(m.refcount(*a), 2);
  EXPECT_FALSE(m.Release(*a));  // still referenced
  EXPECT_TRUE(m.Release(*a));   // back on the free list: its storage may forget it
  EXPECT_EQ(m.free_blocks(), 2);
  EXPECT_FALSE(m.Release(*a));  // no reference left: refused, nothing changes
  EXPECT_EQ(m.free_blocks(), 2);
}

TEST(BlockManagerTest, CachedBlocksAreEvictedLeastRecentlyUsedFirstAfterTheSpillHook) {
  BlockManager m(3);
  std::vector<BlockId> ids;
  for (uint8_t i = 0; i < 3; ++i) {
    auto b = m.Allocate();
    ASSERT_TRUE(b.ok());
    EXPECT_TRUE(m.WouldCommit(*b, H(i)));
    m.Commit(*b, H(i));
    EXPECT_FALSE(m.WouldCommit(*b, H(i)));
    ids.push_back(*b);
  }
  std::vector<KvEvent::Kind> events;
  std::vector<BlockHash> spilled;
  m.SetEventListener([&](const KvEvent& ev) { events.push_back(ev.kind); });
  m.SetSpillHook([&](const BlockHash& h, BlockId) {
    EXPECT_TRUE(m.IsCached(h));  // still findable while it is copied out
    spilled.push_back(h);
  });
  // Cached blocks stay in the prefix cache when released (not free, available).
  for (BlockId id : {ids[1], ids[0], ids[2]}) EXPECT_FALSE(m.Release(id));
  EXPECT_EQ(m.free_blocks(), 0);
  EXPECT_EQ(m.available_blocks(), 3);
  // A hit on block 1 makes it the most recently used.
  const BlockHash one[] = {H(1)};
  ASSERT_EQ(m.MatchPrefix(one), std::vector<BlockId>{ids[1]});
  EXPECT_FALSE(m.Release(ids[1]));
  auto a = m.Allocate();  // evicts the least recently used: block 0
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, ids[0]);
  ASSERT_EQ(spilled.size(), 1u);
  EXPECT_EQ(spilled[0], H(0));
  EXPECT_FALSE(m.IsCached(H(0)));
  EXPECT_EQ(events, std::vector<KvEvent::Kind>{KvEvent::Kind::kEvicted});
  // A committed hash is not taken twice.
  EXPECT_FALSE(m.WouldCommit(*a, H(2)));
  m.Commit(*a, H(2));
  EXPECT_EQ(events.size(), 1u);
  // The rest go in LRU order; then the manager is exhausted.
  EXPECT_EQ(*m.Allocate(), ids[2]);
  EXPECT_EQ(*m.Allocate(), ids[1]);
  EXPECT_EQ(m.Allocate().status().code(), StatusCode::kResourceExhausted);
}

TEST(BlockManagerTest, AMatchStopsAtTheFirstMissingHash) {
  BlockManager m(4);
  for (uint8_t i = 0; i < 3; ++i) {
    auto b = m.Allocate();
    ASSERT_TRUE(b.ok());
    if (i != 1) m.Commit(*b, H(i));
  }
  const BlockHash chain[] = {H(0), H(1), H(2)};
  const std::vector<BlockId> hit = m.MatchPrefix(chain);
  ASSERT_EQ(hit.size(), 1u);
  EXPECT_EQ(m.refcount(hit[0]), 2);
  // Referencing a block that is neither held nor cached is refused.
  m.Ref(3);
  EXPECT_EQ(m.refcount(3), 0);
}

}  // namespace
}  // namespace kvrelay::engine
