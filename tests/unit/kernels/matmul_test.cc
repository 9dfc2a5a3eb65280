// Every fast MatMul path against MatMulReference (fp32 dequantization by
// engine/gguf, double accumulation) on random weights of awkward shapes.
//
// Tolerance, derived: for int8-activation types the kernel quantizes x as
// llama.cpp does (quant_blocks.h): q_j = round(x_j * 127 / amax_b), scale
// d_b = fp16(d0_b) with d0_b = amax_b / 127, block sum s_b = fp16(d0_b sum q).
// So x^_j = d_b q_j is off by |x_j - x^_j| <= d0_b / 2 + 2^-11 d0_b |q_j|
// <= 0.5625 d0_b =: h_b, and a Q4 weight d u_j + m_b meets s_b instead of
// d_b sum q, which adds |m_b| |s_b - d_b sum q| <= |m_b| 2^-10 d0_b |sum q|:
//   |y - y_exact| <= sum_b (sum_{j in b} |w_j|) h_b + |m_b| 2^-10 (sum_j |x_j| + 16 d0_b)
//                  + gamma * sum_j |w_j| (|x_j| + h_b)              (float rounding)
// where gamma = (nb + 16) * 2^-23 bounds the float roundings of the nb block
// terms (scale product, fma, 8-lane and final sums), and the reference's own
// rounding to float adds 2^-24 |y|. Float-weight paths only have the rounding
// term with gamma = (cols + 16) * 2^-23. A wrong nibble order, scale or sign
// shows up as an error of order sum |w||x|, far above these bounds.
#include "engine/kernels/matmul.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "common/thread_pool.h"
#include "engine/gguf/ggml_type.h"
#include "engine/kernels/kernel_table.h"
#include "engine/kernels/ops.h"

namespace kvrelay::engine {
namespace {

struct Weights {
  std::vector<uint8_t> bytes;
  GgufTensor tensor;
};

void PutHalf(uint8_t* p, float v) {
  const uint16_t h = Fp32ToFp16(v);
  std::memcpy(p, &h, 2);
}

// Random encoded weights: random payload bytes, with every fp16 scale field
// overwritten by a sane value so no block holds inf/NaN.
Weights RandomWeights(GgmlType type, int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::uniform_real_distribution<float> scale(0.002f, 0.05f);
  const int64_t row_bytes = RowBytes(type, cols).value();
  Weights w;
  w.bytes.resize(rows * row_bytes);
  for (auto& b : w.bytes) b = static_cast<uint8_t>(rng());
  const int64_t nblocks = rows * cols / BlockElems(type);
  const int64_t bb = BlockBytes(type);
  for (int64_t i = 0; i < nblocks; ++i) {
    uint8_t* blk = w.bytes.data() + i * bb;
    switch (type) {
      case GgmlType::kF32:
        for (int64_t j = 0; j < cols * rows && i == 0; ++j) {
          const float v = uni(rng);
          std::memcpy(w.bytes.data() + 4 * j, &v, 4);
        }
        break;
      case GgmlType::kF16:
        PutHalf(blk, uni(rng));
        break;
      case GgmlType::kBF16: {
        const uint16_t h = Fp32ToBf16(uni(rng));
        std::memcpy(blk, &h, 2);
        break;
      }
      case GgmlType::kQ4_0:
      case GgmlType::kQ5_0:
      case GgmlType::kQ8_0:
        PutHalf(blk, scale(rng));
        break;
      case GgmlType::kQ4_1:
      case GgmlType::kQ5_1:
        PutHalf(blk, scale(rng));
        PutHalf(blk + 2, -8 * scale(rng));
        break;
      case GgmlType::kQ4_K:
        PutHalf(blk, scale(rng));
        PutHalf(blk + 2, scale(rng));
        break;
      case GgmlType::kQ6_K:
        PutHalf(blk + 208, scale(rng));
        break;
      default:
        ADD_FAILURE() << "no generator for " << GgmlTypeName(type);
    }
    if (type == GgmlType::kF32) break;
  }
  w.tensor.name = "w";
  w.tensor.type = type;
  w.tensor.dims = {cols, rows};
  w.tensor.data = w.bytes.data();
  w.tensor.nbytes = w.bytes.size();
  return w;
}

std::vector<float> RandomActs(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  // Non-zero mean: the block sums s (and so the Q4 min terms) are large.
  std::normal_distribution<float> g(0.4f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = g(rng);
  // A few outliers per row make amax (and so the quantization step) uneven.
  for (int64_t i = 0; i < n; i += 97) x[i] *= 8.0f;
  return x;
}

// The bound from the file comment, per output.
std::vector<double> Bounds(const Weights& w, const std::vector<float>& x, int64_t n_tokens) {
  const int64_t rows = w.tensor.Rows(), cols = w.tensor.Cols();
  const bool quant = MatMulQuantizesActivations(w.tensor.type);
  const int act_block = MatMulActivationBlock(w.tensor.type);
  const int64_t nb = (cols + 31) / 32;
  const double gamma =
      quant ? (nb + 16) * std::ldexp(1.0, -23) : (cols + 16) * std::ldexp(1.0, -23);
  std::vector<float> row(cols);
  std::vector<double> bound(rows * n_tokens);
  const int64_t row_bytes = RowBytes(w.tensor.type, cols).value();
  for (int64_t r = 0; r < rows; ++r) {
    DequantizeRow(w.tensor.type, w.tensor.data + r * row_bytes, row.data(), cols);
    for (int64_t t = 0; t < n_tokens; ++t) {
      const float* xt = x.data() + t * cols;
      double quant_err = 0, mag = 0;
      // Q4_K / Q6_K quantize x per 256 with a float scale: |x - x^| <= d0 / 2
      // (plus the float rounding of iscale * x and 1 / iscale, < 2^-20 d0).
      const int64_t ab = act_block == 0 ? 32 : act_block;
      for (int64_t b = 0; b * ab < cols; ++b) {
        double amax = 0, wsum = 0, wx = 0, xsum = 0;
        const int64_t end = std::min<int64_t>(cols, b * ab + ab);
        for (int64_t j = b * ab; j < end; ++j) amax = std::max(amax, std::fabs((double)xt[j]));
        const double d0 = amax / 127.0;
        const double half_step = act_block == 256 ? 0.500001 * d0 : (quant ? 0.5625 * d0 : 0.0);
        for (int64_t j = b * ab; j < end; ++j) {
          wsum += std::fabs(row[j]);
          wx += std::fabs(row[j]) * (std::fabs(xt[j]) + half_step);
          xsum += std::fabs(xt[j]);
        }
        quant_err += wsum * half_step;
        // The Q4 min term meets the fp16 block sum.
        const uint8_t* blk = w.tensor.data + r * row_bytes +
                             b * BlockBytes(w.tensor.type) * ab / BlockElems(w.tensor.type);
        double m = 0;
        if (w.tensor.type == GgmlType::kQ4_1) m = Fp16ToFp32(blk[2] | blk[3] << 8);
        if (w.tensor.type == GgmlType::kQ4_0) m = -8.0 * Fp16ToFp32(blk[0] | blk[1] << 8);
        quant_err += std::fabs(m) * std::ldexp(1.0, -10) * (xsum + 16 * d0);
        mag += wx;
      }
      bound[t * rows + r] = quant_err * (1 + 1e-6) + gamma * mag + 1e-30;
    }
  }
  return bound;
}

void ExpectWithinBound(const Weights& w, const std::vector<float>& x, int64_t n_tokens,
                       const std::vector<float>& got, const std::string& what) {
  const int64_t rows = w.tensor.Rows();
  std::vector<float> ref(rows * n_tokens);
  MatMulReference(w.tensor, x.data(), n_tokens, ref.data());
  const std::vector<double> bound = Bounds(w, x, n_tokens);
  int failures = 0;
  for (int64_t i = 0; i < rows * n_tokens && failures < 5; ++i) {
    const double allowed = bound[i] + std::ldexp(std::fabs(ref[i]), -24);
    if (!(std::fabs((double)got[i] - ref[i]) <= allowed)) {
      ++failures;
      ADD_FAILURE() << what << " token " << i / rows << " row " << i % rows << ": got " << got[i]
                    << " want " << ref[i] << " (allowed error " << allowed << ")";
    }
  }
}

std::vector<KernelPath> Paths() {
  std::vector<KernelPath> p = {KernelPath::kScalar};
  if (KernelPathSupported(KernelPath::kAvx2)) p.push_back(KernelPath::kAvx2);
  if (KernelPathSupported(KernelPath::kAvx512)) p.push_back(KernelPath::kAvx512);
  return p;
}

struct Shape {
  int64_t rows, cols, tokens;
};

class MatMulTypeTest : public ::testing::TestWithParam<GgmlType> {};

TEST_P(MatMulTypeTest, MatchesReferenceWithinDerivedBound) {
  const GgmlType type = GetParam();
  const int64_t blk = BlockElems(type) == 1 ? 32 : BlockElems(type);
  // Awkward shapes: rows 1, 7, 33, 577; cols a multiple of the block; tokens 1, 3, 17, 64.
  const std::vector<Shape> shapes = {{1, blk, 1},
                                     {7, 2 * blk, 3},
                                     {33, 3 * blk, 17},
                                     {577, blk * (blk == 32 ? 18 : 3), 1},
                                     {577, blk * (blk == 32 ? 18 : 3), 3},
                                     {33, blk * (blk == 32 ? 48 : 6), 64},
                                     {7, blk, 17}};
  ThreadPool pool(3, "kt");
  uint32_t seed = 1;
  for (const Shape& s : shapes) {
    const Weights w = RandomWeights(type, s.rows, s.cols, seed++);
    const std::vector<float> x = RandomActs(s.tokens * s.cols, seed++);
    for (KernelPath path : Paths()) {
      for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
        std::vector<float> y(s.rows * s.tokens, std::nanf(""));
        MatMulWithPath(w.tensor, x.data(), s.tokens, y.data(), p, path);
        ExpectWithinBound(w, x, s.tokens, y,
                          std::string(GgmlTypeName(type)) + " " +
                              std::string(KernelPathName(path)) + " " + std::to_string(s.rows) +
                              "x" + std::to_string(s.cols) + " T=" + std::to_string(s.tokens) +
                              (p ? " pool" : ""));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Types, MatMulTypeTest,
                         ::testing::Values(GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ8_0,
                                           GgmlType::kF32, GgmlType::kF16, GgmlType::kBF16,
                                           GgmlType::kQ5_0, GgmlType::kQ5_1, GgmlType::kQ4_K,
                                           GgmlType::kQ6_K),
                         [](const auto& info) { return std::string(GgmlTypeName(info.param)); });

// The block layout read from first principles (not through DequantizeRow):
// Q4_1 byte j holds element j (low nibble) and j + 16 (high nibble); value d*q + m.
TEST(MatMulLayout, Q4_1BlockByHand) {
  std::vector<uint8_t> blk(20);
  PutHalf(blk.data(), 0.5f);
  PutHalf(blk.data() + 2, -1.0f);
  for (int j = 0; j < 16; ++j) blk[4 + j] = static_cast<uint8_t>(j | (15 - j) << 4);
  GgufTensor t;
  t.type = GgmlType::kQ4_1;
  t.dims = {32, 1};
  t.data = blk.data();
  t.nbytes = blk.size();
  // x = 127/128 one-hot at element e: the product is 127/128 times the
  // element's value exactly (q = 127 and d = 2^-7, exact in fp16, s = 127/128).
  for (int e = 0; e < 32; ++e) {
    std::vector<float> x(32, 0.0f);
    x[e] = 127.0f / 128.0f;
    const float want =
        (e < 16 ? 0.5f * e - 1.0f : 0.5f * (15 - (e - 16)) - 1.0f) * (127.0f / 128.0f);
    for (KernelPath path : Paths()) {
      float y = 0;
      MatMulWithPath(t, x.data(), 1, &y, nullptr, path);
      EXPECT_NEAR(y, want, 1e-6) << "element " << e << " " << KernelPathName(path);
    }
  }
}

TEST(MatMulLayout, Q4_0AndQ8_0BlocksByHand) {
  std::vector<uint8_t> q4(18), q8(34);
  PutHalf(q4.data(), 0.25f);
  PutHalf(q8.data(), 0.125f);
  for (int j = 0; j < 16; ++j) q4[2 + j] = static_cast<uint8_t>((j & 15) | ((j + 3) & 15) << 4);
  for (int j = 0; j < 32; ++j) q8[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(j * 7 - 100));
  GgufTensor t4{"q4", GgmlType::kQ4_0, {32, 1}, 0, q4.data(), q4.size()};
  GgufTensor t8{"q8", GgmlType::kQ8_0, {32, 1}, 0, q8.data(), q8.size()};
  for (int e = 0; e < 32; ++e) {
    std::vector<float> x(32, 0.0f);
    x[e] = -2.0f * 127.0f / 128.0f;  // quantizes exactly: q = -127, d = 2^-6
    const int nib = e < 16 ? e : (e - 16 + 3) & 15;
    const float want4 = x[e] * 0.25f * (nib - 8);
    const float want8 = x[e] * 0.125f * (e * 7 - 100);
    for (KernelPath path : Paths()) {
      float y4 = 0, y8 = 0;
      MatMulWithPath(t4, x.data(), 1, &y4, nullptr, path);
      MatMulWithPath(t8, x.data(), 1, &y8, nullptr, path);
      EXPECT_NEAR(y4, want4, 1e-5) << "element " << e << " " << KernelPathName(path);
      EXPECT_NEAR(y8, want8, 1e-5) << "element " << e << " " << KernelPathName(path);
    }
  }
}

// The AVX2 activation quantizer is bit-identical to the scalar one (same
// float operations, round-half-to-even, fp16 roundings), including ties and
// zero blocks, and both follow ggml's quantize_row_q8_1 to the bit.
TEST(Quantize, Avx2MatchesScalarBitForBit) {
  if (!KernelPathSupported(KernelPath::kAvx2)) GTEST_SKIP() << "CPU without AVX2";
  const int64_t cols = 32 * 9, tokens = 5;
  std::vector<float> x = RandomActs(cols * tokens, 77);
  for (int j = 0; j < 32; ++j) x[32 + j] = 0.0f;             // all-zero block
  for (int j = 0; j < 32; ++j) x[64 + j] = (j - 16) * 0.5f;  // exact halves
  const int64_t nb = cols / 32;
  std::vector<int8_t> q1(cols * tokens), q2(cols * tokens);
  std::vector<float> d1(nb * tokens), d2(nb * tokens), s1(nb * tokens), s2(nb * tokens);
  kernels::QuantizedActs a1{q1.data(), d1.data(), s1.data(), nb};
  kernels::QuantizedActs a2{q2.data(), d2.data(), s2.data(), nb};
  kernels::ScalarKernels().quantize(x.data(), cols, 0, tokens, a1);
  kernels::Avx2Kernels().quantize(x.data(), cols, 0, tokens, a2);
  EXPECT_EQ(q1, q2);
  EXPECT_EQ(d1, d2);
  EXPECT_EQ(s1, s2);
  // And the quantization is ggml's, written out from its definition:
  // q = round-half-even(x * (127 / amax)), d = fp16(amax / 127),
  // s = fp16((amax / 127) * sum q) (fp16 by engine/gguf's converter).
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t b = 0; b < nb; ++b) {
      float amax = 0;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[t * cols + b * 32 + j]));
      const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
      int sum = 0;
      for (int j = 0; j < 32; ++j) {
        const int64_t i = t * cols + b * 32 + j;
        EXPECT_EQ(q1[i], static_cast<int>(std::nearbyint(x[i] * id))) << "element " << i;
        sum += q1[i];
      }
      const float d0 = amax / 127.0f;
      EXPECT_EQ(d1[t * nb + b], Fp16ToFp32(Fp32ToFp16(d0)));
      EXPECT_EQ(s1[t * nb + b], Fp16ToFp32(Fp32ToFp16(d0 * static_cast<float>(sum))));
    }
  }
  // Exact halves round to even: x = 0.5 * k with amax 8 gives x * 127 / 8.
  EXPECT_EQ(q1[64 + 0], -127);  // -8 -> -127
}

// The AVX-512 VNNI products give the AVX2 products' bits (same 8-lane float
// accumulators in the same order, same integer lanes), for every tile shape
// the driver uses: 1..4 rows x 1..8 tokens, odd token counts (a half-used
// token pair), single tokens (paired rows), odd row counts, rows longer than
// one scale-table pass, and a second token tile.
TEST(MatMulAvx512, BitIdenticalToAvx2) {
  if (!KernelPathSupported(KernelPath::kAvx512)) {
    GTEST_SKIP() << "CPU (or OS) without AVX-512 F/BW/VL/DQ/VNNI";
  }
  ThreadPool pool(2, "k512");
  uint32_t seed = 300;
  for (GgmlType type : {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ8_0}) {
    for (const Shape& s : std::vector<Shape>{{1, 32, 1},
                                             {3, 64, 1},
                                             {7, 32 * 18, 1},
                                             {5, 32 * 3, 2},
                                             {9, 32 * 5, 7},
                                             {13, 32 * 18, 9},
                                             {33, 32 * 48, 64},
                                             {577, 32 * 18, 17},
                                             // More blocks than one pass of
                                             // the pair tiles' scale table.
                                             {6, 32 * 70, 12},
                                             // Two token tiles (the second
                                             // starts at token 180).
                                             {5, 32 * 18, 201}}) {
      const Weights w = RandomWeights(type, s.rows, s.cols, seed++);
      const std::vector<float> x = RandomActs(s.tokens * s.cols, seed++);
      std::vector<float> y2(s.rows * s.tokens), y5(s.rows * s.tokens, std::nanf(""));
      MatMulWithPath(w.tensor, x.data(), s.tokens, y2.data(), nullptr, KernelPath::kAvx2);
      MatMulWithPath(w.tensor, x.data(), s.tokens, y5.data(), &pool, KernelPath::kAvx512);
      for (size_t i = 0; i < y2.size(); ++i) {
        ASSERT_EQ(y2[i], y5[i]) << GgmlTypeName(type) << " " << s.rows << "x" << s.cols
                                << " T=" << s.tokens << " element " << i;
      }
    }
  }
}

// The scalar fallback gives the AVX2 products' bits too (the same lanes and
// reduction, std::fma where AVX2 fuses), so KVRELAY_KERNELS=scalar computes
// what the vector paths and llama.cpp compute.
TEST(MatMulScalar, BitIdenticalToAvx2) {
  if (!KernelPathSupported(KernelPath::kAvx2)) GTEST_SKIP() << "CPU without AVX2";
  uint32_t seed = 700;
  for (GgmlType type : {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ8_0}) {
    for (const Shape& s : std::vector<Shape>{
             {1, 32, 1}, {7, 32 * 18, 1}, {9, 32 * 5, 7}, {13, 32 * 18, 9}, {33, 32 * 48, 20}}) {
      const Weights w = RandomWeights(type, s.rows, s.cols, seed++);
      const std::vector<float> x = RandomActs(s.tokens * s.cols, seed++);
      std::vector<float> y2(s.rows * s.tokens), ys(s.rows * s.tokens, std::nanf(""));
      MatMulWithPath(w.tensor, x.data(), s.tokens, y2.data(), nullptr, KernelPath::kAvx2);
      MatMulWithPath(w.tensor, x.data(), s.tokens, ys.data(), nullptr, KernelPath::kScalar);
      for (size_t i = 0; i < y2.size(); ++i) {
        ASSERT_EQ(std::memcmp(&y2[i], &ys[i], 4), 0)
            << GgmlTypeName(type) << " " << s.rows << "x" << s.cols << " T=" << s.tokens
            << " element " << i << ": avx2 " << y2[i] << " scalar " << ys[i];
      }
    }
  }
}

// Batch invariance: token t of a batched product equals the same token
// multiplied alone, bit for bit, on every path (a sequence's logits must not
// depend on what else is in the decode batch: docs/ENGINE_NUMERICS.md).
TEST(MatMulBatch, TokenOfBatchEqualsTokenAlone) {
  ThreadPool pool(2, "kbi");
  uint32_t seed = 900;
  for (GgmlType type : {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ8_0}) {
    const Weights w = RandomWeights(type, 37, 32 * 18, seed++);
    const int64_t cols = w.tensor.Cols(), rows = w.tensor.Rows();
    for (int64_t batch : {2, 3, 7, 64}) {
      const std::vector<float> x = RandomActs(batch * cols, seed++);
      for (KernelPath path : Paths()) {
        std::vector<float> all(rows * batch), one(rows);
        MatMulWithPath(w.tensor, x.data(), batch, all.data(), &pool, path);
        for (int64_t t = 0; t < batch; ++t) {
          MatMulWithPath(w.tensor, x.data() + t * cols, 1, one.data(), nullptr, path);
          for (int64_t r = 0; r < rows; ++r) {
            ASSERT_EQ(one[r], all[t * rows + r])
                << GgmlTypeName(type) << " " << KernelPathName(path) << " batch " << batch
                << " token " << t << " row " << r;
          }
        }
      }
    }
  }
}

// A row's result does not depend on how rows are split over threads or
// grouped into tiles: every output sees the same operations in the same order.
TEST(MatMulThreads, ResultIndependentOfThreadCount) {
  const Weights w = RandomWeights(GgmlType::kQ4_1, 577, 32 * 18, 5);
  const std::vector<float> x = RandomActs(17 * 32 * 18, 6);
  std::vector<float> y1(577 * 17), y2(577 * 17), y3(577 * 17);
  ThreadPool two(2, "kt2"), three(3, "kt3");
  MatMul(w.tensor, x.data(), 17, y1.data(), nullptr);
  MatMul(w.tensor, x.data(), 17, y2.data(), &two);
  MatMul(w.tensor, x.data(), 17, y3.data(), &three);
  EXPECT_EQ(y1, y2);
  EXPECT_EQ(y1, y3);
}

TEST(MatMulShared, EqualsSeparateProducts) {
  const int64_t cols = 32 * 18;
  const Weights q = RandomWeights(GgmlType::kQ4_1, 576, cols, 11);
  const Weights k = RandomWeights(GgmlType::kQ4_0, 192, cols, 12);
  const Weights v = RandomWeights(GgmlType::kQ8_0, 193, cols, 13);
  const Weights f = RandomWeights(GgmlType::kF16, 9, cols, 14);
  ThreadPool pool(2, "kt");
  for (int64_t tokens : {1, 3, 64}) {
    const std::vector<float> x = RandomActs(tokens * cols, 15);
    const GgufTensor* ws[] = {&q.tensor, &k.tensor, &v.tensor, &f.tensor};
    std::vector<std::vector<float>> got(4), want(4);
    float* ys[4];
    for (int i = 0; i < 4; ++i) {
      got[i].assign(ws[i]->Rows() * tokens, 0.0f);
      want[i].assign(ws[i]->Rows() * tokens, 1.0f);
      ys[i] = got[i].data();
      MatMul(*ws[i], x.data(), tokens, want[i].data(), &pool);
    }
    MatMulShared(ws, x.data(), tokens, ys, &pool);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(got[i], want[i]) << "tensor " << i << " T=" << tokens;
  }
}

TEST(GetRow, CopiesDequantizedRow) {
  const Weights w = RandomWeights(GgmlType::kQ8_0, 5, 64, 21);
  std::vector<float> row(64), want(64);
  GetRow(w.tensor, 3, row.data());
  DequantizeRow(GgmlType::kQ8_0, w.bytes.data() + 3 * 68, want.data(), 64);
  EXPECT_EQ(row, want);
}

}  // namespace
}  // namespace kvrelay::engine
