#include "kv_store/block_codec.h"

#include <gtest/gtest.h>

#include <cstring>

#include "tests/unit/kv_store/test_blocks.h"

namespace kvrelay::kv_store {
namespace {

using testing::MakeBlock;
using testing::SmallLayout;

TEST(BlockCodecTest, RoundTripGivesTheSamePayloadPerLayer) {
  const auto b = MakeBlock(1);
  const std::string enc = b.Encoded();
  const auto& l = b.meta.layout;
  // Size from the documented format: fixed header + tokens + layers.
  ASSERT_EQ(enc.size(), kFixedHeaderBytes + 4 * static_cast<size_t>(l.block_tokens) +
                            static_cast<size_t>(l.BlockBytes()));
  DecodedBlock d = DecodeBlock(enc, b.meta);
  ASSERT_TRUE(d.ok()) << MissReasonName(d.reason);
  for (int i = 0; i < l.layers; ++i) {
    auto layer = d.Layer(l, i);
    ASSERT_EQ(layer.size(), b.layers[i].size());
    EXPECT_EQ(0, std::memcmp(layer.data(), b.layers[i].data(), layer.size())) << "layer " << i;
  }
}

TEST(BlockCodecTest, HeaderStartsWithMagicAndVersion) {
  const std::string enc = MakeBlock(2).Encoded();
  EXPECT_EQ(enc.substr(0, 4), "KVRB");
  EXPECT_EQ(static_cast<uint8_t>(enc[4]), kBlockFormatVersion);
  EXPECT_EQ(static_cast<uint8_t>(enc[5]), 0);
}

TEST(BlockCodecTest, EveryExpectationMismatchIsAMissWithItsReason) {
  const auto b = MakeBlock(3);
  const std::string enc = b.Encoded();
  struct Case {
    const char* name;
    void (*mutate)(BlockMeta&);
    MissReason want;
  };
  const Case cases[] = {
      {"model", [](BlockMeta& m) { m.model[5] ^= 1; }, MissReason::kModel},
      {"layers", [](BlockMeta& m) { m.layout.layers += 1; }, MissReason::kLayout},
      {"kv_heads", [](BlockMeta& m) { m.layout.kv_heads = 1; }, MissReason::kLayout},
      {"head_dim", [](BlockMeta& m) { m.layout.head_dim = 16; }, MissReason::kLayout},
      {"dtype", [](BlockMeta& m) { m.layout.dtype = engine::KvDtype::kF16; }, MissReason::kLayout},
      {"block_tokens", [](BlockMeta& m) { m.layout.block_tokens = 8; }, MissReason::kLayout},
      {"tenant", [](BlockMeta& m) { m.tenant_salt_hash = TenantSaltHash("tenant-b"); },
       MissReason::kTenant},
      {"hash", [](BlockMeta& m) { m.hash[31] ^= 0x80; }, MissReason::kHash},
      {"tokens", [](BlockMeta& m) { m.tokens[2] += 1; }, MissReason::kTokens},
  };
  for (const Case& c : cases) {
    BlockMeta expected = b.meta;
    c.mutate(expected);
    DecodedBlock d = DecodeBlock(enc, expected);
    EXPECT_EQ(d.reason, c.want) << c.name << " gave " << MissReasonName(d.reason);
    EXPECT_TRUE(d.payload.empty()) << c.name;
  }
}

TEST(BlockCodecTest, EverySingleBitFlipIsDetected) {
  const auto b = MakeBlock(4);
  const std::string enc = b.Encoded();
  // Every byte of the header and tokens, and a stride through the payload.
  std::vector<size_t> positions;
  const size_t head = kFixedHeaderBytes + 4 * b.meta.tokens.size();
  for (size_t i = 0; i < head; ++i) positions.push_back(i);
  for (size_t i = head; i < enc.size(); i += 7) positions.push_back(i);
  positions.push_back(enc.size() - 1);
  for (size_t pos : positions) {
    for (int bit : {0, 7}) {
      std::string bad = enc;
      bad[pos] = static_cast<char>(bad[pos] ^ (1 << bit));
      DecodedBlock d = DecodeBlock(bad, b.meta);
      ASSERT_FALSE(d.ok()) << "flip at byte " << pos << " bit " << bit << " was served";
    }
  }
}

// The payload in pieces (a block restored into the pool's layers): the
// checksum spans every piece, so a flip in any layer is caught, and pieces
// that do not add up to the block are kTruncated.
TEST(BlockCodecTest, VerifyBlockChecksTheWholePayloadAcrossItsPieces) {
  const auto b = MakeBlock(6);
  const std::string enc = b.Encoded();
  const std::string head = enc.substr(0, EncodedPayloadOffset(b.meta.layout));
  std::vector<std::vector<uint8_t>> layers = b.layers;
  auto pieces = [&] { return std::vector<std::span<const uint8_t>>(layers.begin(), layers.end()); };
  ASSERT_EQ(VerifyBlock(head, pieces(), b.meta), MissReason::kNone);
  for (size_t l = 0; l < layers.size(); ++l) {
    for (const size_t at : {size_t{0}, layers[l].size() / 2, layers[l].size() - 1}) {
      layers[l][at] ^= 0x10;
      EXPECT_EQ(VerifyBlock(head, pieces(), b.meta), MissReason::kChecksum) << l << " " << at;
      layers[l][at] ^= 0x10;
    }
  }
  std::vector<std::span<const uint8_t>> fewer = pieces();
  fewer.pop_back();
  EXPECT_EQ(VerifyBlock(head, fewer, b.meta), MissReason::kTruncated);
  EXPECT_EQ(VerifyBlock(head.substr(0, head.size() - 4), pieces(), b.meta), MissReason::kTruncated);
  auto other = b.meta;
  other.tokens[0] ^= 1;
  EXPECT_EQ(VerifyBlock(head, pieces(), other), MissReason::kTokens);
}

TEST(BlockCodecTest, TruncationAndGarbageAreMisses) {
  const auto b = MakeBlock(5);
  const std::string enc = b.Encoded();
  for (size_t n : {size_t{0}, size_t{3}, kFixedHeaderBytes - 1, kFixedHeaderBytes,
                   kFixedHeaderBytes + 5, enc.size() - 1}) {
    EXPECT_FALSE(DecodeBlock(std::string_view(enc).substr(0, n), b.meta).ok()) << n;
  }
  EXPECT_EQ(DecodeBlock(enc + "x", b.meta).reason, MissReason::kTruncated);
  std::string garbage(enc.size(), 'z');
  EXPECT_EQ(DecodeBlock(garbage, b.meta).reason, MissReason::kBadMagic);
  // A header that claims a huge token count must not read out of bounds.
  std::string lying = enc;
  const uint32_t huge = 0xFFFFFFFFu;
  std::memcpy(lying.data() + 20, &huge, 4);
  EXPECT_EQ(DecodeBlock(lying, b.meta).reason, MissReason::kTruncated);
  std::string old_version = enc;
  old_version[4] = 9;
  EXPECT_EQ(DecodeBlock(old_version, b.meta).reason, MissReason::kBadVersion);
}

TEST(BlockCodecTest, EncodeRejectsShapeMismatches) {
  auto b = MakeBlock(6);
  auto spans = b.Spans();
  spans.pop_back();
  EXPECT_EQ(EncodeBlock(b.meta, spans).status().code(), StatusCode::kInvalidArgument);
  spans = b.Spans();
  spans[1] = spans[1].subspan(1);
  EXPECT_EQ(EncodeBlock(b.meta, spans).status().code(), StatusCode::kInvalidArgument);
  BlockMeta m = b.meta;
  m.tokens.pop_back();
  spans = b.Spans();
  EXPECT_EQ(EncodeBlock(m, spans).status().code(), StatusCode::kInvalidArgument);
}

TEST(BlockCodecTest, DifferentTenantsProduceDifferentHeaders) {
  auto a = MakeBlock(7, SmallLayout(), "alice");
  auto b = MakeBlock(7, SmallLayout(), "bob");
  // Same token ids and payload (same id), different salt: neither serves the other.
  ASSERT_EQ(a.meta.tokens, b.meta.tokens);
  EXPECT_EQ(DecodeBlock(a.Encoded(), b.meta).reason, MissReason::kTenant);
  EXPECT_EQ(DecodeBlock(b.Encoded(), a.meta).reason, MissReason::kTenant);
}

}  // namespace
}  // namespace kvrelay::kv_store
