// Chain hash properties. Expected digests were computed independently with
// Python's hashlib over the documented byte layout:
//   sha256(parent || struct.pack('<I', n) || struct.pack('<i', t)... || model || salt)
#include <gtest/gtest.h>

#include <vector>

#include "common/hash.h"
#include "engine/kv_cache/kv_cache.h"

namespace kvrelay::engine {
namespace {

ModelFingerprint Model(uint8_t start) {
  ModelFingerprint m;
  for (int i = 0; i < 32; ++i) m[i] = static_cast<uint8_t>(start + i);
  return m;
}

TEST(KvHashTest, KnownDigestFromIndependentSha256) {
  const std::vector<int32_t> tokens = {1, 2, 3, -1};
  BlockHash h = HashBlock(BlockHash{}, tokens, Model(0), "tenant-a");
  EXPECT_EQ(ToHex(h), "55567d1bc0a8b05beaaa641a0099c587d7b564edea5734b6a6ac60b3121fb378");
}

TEST(KvHashTest, PrefixBlocksChainParents) {
  const std::vector<int32_t> tokens = {5, 6, 7, 8, 9};  // two full blocks of 2, one token left
  std::vector<BlockHash> hs = HashPrefixBlocks(tokens, 2, Model(0), "");
  ASSERT_EQ(hs.size(), 2u);
  EXPECT_EQ(ToHex(hs[0]), "703fb0122be091d6f861fb5782a3501dac920c1594fdde838120d5cdff371d26");
  EXPECT_EQ(ToHex(hs[1]), "5f7acb0900b57eb0749cfffb882a4599b1005baf22c3af272cbc88f21543faab");
  EXPECT_EQ(hs[1], HashBlock(hs[0], std::vector<int32_t>{7, 8}, Model(0), ""));
}

TEST(KvHashTest, EveryInputChangesTheHash) {
  const std::vector<int32_t> tokens = {10, 20, 30, 40};
  BlockHash parent{};
  parent[7] = 1;
  const BlockHash base = HashBlock(parent, tokens, Model(0), "salt");
  EXPECT_EQ(base, HashBlock(parent, tokens, Model(0), "salt"));       // deterministic
  EXPECT_NE(base, HashBlock(BlockHash{}, tokens, Model(0), "salt"));  // parent
  EXPECT_NE(base, HashBlock(parent, std::vector<int32_t>{10, 20, 30, 41}, Model(0), "salt"));
  EXPECT_NE(base, HashBlock(parent, std::vector<int32_t>{20, 10, 30, 40}, Model(0), "salt"));
  EXPECT_NE(base, HashBlock(parent, tokens, Model(1), "salt"));  // model
  EXPECT_NE(base, HashBlock(parent, tokens, Model(0), "salu"));  // salt
  EXPECT_NE(base, HashBlock(parent, tokens, Model(0), ""));
}

TEST(KvHashTest, SameTokensDifferentTenantsNeverShareAHashChain) {
  std::vector<int32_t> tokens(64);
  for (int i = 0; i < 64; ++i) tokens[i] = i * 7;
  auto a = HashPrefixBlocks(tokens, 16, Model(0), "tenant-a");
  auto b = HashPrefixBlocks(tokens, 16, Model(0), "tenant-b");
  ASSERT_EQ(a.size(), 4u);
  for (size_t i = 0; i < a.size(); ++i)
    for (size_t j = 0; j < b.size(); ++j) EXPECT_NE(a[i], b[j]);
}

TEST(KvHashTest, DtypeNamesRoundTrip) {
  for (auto d : {KvDtype::kF32, KvDtype::kF16, KvDtype::kBF16, KvDtype::kInt8, KvDtype::kKivi4,
                 KvDtype::kKivi2}) {
    auto parsed = ParseKvDtype(KvDtypeName(d));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, d);
  }
  auto bad = ParseKvDtype("fp8");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("fp8"), std::string::npos);
}

}  // namespace
}  // namespace kvrelay::engine
