// Dequantization of every ggml format against blocks packed by hand.
//
// Each test picks the quantized integers, sub-block scales and mins itself
// (pseudo-random, covering every bit), packs them into the block layout the
// ggml format defines (ggml-common.h: field order; ggml-quants.c reference
// quantizers: where each element's bits go), and computes the expected floats
// from the format's formula. The packing is written in the encoder's
// direction, independently of the decoder under test.
#include "engine/gguf/ggml_type.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace kvrelay::engine {
namespace {

// Little-endian writers into a block.
void PutF16(std::vector<uint8_t>& b, size_t at, uint16_t h) { std::memcpy(&b[at], &h, 2); }
void PutU32(std::vector<uint8_t>& b, size_t at, uint32_t v) { std::memcpy(&b[at], &v, 4); }

// Exactly representable fp16 scales (checked below): 0.5 = 0x3800, 0.25 = 0x3400,
// 1.5 = 0x3E00, -0.125 = 0xB000, 0.0625 = 0x2C00.
constexpr uint16_t kHalf = 0x3800, kQuarter = 0x3400, kOneAndHalf = 0x3E00, kMinusEighth = 0xB000,
                   kSixteenth = 0x2C00;

TEST(Fp16Test, KnownValues) {
  EXPECT_EQ(Fp16ToFp32(0x3C00), 1.0f);
  EXPECT_EQ(Fp16ToFp32(0xC000), -2.0f);
  EXPECT_EQ(Fp16ToFp32(kHalf), 0.5f);
  EXPECT_EQ(Fp16ToFp32(kQuarter), 0.25f);
  EXPECT_EQ(Fp16ToFp32(kOneAndHalf), 1.5f);
  EXPECT_EQ(Fp16ToFp32(kMinusEighth), -0.125f);
  EXPECT_EQ(Fp16ToFp32(kSixteenth), 0.0625f);
  EXPECT_EQ(Fp16ToFp32(0x7BFF), 65504.0f);                  // largest finite
  EXPECT_EQ(Fp16ToFp32(0x0001), std::ldexp(1.0f, -24));     // smallest subnormal
  EXPECT_EQ(Fp16ToFp32(0x03FF), std::ldexp(1023.0f, -24));  // largest subnormal
  EXPECT_EQ(Fp16ToFp32(0x0400), std::ldexp(1.0f, -14));     // smallest normal
  EXPECT_TRUE(std::isinf(Fp16ToFp32(0x7C00)));
  EXPECT_TRUE(std::isinf(Fp16ToFp32(0xFC00)) && Fp16ToFp32(0xFC00) < 0);
  EXPECT_TRUE(std::isnan(Fp16ToFp32(0x7E00)));
  EXPECT_TRUE(std::signbit(Fp16ToFp32(0x8000)));
}

TEST(Fp16Test, RoundTripsEveryHalf) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = Fp16ToFp32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(Fp16ToFp32(Fp32ToFp16(f))));
      continue;
    }
    ASSERT_EQ(Fp32ToFp16(f), h) << "h=" << h;
  }
}

TEST(Fp16Test, RoundsToNearestEven) {
  // 1 + 2^-11 is halfway between 1 (even mantissa) and 1 + 2^-10: rounds down.
  EXPECT_EQ(Fp32ToFp16(1.0f + std::ldexp(1.0f, -11)), 0x3C00);
  // 1 + 3*2^-11 is halfway between 1+2^-10 (odd) and 1+2^-9 (even): rounds up.
  EXPECT_EQ(Fp32ToFp16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);
  // Just above halfway rounds up.
  EXPECT_EQ(Fp32ToFp16(1.0f + std::ldexp(1.0f, -11) + std::ldexp(1.0f, -20)), 0x3C01);
  EXPECT_EQ(Fp32ToFp16(65520.0f), 0x7C00);  // halfway to 2^16 rounds to inf
  EXPECT_EQ(Fp32ToFp16(65519.0f), 0x7BFF);
  EXPECT_EQ(Fp32ToFp16(1e10f), 0x7C00);
  EXPECT_EQ(Fp32ToFp16(-1e10f), 0xFC00);
  EXPECT_EQ(Fp32ToFp16(std::ldexp(1.0f, -25)), 0x0000);  // half of min subnormal: ties to even 0
  EXPECT_EQ(Fp32ToFp16(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(Fp32ToFp16(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 * min subnormal: tie to even 2
  EXPECT_EQ(Fp32ToFp16(1e-30f), 0x0000);
}

TEST(Bf16Test, ConvertsAndRounds) {
  EXPECT_EQ(Bf16ToFp32(0x3F80), 1.0f);
  EXPECT_EQ(Bf16ToFp32(0xC040), -3.0f);
  EXPECT_EQ(Fp32ToBf16(1.0f), 0x3F80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (down).
  EXPECT_EQ(Fp32ToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);
  EXPECT_EQ(Fp32ToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);
  EXPECT_TRUE(std::isnan(Bf16ToFp32(Fp32ToBf16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(GgmlTypeTest, BlockGeometryMatchesGgml) {
  struct Row {
    GgmlType type;
    int64_t elems, bytes;
  };
  // Sizes from the ggml block structs (ggml-common.h).
  const Row rows[] = {
      {GgmlType::kF32, 1, 4},      {GgmlType::kF16, 1, 2},      {GgmlType::kBF16, 1, 2},
      {GgmlType::kQ4_0, 32, 18},   {GgmlType::kQ4_1, 32, 20},   {GgmlType::kQ5_0, 32, 22},
      {GgmlType::kQ5_1, 32, 24},   {GgmlType::kQ8_0, 32, 34},   {GgmlType::kQ8_1, 32, 36},
      {GgmlType::kQ2_K, 256, 84},  {GgmlType::kQ3_K, 256, 110}, {GgmlType::kQ4_K, 256, 144},
      {GgmlType::kQ5_K, 256, 176}, {GgmlType::kQ6_K, 256, 210}, {GgmlType::kQ8_K, 256, 292},
  };
  for (const Row& r : rows) {
    SCOPED_TRACE(GgmlTypeName(r.type));
    EXPECT_EQ(BlockElems(r.type), r.elems);
    EXPECT_EQ(BlockBytes(r.type), r.bytes);
    EXPECT_TRUE(CanDequantize(r.type));
    ASSERT_EQ(GgmlTypeFromId(static_cast<uint32_t>(r.type)), r.type);
    Result<int64_t> rb = RowBytes(r.type, r.elems * 3);
    ASSERT_TRUE(rb.ok());
    EXPECT_EQ(*rb, r.bytes * 3);
    if (r.elems > 1) {
      EXPECT_FALSE(RowBytes(r.type, r.elems + 1).ok());
    }
  }
  EXPECT_EQ(GgmlTypeName(GgmlType::kQ4_K), "Q4_K");
  EXPECT_FALSE(GgmlTypeFromId(4).has_value());  // Q4_2, removed from ggml
  EXPECT_FALSE(GgmlTypeFromId(5).has_value());
  EXPECT_FALSE(GgmlTypeFromId(1000).has_value());
  EXPECT_FALSE(RowBytes(static_cast<GgmlType>(4), 32).ok());
  EXPECT_FALSE(RowBytes(GgmlType::kQ4_0, -32).ok());
  EXPECT_FALSE(RowBytes(GgmlType::kF32, std::numeric_limits<int64_t>::max()).ok());
}

class Rng {
 public:
  explicit Rng(uint32_t seed) : gen_(seed) {}
  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen_); }

 private:
  std::mt19937 gen_;
};

std::vector<float> Dequant(GgmlType type, const std::vector<uint8_t>& bytes, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n), std::nanf(""));
  DequantizeRow(type, bytes.data(), out.data(), n);
  return out;
}

void ExpectNear(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], 1e-6f * (1.0f + std::fabs(want[i]))) << "element " << i;
  }
}

TEST(DequantizeTest, F32F16Bf16) {
  const std::vector<float> want = {1.0f, -2.0f, 0.5f, 65504.0f};
  std::vector<uint8_t> f32(16);
  std::memcpy(f32.data(), want.data(), 16);
  ExpectNear(Dequant(GgmlType::kF32, f32, 4), want);
  std::vector<uint8_t> f16(8);
  PutF16(f16, 0, 0x3C00);
  PutF16(f16, 2, 0xC000);
  PutF16(f16, 4, 0x3800);
  PutF16(f16, 6, 0x7BFF);
  ExpectNear(Dequant(GgmlType::kF16, f16, 4), want);
  std::vector<uint8_t> bf(6);
  PutF16(bf, 0, 0x3F80);
  PutF16(bf, 2, 0xC000);
  PutF16(bf, 4, 0x3F00);
  ExpectNear(Dequant(GgmlType::kBF16, bf, 3), {1.0f, -2.0f, 0.5f});
}

// Legacy 32-element formats. Two blocks per row to check block stepping.
TEST(DequantizeTest, Q4_0) {
  Rng rng(1);
  std::vector<uint8_t> b(2 * 18);
  std::vector<float> want(64);
  const uint16_t ds[2] = {kHalf, kMinusEighth};
  for (int blk = 0; blk < 2; ++blk) {
    const size_t base = blk * 18;
    PutF16(b, base, ds[blk]);
    for (int e = 0; e < 32; ++e) {
      const int q = rng.Uniform(0, 15);
      // Element e < 16 is the low nibble of qs[e], element e >= 16 the high nibble of qs[e-16].
      b[base + 2 + (e % 16)] |= static_cast<uint8_t>(e < 16 ? q : q << 4);
      want[blk * 32 + e] = static_cast<float>(q - 8) * Fp16ToFp32(ds[blk]);
    }
  }
  ExpectNear(Dequant(GgmlType::kQ4_0, b, 64), want);
}

TEST(DequantizeTest, Q4_1) {
  Rng rng(2);
  std::vector<uint8_t> b(2 * 20);
  std::vector<float> want(64);
  const uint16_t ds[2] = {kQuarter, kOneAndHalf}, ms[2] = {kMinusEighth, kHalf};
  for (int blk = 0; blk < 2; ++blk) {
    const size_t base = blk * 20;
    PutF16(b, base, ds[blk]);
    PutF16(b, base + 2, ms[blk]);
    for (int e = 0; e < 32; ++e) {
      const int q = rng.Uniform(0, 15);
      b[base + 4 + (e % 16)] |= static_cast<uint8_t>(e < 16 ? q : q << 4);
      want[blk * 32 + e] = static_cast<float>(q) * Fp16ToFp32(ds[blk]) + Fp16ToFp32(ms[blk]);
    }
  }
  ExpectNear(Dequant(GgmlType::kQ4_1, b, 64), want);
}

TEST(DequantizeTest, Q5_0) {
  Rng rng(3);
  std::vector<uint8_t> b(2 * 22);
  std::vector<float> want(64);
  const uint16_t ds[2] = {kHalf, kSixteenth};
  for (int blk = 0; blk < 2; ++blk) {
    const size_t base = blk * 22;
    PutF16(b, base, ds[blk]);
    uint32_t qh = 0;
    for (int e = 0; e < 32; ++e) {
      const int q = rng.Uniform(0, 31);
      b[base + 6 + (e % 16)] |= static_cast<uint8_t>(e < 16 ? (q & 15) : (q & 15) << 4);
      qh |= static_cast<uint32_t>(q >> 4) << e;  // the 5th bit of element e is bit e of qh
      want[blk * 32 + e] = static_cast<float>(q - 16) * Fp16ToFp32(ds[blk]);
    }
    PutU32(b, base + 2, qh);
  }
  ExpectNear(Dequant(GgmlType::kQ5_0, b, 64), want);
}

TEST(DequantizeTest, Q5_1) {
  Rng rng(4);
  std::vector<uint8_t> b(2 * 24);
  std::vector<float> want(64);
  const uint16_t ds[2] = {kQuarter, kHalf}, ms[2] = {kOneAndHalf, kMinusEighth};
  for (int blk = 0; blk < 2; ++blk) {
    const size_t base = blk * 24;
    PutF16(b, base, ds[blk]);
    PutF16(b, base + 2, ms[blk]);
    uint32_t qh = 0;
    for (int e = 0; e < 32; ++e) {
      const int q = rng.Uniform(0, 31);
      b[base + 8 + (e % 16)] |= static_cast<uint8_t>(e < 16 ? (q & 15) : (q & 15) << 4);
      qh |= static_cast<uint32_t>(q >> 4) << e;
      want[blk * 32 + e] = static_cast<float>(q) * Fp16ToFp32(ds[blk]) + Fp16ToFp32(ms[blk]);
    }
    PutU32(b, base + 4, qh);
  }
  ExpectNear(Dequant(GgmlType::kQ5_1, b, 64), want);
}

TEST(DequantizeTest, Q8_0AndQ8_1) {
  Rng rng(5);
  std::vector<uint8_t> b0(2 * 34), b1(2 * 36);
  std::vector<float> want(64);
  const uint16_t ds[2] = {kSixteenth, kMinusEighth};
  for (int blk = 0; blk < 2; ++blk) {
    PutF16(b0, blk * 34, ds[blk]);
    PutF16(b1, blk * 36, ds[blk]);
    PutF16(b1, blk * 36 + 2, 0x7BFF);  // s is only a dot-product helper: ignored
    for (int e = 0; e < 32; ++e) {
      const int q = rng.Uniform(-128, 127);
      b0[blk * 34 + 2 + e] = static_cast<uint8_t>(static_cast<int8_t>(q));
      b1[blk * 36 + 4 + e] = static_cast<uint8_t>(static_cast<int8_t>(q));
      want[blk * 32 + e] = static_cast<float>(q) * Fp16ToFp32(ds[blk]);
    }
  }
  ExpectNear(Dequant(GgmlType::kQ8_0, b0, 64), want);
  ExpectNear(Dequant(GgmlType::kQ8_1, b1, 64), want);
}

// k-quants: one 256-element super-block each (two for Q4_K to check stepping).

// 2-bit quants of Q2_K/Q3_K: element e = 128n + 32k + l (l < 32) sits in byte
// 32n + l at bit 2k (quantize_row_q2_K_ref / q3_K_ref).
void Put2Bit(uint8_t* qs, int e, int q) {
  const int n = e / 128, k = (e % 128) / 32, l = e % 32;
  qs[32 * n + l] |= static_cast<uint8_t>(q << (2 * k));
}

TEST(DequantizeTest, Q2_K) {
  Rng rng(6);
  std::vector<uint8_t> b(84);  // scales[16], qs[64], d, dmin
  const float d = Fp16ToFp32(kQuarter), dmin = Fp16ToFp32(kSixteenth);
  PutF16(b, 80, kQuarter);
  PutF16(b, 82, kSixteenth);
  int sc[16], mn[16];
  for (int s = 0; s < 16; ++s) {
    sc[s] = rng.Uniform(0, 15);
    mn[s] = rng.Uniform(0, 15);
    b[s] = static_cast<uint8_t>(sc[s] | (mn[s] << 4));
  }
  std::vector<float> want(256);
  for (int e = 0; e < 256; ++e) {
    const int q = rng.Uniform(0, 3);
    Put2Bit(&b[16], e, q);
    want[e] = d * static_cast<float>(sc[e / 16]) * q - dmin * static_cast<float>(mn[e / 16]);
  }
  ExpectNear(Dequant(GgmlType::kQ2_K, b, 256), want);
}

TEST(DequantizeTest, Q3_K) {
  Rng rng(7);
  std::vector<uint8_t> b(110);  // hmask[32], qs[64], scales[12], d
  const float d = Fp16ToFp32(kHalf);
  PutF16(b, 108, kHalf);
  uint8_t* scales = &b[96];
  int sc[16];
  for (int j = 0; j < 16; ++j) {
    sc[j] = rng.Uniform(-32, 31);
    const int l = sc[j] + 32;  // stored biased 6-bit
    // quantize_row_q3_K_ref: low nibbles two per byte, high 2 bits in scales[8 + j%4].
    if (j < 8) {
      scales[j] |= static_cast<uint8_t>(l & 0xF);
    } else {
      scales[j - 8] |= static_cast<uint8_t>((l & 0xF) << 4);
    }
    scales[8 + j % 4] |= static_cast<uint8_t>((l >> 4) << (2 * (j / 4)));
  }
  std::vector<float> want(256);
  for (int e = 0; e < 256; ++e) {
    const int q = rng.Uniform(-4, 3);  // 3-bit signed: stored as q + 4
    const int stored = q + 4;
    Put2Bit(&b[32], e, stored & 3);
    if (stored & 4) b[e % 32] |= static_cast<uint8_t>(1u << (e / 32));  // hmask bit
    want[e] = d * static_cast<float>(sc[e / 16]) * static_cast<float>(q);
  }
  ExpectNear(Dequant(GgmlType::kQ3_K, b, 256), want);
}

// 6-bit (scale, min) pairs of Q4_K/Q5_K, packed as quantize_row_q4_K_ref does.
void PackScaleMin(uint8_t* scales, const int* ls, const int* lm) {
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      scales[j] = static_cast<uint8_t>(ls[j]);
      scales[j + 4] = static_cast<uint8_t>(lm[j]);
    } else {
      scales[j + 4] = static_cast<uint8_t>((ls[j] & 0xF) | ((lm[j] & 0xF) << 4));
      scales[j - 4] |= static_cast<uint8_t>((ls[j] >> 4) << 6);
      scales[j] |= static_cast<uint8_t>((lm[j] >> 4) << 6);
    }
  }
}

TEST(DequantizeTest, Q4_K) {
  Rng rng(8);
  std::vector<uint8_t> b(2 * 144);  // d, dmin, scales[12], qs[128]
  std::vector<float> want(512);
  const uint16_t ds[2] = {kSixteenth, kHalf}, dmins[2] = {kQuarter, kMinusEighth};
  for (int blk = 0; blk < 2; ++blk) {
    uint8_t* base = &b[blk * 144];
    const float d = Fp16ToFp32(ds[blk]), dmin = Fp16ToFp32(dmins[blk]);
    std::memcpy(base, &ds[blk], 2);
    std::memcpy(base + 2, &dmins[blk], 2);
    int ls[8], lm[8];
    for (int j = 0; j < 8; ++j) {
      ls[j] = rng.Uniform(0, 63);
      lm[j] = rng.Uniform(0, 63);
    }
    PackScaleMin(base + 4, ls, lm);
    for (int e = 0; e < 256; ++e) {
      const int q = rng.Uniform(0, 15);
      // Element e = 64g + r: byte 32g + r%32, low nibble for r < 32, high otherwise.
      const int g = e / 64, r = e % 64;
      base[16 + 32 * g + r % 32] |= static_cast<uint8_t>(r < 32 ? q : q << 4);
      want[blk * 256 + e] = d * static_cast<float>(ls[e / 32]) * static_cast<float>(q) -
                            dmin * static_cast<float>(lm[e / 32]);
    }
  }
  ExpectNear(Dequant(GgmlType::kQ4_K, b, 512), want);
}

TEST(DequantizeTest, Q5_K) {
  Rng rng(9);
  std::vector<uint8_t> b(176);  // d, dmin, scales[12], qh[32], qs[128]
  const float d = Fp16ToFp32(kQuarter), dmin = Fp16ToFp32(kHalf);
  PutF16(b, 0, kQuarter);
  PutF16(b, 2, kHalf);
  int ls[8], lm[8];
  for (int j = 0; j < 8; ++j) {
    ls[j] = rng.Uniform(0, 63);
    lm[j] = rng.Uniform(0, 63);
  }
  PackScaleMin(&b[4], ls, lm);
  std::vector<float> want(256);
  for (int e = 0; e < 256; ++e) {
    const int q = rng.Uniform(0, 31);
    const int g = e / 64, r = e % 64;
    b[48 + 32 * g + r % 32] |= static_cast<uint8_t>(r < 32 ? (q & 15) : (q & 15) << 4);
    if (q & 16) b[16 + e % 32] |= static_cast<uint8_t>(1u << (e / 32));  // qh bit
    want[e] = d * static_cast<float>(ls[e / 32]) * static_cast<float>(q) -
              dmin * static_cast<float>(lm[e / 32]);
  }
  ExpectNear(Dequant(GgmlType::kQ5_K, b, 256), want);
}

TEST(DequantizeTest, Q6_K) {
  Rng rng(10);
  std::vector<uint8_t> b(210);  // ql[128], qh[64], scales[16] (int8), d
  const float d = Fp16ToFp32(kSixteenth);
  PutF16(b, 208, kSixteenth);
  int sc[16];
  for (int j = 0; j < 16; ++j) {
    sc[j] = rng.Uniform(-128, 127);
    b[192 + j] = static_cast<uint8_t>(static_cast<int8_t>(sc[j]));
  }
  std::vector<float> want(256);
  for (int e = 0; e < 256; ++e) {
    const int q = rng.Uniform(-32, 31);
    const int stored = q + 32;
    // quantize_row_q6_K_ref: e = 128n + 32k + l; low nibble in ql[64n + l + 32*(k%2)]
    // (high nibble when k >= 2), high 2 bits in qh[32n + l] at bit 2k.
    const int n = e / 128, k = (e % 128) / 32, l = e % 32;
    b[64 * n + l + 32 * (k % 2)] |= static_cast<uint8_t>((stored & 15) << (k >= 2 ? 4 : 0));
    b[128 + 32 * n + l] |= static_cast<uint8_t>((stored >> 4) << (2 * k));
    want[e] = d * static_cast<float>(sc[e / 16]) * static_cast<float>(q);
  }
  ExpectNear(Dequant(GgmlType::kQ6_K, b, 256), want);
}

TEST(DequantizeTest, Q8_K) {
  Rng rng(11);
  std::vector<uint8_t> b(292);  // float d, qs[256], bsums[16]
  const float d = 0.0078125f;
  std::memcpy(&b[0], &d, 4);
  std::vector<float> want(256);
  for (int e = 0; e < 256; ++e) {
    const int q = rng.Uniform(-128, 127);
    b[4 + e] = static_cast<uint8_t>(static_cast<int8_t>(q));
    want[e] = d * static_cast<float>(q);
  }
  ExpectNear(Dequant(GgmlType::kQ8_K, b, 256), want);
}

}  // namespace
}  // namespace kvrelay::engine
