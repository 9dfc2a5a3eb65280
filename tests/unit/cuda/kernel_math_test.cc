// The CUDA kernels' per-element and per-block arithmetic (engine/cuda/
// kernel_math.h), run on the CPU against the CPU engine's kernels. Built and
// run in every configuration: no GPU and no CUDA toolkit needed.
#include "engine/cuda/kernel_math.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include "engine/gguf/ggml_type.h"
#include "engine/gguf/gguf.h"
#include "engine/gguf/quantize.h"
#include "engine/kernels/gelu.h"
#include "engine/kernels/matmul.h"
#include "engine/kernels/ops.h"
#include "engine/runtime/sampler.h"
#include "tests/gpu/agreement.h"

namespace kvrelay::engine::cuda {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

std::vector<float> RandomFloats(size_t n, float scale, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

TEST(KernelMathTest, HalfConversionsMatchTheGgufCodec) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float a = math::HalfToFloat(static_cast<uint16_t>(h));
    const float b = Fp16ToFp32(static_cast<uint16_t>(h));
    if (std::isnan(b)) {
      EXPECT_TRUE(std::isnan(a));
    } else {
      ASSERT_EQ(Bits(a), Bits(b)) << "half " << h;
    }
  }
  std::mt19937 rng(7);
  std::vector<float> xs = {
      0.0f,    -0.0f,    65504.0f,           65520.0f,           1e-8f,   5.96e-8f, 2.98e-8f,
      6.1e-5f, -3.1e-5f, 1.0f + 1.0f / 2048, 1.0f + 3.0f / 2048, INFINITY};
  for (int i = 0; i < 200000; ++i)
    xs.push_back(std::ldexp(std::uniform_real_distribution<float>(-1, 1)(rng),
                            static_cast<int>(rng() % 40) - 28));
  for (float x : xs) ASSERT_EQ(math::FloatToHalf(x), Fp32ToFp16(x)) << x;
}

TEST(KernelMathTest, ExpAndSiluMatchTheCpuBitForBit) {
  std::vector<float> x;
  for (float v = -110.0f; v < 90.0f; v += 0.0137f) x.push_back(v);
  std::vector<float> want(x.size());
  ExpGgml(x.data(), static_cast<int64_t>(x.size()), want.data(), KernelPath::kScalar);
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(Bits(math::ExpGgml(x[i])), Bits(want[i])) << x[i];

  const int64_t n = 1003;  // a tail that is not a whole group of 8
  std::vector<float> g = RandomFloats(n, 3.0f, 1), u = RandomFloats(n, 1.0f, 2), y(n);
  SiluMul(g.data(), u.data(), n, y.data(), KernelPath::kScalar);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(Bits(math::SiluMulElem(g[i], u[i], i < (n & ~int64_t{7}))), Bits(y[i])) << i;
  }
}

TEST(KernelMathTest, GeluMatchesTheCpuBitForBit) {
  // Every region of the table: both clamps, the fp16 rounding inside, NaN.
  std::vector<float> g;
  for (float v = -12.0f; v < 12.0f; v += 0.00731f) g.push_back(v);
  g.push_back(-10.0f);
  g.push_back(10.0f);
  g.push_back(std::nanf(""));
  const int64_t n = static_cast<int64_t>(g.size());
  std::vector<float> u = RandomFloats(g.size(), 1.0f, 7), y(g.size());
  GeluTanhMulGgml(g.data(), u.data(), n, y.data());
  const uint16_t* table = GeluTableGgml().data();
  for (int64_t i = 0; i < n; ++i) {
    const float got = math::GeluMulElem(g[i], u[i], table);
    if (std::isnan(y[i])) {
      ASSERT_TRUE(std::isnan(got)) << g[i];
    } else {
      ASSERT_EQ(Bits(got), Bits(y[i])) << g[i];
    }
  }
}

TEST(KernelMathTest, RmsNormMatchesTheCpu) {
  for (int n : {64, 576, 4096}) {
    std::vector<float> x = RandomFloats(n, 2.0f, n), w = RandomFloats(n, 1.0f, n + 1), y(n);
    RmsNormFast(x.data(), w.data(), n, 1e-5f, y.data());
    double ss = 0;
    for (float v : x) ss += static_cast<double>(v * v);
    const float scale = math::RmsScale(ss, n, 1e-5f);
    for (int i = 0; i < n; ++i) ASSERT_EQ(Bits(math::RmsApply(x[i], scale, w[i])), Bits(y[i]));
  }
}

TEST(KernelMathTest, RopeMatchesTheCpuBitForBit) {
  const int rope_dim = 64, hd = 64;
  const float base = 100000.0f;
  const float theta_scale = std::pow(base, -2.0f / rope_dim);
  for (bool neox : {false, true}) {
    for (int64_t pos : {0, 1, 17, 1000, 8191}) {
      std::vector<float> x = RandomFloats(hd, 1.0f, pos + 3), want = x;
      float cs[32], sn[32];
      RopeAnglesGgml(pos, base, rope_dim, cs, sn);
      RopeRotate(want.data(), rope_dim / 2, neox, cs, sn, KernelPath::kScalar);
      for (int i = 0; i < rope_dim / 2; ++i) {
        const float theta = math::RopeTheta(pos, theta_scale, i);
        const int a = neox ? i : 2 * i, b = neox ? i + rope_dim / 2 : 2 * i + 1;
        math::RopePair(&x[a], &x[b], std::cos(theta), std::sin(theta));
      }
      for (int i = 0; i < hd; ++i)
        ASSERT_EQ(Bits(x[i]), Bits(want[i])) << "pos " << pos << " i " << i;
    }
  }
}

// The fused RoPE + KV write's units cover each key head once, and the
// rotated units are RopeRotate's pairs (normal: (2i, 2i+1); NeoX: (i, i+half)).
TEST(KernelMathTest, RopeKvUnitsCoverTheHeadOnce) {
  for (const auto& [hd, rope_dim] :
       std::vector<std::pair<int, int>>{{64, 64}, {128, 64}, {96, 32}}) {
    for (bool neox : {false, true}) {
      std::vector<int> seen(hd, 0);
      for (int u = 0; u < hd - rope_dim / 2; ++u) {
        int e0, e1;
        math::RopeKvUnit(u, rope_dim, neox, &e0, &e1);
        ASSERT_GE(e0, 0);
        ASSERT_LT(e0, hd);
        ++seen[e0];
        if (u < rope_dim / 2) {
          ASSERT_EQ(e0, neox ? u : 2 * u);
          ASSERT_EQ(e1, neox ? u + rope_dim / 2 : 2 * u + 1);
          ++seen[e1];
        } else {
          ASSERT_EQ(e1, -1);
          ASSERT_GE(e0, rope_dim);
        }
      }
      for (int e = 0; e < hd; ++e)
        ASSERT_EQ(seen[e], 1) << "hd " << hd << " rope_dim " << rope_dim << " e " << e;
    }
  }
}

GgufTensor MakeTensor(GgmlType type, int64_t rows, int64_t cols, std::vector<uint8_t>* bytes,
                      uint64_t seed) {
  std::vector<float> w = RandomFloats(rows * cols, 0.05f, seed);
  bytes->clear();
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<uint8_t> row = QuantizeRowForTest(type, w.data() + r * cols, cols);
    bytes->insert(bytes->end(), row.begin(), row.end());
  }
  GgufTensor t;
  t.name = "w";
  t.type = type;
  t.dims = {cols, rows};
  t.data = bytes->data();
  t.nbytes = bytes->size();
  return t;
}

// The GEMV's block terms, summed in block order, are the CPU scalar kernel's
// result up to the order of the float sums: the same int8 activations and
// integer dots, while the CPU kernels now sum in ggml's 8-lane AVX2 order
// (every CPU path, scalar included, is llama.cpp-exact) and the device sums
// the terms in its own order. The bound is a few float roundings of the
// terms' magnitude; a wrong integer dot or scale is off by far more.
TEST(KernelMathTest, QuantizedBlockDotsMatchTheCpuScalarKernel) {
  const int64_t rows = 24, cols = 576, T = 3;
  for (GgmlType type : {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ8_0}) {
    std::vector<uint8_t> bytes;
    GgufTensor w = MakeTensor(type, rows, cols, &bytes, static_cast<uint64_t>(type));
    std::vector<float> x = RandomFloats(T * cols, 1.0f, 11), want(T * rows);
    MatMulWithPath(w, x.data(), T, want.data(), nullptr, KernelPath::kScalar);
    const int64_t nb = cols / 32;
    alignas(4) int8_t q[32];
    const int64_t row_bytes = static_cast<int64_t>(bytes.size()) / rows;
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t r = 0; r < rows; ++r) {
        float acc = 0, magnitude = 0;
        for (int64_t b = 0; b < nb; ++b) {
          float d, s;
          math::QuantizeBlockQ8(x.data() + t * cols + b * 32, q, &d, &s);
          const uint8_t* row = bytes.data() + r * row_bytes;
          float term = 0;
          if (type == GgmlType::kQ4_0)
            term = math::BlockTermQ4_0(row + b * math::kQ4_0Bytes, q, d, s);
          if (type == GgmlType::kQ4_1)
            term = math::BlockTermQ4_1(row + b * math::kQ4_1Bytes, q, d, s);
          if (type == GgmlType::kQ8_0) term = math::BlockTermQ8_0(row + b * math::kQ8_0Bytes, q, d);
          acc += term;
          magnitude += std::fabs(term);
        }
        ASSERT_NEAR(acc, want[t * rows + r], 4e-6f * magnitude + 1e-7f)
            << "type " << static_cast<int>(type) << " t " << t << " r " << r;
      }
    }
  }
}

TEST(KernelMathTest, Dp4aIsASignedByteDot) {
  std::mt19937 rng(3);
  for (int i = 0; i < 10000; ++i) {
    const uint32_t a = rng(), b = rng();
    int want = 5;
    for (int k = 0; k < 4; ++k)
      want += static_cast<int8_t>(a >> (8 * k)) * static_cast<int8_t>(b >> (8 * k));
    ASSERT_EQ(math::Dp4a(a, b, 5), want);
  }
}

// Random K-quant super-blocks with finite, modest scales.
std::vector<uint8_t> RandomKBlocks(GgmlType type, int64_t n, uint64_t seed) {
  const int bytes = type == GgmlType::kQ4_K ? math::kQ4_KBytes : math::kQ6_KBytes;
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::vector<uint8_t> out(static_cast<size_t>(n / 256 * bytes));
  for (uint8_t& b : out) b = static_cast<uint8_t>(rng());
  for (int64_t s = 0; s < n / 256; ++s) {
    uint8_t* blk = out.data() + s * bytes;
    const uint16_t d = Fp32ToFp16(0.001f * static_cast<float>(1 + rng() % 100));
    const uint16_t dmin = Fp32ToFp16(0.0005f * static_cast<float>(1 + rng() % 100));
    if (type == GgmlType::kQ4_K) {
      std::memcpy(blk, &d, 2);
      std::memcpy(blk + 2, &dmin, 2);
    } else {
      std::memcpy(blk + 208, &d, 2);
    }
  }
  return out;
}

TEST(KernelMathTest, DequantElemMatchesDequantizeRowForEveryDeviceType) {
  const int64_t n = 512;
  for (GgmlType type : {GgmlType::kF32, GgmlType::kF16, GgmlType::kQ4_0, GgmlType::kQ4_1,
                        GgmlType::kQ8_0, GgmlType::kQ4_K, GgmlType::kQ6_K}) {
    std::vector<uint8_t> row;
    if (type == GgmlType::kQ4_K || type == GgmlType::kQ6_K) {
      row = RandomKBlocks(type, n, 5);
    } else {
      std::vector<float> x = RandomFloats(n, 0.3f, 9);
      row = QuantizeRowForTest(type, x.data(), n);
    }
    ASSERT_EQ(static_cast<int64_t>(row.size()), *RowBytes(type, n));
    ASSERT_TRUE(math::DeviceSupportsType(static_cast<uint32_t>(type)));
    std::vector<float> want(n);
    DequantizeRow(type, row.data(), want.data(), n);
    for (int64_t c = 0; c < n; ++c) {
      ASSERT_EQ(Bits(math::DequantElem(static_cast<uint32_t>(type), row.data(), c)), Bits(want[c]))
          << "type " << static_cast<int>(type) << " element " << c;
    }
  }
  EXPECT_FALSE(math::DeviceSupportsType(static_cast<uint32_t>(GgmlType::kQ5_K)));
}

// The device attention, emulated: positions split into chunks, each chunk
// walked by 4 "warps" with stride 4 and an online softmax, warps merged, then
// chunks merged. Against the CPU's two-pass attention row.
TEST(KernelMathTest, SplitOnlineSoftmaxAttentionMatchesTheCpuRow) {
  const int hd = 64, B = 16;
  const int64_t len = 700;
  std::vector<float> k = RandomFloats(len * hd, 1.0f, 21), v = RandomFloats(len * hd, 1.0f, 22);
  std::vector<float> q = RandomFloats(hd, 1.0f, 23);
  std::vector<const float*> kb, vb;
  for (int64_t b = 0; b * B < len; ++b) {
    kb.push_back(k.data() + b * B * hd);
    vb.push_back(v.data() + b * B * hd);
  }
  const float scale = 0.125f;
  for (int64_t j0 : {int64_t{0}, int64_t{300}}) {
    std::vector<float> scores(len), acc(8 * hd), want(hd);
    AttendRowGgml(q.data(), kb.data(), vb.data(), B, hd, j0, len, scale, false, scores.data(),
                  acc.data(), want.data(), KernelPath::kScalar);
    for (int split : {64, 256, 1024}) {
      math::SoftmaxState total{0, 0};
      std::vector<float> tacc(hd, 0.0f);
      for (int64_t s0 = 0; s0 < len; s0 += split) {
        const int64_t a = std::max(s0, j0), b = std::min<int64_t>(s0 + split, len);
        math::SoftmaxState ws[4] = {{0, 0}, {0, 0}, {0, 0}, {0, 0}};
        std::vector<float> wacc(4 * hd, 0.0f);
        for (int w = 0; w < 4; ++w) {
          for (int64_t j = a + w; j < b; j += 4) {
            float dot = 0;
            for (int e = 0; e < hd; ++e) dot = std::fma(q[e], k[j * hd + e], dot);
            float sa, p;
            ws[w] = math::PushSoftmax(ws[w], dot * scale, &sa, &p);
            for (int e = 0; e < hd; ++e)
              wacc[w * hd + e] = wacc[w * hd + e] * sa + p * v[j * hd + e];
          }
        }
        math::SoftmaxState m = ws[0];
        std::vector<float> sacc(wacc.begin(), wacc.begin() + hd);
        for (int w = 1; w < 4; ++w) {
          float sa, sb;
          m = math::MergeSoftmax(m, ws[w], &sa, &sb);
          for (int e = 0; e < hd; ++e) sacc[e] = sacc[e] * sa + wacc[w * hd + e] * sb;
        }
        float sa, sb;
        total = math::MergeSoftmax(total, m, &sa, &sb);
        for (int e = 0; e < hd; ++e) tacc[e] = tacc[e] * sa + sacc[e] * sb;
      }
      for (int e = 0; e < hd; ++e) {
        EXPECT_NEAR(tacc[e] / total.l, want[e], 2e-5f * (1.0f + std::fabs(want[e])))
            << "split " << split << " j0 " << j0 << " e " << e;
      }
    }
  }
}

// The device sampler's pick, given the uniform the request's RNG draws first,
// chooses exactly what Sampler::Sample chooses (same seed, same logits).
TEST(KernelMathTest, PickSortedReproducesTheSeededCpuSampler) {
  const int vocab = 5000;
  int checked = 0;
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    std::vector<float> logits = RandomFloats(vocab, 2.0f, seed * 7);
    logits[17] = logits[18] = 9.0f;  // a tie at the top (broken by id)
    for (const auto& [k, p, mp, temp] :
         std::vector<std::tuple<int, float, float, float>>{{40, 1.0f, 0.0f, 0.8f},
                                                           {0, 0.9f, 0.0f, 1.0f},
                                                           {100, 0.5f, 0.05f, 1.3f},
                                                           {1, 1.0f, 0.0f, 0.7f}}) {
      SamplingParams sp;
      sp.temperature = temp;
      sp.top_k = k;
      sp.top_p = p;
      sp.min_p = mp;
      sp.seed = seed;
      Sampler sampler(sp);
      std::vector<float> copy = logits;
      const int32_t want = sampler.Sample(copy.data(), vocab, {}, 0);

      std::vector<int32_t> ids(vocab);
      for (int i = 0; i < vocab; ++i) ids[i] = i;
      std::sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) {
        return math::CandidateBefore(logits[a], a, logits[b], b);
      });
      const int keep = k > 0 ? k : vocab;
      std::vector<float> sorted(keep);
      for (int i = 0; i < keep; ++i) sorted[i] = logits[ids[i]];
      std::mt19937_64 rng(seed);
      const double u = static_cast<double>(rng() >> 11) * (1.0 / 9007199254740992.0);
      std::vector<double> probs(keep);
      EXPECT_EQ(math::PickSorted(sorted.data(), ids.data(), keep, temp, mp, p, u, probs.data()),
                want)
          << "seed " << seed << " top_k " << k;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 160);
}

// A request whose picks a backend makes (Sampler::NextPickForBackend, then
// the device's arithmetic: PickSorted over the sorted top_k) gets the host
// Sampler's tokens step after step: the RNG advances alike on both paths.
TEST(KernelMathTest, BackendPicksFollowTheHostSamplersSeededSequence) {
  const int vocab = 3000;
  for (const auto& [k, p, mp, temp] : std::vector<std::tuple<int, float, float, float>>{
           {40, 1.0f, 0.0f, 0.8f}, {200, 0.9f, 0.05f, 1.2f}, {50, 1.0f, 0.0f, 0.0f}}) {
    SamplingParams sp;
    sp.temperature = temp;
    sp.top_k = k;
    sp.top_p = p;
    sp.min_p = mp;
    sp.seed = 11;
    Sampler host(sp), backend(sp);
    ASSERT_TRUE(backend.BackendCanPick(vocab));
    for (int step = 0; step < 24; ++step) {
      std::vector<float> logits = RandomFloats(vocab, 1.5f, 100 + step);
      std::vector<float> copy = logits;
      const int32_t want = host.Sample(copy.data(), vocab, {}, 0);
      const BackendPick pick = backend.NextPickForBackend();
      std::vector<int32_t> ids(vocab);
      for (int i = 0; i < vocab; ++i) ids[i] = i;
      std::sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) {
        return math::CandidateBefore(logits[a], a, logits[b], b);
      });
      int32_t got = ids[0];  // greedy: the first maximum
      if (pick.temperature > 0.0f) {
        std::vector<float> sorted(pick.top_k);
        for (int i = 0; i < pick.top_k; ++i) sorted[i] = logits[ids[i]];
        std::vector<double> probs(pick.top_k);
        got = math::PickSorted(sorted.data(), ids.data(), pick.top_k, pick.temperature, pick.min_p,
                               pick.top_p, pick.uniform, probs.data());
      }
      ASSERT_EQ(got, want) << "top_k " << k << " step " << step;
    }
  }
  // What only the host does keeps a request on the host.
  SamplingParams sp;
  sp.temperature = 0.7f;
  sp.top_k = 0;  // the whole vocabulary: beyond the device's candidate buffer
  EXPECT_FALSE(Sampler(sp).BackendCanPick(vocab));
  sp.top_k = 40;
  EXPECT_TRUE(Sampler(sp).BackendCanPick(vocab));
  sp.repetition_penalty = 1.1f;
  EXPECT_FALSE(Sampler(sp).BackendCanPick(vocab));
  sp.repetition_penalty = 1.0f;
  sp.logprobs = 0;
  EXPECT_FALSE(Sampler(sp).BackendCanPick(vocab));
  sp.logprobs = -1;
  sp.logit_bias = {{5, 1.0f}};
  EXPECT_FALSE(Sampler(sp).BackendCanPick(vocab));
}

// ---- the decode GEMV (mmvq), the fused RMSNorm / SwiGLU + q8 kernels ----

int BlockBytes(uint32_t type) {
  return type == math::kTypeQ4_0   ? math::kQ4_0Bytes
         : type == math::kTypeQ4_1 ? math::kQ4_1Bytes
                                   : math::kQ8_0Bytes;
}

// The two parts of a block cover its 32 elements exactly once, and each
// weight byte, scaled, is the element DequantizeRow decodes.
TEST(KernelMathTest, WeightPartsCoverTheBlockOnce) {
  const int64_t n = 256;
  for (GgmlType type : {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ8_0}) {
    const uint32_t t = static_cast<uint32_t>(type);
    std::vector<float> x = RandomFloats(n, 0.3f, 31);
    std::vector<uint8_t> row = QuantizeRowForTest(type, x.data(), n);
    std::vector<float> want(n);
    DequantizeRow(type, row.data(), want.data(), n);
    for (int64_t b = 0; b < n / 32; ++b) {
      int seen[32] = {};
      for (int part = 0; part < math::kMmvqParts; ++part) {
        const math::WeightPart wp = math::LoadWeightPart(t, row.data() + b * BlockBytes(t), part);
        for (int i = 0; i < 4; ++i) {
          const int a = math::MmvqActInt(t, part, i);
          ASSERT_GE(a, 0);
          ASSERT_LT(a, 8);
          for (int k = 0; k < 4; ++k) {
            const int e = 4 * a + k;
            ++seen[e];
            const int code = t == math::kTypeQ8_0 ? static_cast<int8_t>(wp.w[i] >> (8 * k))
                                                  : static_cast<int>((wp.w[i] >> (8 * k)) & 0xFF);
            if (t != math::kTypeQ8_0) {
              ASSERT_LT(code, 16);
            }
            const float got = wp.d * static_cast<float>(code) + wp.m;
            ASSERT_NEAR(got, want[b * 32 + e], 1e-6f * (1.0f + std::fabs(want[b * 32 + e])))
                << "type " << t << " block " << b << " element " << e;
          }
        }
      }
      for (int e = 0; e < 32; ++e) ASSERT_EQ(seen[e], 1) << "type " << t << " element " << e;
    }
  }
}

// kernels.cu MmvqKernel's sum for one (row, token), in its order: 128
// threads, thread tid takes part tid % 2 of blocks tid / 2, + 64, ...; each
// warp's partials are reduced by the xor-shuffle tree, then the four warps
// are added in order. Bit for bit what the device computes (every product
// whose rounding could differ is an explicit fma).
float EmulateMmvq(uint32_t type, const uint8_t* row, int64_t nb, const int8_t* q, const float* d,
                  const float* s) {
  float acc[128] = {};
  for (int tid = 0; tid < 128; ++tid) {
    const int part = tid % math::kMmvqParts;
    for (int64_t b = tid / math::kMmvqParts; b < nb; b += 128 / math::kMmvqParts) {
      const math::WeightPart wp = math::LoadWeightPart(type, row + b * BlockBytes(type), part);
      uint32_t xa[4];
      for (int i = 0; i < 4; ++i)
        std::memcpy(&xa[i], q + b * 32 + 4 * math::MmvqActInt(type, part, i), 4);
      acc[tid] += math::PartTerm(wp, xa, d[b], s[b], part);
    }
  }
  float warp_sum[4];
  for (int w = 0; w < 4; ++w) {
    float v[32];
    std::copy(acc + 32 * w, acc + 32 * w + 32, v);
    for (int o = 16; o > 0; o >>= 1) {
      float next[32];
      for (int l = 0; l < 32; ++l) next[l] = v[l] + v[l ^ o];
      std::copy(next, next + 32, v);
    }
    warp_sum[w] = v[0];
  }
  float out = warp_sum[0];
  for (int w = 1; w < 4; ++w) out += warp_sum[w];
  return out;
}

// Activations [T][cols] -> q8 blocks, as QuantizeQ8Kernel (one block per warp).
struct HostQ8 {
  std::vector<int8_t> q;
  std::vector<float> d, s;
};
HostQ8 QuantizeRows(const float* x, int64_t T, int64_t cols) {
  HostQ8 out;
  const int64_t nb = cols / 32;
  out.q.resize(T * cols);
  out.d.resize(T * nb);
  out.s.resize(T * nb);
  for (int64_t i = 0; i < T * nb; ++i)
    math::QuantizeBlockQ8(x + i * 32, out.q.data() + i * 32, &out.d[i], &out.s[i]);
  return out;
}

// y[t][r] of the emulated mmvq, with the bound the reordering allows:
// 4e-6 of the terms' magnitude (as the block-dot test above).
void ExpectMmvqMatchesCpu(const GgufTensor& w, const std::vector<uint8_t>& bytes, const float* x,
                          int64_t T, const char* what) {
  const int64_t rows = w.Rows(), cols = w.Cols(), nb = cols / 32;
  const uint32_t type = static_cast<uint32_t>(w.type);
  std::vector<float> want(T * rows);
  MatMulWithPath(w, x, T, want.data(), nullptr, KernelPath::kScalar);
  const HostQ8 xq = QuantizeRows(x, T, cols);
  const int64_t row_bytes = static_cast<int64_t>(bytes.size()) / rows;
  std::vector<float> deq(cols);
  for (int64_t r = 0; r < rows; ++r) {
    DequantizeRow(w.type, bytes.data() + r * row_bytes, deq.data(), cols);
    for (int64_t t = 0; t < T; ++t) {
      double magnitude = 0;
      for (int64_t c = 0; c < cols; ++c) magnitude += std::fabs(deq[c] * x[t * cols + c]);
      const float got = EmulateMmvq(type, bytes.data() + r * row_bytes, nb, xq.q.data() + t * cols,
                                    xq.d.data() + t * nb, xq.s.data() + t * nb);
      ASSERT_NEAR(got, want[t * rows + r], 4e-6 * magnitude + 1e-6)
          << what << " type " << type << " t " << t << " r " << r;
    }
  }
}

// Widths below one pass (18 blocks), over three passes (130) and the 7B
// shape's FFN input (344 blocks); odd row counts; 1..8 tokens and more.
TEST(KernelMathTest, MmvqMatchesTheCpuGemm) {
  for (GgmlType type : {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ8_0}) {
    for (const auto& [rows, cols, T] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
             {5, 576, 1}, {7, 4160, 3}, {3, 11008, 8}, {4, 2048, 11}}) {
      std::vector<uint8_t> bytes;
      GgufTensor w = MakeTensor(type, rows, cols, &bytes, static_cast<uint64_t>(cols + T));
      std::vector<float> x = RandomFloats(T * cols, 1.0f, 40 + T);
      ExpectMmvqMatchesCpu(w, bytes, x.data(), T, "mmvq");
    }
  }
}

// kernels.cu RmsNormKernel's double sum, in its order: threads of a
// 32-multiple CTA of about d / 4 threads (at most 1024) sum float4 groups
// strided by the CTA, warps reduce by the xor tree, warps added in order.
float EmulateRmsScale(const float* x, int d, float eps) {
  int threads = (d / 4 + 31) / 32 * 32;
  threads = std::clamp(threads, 32, 1024);
  std::vector<double> ss(threads, 0.0);
  for (int tid = 0; tid < threads; ++tid) {
    for (int i = tid; i < d / 4; i += threads) {
      const float* v = x + 4 * i;
      ss[tid] += static_cast<double>(v[0] * v[0]) + static_cast<double>(v[1] * v[1]) +
                 static_cast<double>(v[2] * v[2]) + static_cast<double>(v[3] * v[3]);
    }
  }
  double total = 0;
  for (int w = 0; w < threads / 32; ++w) {
    double v[32];
    std::copy(ss.begin() + 32 * w, ss.begin() + 32 * w + 32, v);
    for (int o = 16; o > 0; o >>= 1) {
      double next[32];
      for (int l = 0; l < 32; ++l) next[l] = v[l] + v[l ^ o];
      std::copy(next, next + 32, v);
    }
    total += v[0];
  }
  return math::RmsScale(total, d, eps);
}

// The fused RMSNorm + q8 kernel's float output is the CPU's RmsNormFast bit
// for bit (the double sum's order does not reach the float mean on these
// inputs), and its q8 blocks are QuantizeBlockQ8 of that output.
TEST(KernelMathTest, FusedRmsNormQuantizeMatchesTheCpu) {
  for (int d : {64, 576, 4096, 5120}) {
    std::vector<float> x = RandomFloats(d, 2.0f, d + 7), w = RandomFloats(d, 1.0f, d + 8);
    std::vector<float> want(d), got(d);
    RmsNormFast(x.data(), w.data(), d, 1e-5f, want.data());
    const float scale = EmulateRmsScale(x.data(), d, 1e-5f);
    for (int i = 0; i < d; ++i) got[i] = math::RmsApply(x[i], scale, w[i]);
    for (int i = 0; i < d; ++i) ASSERT_EQ(Bits(got[i]), Bits(want[i])) << "d " << d << " i " << i;
  }
}

// One transformer FFN, decode-style, as the device runs it after the
// fusions: RMSNorm + q8 in one kernel, one mmvq over the stacked gate|up
// rows, SwiGLU + q8 in one kernel, mmvq of the down projection. Against the
// CPU engine's RmsNormFast, MatMul (gate, up), SiluMul, MatMul (down). The
// bound on the output: float reordering (4e-6) plus the q8 code of an
// activation that a reordered sum moved across a rounding boundary (one
// code step of one element: ~1/(127 n) of the magnitude), 1e-4 of the
// magnitude sum_j |W_rj h_j| in all.
TEST(KernelMathTest, FusedFfnPipelineMatchesTheCpu) {
  const int64_t d = 576, ffn = 1536, T = 4;
  for (GgmlType type : {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ8_0}) {
    const uint32_t ty = static_cast<uint32_t>(type);
    std::vector<uint8_t> gb, ub, db;
    GgufTensor gate = MakeTensor(type, ffn, d, &gb, 51), up = MakeTensor(type, ffn, d, &ub, 52);
    GgufTensor down = MakeTensor(type, d, ffn, &db, 53);
    std::vector<float> x = RandomFloats(T * d, 1.5f, 54), norm_w = RandomFloats(d, 1.0f, 55);
    // CPU engine.
    std::vector<float> xn(T * d), g(T * ffn), u(T * ffn), h(T * ffn), want(T * d);
    for (int64_t t = 0; t < T; ++t)
      RmsNormFast(x.data() + t * d, norm_w.data(), d, 1e-5f, xn.data() + t * d);
    MatMulWithPath(gate, xn.data(), T, g.data(), nullptr, KernelPath::kScalar);
    MatMulWithPath(up, xn.data(), T, u.data(), nullptr, KernelPath::kScalar);
    for (int64_t t = 0; t < T; ++t)
      SiluMul(g.data() + t * ffn, u.data() + t * ffn, ffn, h.data() + t * ffn, KernelPath::kScalar);
    MatMulWithPath(down, h.data(), T, want.data(), nullptr, KernelPath::kScalar);
    // Device emulation.
    std::vector<float> yn(T * d);
    for (int64_t t = 0; t < T; ++t) {
      const float scale = EmulateRmsScale(x.data() + t * d, static_cast<int>(d), 1e-5f);
      for (int64_t i = 0; i < d; ++i)
        yn[t * d + i] = math::RmsApply(x[t * d + i], scale, norm_w[i]);
    }
    const HostQ8 nq = QuantizeRows(yn.data(), T, d);
    std::vector<uint8_t> stacked = gb;  // gate rows, then up rows
    stacked.insert(stacked.end(), ub.begin(), ub.end());
    const int64_t gu_row = static_cast<int64_t>(stacked.size()) / (2 * ffn);
    std::vector<float> gu(T * 2 * ffn), hd(T * ffn), got(T * d);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t r = 0; r < 2 * ffn; ++r) {
        gu[t * 2 * ffn + r] =
            EmulateMmvq(ty, stacked.data() + r * gu_row, d / 32, nq.q.data() + t * d,
                        nq.d.data() + t * (d / 32), nq.s.data() + t * (d / 32));
      }
      for (int64_t i = 0; i < ffn; ++i)
        hd[t * ffn + i] = math::SiluMulElem(gu[t * 2 * ffn + i], gu[t * 2 * ffn + ffn + i], true);
    }
    const HostQ8 hq = QuantizeRows(hd.data(), T, ffn);
    const int64_t down_row = static_cast<int64_t>(db.size()) / d;
    std::vector<float> deq(ffn);
    for (int64_t r = 0; r < d; ++r) {
      DequantizeRow(type, db.data() + r * down_row, deq.data(), ffn);
      for (int64_t t = 0; t < T; ++t) {
        got[t * d + r] = EmulateMmvq(ty, db.data() + r * down_row, ffn / 32, hq.q.data() + t * ffn,
                                     hq.d.data() + t * (ffn / 32), hq.s.data() + t * (ffn / 32));
        double magnitude = 0;
        for (int64_t j = 0; j < ffn; ++j) magnitude += std::fabs(deq[j] * h[t * ffn + j]);
        ASSERT_NEAR(got[t * d + r], want[t * d + r], 1e-4 * magnitude + 1e-6)
            << "type " << ty << " t " << t << " r " << r;
      }
    }
  }
}

// The agreement metric of `kvrelay_gpu_check agree` (tests/gpu/agreement.h):
// near-ties are counted but not required; a flip where the CPU's top-2 gap
// exceeds 2 * eps fails, and so does any logit off by more than eps.
TEST(KernelMathTest, AgreementRequiresTop1OnlyAtDecisivePositions) {
  gpucheck::Agreement a;
  a.eps = 0.1;
  const float cpu_tie[3] = {1.0f, 1.15f, 0.0f}, gpu_tie[3] = {1.08f, 1.07f, 0.0f};
  EXPECT_FALSE(a.Add(cpu_tie, gpu_tie, 3));  // gap 0.15 < 0.2: a near-tie flip
  const float cpu_clear[3] = {0.0f, 2.0f, 1.0f}, gpu_clear[3] = {0.05f, 1.95f, 1.02f};
  EXPECT_TRUE(a.Add(cpu_clear, gpu_clear, 3));
  EXPECT_EQ(a.positions, 2);
  EXPECT_EQ(a.decisive, 1);
  EXPECT_EQ(a.decisive_agree, 1);
  EXPECT_TRUE(a.Pass());
  const float cpu_flip[3] = {0.0f, 2.0f, 1.7f}, gpu_flip[3] = {0.0f, 1.92f, 1.98f};
  EXPECT_FALSE(a.Add(cpu_flip, gpu_flip, 3));  // gap 0.3 > 0.2 and flipped
  EXPECT_EQ(a.decisive, 2);
  EXPECT_FALSE(a.Pass());

  gpucheck::Agreement b;
  b.eps = 0.1;
  const float cpu_far[2] = {0.0f, 5.0f}, gpu_far[2] = {0.3f, 5.0f};
  EXPECT_TRUE(b.Add(cpu_far, gpu_far, 2));
  EXPECT_NEAR(b.max_dlogit, 0.3, 1e-6);
  EXPECT_FALSE(b.Pass());  // top-1 agrees, but a logit is off by 0.3 > eps
}

}  // namespace
}  // namespace kvrelay::engine::cuda
