// The in-place K-quant kernels (engine/kernels/kquant.h): every vector path (AVX2,
// AVX-512, their batched register tiles) returns the scalar path's bits, the Q8_K
// activation format is ggml's, and a Q4_K /
// Q6_K / Q5_0 block written by hand multiplies to the value its layout says.
// (Agreement with MatMulReference within the derived bound is in matmul_test.)
#include "engine/kernels/kquant.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/thread_pool.h"
#include "engine/gguf/ggml_type.h"
#include "engine/kernels/matmul.h"

namespace kvrelay::engine {
namespace {

GgufTensor View(GgmlType type, int64_t rows, int64_t cols, std::vector<uint8_t>* bytes) {
  GgufTensor t;
  t.name = "w";
  t.type = type;
  t.dims = {cols, rows};
  t.data = bytes->data();
  t.nbytes = bytes->size();
  return t;
}

void PutHalf(uint8_t* p, float v) {
  const uint16_t h = Fp32ToFp16(v);
  std::memcpy(p, &h, 2);
}

std::vector<uint8_t> RandomBytes(GgmlType type, int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> scale(0.002f, 0.05f);
  std::vector<uint8_t> bytes(rows * RowBytes(type, cols).value());
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  const int64_t bb = BlockBytes(type);
  for (int64_t i = 0; i < static_cast<int64_t>(bytes.size()) / bb; ++i) {
    uint8_t* blk = bytes.data() + i * bb;
    if (type == GgmlType::kQ4_K) {
      PutHalf(blk, scale(rng));
      PutHalf(blk + 2, scale(rng));
    } else if (type == GgmlType::kQ6_K) {
      PutHalf(blk + 208, scale(rng));
    } else {
      PutHalf(blk, scale(rng));
    }
  }
  return bytes;
}

std::vector<float> RandomActs(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.3f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = g(rng);
  for (int64_t i = 0; i < n; i += 61) x[i] *= -9.0f;  // negative outliers: max < 0
  return x;
}

// A vector path this CPU lacks is a skip of that (type, path) case, listed as
// skipped by ctest and scripts/test.sh, not a silent `continue`.
class KQuantPathTest : public ::testing::TestWithParam<std::tuple<GgmlType, KernelPath>> {};

// Every vector path (AVX2, AVX-512 with its register tiles of several rows x
// tokens) returns the scalar row-by-row bits, for odd and even row and token
// counts, tile remainders included; and a batch returns, per token, the bits
// of that token multiplied alone (batch invariance).
TEST_P(KQuantPathTest, VectorPathsEqualScalarBitForBit) {
  const auto [type, path] = GetParam();
  if (!KernelPathSupported(path)) GTEST_SKIP() << "CPU (or OS) without " << KernelPathName(path);
  const int64_t be = BlockElems(type);
  ThreadPool pool(2, "kq");
  uint32_t seed = 7;
  {
    for (const auto& [rows, cols, tokens] : std::vector<std::array<int64_t, 3>>{{1, be, 1},
                                                                                {9, 3 * be, 5},
                                                                                {65, 4 * be, 1},
                                                                                {33, 2 * be, 19},
                                                                                {3, be, 2},
                                                                                {5, 2 * be, 3},
                                                                                {7, 2 * be, 4},
                                                                                {13, be, 9},
                                                                                {6, 3 * be, 33},
                                                                                {17, 2 * be, 8},
                                                                                {2, 5 * be, 7},
                                                                                {48, 2 * be, 70}}) {
      std::vector<uint8_t> bytes = RandomBytes(type, rows, cols, seed++);
      const GgufTensor w = View(type, rows, cols, &bytes);
      const std::vector<float> x = RandomActs(tokens * cols, seed++);
      std::vector<float> ys(rows * tokens), yv(rows * tokens), y1(rows);
      MatMulWithPath(w, x.data(), tokens, ys.data(), nullptr, KernelPath::kScalar);
      MatMulWithPath(w, x.data(), tokens, yv.data(), &pool, path);
      for (int64_t i = 0; i < rows * tokens; ++i) {
        ASSERT_EQ(std::memcmp(&ys[i], &yv[i], 4), 0)
            << GgmlTypeName(type) << " " << KernelPathName(path) << " " << rows << "x" << cols
            << " T=" << tokens << " i=" << i << ": scalar " << ys[i] << " vector " << yv[i];
      }
      for (int64_t t = 0; t < tokens; ++t) {
        MatMulWithPath(w, x.data() + t * cols, 1, y1.data(), nullptr, path);
        ASSERT_EQ(std::memcmp(y1.data(), yv.data() + t * rows, 4 * rows), 0)
            << GgmlTypeName(type) << " " << KernelPathName(path) << " " << rows << "x" << cols
            << " T=" << tokens << ": token " << t << " alone differs from its batch";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    TypesAndPaths, KQuantPathTest,
    ::testing::Combine(::testing::Values(GgmlType::kQ4_K, GgmlType::kQ6_K, GgmlType::kQ5_0),
                       ::testing::Values(KernelPath::kAvx2, KernelPath::kAvx512)),
    [](const auto& info) {
      return std::string(GgmlTypeName(std::get<0>(info.param))) + "_" +
             std::string(KernelPathName(std::get<1>(info.param)));
    });

TEST(Q8K, QuantizesAsGgml) {
  // One block whose largest magnitude is negative: iscale = -127 / max > 0.
  std::vector<float> x(256);
  for (int j = 0; j < 256; ++j) x[j] = 0.01f * static_cast<float>(j % 37) - 0.1f;
  x[100] = -3.0f;
  std::vector<int8_t> q(256);
  float d = 0;
  std::vector<int16_t> bs(16);
  const kernels::Q8KActs a{q.data(), &d, bs.data(), 1};
  kernels::ScalarKQuantKernels().quantize_q8k(x.data(), 256, 0, 1, a);
  const float iscale = -127.0f / -3.0f;
  EXPECT_EQ(d, 1.0f / iscale);
  EXPECT_EQ(q[100], -127);
  for (int j = 0; j < 256; ++j) {
    ASSERT_EQ(q[j], static_cast<int>(std::nearbyint(iscale * x[j]))) << j;
  }
  for (int s = 0; s < 16; ++s) {
    int sum = 0;
    for (int j = 0; j < 16; ++j) sum += q[16 * s + j];
    EXPECT_EQ(bs[s], sum);
  }
}

// A Q4_K block by hand: sub-block s has scale s + 1 and min 2, element e of
// sub-block s (32 each) holds nibble e % 16; d = 1, dmin = 0.5. x is exactly
// representable in Q8_K (all values 1), so the product is exact.
TEST(Q4K, HandBlock) {
  std::vector<uint8_t> blk(144, 0);
  PutHalf(blk.data(), 1.0f);
  PutHalf(blk.data() + 2, 0.5f);
  uint8_t* sc = blk.data() + 4;
  // 6-bit packing: j < 4: sc[j] low 6 bits = scale, sc[j+4] low 6 bits = min;
  // j >= 4: low nibbles in sc[j+4], top 2 bits in sc[j-4] / sc[j] bits 6-7.
  for (int j = 0; j < 8; ++j) {
    const int scale = j + 1, mn = 2;
    if (j < 4) {
      sc[j] = static_cast<uint8_t>((sc[j] & 0xC0) | scale);
      sc[j + 4] = static_cast<uint8_t>((sc[j + 4] & 0xC0) | mn);
    } else {
      sc[j + 4] = static_cast<uint8_t>((scale & 0x0F) | ((mn & 0x0F) << 4));
      sc[j - 4] = static_cast<uint8_t>(sc[j - 4] | ((scale >> 4) << 6));
      sc[j] = static_cast<uint8_t>(sc[j] | ((mn >> 4) << 6));
    }
  }
  for (int j = 0; j < 4; ++j) {
    for (int l = 0; l < 32; ++l) {
      blk[16 + 32 * j + l] = static_cast<uint8_t>((l % 16) | ((l % 16) << 4));
    }
  }
  std::vector<float> x(256, 1.0f);
  double want = 0;
  for (int s = 0; s < 8; ++s) {
    for (int e = 0; e < 32; ++e) want += 1.0 * (s + 1) * (e % 16) - 0.5 * 2;
  }
  const GgufTensor w = View(GgmlType::kQ4_K, 1, 256, &blk);
  std::vector<float> deq(256);
  DequantizeRow(GgmlType::kQ4_K, blk.data(), deq.data(), 256);
  double deq_sum = 0;
  for (float v : deq) deq_sum += v;
  EXPECT_EQ(deq_sum, want);  // the dequantizer agrees with the layout above
  for (KernelPath path : {KernelPath::kScalar, KernelPath::kAvx2}) {
    if (!KernelPathSupported(path)) continue;
    float y = 0;
    MatMulWithPath(w, x.data(), 1, &y, nullptr, path);
    EXPECT_EQ(y, static_cast<float>(want)) << KernelPathName(path);
  }
}

// One vector table per test case: a table this CPU cannot run is a skip of
// that case (the AVX-512 half on an AVX2-only host), never dropped silently.
class KQuantTables : public ::testing::TestWithParam<KernelPath> {
 protected:
  std::vector<const kernels::KQuantKernels*> VectorTables() const {
    if (!KernelPathSupported(GetParam())) return {};
    return {GetParam() == KernelPath::kAvx512 ? &kernels::Avx512KQuantKernels()
                                              : &kernels::Avx2KQuantKernels()};
  }
};

// Every vector table against the scalar one, called directly (MatMul picks
// only the best table of the CPU).
TEST_P(KQuantTables, EveryVectorTableEqualsScalarForQ5_0) {
  const std::vector<const kernels::KQuantKernels*> tables = VectorTables();
  if (tables.empty()) GTEST_SKIP() << "CPU (or OS) without " << KernelPathName(GetParam());
  const int64_t rows = 13, cols = 32 * 11, tokens = 7;
  std::vector<uint8_t> bytes = RandomBytes(GgmlType::kQ5_0, rows, cols, 99);
  const std::vector<float> x = RandomActs(tokens * cols, 100);
  std::vector<int8_t> q(tokens * cols);
  std::vector<float> d(tokens * cols / 32), s(tokens * cols / 32);
  const kernels::QuantizedActs acts{q.data(), d.data(), s.data(), cols / 32};
  kernels::ScalarKernels().quantize(x.data(), cols, 0, tokens, acts);
  const int64_t rb = RowBytes(GgmlType::kQ5_0, cols).value();
  std::vector<float> want(rows * tokens);
  kernels::ScalarKQuantKernels().gemm_q5_0(bytes.data(), rb, 0, rows, acts, 0, tokens, want.data(),
                                           rows);
  for (const kernels::KQuantKernels* t : tables) {
    std::vector<float> got(rows * tokens);
    t->gemm_q5_0(bytes.data(), rb, 0, rows, acts, 0, tokens, got.data(), rows);
    EXPECT_EQ(std::memcmp(got.data(), want.data(), 4 * got.size()), 0) << t->name;
  }
}

// Q8_K activations of `tokens` x `cols` (a multiple of 256), ggml's quantizer.
struct Q8KBuffers {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> bsums;
  kernels::Q8KActs acts;
};
Q8KBuffers QuantizeQ8K(const std::vector<float>& x, int64_t tokens, int64_t cols) {
  Q8KBuffers b;
  const int64_t nb = cols / 256;
  b.q.resize(tokens * cols);
  b.d.resize(tokens * nb);
  b.bsums.resize(tokens * nb * 16);
  b.acts = {b.q.data(), b.d.data(), b.bsums.data(), nb};
  kernels::ScalarKQuantKernels().quantize_q8k(x.data(), cols, 0, tokens, b.acts);
  return b;
}

// The vector tables' Q8_K quantizer returns the scalar one's bytes, scales
// and block sums: random blocks, a zero block, a block whose largest
// magnitude occurs twice with opposite signs (the first one's sign counts),
// and values on the rounding ties of iscale * x.
TEST_P(KQuantTables, EveryVectorQuantizerEqualsScalarQ8K) {
  const std::vector<const kernels::KQuantKernels*> tables = VectorTables();
  if (tables.empty()) GTEST_SKIP() << "CPU (or OS) without " << KernelPathName(GetParam());
  const int64_t tokens = 5, cols = 256 * 3;
  std::vector<float> x = RandomActs(tokens * cols, 31);
  std::fill(x.begin() + cols, x.begin() + cols + 256, 0.0f);  // token 1, block 0
  x[2 * cols + 10] = 40.0f;  // token 2, block 0: a tie of the largest magnitudes
  x[2 * cols + 200] = -40.0f;
  for (int j = 0; j < 256; ++j) x[3 * cols + j] = 0.5f * static_cast<float>(j % 9) - 2.0f;
  x[3 * cols + 7] = -127.0f;  // iscale = 1: products on .5 ties
  const Q8KBuffers want = QuantizeQ8K(x, tokens, cols);
  for (const kernels::KQuantKernels* t : tables) {
    Q8KBuffers got;
    got.q.assign(want.q.size(), 1);
    got.d.assign(want.d.size(), 1.0f);
    got.bsums.assign(want.bsums.size(), 1);
    got.acts = {got.q.data(), got.d.data(), got.bsums.data(), cols / 256};
    t->quantize_q8k(x.data(), cols, 0, 2, got.acts);
    t->quantize_q8k(x.data(), cols, 2, tokens, got.acts);
    EXPECT_EQ(got.q, want.q) << t->name;
    EXPECT_EQ(std::memcmp(got.d.data(), want.d.data(), 4 * got.d.size()), 0) << t->name;
    EXPECT_EQ(got.bsums, want.bsums) << t->name;
  }
}

// The same for Q4_K and Q6_K, every table and the scalar one (the AVX-512
// table's batched tiles fall back to AVX2 for small calls; KVRELAY_KERNELS picks among these).
TEST_P(KQuantTables, EveryVectorTableEqualsScalarForQ4KAndQ6K) {
  const std::vector<const kernels::KQuantKernels*> tables = VectorTables();
  if (tables.empty()) GTEST_SKIP() << "CPU (or OS) without " << KernelPathName(GetParam());
  const int64_t rows = 11, cols = 256 * 5, tokens = 9;
  const std::vector<float> x = RandomActs(tokens * cols, 7);
  const Q8KBuffers a = QuantizeQ8K(x, tokens, cols);
  for (GgmlType type : {GgmlType::kQ4_K, GgmlType::kQ6_K}) {
    std::vector<uint8_t> bytes = RandomBytes(type, rows, cols, 8);
    const int64_t rb = RowBytes(type, cols).value();
    auto gemm = [&](const kernels::KQuantKernels& k) {
      return type == GgmlType::kQ4_K ? k.gemm_q4_k : k.gemm_q6_k;
    };
    std::vector<float> want(rows * tokens);
    gemm(kernels::ScalarKQuantKernels())(bytes.data(), rb, 0, rows, a.acts, 0, tokens, want.data(),
                                         rows);
    for (const kernels::KQuantKernels* t : tables) {
      std::vector<float> got(rows * tokens);
      // Odd token and row sub-ranges: the vector kernels' tiles of 4 tokens
      // end mid-tile.
      gemm (*t)(bytes.data(), rb, 0, 5, a.acts, 0, tokens, got.data(), rows);
      gemm (*t)(bytes.data(), rb, 5, rows, a.acts, 0, 3, got.data(), rows);
      gemm (*t)(bytes.data(), rb, 5, rows, a.acts, 3, tokens, got.data(), rows);
      EXPECT_EQ(std::memcmp(got.data(), want.data(), 4 * got.size()), 0)
          << GgmlTypeName(type) << " " << t->name;
    }
  }
}

// The float order of the K-quant dots is llama.cpp's for a prompt pass
// (kquant.h): written out here from the block layout, step by step, and
// compared bit for bit (the two orders it replaced differ on these data).
INSTANTIATE_TEST_SUITE_P(Paths, KQuantTables,
                         ::testing::Values(KernelPath::kAvx2, KernelPath::kAvx512),
                         [](const auto& info) { return std::string(KernelPathName(info.param)); });

TEST(KQuantOrder, Q4KAndQ6KSumAsGgmlsPromptPass) {
  const int64_t cols = 256 * 4, rows = 6, tokens = 3;
  const std::vector<float> x = RandomActs(tokens * cols, 21);
  const Q8KBuffers a = QuantizeQ8K(x, tokens, cols);
  const int64_t nb = cols / 256;
  auto half = [](const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return Fp16ToFp32(h);
  };
  {
    std::vector<uint8_t> w = RandomBytes(GgmlType::kQ4_K, rows, cols, 22);
    const int64_t rb = RowBytes(GgmlType::kQ4_K, cols).value();
    std::vector<float> got(rows * tokens);
    kernels::ScalarKQuantKernels().gemm_q4_k(w.data(), rb, 0, rows, a.acts, 0, tokens, got.data(),
                                             rows);
    int differs_from_one_accumulator = 0;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t t = 0; t < tokens; ++t) {
        float acc = 0, accm = 0, single = 0;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* blk = w.data() + r * rb + b * 144;
          uint8_t sc[8], mn[8];
          kernels::UnpackQ4KScales(blk + 4, sc, mn);
          const int8_t* xq = a.q.data() + (t * nb + b) * 256;
          const int16_t* bs = a.bsums.data() + (t * nb + b) * 16;
          const float dx = a.d[t * nb + b];
          int64_t block_i = 0, block_m = 0;
          for (int p = 0; p < 4; ++p) {
            int64_t i = 0, m = 0;
            for (int half_p = 0; half_p < 2; ++half_p) {
              const int s = 2 * p + half_p;
              int64_t dot = 0;
              for (int l = 0; l < 32; ++l) {
                const uint8_t byte = blk[16 + 32 * p + l];
                dot += (half_p == 0 ? (byte & 0x0F) : (byte >> 4)) * xq[32 * s + l];
              }
              i += sc[s] * dot;
              m += mn[s] * (bs[2 * s] + bs[2 * s + 1]);
            }
            acc = std::fma(static_cast<float>(i), half(blk) * dx, acc);
            accm = std::fma(static_cast<float>(m), half(blk + 2) * dx, accm);
            block_i += i;
            block_m += m;
          }
          // The order kvrelay used before: one accumulator, one fma per block each.
          single = std::fma(half(blk) * dx, static_cast<float>(block_i), single);
          single = std::fma(-(half(blk + 2) * dx), static_cast<float>(block_m), single);
        }
        const float want = acc - accm;
        EXPECT_EQ(std::memcmp(&got[t * rows + r], &want, 4), 0) << "Q4_K r " << r << " t " << t;
        differs_from_one_accumulator += std::memcmp(&single, &want, 4) != 0;
      }
    }
    EXPECT_GT(differs_from_one_accumulator, 0) << "the data do not tell the orders apart";
  }
  {
    std::vector<uint8_t> w = RandomBytes(GgmlType::kQ6_K, rows, cols, 23);
    const int64_t rb = RowBytes(GgmlType::kQ6_K, cols).value();
    std::vector<float> got(rows * tokens);
    kernels::ScalarKQuantKernels().gemm_q6_k(w.data(), rb, 0, rows, a.acts, 0, tokens, got.data(),
                                             rows);
    int differs_from_scale_first = 0;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t t = 0; t < tokens; ++t) {
        float acc = 0, scale_first = 0;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* blk = w.data() + r * rb + b * 210;
          // ggml's Q6_K layout: low nibbles in ql, two high bits in qh, 16 int8
          // scales (one per 16 elements), fp16 d last.
          int v[256];
          for (int n = 0; n < 2; ++n) {
            const uint8_t* ql = blk + 64 * n;
            const uint8_t* qh = blk + 128 + 32 * n;
            for (int l = 0; l < 32; ++l) {
              v[128 * n + l] = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
              v[128 * n + l + 32] = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
              v[128 * n + l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
              v[128 * n + l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
            }
          }
          const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
          const float d = half(blk + 208);
          const int8_t* xq = a.q.data() + (t * nb + b) * 256;
          int64_t sumi = 0;
          for (int j = 0; j < 256; ++j) sumi += int64_t{sc[j / 16]} * (v[j] - 32) * xq[j];
          const float dx = a.d[t * nb + b];
          acc = std::fma(d * static_cast<float>(sumi), dx, acc);
          scale_first = std::fma(d * dx, static_cast<float>(sumi), scale_first);
        }
        EXPECT_EQ(std::memcmp(&got[t * rows + r], &acc, 4), 0) << "Q6_K r " << r << " t " << t;
        differs_from_scale_first += std::memcmp(&scale_first, &acc, 4) != 0;
      }
    }
    EXPECT_GT(differs_from_scale_first, 0) << "the data do not tell the orders apart";
  }
}

}  // namespace
}  // namespace kvrelay::engine
