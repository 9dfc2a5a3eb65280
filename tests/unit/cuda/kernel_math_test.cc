// The CUDA kernels' per-element and per-block arithmetic (engine/cuda/
// kernel_math.h), run on the CPU against the CPU engine's kernels. Built and
// run in every configuration: no GPU and no CUDA toolkit needed.
#include "engine/cuda/kernel_math.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "engine/gguf/ggml_type.h"
#include "engine/gguf/gguf.h"
#include "engine/gguf/quantize.h"
#include "engine/kernels/matmul.h"
#include "engine/kernels/ops.h"
#include "engine/runtime/sampler.h"

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

}  // namespace
}  // namespace kvrelay::engine::cuda
