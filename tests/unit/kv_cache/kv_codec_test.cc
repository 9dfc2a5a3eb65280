// Encode/decode error of every KV dtype against the bound its format implies:
//   f16   round to nearest of an 11-bit significand: |err| <= 2^-11 |x| (normal range)
//   bf16  round to nearest of an 8-bit significand:  |err| <= 2^-8 |x|
//   int8  symmetric, scale = max|x| / 127 per token and head: |err| <= scale / 2
//   kivi  asymmetric, L = 2^bits - 1 steps over [lo, hi] of the group:
//         |err| <= (hi - lo) / (2L), i.e. range/30 (4 bits) and range/6 (2 bits),
//         where hi - lo <= range + 2^-10 (|min| + |max|) (the ends are binary16,
//         rounded outward by at most one binary16 ulp <= 2^-10 |x| each).
#include "engine/kv_cache/kv_codec.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "engine/kv_cache/kv_cache.h"

namespace kvrelay::engine {
namespace {

using kvcodec::Bf16ToFloat;
using kvcodec::FloatToBf16;
using kvcodec::FloatToHalf;
using kvcodec::HalfToFloat;

TEST(KvCodecTest, HalfKnownValues) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xc000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);                          // rounds to +inf
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -24)), 0x0001);             // smallest subnormal
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -14)), 0x0400);             // smallest normal
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3c00);      // tie -> even
  EXPECT_EQ(FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie -> even (up)
  EXPECT_EQ(HalfToFloat(0x3555), 0.333251953125f);                   // 1/3 in half = 0x3555
  EXPECT_EQ(FloatToHalf(1.0f / 3.0f), 0x3555);
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_TRUE(std::isinf(HalfToFloat(0x7c00)));
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::nanf("")))));
}

TEST(KvCodecTest, Bf16KnownValues) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);      // tie -> even
  EXPECT_EQ(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);  // tie -> even (up)
  EXPECT_EQ(Bf16ToFloat(0xc040), -3.0f);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
}

TEST(KvCodecTest, HalfAndBf16RelativeErrorBound) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> ex(-14, 15);
  double worst16 = 0, worstbf = 0;
  for (int i = 0; i < 200000; ++i) {
    float x = std::ldexp(mant(rng), ex(rng)) * (i % 2 ? -1.0f : 1.0f);
    if (std::fabs(x) > 65504.0f) continue;
    const double e16 = std::fabs(HalfToFloat(FloatToHalf(x)) - x) / std::fabs(x);
    const double ebf = std::fabs(Bf16ToFloat(FloatToBf16(x)) - x) / std::fabs(x);
    ASSERT_LE(e16, std::ldexp(1.0, -11)) << x;
    ASSERT_LE(ebf, std::ldexp(1.0, -8)) << x;
    worst16 = std::max(worst16, e16);
    worstbf = std::max(worstbf, ebf);
  }
  // The bounds are tight: random inputs come within 10% of them.
  EXPECT_GT(worst16, 0.9 * std::ldexp(1.0, -11));
  EXPECT_GT(worstbf, 0.9 * std::ldexp(1.0, -8));
}

TEST(KvCodecTest, F16SlabMatchesScalarConversion) {
  // EncodeRow/DecodeRows may use F16C; they must agree bit for bit with the
  // scalar conversion, including subnormals, overflow and signed zero.
  const int T = 4, D = 37;  // odd width exercises the vector tail
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> ex(-27, 17);
  std::vector<float> x(T * D);
  for (float& v : x) v = std::ldexp(mant(rng), ex(rng)) * (rng() % 2 ? -1.0f : 1.0f);
  x[0] = -0.0f;
  x[1] = 65519.0f;
  x[2] = 65520.0f;
  std::vector<uint8_t> slab(kvcodec::SlabBytes(KvDtype::kF16, T, D));
  for (int t = 0; t < T; ++t) kvcodec::EncodeRow(KvDtype::kF16, slab.data(), T, D, t, &x[t * D]);
  std::vector<float> y(T * D);
  kvcodec::DecodeRows(KvDtype::kF16, true, slab.data(), T, D, T, y.data());
  for (int i = 0; i < T * D; ++i) {
    uint16_t h;
    std::memcpy(&h, slab.data() + 2 * i, 2);
    ASSERT_EQ(h, FloatToHalf(x[i])) << x[i];
    const float ref = HalfToFloat(h);
    ASSERT_EQ(std::memcmp(&y[i], &ref, 4), 0) << x[i];
  }
}

struct SlabCase {
  KvDtype dtype;
  int block_tokens = 16;
  int head_dim = 64;
};

std::vector<float> RandomRows(std::mt19937& rng, int rows, int dim) {
  std::vector<float> x(static_cast<size_t>(rows) * dim);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int t = 0; t < rows; ++t)
    for (int c = 0; c < dim; ++c)  // per-channel offsets and scales, like real keys
      x[t * dim + c] = nd(rng) * (0.1f + 0.2f * static_cast<float>(c % 7)) + 0.5f * (c % 5) - 1.0f;
  return x;
}

double KiviBound(float mn, float mx, int bits) {
  const double levels = (1 << bits) - 1;
  const double span =
      (mx - mn) + std::ldexp(1.0, -10) * (std::fabs(mn) + std::fabs(mx)) + std::ldexp(1.0, -24);
  return span / (2 * levels) * (1 + 1e-5) + 1e-6 * (std::fabs(mn) + std::fabs(mx));
}

TEST(KvCodecTest, Int8PerTokenScaleBound) {
  const int T = 16, D = 64;
  std::mt19937 rng(11);
  auto x = RandomRows(rng, T, D);
  for (int c = 0; c < D; ++c) x[5 * D + c] *= 100.0f;  // one loud token must not hurt the others
  std::vector<uint8_t> slab(kvcodec::SlabBytes(KvDtype::kInt8, T, D));
  for (int t = 0; t < T; ++t) kvcodec::EncodeRow(KvDtype::kInt8, slab.data(), T, D, t, &x[t * D]);
  std::vector<float> y(T * D);
  kvcodec::DecodeRows(KvDtype::kInt8, true, slab.data(), T, D, T, y.data());
  for (int t = 0; t < T; ++t) {
    float amax = 0;
    for (int c = 0; c < D; ++c) amax = std::max(amax, std::fabs(x[t * D + c]));
    const double bound = amax / 127.0 / 2.0 * (1 + 1e-5);
    for (int c = 0; c < D; ++c) ASSERT_LE(std::fabs(y[t * D + c] - x[t * D + c]), bound) << t;
  }
}

class KiviSlabTest : public ::testing::TestWithParam<SlabCase> {};

TEST_P(KiviSlabTest, KeysPerChannelValuesPerTokenGroupBound) {
  const auto [dtype, T, D] = GetParam();
  const int bits = kvcodec::KiviBits(dtype);
  std::mt19937 rng(static_cast<unsigned>(T * 131 + D + bits));
  for (int n : {T, T / 2 + 1}) {
    auto x = RandomRows(rng, T, D);
    for (int t = 0; t < T; ++t) x[t * D + 1] *= 1e-3f;  // a quiet key channel keeps its precision
    std::vector<uint8_t> ks(kvcodec::SlabBytes(dtype, T, D)), vs(ks.size());
    kvcodec::QuantizeKivi(dtype, true, ks.data(), T, D, n, x.data());
    kvcodec::QuantizeKivi(dtype, false, vs.data(), T, D, n, x.data());
    std::vector<float> yk(T * D), yv(T * D);
    kvcodec::DecodeRows(dtype, true, ks.data(), T, D, n, yk.data());
    kvcodec::DecodeRows(dtype, false, vs.data(), T, D, n, yv.data());
    double worst_ratio = 0;
    for (int c = 0; c < D; ++c) {  // keys: one range per channel over the n tokens
      float mn = x[c], mx = x[c];
      for (int t = 0; t < n; ++t) mn = std::min(mn, x[t * D + c]), mx = std::max(mx, x[t * D + c]);
      const double bound = KiviBound(mn, mx, bits);
      for (int t = 0; t < n; ++t) {
        const double err = std::fabs(yk[t * D + c] - x[t * D + c]);
        ASSERT_LE(err, bound) << "key t=" << t << " c=" << c << " n=" << n;
        worst_ratio = std::max(worst_ratio, err / bound);
      }
    }
    EXPECT_GT(worst_ratio, 0.5);  // the bound is the real resolution, not a loose one
    const int G = kvcodec::kKiviGroup;
    for (int t = 0; t < n; ++t) {  // values: one range per token and group of G channels
      for (int g = 0; g * G < D; ++g) {
        const int end = std::min(D, (g + 1) * G);
        float mn = x[t * D + g * G], mx = mn;
        for (int c = g * G; c < end; ++c)
          mn = std::min(mn, x[t * D + c]), mx = std::max(mx, x[t * D + c]);
        const double bound = KiviBound(mn, mx, bits);
        for (int c = g * G; c < end; ++c)
          ASSERT_LE(std::fabs(yv[t * D + c] - x[t * D + c]), bound)
              << "value t=" << t << " c=" << c;
      }
    }
  }
}

TEST_P(KiviSlabTest, ConstantInputIsExactWhenRepresentable) {
  const auto [dtype, T, D] = GetParam();
  std::vector<float> x(T * D, 0.375f);
  std::vector<uint8_t> s(kvcodec::SlabBytes(dtype, T, D));
  std::vector<float> y(T * D);
  for (bool key : {true, false}) {
    kvcodec::QuantizeKivi(dtype, key, s.data(), T, D, T, x.data());
    kvcodec::DecodeRows(dtype, key, s.data(), T, D, T, y.data());
    EXPECT_EQ(y, x);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, KiviSlabTest,
                         ::testing::Values(SlabCase{KvDtype::kKivi4, 16, 64},
                                           SlabCase{KvDtype::kKivi2, 16, 64},
                                           SlabCase{KvDtype::kKivi4, 8, 40},  // partial group
                                           SlabCase{KvDtype::kKivi2, 32, 128}));

// --- through the pool ---

std::unique_ptr<KvBlockPool> MakePool(KvDtype dtype, int blocks, int staging_slots) {
  KvBlockPool::Options o;
  o.layout = KvLayout{2, 2, 64, 16, dtype};
  const int64_t slot = 2LL * 2 * 16 * 64 * 4;
  o.staging_bytes = kvcodec::IsKivi(dtype) ? staging_slots * slot : 0;
  o.capacity_bytes = blocks * o.layout.BlockBytes() + o.staging_bytes;
  auto pool = KvBlockPool::Create(o);
  EXPECT_TRUE(pool.ok()) << pool.status().ToString();
  EXPECT_EQ((*pool)->total_blocks(), blocks);
  return std::move(pool).value();
}

// rows[layer][token][kv][head][dim] of random data.
std::vector<float> WriteRandom(KvBlockPool& pool, BlockId id, int tokens, unsigned seed) {
  const KvLayout& l = pool.layout();
  const int row = l.kv_heads * l.head_dim;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> all(static_cast<size_t>(l.layers) * l.block_tokens * 2 * row);
  for (int layer = 0; layer < l.layers; ++layer)
    for (int t = 0; t < tokens; ++t) {
      float* k = &all[((layer * l.block_tokens + t) * 2) * row];
      float* v = k + row;
      for (int i = 0; i < 2 * row; ++i) k[i] = nd(rng);
      pool.WriteToken(id, layer, t, k, v);
    }
  return all;
}

// Max |decoded - written| over rows [0, n) of every head, K and V separately,
// divided by the largest |written| value (a relative error).
std::pair<double, double> MaxError(const KvBlockPool& pool, BlockId id, int n,
                                   const std::vector<float>& all) {
  const KvLayout& l = pool.layout();
  const int row = l.kv_heads * l.head_dim;
  std::vector<float> k(l.block_tokens * l.head_dim), v(k.size());
  double ek = 0, ev = 0;
  for (int layer = 0; layer < l.layers; ++layer)
    for (int h = 0; h < l.kv_heads; ++h) {
      pool.ReadHead(id, layer, h, n, k.data(), v.data());
      for (int t = 0; t < n; ++t)
        for (int c = 0; c < l.head_dim; ++c) {
          const float* src = &all[((layer * l.block_tokens + t) * 2) * row];
          ek = std::max(
              ek, static_cast<double>(std::fabs(k[t * l.head_dim + c] - src[h * l.head_dim + c])));
          ev = std::max(ev, static_cast<double>(
                                std::fabs(v[t * l.head_dim + c] - src[row + h * l.head_dim + c])));
        }
    }
  return {ek, ev};
}

TEST(KvPoolDtypeTest, RoundTripWithinFormatBound) {
  // Data ~ N(0, 2), |x| < 16 in practice: absolute bounds derived from the formats.
  struct Case {
    KvDtype d;
    double abs_bound;
  } cases[] = {
      {KvDtype::kF32, 0.0},
      {KvDtype::kF16, 16 * std::ldexp(1.0, -11)},
      {KvDtype::kBF16, 16 * std::ldexp(1.0, -8)},
      {KvDtype::kInt8, 16 / 127.0 / 2},
      {KvDtype::kKivi4, 32 * (1 + 2e-3) / 30},  // range < 32
      {KvDtype::kKivi2, 32 * (1 + 2e-3) / 6},
  };
  for (const Case& c : cases) {
    auto pool = MakePool(c.d, 2, 2);
    BlockId id = *pool->Allocate();
    auto all = WriteRandom(*pool, id, 16, 3);
    auto [ek, ev] = MaxError(*pool, id, 16, all);
    EXPECT_LE(ek, c.abs_bound) << KvDtypeName(c.d);
    EXPECT_LE(ev, c.abs_bound) << KvDtypeName(c.d);
    if (c.d != KvDtype::kF32) {
      EXPECT_GT(ek, 0.0) << KvDtypeName(c.d);
    }
    EXPECT_EQ(pool->staging_slots_free(), kvcodec::IsKivi(c.d) ? 2 : 0);
    EXPECT_EQ(pool->HeadSlabF32(id, 0, false, 0) != nullptr, c.d == KvDtype::kF32);
  }
}

TEST(KvPoolDtypeTest, GarbageImportedBytesDecodeWithoutFaults) {
  // Bytes from a peer or a disk may be anything; decoding them must stay in
  // bounds (the sanitizer build checks) and writing on top must still work.
  for (KvDtype d : {KvDtype::kF32, KvDtype::kF16, KvDtype::kBF16, KvDtype::kInt8, KvDtype::kKivi4,
                    KvDtype::kKivi2}) {
    auto pool = MakePool(d, 2, 1);
    const KvLayout& l = pool->layout();
    BlockId id = *pool->Allocate();
    std::mt19937 rng(99);
    for (int layer = 0; layer < l.layers; ++layer)
      for (uint8_t& b : pool->LayerData(id, layer)) b = static_cast<uint8_t>(rng());
    std::vector<float> k(l.block_tokens * l.head_dim), v(k.size());
    pool->ReadHead(id, 1, 1, l.block_tokens, k.data(), v.data());
    std::vector<float> row(2 * l.kv_heads * l.head_dim, 1.25f);
    pool->WriteToken(id, 0, 3, row.data(), row.data() + l.kv_heads * l.head_dim);
    pool->ReadHead(id, 0, 0, 4, k.data(), v.data());
    if (!kvcodec::IsKivi(d)) {
      EXPECT_NEAR(k[3 * l.head_dim], 1.25f, 1.25f / 127) << KvDtypeName(d);
    } else {
      EXPECT_EQ(k[3 * l.head_dim], 1.25f) << KvDtypeName(d);  // staged: exact
    }
  }
}

class KiviPoolTest : public ::testing::TestWithParam<KvDtype> {};

TEST_P(KiviPoolTest, PartialBlockIsExactUntilFullThenQuantized) {
  auto pool = MakePool(GetParam(), 3, 4);
  BlockId id = *pool->Allocate();
  auto all = WriteRandom(*pool, id, 9, 5);
  EXPECT_EQ(pool->staging_slots_free(), 2);  // both layers of the block are staged
  auto [ek, ev] = MaxError(*pool, id, 9, all);
  EXPECT_EQ(ek, 0.0);
  EXPECT_EQ(ev, 0.0);
  // Fill the block: each layer is quantized when slot 15 is written.
  auto full = WriteRandom(*pool, id, 16, 5);  // same seed: rows 0..8 identical
  EXPECT_EQ(pool->staging_slots_free(), 4);
  auto [fk, fv] = MaxError(*pool, id, 16, full);
  EXPECT_GT(fk, 0.0);
  EXPECT_LT(fk, GetParam() == KvDtype::kKivi4 ? 32.0 / 30 : 32.0 / 6);
  pool->Release(id);
}

TEST_P(KiviPoolTest, LayerDataFlushesPartialAndImportReproducesIt) {
  auto pool = MakePool(GetParam(), 3, 4);
  const KvLayout& l = pool->layout();
  BlockId a = *pool->Allocate();
  auto all = WriteRandom(*pool, a, 7, 9);
  BlockId b = *pool->Allocate();
  for (int layer = 0; layer < l.layers; ++layer) {
    auto src = pool->LayerData(a, layer);  // quantizes rows 0..6 of this layer
    auto dst = pool->LayerData(b, layer);
    std::memcpy(dst.data(), src.data(), src.size());
  }
  EXPECT_EQ(pool->staging_slots_free(), 4);
  auto [ek, ev] = MaxError(*pool, a, 7, all);
  EXPECT_GT(ek, 0.0);  // now quantized
  EXPECT_LT(ek, GetParam() == KvDtype::kKivi4 ? 32.0 / 30 : 32.0 / 6);
  std::vector<float> ka(l.block_tokens * l.head_dim), va(ka.size()), kb(ka.size()), vb(ka.size());
  for (int layer = 0; layer < l.layers; ++layer)
    for (int h = 0; h < l.kv_heads; ++h) {
      pool->ReadHead(a, layer, h, 7, ka.data(), va.data());
      pool->ReadHead(b, layer, h, 7, kb.data(), vb.data());
      ASSERT_EQ(ka, kb);
      ASSERT_EQ(va, vb);
    }
  // Writing on after a flush keeps the earlier rows (re-staged from the slab).
  std::vector<float> row(2 * l.kv_heads * l.head_dim, 0.5f);
  for (int layer = 0; layer < l.layers; ++layer)
    pool->WriteToken(a, layer, 7, row.data(), row.data() + l.kv_heads * l.head_dim);
  std::vector<float> k2(ka.size()), v2(ka.size());
  pool->ReadHead(a, 1, 1, 8, k2.data(), v2.data());
  pool->ReadHead(b, 1, 1, 7, kb.data(), vb.data());
  for (int i = 0; i < 7 * l.head_dim; ++i) ASSERT_EQ(k2[i], kb[i]);
  EXPECT_EQ(k2[7 * l.head_dim], 0.5f);  // staged again: exact
}

TEST_P(KiviPoolTest, WithoutStagingWritesStillRoundTrip) {
  auto pool = MakePool(GetParam(), 2, 0);
  EXPECT_EQ(pool->staging_slots_free(), 0);
  BlockId id = *pool->Allocate();
  auto all = WriteRandom(*pool, id, 16, 21);
  auto [ek, ev] = MaxError(*pool, id, 16, all);
  // Each of the 16 writes re-quantizes the layer: errors of earlier rows add up,
  // at most one half step per re-quantization.
  const double step_bound = GetParam() == KvDtype::kKivi4 ? 32.0 / 30 : 32.0 / 6;
  EXPECT_LE(ek, 16 * step_bound);
  EXPECT_LE(ev, step_bound);  // values are per token: the new row never moves old ones
}

TEST_P(KiviPoolTest, CopyBlockCopiesStagedRows) {
  auto pool = MakePool(GetParam(), 3, 4);
  const KvLayout& l = pool->layout();
  BlockId a = *pool->Allocate(), b = *pool->Allocate();
  auto all = WriteRandom(*pool, a, 5, 13);
  pool->CopyBlock(a, b);
  EXPECT_EQ(pool->staging_slots_free(), 0);
  auto [ek, ev] = MaxError(*pool, b, 5, all);
  EXPECT_EQ(ek, 0.0);
  EXPECT_EQ(ev, 0.0);
  pool->Release(a);
  pool->Release(b);
  EXPECT_EQ(pool->staging_slots_free(), 4);
  EXPECT_EQ(pool->free_blocks(), 3);
  (void)l;
}

INSTANTIATE_TEST_SUITE_P(Dtypes, KiviPoolTest, ::testing::Values(KvDtype::kKivi4, KvDtype::kKivi2),
                         [](const auto& info) { return std::string(KvDtypeName(info.param)); });

}  // namespace
}  // namespace kvrelay::engine
