#include "kv_store/block_seal.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "tests/unit/kv_store/test_blocks.h"

namespace kvrelay::kv_store {
namespace {

constexpr char kSecret[] = "0123456789abcdef0123456789abcdef-cluster-a";
constexpr char kOtherSecret[] = "0123456789abcdef0123456789abcdef-cluster-b";

std::shared_ptr<const BlockSealer> Sealer(std::string_view secret = kSecret) {
  return BlockSealer::Create(secret).value();
}

std::string_view Bytes(const std::vector<int32_t>& tokens) {
  return {reinterpret_cast<const char*>(tokens.data()), tokens.size() * sizeof(int32_t)};
}

TEST(BlockSealTest, OpensToTheSameBytesAndHidesTheTokens) {
  const testing::TestBlock b = testing::MakeBlock(1);
  const std::string plain = b.Encoded();
  ASSERT_FALSE(plain.empty());
  ASSERT_NE(plain.find(Bytes(b.meta.tokens)), std::string::npos) << "the plaintext holds them";
  auto sealer = Sealer();
  Result<std::string> sealed = sealer->Seal(b.meta.hash, b.meta.tenant_salt_hash, plain);
  ASSERT_TRUE(sealed.ok()) << sealed.status().ToString();
  EXPECT_EQ(sealed->size(), BlockSealer::SealedBytes(plain.size()));
  EXPECT_EQ(sealed->find(Bytes(b.meta.tokens)), std::string::npos);
  EXPECT_EQ(sealed->find(plain.substr(kFixedHeaderBytes, 64)), std::string::npos);

  std::string opened;
  ASSERT_EQ(sealer->Open(b.meta.hash, b.meta.tenant_salt_hash, *sealed, &opened),
            MissReason::kNone);
  EXPECT_EQ(opened, plain);
  EXPECT_TRUE(DecodeBlock(opened, b.meta).ok());
  // A sealer made again from the same secret (a restart) opens it too.
  EXPECT_EQ(Sealer()->Open(b.meta.hash, b.meta.tenant_salt_hash, *sealed, &opened),
            MissReason::kNone);
}

// OpenInto decrypts into the caller's pieces (a restore's head buffer and
// the pool's layers): the same bytes as Open, and VerifyBlock accepts them
// there. Pieces that do not add up to the block are refused before any
// write; a block that does not authenticate leaves them wiped.
TEST(BlockSealTest, OpensIntoPiecesAndWipesThemWhenItFails) {
  const testing::TestBlock b = testing::MakeBlock(3);
  const std::string plain = b.Encoded();
  auto sealer = Sealer();
  const std::string sealed = sealer->Seal(b.meta.hash, b.meta.tenant_salt_hash, plain).value();
  const size_t head_bytes = EncodedPayloadOffset(b.meta.layout);
  std::string head(head_bytes, 'x');
  std::vector<std::vector<uint8_t>> layers(b.layers.size());
  std::vector<std::span<uint8_t>> parts{
      std::span<uint8_t>(reinterpret_cast<uint8_t*>(head.data()), head.size())};
  for (size_t l = 0; l < layers.size(); ++l) {
    layers[l].assign(b.layers[l].size(), 0x5A);
    parts.emplace_back(layers[l]);
  }
  ASSERT_EQ(sealer->OpenInto(b.meta.hash, b.meta.tenant_salt_hash, sealed, parts),
            MissReason::kNone);
  EXPECT_EQ(head, plain.substr(0, head_bytes));
  EXPECT_EQ(layers, b.layers);
  const std::vector<std::span<const uint8_t>> payload(layers.begin(), layers.end());
  EXPECT_EQ(VerifyBlock(head, payload, b.meta), MissReason::kNone);

  // One byte short: nothing written.
  std::vector<uint8_t> short_layer(b.layers.back().size() - 1, 0x5A);
  std::vector<std::span<uint8_t>> short_parts(parts.begin(), parts.end() - 1);
  short_parts.emplace_back(short_layer);
  EXPECT_EQ(sealer->OpenInto(b.meta.hash, b.meta.tenant_salt_hash, sealed, short_parts),
            MissReason::kTruncated);
  EXPECT_TRUE(
      std::all_of(short_layer.begin(), short_layer.end(), [](uint8_t x) { return x == 0x5A; }));

  // Another tenant: kAuth, and the pieces hold nothing of the plaintext.
  EXPECT_EQ(sealer->OpenInto(b.meta.hash, TenantSaltHash("tenant-b"), sealed, parts),
            MissReason::kAuth);
  for (const std::span<uint8_t> part : parts) {
    EXPECT_TRUE(std::all_of(part.begin(), part.end(), [](uint8_t x) { return x == 0; }));
  }
}

TEST(BlockSealTest, EverySealUsesAFreshNonce) {
  const testing::TestBlock b = testing::MakeBlock(2);
  auto sealer = Sealer();
  const std::string plain = b.Encoded();
  std::string a = *sealer->Seal(b.meta.hash, b.meta.tenant_salt_hash, plain);
  std::string c = *sealer->Seal(b.meta.hash, b.meta.tenant_salt_hash, plain);
  EXPECT_NE(a.substr(8, kSealNonceBytes), c.substr(8, kSealNonceBytes));
  EXPECT_NE(a, c);
}

TEST(BlockSealTest, AnotherClusterKeyTenantOrBlockKeyFailsAuthentication) {
  const testing::TestBlock b = testing::MakeBlock(3);
  const std::string sealed = *Sealer()->Seal(b.meta.hash, b.meta.tenant_salt_hash, b.Encoded());
  std::string opened = "left over";
  EXPECT_EQ(Sealer(kOtherSecret)->Open(b.meta.hash, b.meta.tenant_salt_hash, sealed, &opened),
            MissReason::kAuth);
  EXPECT_TRUE(opened.empty());
  EXPECT_EQ(Sealer()->Open(b.meta.hash, TenantSaltHash("tenant-b"), sealed, &opened),
            MissReason::kAuth);
  BlockHash moved = b.meta.hash;
  moved[0] ^= 1;  // the same bytes stored under another block's key
  EXPECT_EQ(Sealer()->Open(moved, b.meta.tenant_salt_hash, sealed, &opened), MissReason::kAuth);
  EXPECT_TRUE(opened.empty());
}

TEST(BlockSealTest, AnyFlippedByteIsAMiss) {
  const testing::TestBlock b = testing::MakeBlock(4);
  auto sealer = Sealer();
  const std::string sealed = *sealer->Seal(b.meta.hash, b.meta.tenant_salt_hash, b.Encoded());
  // Nonce, the ciphertext's first, middle and last byte, the tag.
  for (size_t at : {size_t{9}, kSealHeaderBytes, sealed.size() / 2,
                    sealed.size() - kSealTagBytes - 1, sealed.size() - 1}) {
    std::string bad = sealed;
    bad[at] ^= 0x20;
    std::string opened;
    EXPECT_EQ(sealer->Open(b.meta.hash, b.meta.tenant_salt_hash, bad, &opened), MissReason::kAuth)
        << "byte " << at;
    EXPECT_TRUE(opened.empty());
  }
  std::string other_version = sealed;
  other_version[4] ^= 0x02;
  std::string opened;
  EXPECT_EQ(sealer->Open(b.meta.hash, b.meta.tenant_salt_hash, other_version, &opened),
            MissReason::kBadVersion);
  EXPECT_EQ(sealer->Open(b.meta.hash, b.meta.tenant_salt_hash, sealed.substr(0, 30), &opened),
            MissReason::kTruncated);
}

TEST(BlockSealTest, APlaintextBlockIsAMissNotAnError) {
  const testing::TestBlock b = testing::MakeBlock(5);
  std::string opened;
  EXPECT_EQ(Sealer()->Open(b.meta.hash, b.meta.tenant_salt_hash, b.Encoded(), &opened),
            MissReason::kUnsealed);
  EXPECT_EQ(Sealer()->Open(b.meta.hash, b.meta.tenant_salt_hash, "garbage!", &opened),
            MissReason::kBadMagic);
  EXPECT_EQ(Sealer()->Open(b.meta.hash, b.meta.tenant_salt_hash, "", &opened),
            MissReason::kTruncated);
}

// Tenant keys are derived once and kept (at most 1,024, then forgotten at
// once): past that bound, from several threads at once, every tenant still
// opens its own blocks and never another's.
TEST(BlockSealTest, KeptTenantKeysStayPerTenantPastTheirBoundAndAcrossThreads) {
  const testing::TestBlock b = testing::MakeBlock(5);
  const std::string plain = b.Encoded();
  auto sealer = Sealer();
  constexpr int kTenants = 1100;
  auto salt = [](int t) {
    Sha256Digest d{};
    d[0] = static_cast<uint8_t>(t & 0xff);
    d[1] = static_cast<uint8_t>(t >> 8);
    return d;
  };
  std::vector<std::string> sealed(kTenants);
  for (int t = 0; t < kTenants; ++t) {
    sealed[t] = sealer->Seal(b.meta.hash, salt(t), plain).value();
  }
  std::vector<int> wrong(4, 0);
  std::vector<std::thread> threads;
  for (int w = 0; w < 4; ++w) {
    threads.emplace_back([&, w] {
      std::string opened;
      for (int t = w; t < kTenants; t += 2) {
        if (sealer->Open(b.meta.hash, salt(t), sealed[t], &opened) != MissReason::kNone ||
            opened != plain) {
          ++wrong[w];
        }
        const int other = (t + 1) % kTenants;
        if (sealer->Open(b.meta.hash, salt(other), sealed[t], &opened) != MissReason::kAuth ||
            !opened.empty()) {
          ++wrong[w];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int w = 0; w < 4; ++w) EXPECT_EQ(wrong[w], 0) << "thread " << w;
}

TEST(BlockSealTest, AnEmptySecretIsRefused) {
  EXPECT_EQ(BlockSealer::Create("").status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvrelay::kv_store
