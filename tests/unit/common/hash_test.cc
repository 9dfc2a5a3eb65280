#include "common/hash.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace kvrelay {
namespace {

// Reference digests from FIPS 180-2 / `sha256sum`.
TEST(HashTest, Sha256KnownVectors) {
  EXPECT_EQ(ToHex(Sha256::Of("", 0)),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(ToHex(Sha256::Of("abc", 3)),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  Sha256 h;
  h.Update("a");
  h.Update("bc");
  EXPECT_EQ(ToHex(h.Finish()), ToHex(Sha256::Of("abc", 3)));
}

TEST(HashTest, Xxh3SeedAndContentMatter) {
  const char data[] = "kvrelay";
  EXPECT_EQ(Xxh3_64(data, 7), Xxh3_64(data, 7));
  EXPECT_NE(Xxh3_64(data, 7), Xxh3_64(data, 6));
  EXPECT_NE(Xxh3_64(data, 7, 1), Xxh3_64(data, 7, 2));
}

// The one-shot function is the reference: a stream fed the same bytes in any
// pieces gives its value (short inputs, the 240-byte boundary, inputs longer
// than the stream's 256-byte buffer, pieces that straddle it).
TEST(HashTest, Xxh3StreamEqualsOneShotOverAnySplit) {
  std::vector<uint8_t> data(5000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 131 + (i >> 7));
  for (const size_t size :
       {size_t{0}, size_t{7}, size_t{240}, size_t{241}, size_t{1025}, data.size()}) {
    for (const uint64_t seed : {uint64_t{0}, uint64_t{0x9e3779b97f4a7c15}}) {
      const uint64_t want = Xxh3_64(data.data(), size, seed);
      for (const size_t piece : {size_t{1}, size_t{13}, size_t{256}, size_t{1000}}) {
        Xxh3Stream s(seed);
        for (size_t at = 0; at < size; at += piece)
          s.Update(data.data() + at, std::min(piece, size - at));
        EXPECT_EQ(s.Digest(), want) << "size " << size << " seed " << seed << " piece " << piece;
      }
    }
  }
  Xxh3Stream other(1);
  other.Update(data.data(), 100);
  EXPECT_NE(other.Digest(), Xxh3_64(data.data(), 100, 0)) << "the seed matters";
}

}  // namespace
}  // namespace kvrelay
