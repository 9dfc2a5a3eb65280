// Element-wise and attention ops against double-precision references, and the
// scalar path against the AVX2 path bit for bit (both reproduce llama.cpp's
// arithmetic; the conformance test checks that against llama.cpp itself).
#include "engine/kernels/ops.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "engine/gguf/ggml_type.h"
#include "engine/kernels/gelu.h"

namespace kvrelay::engine {
namespace {

std::vector<float> Random(int64_t n, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = g(rng);
  return v;
}

TEST(Ops, RmsNormMatchesDoubleReference) {
  for (int64_t n : {1, 7, 64, 576, 1003}) {
    const auto x = Random(n, 3.0f, 1), w = Random(n, 1.0f, 2);
    std::vector<float> y(n);
    RmsNormFast(x.data(), w.data(), n, 1e-5f, y.data());
    double ss = 0;
    for (float v : x) ss += double(v) * v;
    const double scale = 1.0 / std::sqrt(ss / n + 1e-5);
    for (int64_t i = 0; i < n; ++i) {
      const double want = x[i] * scale * w[i];
      // float sum of squares (n * 2^-24 relative), scale and two products.
      EXPECT_NEAR(y[i], want, std::fabs(want) * (n + 8) * 6e-8 + 1e-30) << "n=" << n << " i=" << i;
    }
  }
}

TEST(Ops, RmsNormInPlace) {
  auto x = Random(100, 1.0f, 3);
  const auto w = Random(100, 1.0f, 4);
  std::vector<float> y(100);
  RmsNormFast(x.data(), w.data(), 100, 1e-5f, y.data());
  RmsNormFast(x.data(), w.data(), 100, 1e-5f, x.data());
  EXPECT_EQ(x, y);
}

TEST(Ops, SiluMulMatchesDoubleReference) {
  auto g = Random(1003, 4.0f, 5);
  g[0] = -100.0f;  // exp overflow side: silu -> -0
  g[1] = 100.0f;   // silu(g) -> g
  g[2] = 0.0f;
  const auto u = Random(1003, 1.0f, 6);
  std::vector<float> out(1003);
  SiluMul(g.data(), u.data(), 1003, out.data());
  for (int i = 0; i < 1003; ++i) {
    const double want = g[i] / (1.0 + std::exp(-double(g[i]))) * u[i];
    // exp polynomial ~2e-7 relative, plus four float roundings.
    EXPECT_NEAR(out[i], want, std::fabs(want) * 1e-6 + 1e-30) << "i=" << i << " g=" << g[i];
  }
}

std::vector<KernelPath> Paths() {
  std::vector<KernelPath> p = {KernelPath::kScalar};
  if (KernelPathSupported(KernelPath::kAvx2)) p.push_back(KernelPath::kAvx2);
  if (KernelPathSupported(KernelPath::kAvx512)) p.push_back(KernelPath::kAvx512);
  return p;
}

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// ggml's exp approximation is documented at <= 1.46 ulp + 0.5 (rounding):
// allow 2 ulp of the float result against exp in double.
TEST(Ops, ExpGgmlWithinTwoUlp) {
  std::vector<float> x;
  for (float v = -87.0f; v <= 88.0f; v += 0.01171875f) x.push_back(v);
  const auto r = Random(4001, 20.0f, 11);
  x.insert(x.end(), r.begin(), r.end());
  for (KernelPath path : Paths()) {
    std::vector<float> y(x.size());
    ExpGgml(x.data(), static_cast<int64_t>(x.size()), y.data(), path);
    for (size_t i = 0; i < x.size(); ++i) {
      if (x[i] < -87.0f || x[i] > 88.0f) continue;
      const double want = std::exp(static_cast<double>(x[i]));
      const double ulp = std::ldexp(1.0, std::ilogb(want) - 23);
      ASSERT_LE(std::fabs(y[i] - want), 2 * ulp) << "x=" << x[i] << " " << KernelPathName(path);
    }
  }
}

TEST(Ops, ExpGgmlEdges) {
  const float inf = std::numeric_limits<float>::infinity();
  // 8 values so the vector path sees them; exp(0) = 1 exactly.
  std::vector<float> x = {0.0f, -inf, -200.0f, 89.0f, 200.0f, -103.0f, 1.0f, -1.0f};
  for (KernelPath path : Paths()) {
    std::vector<float> y(x.size());
    ExpGgml(x.data(), 8, y.data(), path);
    EXPECT_EQ(y[0], 1.0f);
    EXPECT_EQ(y[1], 0.0f);
    EXPECT_EQ(y[2], 0.0f);
    EXPECT_EQ(y[3], inf);  // exp(89) > FLT_MAX
    EXPECT_EQ(y[4], inf);
    // exp(-103) = 1.4e-45 (subnormal): within one subnormal step.
    EXPECT_NEAR(y[5], std::exp(-103.0), std::ldexp(1.0, -149));
    EXPECT_NEAR(y[6], std::exp(1.0), 2 * std::ldexp(1.0, -22));
    EXPECT_NEAR(y[7], std::exp(-1.0), 2 * std::ldexp(1.0, -25));
  }
}

TEST(Ops, ScalarPathMatchesAvx2BitForBit) {
  if (!KernelPathSupported(KernelPath::kAvx2)) GTEST_SKIP() << "CPU without AVX2";
  const auto x = Random(1003, 6.0f, 12), u = Random(1003, 1.0f, 13);
  std::vector<float> e1(1003), e2(1003), s1(1003), s2(1003);
  ExpGgml(x.data(), 1003, e1.data(), KernelPath::kScalar);
  ExpGgml(x.data(), 1003, e2.data(), KernelPath::kAvx2);
  SiluMul(x.data(), u.data(), 1003, s1.data(), KernelPath::kScalar);
  SiluMul(x.data(), u.data(), 1003, s2.data(), KernelPath::kAvx2);
  for (int i = 0; i < 1003; ++i) {
    ASSERT_EQ(Bits(e1[i]), Bits(e2[i])) << "exp x=" << x[i];
    ASSERT_EQ(Bits(s1[i]), Bits(s2[i])) << "silu x=" << x[i];
  }
  std::vector<float> c(32), s(32);
  RopeAnglesGgml(37, 10000.0f, 64, c.data(), s.data());
  auto r1 = Random(64 * 3, 2.0f, 14), r2 = r1;
  for (int h = 0; h < 3; ++h) {
    RopeRotate(r1.data() + 64 * h, 32, h == 1, c.data(), s.data(), KernelPath::kScalar);
    RopeRotate(r2.data() + 64 * h, 32, h == 1, c.data(), s.data(), KernelPath::kAvx2);
  }
  EXPECT_EQ(r1, r2);
}

// Angles: theta_i = pos * base^(-2i/d) up to the float recurrence's rounding,
// i + 2 roundings of relative size 2^-24 each (powf is within 1 ulp).
TEST(Ops, RopeAnglesFollowTheFrequencies) {
  for (int64_t pos : {0, 1, 7, 300, 1000}) {
    std::vector<float> c(32), s(32);
    RopeAnglesGgml(pos, 100000.0f, 64, c.data(), s.data());
    for (int i = 0; i < 32; ++i) {
      const double theta = pos * std::pow(100000.0, -2.0 * i / 64);
      const double err = (i + 3) * std::ldexp(1.0, -24) * theta + std::ldexp(1.0, -24);
      EXPECT_NEAR(c[i], std::cos(theta), err) << "pos " << pos << " i " << i;
      EXPECT_NEAR(s[i], std::sin(theta), err) << "pos " << pos << " i " << i;
    }
  }
  // Position 0 is the identity rotation, bit for bit.
  std::vector<float> c(32), s(32);
  RopeAnglesGgml(0, 100000.0f, 64, c.data(), s.data());
  const auto x = Random(64, 3.0f, 15);
  for (bool neox : {false, true}) {
    auto y = x;
    RopeRotate(y.data(), 32, neox, c.data(), s.data());
    EXPECT_EQ(y, x);
  }
}

TEST(Ops, RopeRotateIsTheRotation) {
  std::vector<float> c(32), s(32);
  RopeAnglesGgml(123, 10000.0f, 64, c.data(), s.data());
  const auto x = Random(64, 3.0f, 16);
  for (bool neox : {false, true}) {
    auto y = x;
    RopeRotate(y.data(), 32, neox, c.data(), s.data());
    for (int i = 0; i < 32; ++i) {
      const int a = neox ? i : 2 * i, b = neox ? i + 32 : 2 * i + 1;
      const double ya = double(x[a]) * c[i] - double(x[b]) * s[i];
      const double yb = double(x[a]) * s[i] + double(x[b]) * c[i];
      const double tol = 4 * std::ldexp(std::fabs(x[a]) + std::fabs(x[b]), -24);
      EXPECT_NEAR(y[a], ya, tol) << "pair " << i << (neox ? " neox" : "");
      EXPECT_NEAR(y[b], yb, tol) << "pair " << i << (neox ? " neox" : "");
    }
  }
}

// Attention over a paged cache against softmax attention in double. Error
// budget: scores |q.k| * scale with float products over hd <= 128 terms (~hd * 2^-24
// relative to sum |q||k| * scale, here <= ~1.5e-4 absolute), exp within
// 2 ulp, so p relative error ~2e-4; the output is a convex combination of v,
// off by <= 2e-4 * max|v| plus its own float sums. Tolerance 5e-4 * max|v|.
class AttendRowTest : public ::testing::TestWithParam<int> {};

TEST_P(AttendRowTest, MatchesDoubleSoftmaxAttention) {
  const int hd = GetParam(), B = 16;
  const int n = 70;
  const auto k = Random(int64_t{n} * hd, 1.0f, 17), v = Random(int64_t{n} * hd, 2.0f, 18);
  std::vector<const float*> kb, vb;
  for (int b = 0; b * B < n; ++b) {
    kb.push_back(k.data() + b * B * hd);
    vb.push_back(v.data() + b * B * hd);
  }
  float vmax = 0;
  for (float x : v) vmax = std::max(vmax, std::fabs(x));
  const float scale = 0.125f;
  std::vector<float> scores(n), acc(32 * hd), out(hd), out_other(hd);
  for (uint32_t seed = 0; seed < 6; ++seed) {
    const auto q = Random(hd, 1.5f, 100 + seed);
    for (auto [j0, j1] : {std::pair<int64_t, int64_t>{0, 1},
                          {0, 7},
                          {0, 33},
                          {0, 70},
                          {5, 70},
                          {40, 41},
                          {9, 26}}) {
      std::vector<double> sc(n), ref(hd, 0.0);
      double mx = -1e300, sum = 0;
      for (int64_t j = j0; j < j1; ++j) {
        double d = 0;
        for (int e = 0; e < hd; ++e) d += double(q[e]) * k[j * hd + e];
        sc[j] = d * scale;
        mx = std::max(mx, sc[j]);
      }
      for (int64_t j = j0; j < j1; ++j) sum += std::exp(sc[j] - mx);
      for (int64_t j = j0; j < j1; ++j) {
        const double p = std::exp(sc[j] - mx) / sum;
        for (int e = 0; e < hd; ++e) ref[e] += p * v[j * hd + e];
      }
      for (KernelPath path : Paths()) {
        for (bool single : {false, true}) {
          AttendRowGgml(q.data(), kb.data(), vb.data(), B, hd, j0, j1, scale, single, scores.data(),
                        acc.data(), out.data(), path);
          for (int e = 0; e < hd; ++e) {
            ASSERT_NEAR(out[e], ref[e], 5e-4 * vmax)
                << "[" << j0 << "," << j1 << ") e=" << e << (single ? " single " : " batch ")
                << KernelPathName(path);
          }
          if (path == KernelPath::kAvx2 || path == KernelPath::kAvx512) {
            // Every vector path gives the scalar (ggml-order) bits.
            AttendRowGgml(q.data(), kb.data(), vb.data(), B, hd, j0, j1, scale, single,
                          scores.data(), acc.data(), out_other.data(), KernelPath::kScalar);
            for (int e = 0; e < hd; ++e) {
              ASSERT_EQ(Bits(out[e]), Bits(out_other[e]))
                  << "[" << j0 << "," << j1 << ") e=" << e << " " << KernelPathName(path);
            }
          }
        }
      }
    }
  }
}

// Head sizes of real models, and one that is not a multiple of 8.
INSTANTIATE_TEST_SUITE_P(HeadDims, AttendRowTest, ::testing::Values(64, 128, 256, 36, 32, 96));

// The three-pass split (scores over position chunks, one softmax, values over
// head slices) gives AttendRowGgml's bits for any chunking, including chunks
// that start before j0, end past j1 or are empty.
TEST(Ops, AttendSplitEqualsAttendRowBitForBit) {
  const int B = 32;
  for (int hd : {64, 128, 256}) {
    if (!AttendSplitSupported(B, hd)) GTEST_SKIP() << "split attention needs the AVX-512 path";
    const int n = 600;
    const auto k = Random(int64_t{n} * hd, 1.0f, 31), v = Random(int64_t{n} * hd, 2.0f, 32);
    std::vector<const float*> kb, vb;
    for (int b = 0; b * B < n; ++b) {
      kb.push_back(k.data() + b * B * hd);
      vb.push_back(v.data() + b * B * hd);
    }
    std::vector<float> scores(n), split_scores(n), acc(32 * hd), out(hd), split(hd);
    for (uint32_t seed = 0; seed < 4; ++seed) {
      const auto q = Random(hd, 1.5f, 200 + seed);
      for (auto [j0, j1] : {std::pair<int64_t, int64_t>{0, 1},
                            {0, 600},
                            {3, 517},
                            {130, 131},
                            {255, 600},
                            {17, 64}}) {
        AttendRowGgml(q.data(), kb.data(), vb.data(), B, hd, j0, j1, 0.125f, false, scores.data(),
                      acc.data(), out.data());
        for (int64_t chunk : {16, 48, 256, 1024}) {
          float mx = -INFINITY;
          for (int64_t c0 = 0; c0 < n; c0 += chunk) {
            mx = std::max(mx, AttendScoresGgml(q.data(), kb.data(), B, hd, j0, j1, c0, c0 + chunk,
                                               0.125f, split_scores.data()));
          }
          AttendSoftmaxGgml(split_scores.data(), j0, j1, mx);
          for (int e0 = 0; e0 < hd; e0 += 32) {
            AttendValuesGgml(split_scores.data(), vb.data(), B, hd, j0, j1, e0, e0 + 32,
                             split.data());
          }
          for (int e = 0; e < hd; ++e) {
            ASSERT_EQ(Bits(out[e]), Bits(split[e]))
                << "hd " << hd << " [" << j0 << "," << j1 << ") chunk " << chunk << " e=" << e;
          }
        }
      }
    }
  }
}

// The tile (the query heads of a GQA group and a run of new tokens walking
// each K/V chunk together) gives every row AttendRowGgml's bits on every
// kernel path: ragged runs of tokens (not a multiple of anything, more than
// one pass of rows), causal edges mid-chunk, sliding windows, an empty row,
// block sizes the AVX-512 kernel takes (16, 32) and one it leaves to AVX2 (8),
// head sizes 64 / 128 / 256 (compile-time kernels) and 36 (AVX-512 falls back).
TEST(Ops, AttendTileEqualsAttendRowBitForBit) {
  const int n = 700;
  struct Case {
    int64_t cache_len, tokens, window;
  };
  const Case cases[] = {{0, 25, 0},  {0, 70, 0},     {130, 21, 0}, {517, 19, 0},
                        {0, 40, 37}, {600, 21, 200}, {250, 1, 0},  {3, 5, 0}};
  for (int hd : {64, 128, 256, 36}) {
    const auto k = Random(int64_t{n} * hd, 1.0f, 41), v = Random(int64_t{n} * hd, 2.0f, 42);
    for (int B : {16, 32, 8}) {
      std::vector<const float*> kb, vb;
      for (int b = 0; b * B < n; ++b) {
        kb.push_back(k.data() + b * B * hd);
        vb.push_back(v.data() + b * B * hd);
      }
      for (int group : {1, 3}) {
        for (const Case& cs : cases) {
          const int64_t nrows = cs.tokens * group + 1;
          const auto q = Random(nrows * hd, 1.5f, static_cast<uint32_t>(300 + cs.tokens + group));
          std::vector<AttendTileRow> rows;
          std::vector<float> tile_out(nrows * hd, -1.0f), row_out(hd);
          rows.push_back({q.data(), tile_out.data(), 5, 5});  // empty: zeros
          for (int64_t i = 0; i < cs.tokens; ++i) {
            const int64_t pos = cs.cache_len + i;
            const int64_t j0 = cs.window > 0 ? std::max<int64_t>(0, pos - cs.window + 1) : 0;
            for (int g = 0; g < group; ++g) {
              const int64_t r = static_cast<int64_t>(rows.size());
              rows.push_back({q.data() + r * hd, tile_out.data() + r * hd, j0, pos + 1});
            }
          }
          std::vector<float> scratch(AttendTileScratchFloats(nrows, cs.cache_len + cs.tokens, hd));
          std::vector<float> scores(n), acc(8 * hd);
          for (KernelPath path : Paths()) {
            std::fill(tile_out.begin(), tile_out.end(), -1.0f);
            AttendTileGgml(rows, kb.data(), vb.data(), B, hd, 0.125f, scratch.data(), path);
            for (size_t r = 0; r < rows.size(); ++r) {
              AttendRowGgml(rows[r].q, kb.data(), vb.data(), B, hd, rows[r].j0, rows[r].j1, 0.125f,
                            false, scores.data(), acc.data(), row_out.data(), path);
              for (int e = 0; e < hd; ++e) {
                ASSERT_EQ(Bits(rows[r].out[e]), Bits(row_out[e]))
                    << KernelPathName(path) << " hd " << hd << " B " << B << " group " << group
                    << " cache_len " << cs.cache_len << " tokens " << cs.tokens << " window "
                    << cs.window << " row " << r << " e " << e;
              }
            }
          }
        }
      }
    }
  }
}

// One key: the output is exactly its value row (softmax weight 1).
TEST(Ops, AttendRowOneKeyIsItsValue) {
  const int hd = 64;
  const auto q = Random(hd, 1.0f, 20), k = Random(hd, 1.0f, 21), v = Random(hd, 1.0f, 22);
  const float* kb[] = {k.data()};
  const float* vb[] = {v.data()};
  std::vector<float> scores(1), acc(32 * hd), out(hd);
  for (KernelPath path : Paths()) {
    for (bool single : {false, true}) {
      AttendRowGgml(q.data(), kb, vb, 16, hd, 0, 1, 0.125f, single, scores.data(), acc.data(),
                    out.data(), path);
      for (int e = 0; e < hd; ++e) EXPECT_EQ(out[e], v[e]) << e;
    }
  }
}

// The vector GELU returns the scalar loop's bits for every fp16 value, values
// between them (rounding to fp16 both ways), the two ends, infinities and a
// NaN, with a length that leaves a scalar tail, and in place (out == gate).
TEST(Ops, GeluVectorPathEqualsScalarBitForBit) {
  if (!KernelPathSupported(KernelPath::kAvx2)) GTEST_SKIP() << "CPU without AVX2";
  std::vector<float> g;
  for (uint32_t h = 0; h < (1u << 16); ++h) {
    const float v = Fp16ToFp32(static_cast<uint16_t>(h));
    if (!std::isnan(v)) g.push_back(v);
  }
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> dist(-12.0f, 12.0f);
  for (int i = 0; i < 20000; ++i) g.push_back(dist(rng));
  for (float v : {-10.0f, 10.0f, std::nextafter(10.0f, 0.0f), std::nextafter(-10.0f, 0.0f),
                  INFINITY, -INFINITY, NAN, 1e-30f, -1e-42f}) {
    g.push_back(v);
  }
  g.push_back(0.5f);  // length % 8 != 0
  std::vector<float> up(g.size());
  for (size_t i = 0; i < up.size(); ++i) up[i] = dist(rng);
  std::vector<float> want(g.size()), got(g.size());
  GeluTanhMulGgmlWithPath(g.data(), up.data(), static_cast<int64_t>(g.size()), want.data(),
                          KernelPath::kScalar);
  GeluTanhMulGgmlWithPath(g.data(), up.data(), static_cast<int64_t>(g.size()), got.data(),
                          KernelPath::kAvx2);
  std::vector<float> inplace = g;
  GeluTanhMulGgmlWithPath(inplace.data(), up.data(), static_cast<int64_t>(g.size()), inplace.data(),
                          KernelPath::kAvx2);
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::isnan(want[i])) {
      EXPECT_TRUE(std::isnan(got[i]) && std::isnan(inplace[i])) << i;
      continue;
    }
    ASSERT_EQ(std::memcmp(&want[i], &got[i], 4), 0)
        << "g " << g[i] << ": " << want[i] << " vs " << got[i];
    ASSERT_EQ(std::memcmp(&want[i], &inplace[i], 4), 0) << "in place, g " << g[i];
  }
}

// GELU through ggml's fp16 table. The entry at fp16 0xBFFF (g = -1.999) is
// the one that depends on the fused 1 + 0.044715 g^2 of ggml's CPU build:
// llama.cpp (llama-cpp-python 0.3.36, AVX2 + FMA) holds fp16 0xA9D3 there
// (read back from its Gemma 3 FFN: gelu(g) * up == fp32(0xA9D3) * up), the
// unfused formula gives 0xA9D2.
TEST(Ops, GeluTableMatchesGgmlsFusedEntry) {
  const float g = Fp16ToFp32(0xBFFF);
  const float up = 1.0f;
  float y = 0;
  GeluTanhMulGgml(&g, &up, 1, &y);
  EXPECT_EQ(Fp32ToFp16(y), 0xA9D3) << y;
  // Outside (-10, 10) ggml skips the table: 0 below, g * up above.
  const float gs[] = {-10.0f, -12.5f, 10.0f, 11.0f}, ups[] = {3.0f, 3.0f, 0.5f, -2.0f};
  float ys[4];
  GeluTanhMulGgml(gs, ups, 4, ys);
  EXPECT_EQ(ys[0], 0.0f);
  EXPECT_EQ(ys[1], 0.0f);
  EXPECT_EQ(ys[2], 5.0f);
  EXPECT_EQ(ys[3], -22.0f);
  // And the table is the function to fp16 precision near its ends and middle.
  for (float v : {-3.0f, -0.5f, 0.25f, 1.0f, 4.0f}) {
    float out = 0;
    GeluTanhMulGgml(&v, &up, 1, &out);
    const double x = Fp16ToFp32(Fp32ToFp16(v));
    const double want = 0.5 * x * (1 + std::tanh(0.7978845608028654 * x * (1 + 0.044715 * x * x)));
    EXPECT_NEAR(out, want, 1e-3 * std::max(1.0, std::abs(want))) << v;
  }
}

TEST(Ops, AddInPlace) {
  std::vector<float> y = {1, 2, 3}, x = {0.5f, -2, 4};
  AddInPlace(y.data(), x.data(), 3);
  EXPECT_EQ(y, (std::vector<float>{1.5f, 0, 7}));
}

}  // namespace
}  // namespace kvrelay::engine
