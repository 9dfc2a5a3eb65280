#include "common/hash.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace kvrelay
