// Forward pass on small synthetic models: the paged, chunked, batched forward
// is checked against (a) itself under other chunkings and batchings and (b) a
// dense float64 reference written independently of the paged code path.
#include "engine/runtime/forward.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "engine/kernels/matmul.h"
#include "tests/testing/synthetic_model.h"
#include "tests/unit/runtime/forward_test_util.h"

namespace kvrelay::engine {
namespace {

using testutil::ChunkedLogits;
using testutil::MakePool;

std::shared_ptr<const Model> LoadSynthetic(const testing::SyntheticModelOptions& o) {
  auto path = testing::WriteTempSyntheticModel(o);
  EXPECT_TRUE(path.ok()) << path.status().ToString();
  ModelLoadOptions lo;
  lo.load_tokenizer = false;
  auto m = Model::Load(*path, lo);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  std::remove(path->c_str());
  return m.ok() ? std::shared_ptr<const Model>(std::move(m).value()) : nullptr;
}

std::vector<int32_t> RandomTokens(int n, int vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

// Dense reference: dequantized weights, float64 everywhere, contiguous KV,
// explicit softmax. Positions 0..n-1 in one pass. RoPE is the llama
// convention (adjacent pairs) or NeoX halves for qwen2 and gemma3. gemma3 as
// its model card describes it: embeddings times sqrt(d), RMSNorm of every Q
// and K head, per-layer window and RoPE base, norms of the attention and FFN
// outputs before the residual adds, exact tanh GELU (in double).
std::vector<double> ReferenceLogits(const Model& m, const std::vector<int32_t>& tokens) {
  const ModelConfig& c = m.config();
  const int n = static_cast<int>(tokens.size()), d = c.d_model, hd = c.head_dim;
  auto dense = [](const GgufTensor& t) {
    std::vector<float> w(t.Rows() * t.Cols());
    for (int64_t r = 0; r < t.Rows(); ++r) GetRow(t, r, w.data() + r * t.Cols());
    return w;
  };
  auto matvec = [](const std::vector<float>& w, int rows, int cols, const std::vector<double>& x) {
    std::vector<double> y(rows, 0.0);
    for (int r = 0; r < rows; ++r) {
      for (int k = 0; k < cols; ++k) y[r] += static_cast<double>(w[r * cols + k]) * x[k];
    }
    return y;
  };
  auto norm = [&](const std::vector<double>& x, const std::vector<float>& w) {
    double ss = 0;
    for (double v : x) ss += v * v;
    const double s = 1.0 / std::sqrt(ss / x.size() + c.rms_eps);
    std::vector<double> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * s * w[i];
    return y;
  };
  auto rope = [&](std::vector<double>& v, int heads, int pos, double base) {
    for (int h = 0; h < heads; ++h) {
      for (int i = 0; i < c.rope_dim / 2; ++i) {
        const double theta = pos * std::pow(base, -2.0 * i / c.rope_dim);
        const int a = c.rope_layout == RopeLayout::kNormal ? 2 * i : i;
        const int b = c.rope_layout == RopeLayout::kNormal ? 2 * i + 1 : i + c.rope_dim / 2;
        double& x0 = v[h * hd + a];
        double& x1 = v[h * hd + b];
        const double r0 = x0 * std::cos(theta) - x1 * std::sin(theta);
        const double r1 = x0 * std::sin(theta) + x1 * std::cos(theta);
        x0 = r0;
        x1 = r1;
      }
    }
  };
  std::vector<std::vector<double>> x(n, std::vector<double>(d));
  std::vector<float> row(d);
  for (int t = 0; t < n; ++t) {
    GetRow(m.token_embd(), tokens[t], row.data());
    for (int i = 0; i < d; ++i) x[t][i] = row[i] * (c.gemma_norms ? std::sqrt(double(d)) : 1.0);
  }
  auto head_norm = [&](std::vector<double>& v, int heads, const std::vector<float>& w) {
    for (int h = 0; h < heads; ++h) {
      std::vector<double> one(v.begin() + h * hd, v.begin() + (h + 1) * hd);
      one = norm(one, w);
      std::copy(one.begin(), one.end(), v.begin() + h * hd);
    }
  };
  const bool gemma = c.arch == "gemma3";
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& w = m.layers()[l];
    auto wq = dense(*w.wq), wk = dense(*w.wk), wv = dense(*w.wv), wo = dense(*w.wo);
    auto wg = dense(*w.ffn_gate), wu = dense(*w.ffn_up), wd = dense(*w.ffn_down);
    std::vector<std::vector<double>> q(n), k(n), v(n);
    for (int t = 0; t < n; ++t) {
      auto xn = norm(x[t], w.attn_norm_w);
      q[t] = matvec(wq, c.q_dim(), d, xn);
      k[t] = matvec(wk, c.kv_dim(), d, xn);
      v[t] = matvec(wv, c.kv_dim(), d, xn);
      for (int i = 0; i < static_cast<int>(w.bq.size()); ++i) q[t][i] += w.bq[i];
      for (int i = 0; i < static_cast<int>(w.bk.size()); ++i) k[t][i] += w.bk[i];
      for (int i = 0; i < static_cast<int>(w.bv.size()); ++i) v[t][i] += w.bv[i];
      if (gemma) {
        head_norm(q[t], c.n_heads, w.q_norm_w);
        head_norm(k[t], c.n_kv_heads, w.k_norm_w);
      }
      rope(q[t], c.n_heads, t, c.LayerRopeBase(l));
      rope(k[t], c.n_kv_heads, t, c.LayerRopeBase(l));
    }
    for (int t = 0; t < n; ++t) {
      std::vector<double> attn(c.q_dim(), 0.0);
      for (int h = 0; h < c.n_heads; ++h) {
        const int kh = h / (c.n_heads / c.n_kv_heads);
        std::vector<double> s(t + 1);
        double mx = -1e300;
        const int window = c.LayerWindow(l);
        const int j0 = window > 0 ? std::max(0, t - window + 1) : 0;
        for (int j = 0; j < j0; ++j) s[j] = -1e300;
        for (int j = j0; j <= t; ++j) {
          double dot = 0;
          for (int e = 0; e < hd; ++e) dot += q[t][h * hd + e] * k[j][kh * hd + e];
          s[j] = dot / std::sqrt(static_cast<double>(hd));
          mx = std::max(mx, s[j]);
        }
        double sum = 0;
        for (double& p : s) sum += (p = p == -1e300 ? 0.0 : std::exp(p - mx));
        for (int j = 0; j <= t; ++j) {
          for (int e = 0; e < hd; ++e) attn[h * hd + e] += s[j] / sum * v[j][kh * hd + e];
        }
      }
      auto o = matvec(wo, d, c.q_dim(), attn);
      if (gemma) o = norm(o, w.post_attn_norm_w);
      for (int i = 0; i < d; ++i) x[t][i] += o[i];
      auto xn = norm(x[t], w.ffn_norm_w);
      auto g = matvec(wg, c.ffn_dim, d, xn), u = matvec(wu, c.ffn_dim, d, xn);
      for (int i = 0; i < c.ffn_dim; ++i) {
        if (gemma) {
          const double gi = g[i];
          g[i] = 0.5 * gi * (1 + std::tanh(std::sqrt(2 / M_PI) * gi * (1 + 0.044715 * gi * gi))) *
                 u[i];
        } else {
          g[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
        }
      }
      auto dn = matvec(wd, d, c.ffn_dim, g);
      if (gemma) dn = norm(dn, w.post_ffn_norm_w);
      for (int i = 0; i < d; ++i) x[t][i] += dn[i];
    }
  }
  auto head = dense(m.lm_head());
  std::vector<double> logits;
  for (int t = 0; t < n; ++t) {
    auto y = matvec(head, c.vocab, d, norm(x[t], m.output_norm()));
    logits.insert(logits.end(), y.begin(), y.end());
  }
  return logits;
}

// Worst |a - b| over all entries, and the largest |b|.
std::pair<double, double> MaxDiff(const std::vector<float>& a, const std::vector<double>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(a[i] - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return {diff, scale};
}

class ForwardTest : public ::testing::TestWithParam<std::string> {};

// The float32 paged forward agrees with the float64 dense reference.
// Bound: every value is a chain of float32 dot products of length <= 128 and
// a few elementwise ops; each dot has relative error <= n*2^-24 ~ 8e-6 of the
// sum of |terms|, and 2 layers + head compound that to ~1e-4 of the logit
// scale. We allow 1e-3 * (1 + max|logit|), ten times that. gemma3 adds the
// fp16 GELU table (ggml's): input and output each rounded to fp16, relative
// error <= 2 * 2^-11 ~ 1e-3 per FFN activation, so ~1e-3 of the logit scale
// through 2 layers; its bound is 1e-2 * (1 + max|logit|).
TEST_P(ForwardTest, MatchesDenseFloat64Reference) {
  testing::SyntheticModelOptions o;
  o.arch = GetParam();
  if (o.arch == "gemma3") o.sliding_window = 9;  // layer 0 slides, layer 1 is global
  auto m = LoadSynthetic(o);
  ASSERT_NE(m, nullptr);
  auto pool = MakePool(*m, 64);
  ASSERT_NE(pool, nullptr);
  ThreadPool threads(2);
  auto tokens = RandomTokens(40, m->config().vocab, 7);
  auto got = ChunkedLogits(*m, pool.get(), &threads, tokens, 40, 1);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  auto want = ReferenceLogits(*m, tokens);
  ASSERT_EQ(got->size(), want.size());
  auto [diff, scale] = MaxDiff(*got, want);
  EXPECT_LE(diff, (o.arch == "gemma3" ? 1e-2 : 1e-3) * (1 + scale)) << "scale " << scale;
  EXPECT_GT(scale, 0.5);  // the logits are not trivially small
}

// Prefilling k tokens and then decoding one by one gives the logits of one
// full causal pass. Both paths do the same float32 operations per position
// except for how the matmul kernel groups tokens; the kernel's result per
// token does not depend on the batch (each output is one row-dot), so we
// allow only float32 rounding noise: 1e-5 * (1 + max|logit|).
TEST_P(ForwardTest, CacheEquivalence) {
  testing::SyntheticModelOptions o;
  o.arch = GetParam();
  if (o.arch == "gemma3") o.sliding_window = 9;  // layer 0 slides, layer 1 is global
  o.matrix_type = GgmlType::kQ4_1;
  o.embedding_type = GgmlType::kQ8_0;
  auto m = LoadSynthetic(o);
  ASSERT_NE(m, nullptr);
  auto pool = MakePool(*m, 64, 8);
  ASSERT_NE(pool, nullptr);
  const int64_t free0 = pool->free_blocks();
  ThreadPool threads(2);
  auto tokens = RandomTokens(37, m->config().vocab, 11);
  auto full = ChunkedLogits(*m, pool.get(), &threads, tokens, 37, 37);
  ASSERT_TRUE(full.ok()) << full.status().ToString();
  double scale = 0;
  for (float v : *full) scale = std::max<double>(scale, std::abs(v));
  for (int64_t k : {1, 4, 37}) {
    auto part = ChunkedLogits(*m, pool.get(), &threads, tokens, k, 1);
    ASSERT_TRUE(part.ok()) << part.status().ToString();
    ASSERT_EQ(part->size(), full->size());
    double diff = 0;
    for (size_t i = 0; i < full->size(); ++i)
      diff = std::max<double>(diff, std::abs((*part)[i] - (*full)[i]));
    EXPECT_LE(diff, 1e-5 * (1 + scale)) << "k=" << k;
  }
  // Odd chunk sizes crossing block boundaries.
  auto chunked = ChunkedLogits(*m, pool.get(), &threads, tokens, 5, 7);
  ASSERT_TRUE(chunked.ok());
  double diff = 0;
  for (size_t i = 0; i < full->size(); ++i)
    diff = std::max<double>(diff, std::abs((*chunked)[i] - (*full)[i]));
  EXPECT_LE(diff, 1e-5 * (1 + scale));
  EXPECT_EQ(pool->free_blocks(), free0);
}

// Several sequences in one step give the same logits as each alone.
TEST_P(ForwardTest, BatchEqualsAlone) {
  testing::SyntheticModelOptions o;
  o.arch = GetParam();
  if (o.arch == "gemma3") o.sliding_window = 9;  // layer 0 slides, layer 1 is global
  auto m = LoadSynthetic(o);
  ASSERT_NE(m, nullptr);
  auto pool = MakePool(*m, 64, 4);
  ThreadPool threads(2);
  const int vocab = m->config().vocab;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 5; ++i) prompts.push_back(RandomTokens(3 + 5 * i, vocab, 100 + i));
  // Alone: last-position logits of each prompt.
  std::vector<std::vector<float>> alone;
  for (const auto& p : prompts) {
    auto l = ChunkedLogits(*m, pool.get(), &threads, p, static_cast<int64_t>(p.size()), 1);
    ASSERT_TRUE(l.ok());
    alone.emplace_back(l->end() - vocab, l->end());
  }
  // Together in one step.
  std::vector<std::vector<BlockId>> tables(prompts.size());
  std::vector<SeqStep> seqs(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    for (size_t b = 0; b < (prompts[i].size() + 3) / 4; ++b) tables[i].push_back(*pool->Allocate());
    seqs[i].blocks.assign(tables[i].begin(), tables[i].end());
    seqs[i].tokens.assign(prompts[i].begin(), prompts[i].end());
  }
  ForwardPass fwd(*m, pool.get(), &threads);
  ForwardOutput out;
  ASSERT_TRUE(fwd.Run(seqs, &out).ok());
  ASSERT_EQ(out.row_begin.size(), prompts.size() + 1);
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_EQ(out.row_begin[i + 1] - out.row_begin[i], 1);
    const float* row = out.Row(out.row_begin[i], vocab);
    for (int v = 0; v < vocab; ++v) ASSERT_NEAR(row[v], alone[i][v], 1e-4) << "seq " << i;
  }
  for (auto& t : tables) {
    for (BlockId b : t) pool->Release(b);
  }
}

// A decoded (non-f32) pool goes through ReadHead instead of in-place slabs.
// f16 K/V carry a relative error <= 2^-11; through softmax and the remaining
// layers that moves logits by far less than 1e-2 * (1 + max|logit|), while a
// wrong row/block mapping in the decoded path would move them by O(1).
TEST_P(ForwardTest, DecodedPoolPathAgreesWithInPlaceF32) {
  testing::SyntheticModelOptions o;
  o.arch = GetParam();
  if (o.arch == "gemma3") o.sliding_window = 9;  // layer 0 slides, layer 1 is global
  auto m = LoadSynthetic(o);
  ASSERT_NE(m, nullptr);
  ThreadPool threads(2);
  auto tokens = RandomTokens(29, m->config().vocab, 5);
  auto f32 = MakePool(*m, 16, 8, KvDtype::kF32);
  auto f16 = MakePool(*m, 16, 8, KvDtype::kF16);
  ASSERT_NE(f16, nullptr);
  auto a = ChunkedLogits(*m, f32.get(), &threads, tokens, 6, 5);
  auto b = ChunkedLogits(*m, f16.get(), &threads, tokens, 6, 5);
  ASSERT_TRUE(a.ok() && b.ok());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a->size(); ++i) {
    diff = std::max<double>(diff, std::abs((*a)[i] - (*b)[i]));
    scale = std::max<double>(scale, std::abs((*a)[i]));
  }
  EXPECT_LE(diff, 1e-2 * (1 + scale));
  EXPECT_GT(diff, 0.0);  // the f16 path really was taken
}

// Decode rows over a long context take the split attention (position chunks,
// then head slices, over the pool's threads: forward.cc) where the kernels
// support it; prefill rows take the whole-row path. Both give the same bits,
// so decoding token by token reproduces a full prefill's logits exactly, and
// so does a different thread count.
TEST_P(ForwardTest, LongContextDecodeEqualsPrefillBitForBit) {
  testing::SyntheticModelOptions o;
  o.arch = GetParam();
  if (o.arch == "gemma3") o.sliding_window = 9;  // layer 0 slides, layer 1 is global
  o.d_model = 128;
  o.heads = 2;
  o.kv_heads = 1;  // head_dim 64: the split path's shape
  o.context_length = 1024;
  // Float weights: no int8 activation rounding that could hide a one-ulp
  // difference in an attention output.
  auto m = LoadSynthetic(o);
  ASSERT_NE(m, nullptr);
  const int vocab = m->config().vocab;
  auto tokens = RandomTokens(620, vocab, 21);
  ThreadPool two(2), three(3);
  // In-place f32 slabs and a decoded (f16) pool: both feed the split path.
  for (KvDtype dtype : {KvDtype::kF32, KvDtype::kF16}) {
    auto pool = MakePool(*m, 48, 16, dtype);
    ASSERT_NE(pool, nullptr);
    auto full = ChunkedLogits(*m, pool.get(), &two, tokens, 620, 1);
    ASSERT_TRUE(full.ok()) << full.status().ToString();
    // Positions 600..619 decoded one at a time (600+ keys: split when supported).
    for (ThreadPool* threads : {&two, &three}) {
      auto decoded = ChunkedLogits(*m, pool.get(), threads, tokens, 600, 1);
      ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
      ASSERT_EQ(decoded->size(), full->size());
      for (size_t i = 600 * static_cast<size_t>(vocab); i < full->size(); ++i) {
        ASSERT_EQ((*decoded)[i], (*full)[i])
            << "position " << i / vocab << " logit " << i % vocab << " threads "
            << threads->num_threads() << (dtype == KvDtype::kF16 ? " f16" : " f32");
      }
    }
  }
}

// Tiled attention (the query heads of one KV head and a run of new tokens
// walking each K/V chunk together, the default) against row by row: the same
// bits, for f32 (in place) and f16 (decoded) pools, GQA ratios 1 and 3,
// prompts that are not a multiple of the tile, chunks that start mid-block
// (cache_len > 0) and gemma3's sliding window.
TEST_P(ForwardTest, TiledAttentionEqualsRowByRowBitForBit) {
  for (int heads : {3, 1}) {
    testing::SyntheticModelOptions o;
    o.arch = GetParam();
    if (o.arch == "gemma3") o.sliding_window = 37;  // layer 0 slides, layer 1 is global
    o.d_model = 64 * heads;
    o.heads = heads;
    o.kv_heads = 1;  // head_dim 64; GQA ratio `heads`
    o.context_length = 512;
    auto m = LoadSynthetic(o);
    ASSERT_NE(m, nullptr);
    auto tokens = RandomTokens(301, m->config().vocab, 33);
    ThreadPool threads(2);
    for (KvDtype dtype : {KvDtype::kF32, KvDtype::kF16}) {
      auto pool = MakePool(*m, 24, 16, dtype);
      ASSERT_NE(pool, nullptr);
      // A 203-token first chunk, then chunks of 49 (rows with cache_len > 0).
      auto tiled = ChunkedLogits(*m, pool.get(), &threads, tokens, 203, 49, true);
      auto rows = ChunkedLogits(*m, pool.get(), &threads, tokens, 203, 49, false);
      ASSERT_TRUE(tiled.ok() && rows.ok());
      ASSERT_EQ(tiled->size(), rows->size());
      for (size_t i = 0; i < rows->size(); ++i) {
        ASSERT_EQ((*tiled)[i], (*rows)[i])
            << "logit " << i << " heads " << heads << (dtype == KvDtype::kF16 ? " f16" : " f32");
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Archs, ForwardTest, ::testing::Values("llama", "qwen2", "gemma3"));

TEST(ForwardErrors, RejectsBadInput) {
  auto m = LoadSynthetic({});
  ASSERT_NE(m, nullptr);
  auto pool = MakePool(*m, 8, 4);
  ForwardPass fwd(*m, pool.get(), nullptr);
  BlockId b = *pool->Allocate();
  std::vector<BlockId> table{b};
  std::vector<int32_t> bad_token{1, 100000};
  SeqStep s;
  s.blocks.assign(table.begin(), table.end());
  s.tokens.assign(bad_token.begin(), bad_token.end());
  ForwardOutput out;
  Status st = fwd.Run(std::span<const SeqStep>(&s, 1), &out);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("100000"), std::string::npos) << st.message();
  std::vector<int32_t> too_long(5, 1);  // 5 positions, one block of 4
  s.tokens.assign(too_long.begin(), too_long.end());
  st = fwd.Run(std::span<const SeqStep>(&s, 1), &out);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  pool->Release(b);
}

}  // namespace
}  // namespace kvrelay::engine
