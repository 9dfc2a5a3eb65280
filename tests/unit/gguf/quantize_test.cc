// QuantizeRowForTest round trips: dequantized values are within the format's
// quantization step of the input, and exact when the input is on the grid.
#include "engine/gguf/quantize.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

namespace kvrelay::engine {
namespace {

std::vector<float> RandomRow(int n, uint32_t seed, float lo, float hi) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> x(n);
  for (float& v : x) v = dist(gen);
  return x;
}

std::vector<float> RoundTrip(GgmlType type, const std::vector<float>& x) {
  std::vector<uint8_t> q = QuantizeRowForTest(type, x.data(), static_cast<int64_t>(x.size()));
  EXPECT_EQ(static_cast<int64_t>(q.size()), *RowBytes(type, static_cast<int64_t>(x.size())));
  std::vector<float> y(x.size());
  DequantizeRow(type, q.data(), y.data(), static_cast<int64_t>(x.size()));
  return y;
}

float BlockAbsMax(const std::vector<float>& x, size_t block) {
  float m = 0;
  for (size_t j = 32 * block; j < 32 * block + 32; ++j) m = std::max(m, std::fabs(x[j]));
  return m;
}

float BlockRange(const std::vector<float>& x, size_t block, float* mn) {
  float lo = x[32 * block], hi = lo;
  for (size_t j = 32 * block; j < 32 * block + 32; ++j) {
    lo = std::min(lo, x[j]);
    hi = std::max(hi, x[j]);
  }
  *mn = lo;
  return hi - lo;
}

// Step sizes follow the format definitions: Q8: amax/127, Q4_0: amax/8, Q5_0:
// amax/16, Q4_1: range/15, Q5_1: range/31. Slack covers fp16 rounding of d and m.
struct Case {
  GgmlType type;
  float steps;  // symmetric formats: amax / steps; affine: range / steps
  bool affine;
};

class QuantizeRoundTripTest : public ::testing::TestWithParam<Case> {};

TEST_P(QuantizeRoundTripTest, ErrorWithinHalfAStep) {
  const Case c = GetParam();
  const std::vector<float> x = RandomRow(32 * 64, 42, -3.0f, 2.0f);
  const std::vector<float> y = RoundTrip(c.type, x);
  double err2 = 0, sig2 = 0;
  for (size_t blk = 0; blk < x.size() / 32; ++blk) {
    float mn = 0;
    const float step = c.affine ? BlockRange(x, blk, &mn) / c.steps : BlockAbsMax(x, blk) / c.steps;
    const float slack = 2e-3f * (BlockAbsMax(x, blk) + std::fabs(mn));
    for (size_t j = 32 * blk; j < 32 * blk + 32; ++j) {
      // Q4_0/Q5_0 clamp the positive end to q = 2^(b-1)-1: up to a full step there.
      const bool clamped_end = !c.affine && c.steps < 100 && std::fabs(x[j]) > (c.steps - 1) * step;
      const float bound = (clamped_end ? 1.0f : 0.5f) * step + slack;
      ASSERT_LE(std::fabs(y[j] - x[j]), bound) << "element " << j;
      err2 += (y[j] - x[j]) * (y[j] - x[j]);
      sig2 += x[j] * x[j];
    }
  }
  EXPECT_GT(sig2, 0);
  EXPECT_LT(err2 / sig2, c.steps < 20 ? 0.02 : 0.002);  // coarse SNR sanity
}

INSTANTIATE_TEST_SUITE_P(
    Formats, QuantizeRoundTripTest,
    ::testing::Values(Case{GgmlType::kQ8_0, 127, false}, Case{GgmlType::kQ8_1, 127, false},
                      Case{GgmlType::kQ4_0, 8, false}, Case{GgmlType::kQ5_0, 16, false},
                      Case{GgmlType::kQ4_1, 15, true}, Case{GgmlType::kQ5_1, 31, true}));

TEST(QuantizeTest, GridValuesAreExact) {
  // x = (k - 8) * 0.25 for k in 0..15 is exactly representable in Q4_0 with d = -0.25
  // only if the largest magnitude is -2 (= -8 * 0.25): ggml picks d = max / -8.
  std::vector<float> x(32);
  for (int j = 0; j < 32; ++j) x[j] = static_cast<float>((j % 16) - 8) * 0.25f;
  EXPECT_EQ(RoundTrip(GgmlType::kQ4_0, x), x);
  // Q8_0 with amax 127 * 2^-4: every multiple of 2^-4 is exact.
  for (int j = 0; j < 32; ++j) x[j] = static_cast<float>(j * 8 - 127) / 16.0f;
  x[31] = 127.0f / 16.0f;
  EXPECT_EQ(RoundTrip(GgmlType::kQ8_0, x), x);
  // Q4_1: min -1, step 0.5 (range 7.5 / 15).
  for (int j = 0; j < 32; ++j) x[j] = -1.0f + 0.5f * static_cast<float>(j % 16);
  EXPECT_EQ(RoundTrip(GgmlType::kQ4_1, x), x);
}

TEST(QuantizeTest, ZeroBlocksAndFloatFormats) {
  const std::vector<float> zeros(64, 0.0f);
  for (GgmlType t : {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ5_0, GgmlType::kQ5_1,
                     GgmlType::kQ8_0, GgmlType::kQ8_1}) {
    EXPECT_EQ(RoundTrip(t, zeros), zeros) << GgmlTypeName(t);
  }
  const std::vector<float> x = {1.0f, -0.5f, 3.140625f, 65504.0f};
  EXPECT_EQ(RoundTrip(GgmlType::kF32, x), x);
  EXPECT_EQ(RoundTrip(GgmlType::kF16, x), x);  // all exactly representable in fp16
  EXPECT_EQ(RoundTrip(GgmlType::kBF16, std::vector<float>{1.0f, -0.5f, 3.140625f}),
            (std::vector<float>{1.0f, -0.5f, 3.140625f}));
}

TEST(QuantizeTest, RejectsUnsupportedTypeAndBadLength) {
  const std::vector<float> x(256, 1.0f);
  EXPECT_TRUE(QuantizeRowForTest(GgmlType::kQ4_K, x.data(), 256).empty());
  EXPECT_TRUE(QuantizeRowForTest(GgmlType::kQ8_0, x.data(), 33).empty());
  EXPECT_FALSE(CanQuantizeForTest(GgmlType::kQ6_K));
  EXPECT_TRUE(CanQuantizeForTest(GgmlType::kQ4_1));
}

}  // namespace
}  // namespace kvrelay::engine
