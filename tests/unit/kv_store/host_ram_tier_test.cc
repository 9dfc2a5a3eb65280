#include "kv_store/host_ram_tier.h"

#include <gtest/gtest.h>

#include <thread>

#include "tests/unit/kv_store/test_blocks.h"

namespace kvrelay::kv_store {
namespace {

BlockHash H(int i) {
  BlockHash h{};
  h[0] = static_cast<uint8_t>(i);
  h[1] = static_cast<uint8_t>(i >> 8);
  return h;
}

TEST(HostRamTierTest, EvictsLeastRecentlyUsedToStayUnderByteCapacity) {
  auto tier = HostRamTier::Create({.capacity_bytes = 300}).value();
  std::vector<int> evicted;
  tier->SetEvictionCallback([&](const BlockHash& h, std::string v) {
    evicted.push_back(h[0]);
    EXPECT_EQ(v.size(), 100u);
  });
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(tier->Put(H(i), std::string(100, 'a' + i)).ok());
  EXPECT_EQ(tier->used_bytes(), 300);
  ASSERT_TRUE(tier->Get(H(0)).ok());  // 0 becomes most recent: order 1, 2, 0
  ASSERT_TRUE(tier->Put(H(3), std::string(100, 'd')).ok());
  ASSERT_TRUE(tier->Put(H(4), std::string(100, 'e')).ok());
  EXPECT_EQ(evicted, (std::vector<int>{1, 2}));
  EXPECT_FALSE(tier->Contains(H(1)));
  EXPECT_FALSE(tier->Contains(H(2)));
  EXPECT_EQ(*tier->Get(H(0)), std::string(100, 'a'));
  EXPECT_EQ(tier->used_bytes(), 300);
  // One value evicts several smaller ones.
  ASSERT_TRUE(tier->Put(H(5), std::string(250, 'f')).ok());
  EXPECT_EQ(evicted, (std::vector<int>{1, 2, 3, 4, 0}));
  EXPECT_EQ(tier->used_bytes(), 250);
  TierStats s = tier->stats();
  EXPECT_EQ(s.evictions, 5);
  EXPECT_EQ(s.entries, 1);
}

TEST(HostRamTierTest, OversizedValueIsRefusedAndNothingIsEvicted) {
  auto tier = HostRamTier::Create({.capacity_bytes = 100}).value();
  ASSERT_TRUE(tier->Put(H(1), std::string(60, 'x')).ok());
  EXPECT_EQ(tier->Put(H(2), std::string(101, 'y')).code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(tier->Contains(H(1)));
  EXPECT_EQ(tier->stats().puts_dropped, 1);
}

TEST(HostRamTierTest, ReplaceEraseAndMiss) {
  auto tier = HostRamTier::Create({.capacity_bytes = 1000}).value();
  ASSERT_TRUE(tier->Put(H(1), "old").ok());
  ASSERT_TRUE(tier->Put(H(1), "newer").ok());
  EXPECT_EQ(*tier->Get(H(1)), "newer");
  EXPECT_EQ(tier->used_bytes(), 5);
  ASSERT_TRUE(tier->Erase(H(1)).ok());
  EXPECT_EQ(tier->Get(H(1)).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(tier->used_bytes(), 0);
  auto batch = tier->GetBatch(std::vector<BlockHash>{H(1), H(2)});
  EXPECT_FALSE(batch[0].ok());
  EXPECT_FALSE(batch[1].ok());
}

TEST(HostRamTierTest, ConcurrentPutGetKeepsValuesIntactAndWithinCapacity) {
  auto tier = HostRamTier::Create({.capacity_bytes = 64 * 50}).value();
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 2000; ++i) {
        const int key = (i * 7 + t) % 200;
        if (i % 3 == 0) {
          (void)tier->Put(H(key), std::string(64, static_cast<char>(key)));
        } else {
          auto v = tier->Get(H(key));
          if (v.ok() && *v != std::string(64, static_cast<char>(key))) ++wrong;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_LE(tier->used_bytes(), 64 * 50);
  EXPECT_EQ(tier->used_bytes(), 64 * tier->stats().entries);
}

}  // namespace
}  // namespace kvrelay::kv_store
