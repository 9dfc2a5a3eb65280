// The CUDA backend on a real GPU (label gpu): skipped, naming why, when the
// machine has no CUDA device. Compares the device forward with the CPU
// ForwardPass on synthetic models, the host->device KV path (blocks written
// into the host pool, then decoded on the device), the engine end to end with
// --device cuda, and the device sampler.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>

#include "engine/cuda/cuda_sampler.h"
#include "engine/cuda/device.h"
#include "engine/runtime/compute_backend.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/sampler.h"
#include "tests/testing/synthetic_model.h"
#include "tests/unit/runtime/forward_test_util.h"

namespace kvrelay::engine {
namespace {

#define REQUIRE_GPU()                                                 \
  do {                                                                \
    std::string why;                                                  \
    Status s = cuda::UseDevice(0, &why);                              \
    if (!s.ok()) GTEST_SKIP() << "needs a CUDA GPU: " << s.message(); \
  } while (0)

std::shared_ptr<const Model> Synthetic(GgmlType matrix, GgmlType embd,
                                       const std::string& arch = "llama", int window = 0) {
  testing::SyntheticModelOptions o;
  o.arch = arch;
  o.sliding_window = window;
  o.layers = 3;
  o.d_model = 128;
  o.heads = 4;
  o.kv_heads = 2;
  o.ffn = 256;
  o.matrix_type = matrix;
  o.embedding_type = embd;
  auto path = testing::WriteTempSyntheticModel(o);
  EXPECT_TRUE(path.ok());
  ModelLoadOptions lo;
  lo.load_tokenizer = false;
  auto m = Model::Load(*path, lo);
  std::remove(path->c_str());
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return std::shared_ptr<const Model>(std::move(m).value());
}

std::vector<int32_t> Tokens(int n, int vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

// Logits of a prefill of `n` tokens then `steps` single-token steps.
std::vector<float> RunSteps(const Model& m, KvBlockPool* pool, ComputeBackend* be, int n,
                            int steps) {
  std::vector<int32_t> tokens = Tokens(n + steps, m.config().vocab, 3);
  std::vector<BlockId> blocks;
  for (int i = 0; i < (n + steps + 15) / 16; ++i) blocks.push_back(*pool->Allocate());
  std::vector<float> all;
  SeqStep s = MakeSeqStep(blocks, 0, std::span<const int32_t>(tokens.data(), n), LogitRows::kAll);
  ForwardOutput out;
  EXPECT_TRUE(be->Run(std::span<const SeqStep>(&s, 1), &out).ok());
  all = out.logits;
  for (int i = 0; i < steps; ++i) {
    SeqStep d = MakeSeqStep(blocks, n + i, std::span<const int32_t>(tokens.data() + n + i, 1),
                            LogitRows::kLast);
    EXPECT_TRUE(be->Run(std::span<const SeqStep>(&d, 1), &out).ok());
    all.insert(all.end(), out.logits.begin(), out.logits.end());
  }
  for (BlockId b : blocks) pool->Release(b);
  return all;
}

TEST(CudaBackendGpuTest, ForwardMatchesTheCpuForEveryWeightType) {
  REQUIRE_GPU();
  for (GgmlType t : {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ8_0, GgmlType::kF16}) {
    for (KvDtype kv : {KvDtype::kF32, KvDtype::kF16}) {
      auto m = Synthetic(t, GgmlType::kQ8_0, t == GgmlType::kQ8_0 ? "qwen2" : "llama");
      auto cpu_pool = testutil::MakePool(*m, 16, 16, kv),
           gpu_pool = testutil::MakePool(*m, 16, 16, kv);
      auto cpu = CreateComputeBackend({}, *m, cpu_pool.get(), nullptr);
      ComputeBackendOptions o;
      o.device = {DeviceKind::kCuda, 0};
      o.attention_split_tokens = 32;  // several splits even on short contexts
      auto gpu = CreateComputeBackend(o, *m, gpu_pool.get(), nullptr);
      ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
      // 40-token prefill (fp16 GEMM path), 24 decode steps (GEMV path).
      std::vector<float> a = RunSteps(*m, cpu_pool.get(), cpu->get(), 40, 24);
      std::vector<float> b = RunSteps(*m, gpu_pool.get(), gpu->get(), 40, 24);
      ASSERT_EQ(a.size(), b.size());
      double max_d = 0;
      for (size_t i = 0; i < a.size(); ++i) max_d = std::max(max_d, std::fabs(double(a[i]) - b[i]));
      EXPECT_LT(max_d, 0.25) << "type " << static_cast<int>(t) << " kv " << KvDtypeName(kv);
    }
  }
}

// Logits of `batch` sequences, each prefilled with 20 tokens on its own,
// then `steps` decode steps that advance all of them in one Run (the mmvq
// GEMV with 1..16 tokens per weight pass, in chunks of 16 above).
std::vector<float> RunBatchedDecode(const Model& m, KvBlockPool* pool, ComputeBackend* be,
                                    int batch, int steps) {
  const int prompt = 20, vocab = m.config().vocab;
  std::vector<std::vector<BlockId>> blocks(batch);
  std::vector<std::vector<int32_t>> tokens(batch);
  ForwardOutput out;
  for (int s = 0; s < batch; ++s) {
    for (int i = 0; i < (prompt + steps + 15) / 16; ++i) blocks[s].push_back(*pool->Allocate());
    tokens[s] = Tokens(prompt + steps, vocab, 100 + s);
    SeqStep p = MakeSeqStep(blocks[s], 0, std::span<const int32_t>(tokens[s].data(), prompt),
                            LogitRows::kNone);
    EXPECT_TRUE(be->Run(std::span<const SeqStep>(&p, 1), &out).ok());
  }
  std::vector<float> all;
  for (int i = 0; i < steps; ++i) {
    std::vector<SeqStep> seqs;
    for (int s = 0; s < batch; ++s) {
      seqs.push_back(MakeSeqStep(blocks[s], prompt + i,
                                 std::span<const int32_t>(tokens[s].data() + prompt + i, 1),
                                 LogitRows::kLast));
    }
    EXPECT_TRUE(be->Run(seqs, &out).ok());
    all.insert(all.end(), out.logits.begin(), out.logits.end());
  }
  for (auto& b : blocks) {
    for (BlockId id : b) pool->Release(id);
  }
  return all;
}

TEST(CudaBackendGpuTest, BatchedDecodeMatchesTheCpu) {
  REQUIRE_GPU();
  for (GgmlType t : {GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kQ8_0}) {
    // qwen2 has Q/K/V biases (stacked with the weights on the device).
    auto m = Synthetic(t, GgmlType::kQ8_0, t == GgmlType::kQ8_0 ? "qwen2" : "llama");
    for (int batch : {2, 3, 8, 11, 17}) {
      auto cpu_pool = testutil::MakePool(*m, 2 * batch, 16, KvDtype::kF16),
           gpu_pool = testutil::MakePool(*m, 2 * batch, 16, KvDtype::kF16);
      auto cpu = CreateComputeBackend({}, *m, cpu_pool.get(), nullptr);
      ComputeBackendOptions o;
      o.device = {DeviceKind::kCuda, 0};
      auto gpu = CreateComputeBackend(o, *m, gpu_pool.get(), nullptr);
      ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
      std::vector<float> a = RunBatchedDecode(*m, cpu_pool.get(), cpu->get(), batch, 4);
      std::vector<float> b = RunBatchedDecode(*m, gpu_pool.get(), gpu->get(), batch, 4);
      ASSERT_EQ(a.size(), b.size());
      double max_d = 0;
      for (size_t i = 0; i < a.size(); ++i) max_d = std::max(max_d, std::fabs(double(a[i]) - b[i]));
      EXPECT_LT(max_d, 0.25) << "type " << static_cast<int>(t) << " batch " << batch;
    }
  }
}

TEST(CudaBackendGpuTest, KvWrittenIntoTheHostPoolIsUploadedBeforeUse) {
  REQUIRE_GPU();
  auto m = Synthetic(GgmlType::kQ4_1, GgmlType::kQ8_0);
  // Prefill on the CPU, copy the blocks' bytes into the device engine's
  // pool as an importer would (its host-write hook tells the backend), decode
  // on the device.
  auto cpu_pool = testutil::MakePool(*m, 8);
  auto tracked = testutil::MakePool(*m, 8);
  ComputeBackendOptions o;
  o.device = {DeviceKind::kCuda, 0};
  auto gpu = CreateComputeBackend(o, *m, tracked.get(), nullptr);
  ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
  ComputeBackend* backend = gpu->get();
  tracked->SetHostWriteHook([backend](BlockId b) { backend->InvalidateBlock(b); });
  auto cpu = CreateComputeBackend({}, *m, cpu_pool.get(), nullptr);
  std::vector<int32_t> tokens = Tokens(40, m->config().vocab, 9);
  std::vector<BlockId> cb = {*cpu_pool->Allocate(), *cpu_pool->Allocate(), *cpu_pool->Allocate()};
  std::vector<BlockId> gb = {*tracked->Allocate(), *tracked->Allocate(), *tracked->Allocate()};
  SeqStep p = MakeSeqStep(cb, 0, std::span<const int32_t>(tokens.data(), 39), LogitRows::kNone);
  ForwardOutput out, want;
  ASSERT_TRUE((*cpu)->Run(std::span<const SeqStep>(&p, 1), &out).ok());
  for (size_t i = 0; i < cb.size(); ++i) {
    for (int l = 0; l < m->config().n_layers; ++l) {
      auto src = std::as_const(*cpu_pool).LayerData(cb[i], l);
      auto dst = tracked->LayerData(gb[i], l);
      std::copy(src.begin(), src.end(), dst.begin());
    }
  }
  SeqStep dc =
      MakeSeqStep(cb, 39, std::span<const int32_t>(tokens.data() + 39, 1), LogitRows::kLast);
  SeqStep dg =
      MakeSeqStep(gb, 39, std::span<const int32_t>(tokens.data() + 39, 1), LogitRows::kLast);
  ASSERT_TRUE((*cpu)->Run(std::span<const SeqStep>(&dc, 1), &want).ok());
  ASSERT_TRUE((*gpu)->Run(std::span<const SeqStep>(&dg, 1), &out).ok());
  double max_d = 0;
  for (size_t i = 0; i < want.logits.size(); ++i)
    max_d = std::max(max_d, std::fabs(double(want.logits[i]) - out.logits[i]));
  EXPECT_LT(max_d, 0.05);
  // And the device's new K/V came back into the host pool.
  std::vector<float> k(16 * m->config().head_dim), v(k.size()), k2(k.size()), v2(k.size());
  cpu_pool->ReadHead(cb[2], 1, 0, 8, k.data(), v.data());
  tracked->ReadHead(gb[2], 1, 0, 8, k2.data(), v2.data());
  for (int i = 7 * m->config().head_dim; i < 8 * m->config().head_dim; ++i)
    EXPECT_NEAR(k[i], k2[i], 1e-2);
}

TEST(CudaBackendGpuTest, EngineGeneratesOnTheDeviceLikeOnTheCpu) {
  REQUIRE_GPU();
  auto m = Synthetic(GgmlType::kQ8_0, GgmlType::kQ8_0);
  std::vector<std::vector<int32_t>> outs;
  for (const char* dev : {"cpu", "cuda"}) {
    EngineOptions eo;
    eo.device = dev;
    eo.threads = 2;
    auto e = Engine::Create(eo, m);
    ASSERT_TRUE(e.ok()) << dev << ": " << e.status().ToString();
    RequestSpec r;
    r.id = 1;
    r.prompt = Tokens(20, m->config().vocab, 4);
    r.sampling.max_tokens = 16;
    r.sampling.ignore_eos = true;
    ASSERT_TRUE((*e)->Submit(r).ok());
    std::vector<int32_t> toks;
    for (int i = 0; i < 100 && (*e)->HasWork(); ++i) {
      auto ev = (*e)->Step();
      ASSERT_TRUE(ev.ok()) << ev.status().ToString();
      for (const TokenEvent& t : *ev) {
        if (t.token >= 0) toks.push_back(t.token);
      }
    }
    outs.push_back(toks);
  }
  // Same int8 block dots on both (20-token prompt: the GEMV path), float sums
  // in another order, so a late near-tie may flip; the start must agree.
  ASSERT_EQ(outs[0].size(), 16u);
  ASSERT_EQ(outs[1].size(), 16u);
  EXPECT_EQ(std::vector<int32_t>(outs[0].begin(), outs[0].begin() + 4),
            std::vector<int32_t>(outs[1].begin(), outs[1].begin() + 4));
}

// Gemma 3 (QK norms, post-norms, GeGLU, embedding scale, per-layer windows
// and RoPE bases) through the same forward pass: 40 prefill tokens and 24
// decode steps with an 8-token window on every other layer.
TEST(CudaBackendGpuTest, Gemma3ForwardMatchesTheCpu) {
  REQUIRE_GPU();
  auto m = Synthetic(GgmlType::kQ8_0, GgmlType::kQ8_0, "gemma3", /*window=*/8);
  ASSERT_TRUE(m->config().gemma_norms);
  auto cpu_pool = testutil::MakePool(*m, 16, 16, KvDtype::kF16),
       gpu_pool = testutil::MakePool(*m, 16, 16, KvDtype::kF16);
  auto cpu = CreateComputeBackend({}, *m, cpu_pool.get(), nullptr);
  ComputeBackendOptions o;
  o.device = {DeviceKind::kCuda, 0};
  auto gpu = CreateComputeBackend(o, *m, gpu_pool.get(), nullptr);
  ASSERT_TRUE(gpu.ok()) << gpu.status().ToString();
  std::vector<float> a = RunSteps(*m, cpu_pool.get(), cpu->get(), 40, 24);
  std::vector<float> b = RunSteps(*m, gpu_pool.get(), gpu->get(), 40, 24);
  ASSERT_EQ(a.size(), b.size());
  double max_d = 0;
  for (size_t i = 0; i < a.size(); ++i) max_d = std::max(max_d, std::fabs(double(a[i]) - b[i]));
  EXPECT_LT(max_d, 0.25);
}

// The engine with split KV cache groups (a full-attention and a
// sliding-window group, the window group dropping blocks behind it) on the
// device: the same greedy start as on the CPU.
TEST(CudaBackendGpuTest, Gemma3EngineWithKvGroupsGeneratesLikeTheCpu) {
  REQUIRE_GPU();
  auto m = Synthetic(GgmlType::kQ8_0, GgmlType::kQ8_0, "gemma3", /*window=*/8);
  std::vector<std::vector<int32_t>> outs;
  for (const char* dev : {"cpu", "cuda"}) {
    EngineOptions eo;
    eo.device = dev;
    eo.threads = 2;
    eo.block_tokens = 4;  // blocks fall behind the 8-token window and are dropped
    auto e = Engine::Create(eo, m);
    ASSERT_TRUE(e.ok()) << dev << ": " << e.status().ToString();
    ASSERT_GT((*e)->kv_groups().size(), 1) << (*e)->kv_groups().DebugString();
    RequestSpec r;
    r.id = 1;
    r.prompt = Tokens(20, m->config().vocab, 4);
    r.sampling.max_tokens = 16;
    r.sampling.ignore_eos = true;
    ASSERT_TRUE((*e)->Submit(r).ok());
    std::vector<int32_t> toks;
    for (int i = 0; i < 100 && (*e)->HasWork(); ++i) {
      auto ev = (*e)->Step();
      ASSERT_TRUE(ev.ok()) << ev.status().ToString();
      for (const TokenEvent& t : *ev) {
        if (t.token >= 0) toks.push_back(t.token);
      }
    }
    outs.push_back(toks);
  }
  ASSERT_EQ(outs[0].size(), 16u);
  ASSERT_EQ(outs[1].size(), 16u);
  EXPECT_EQ(std::vector<int32_t>(outs[0].begin(), outs[0].begin() + 4),
            std::vector<int32_t>(outs[1].begin(), outs[1].begin() + 4));
}

TEST(CudaBackendGpuTest, DeviceSamplerPicksWhatTheCpuSamplerPicks) {
  REQUIRE_GPU();
  const int rows = 4, vocab = 1000;
  std::vector<float> logits(rows * vocab);
  std::mt19937_64 rng(1);
  std::normal_distribution<float> dist(0, 2);
  for (float& x : logits) x = dist(rng);
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, logits.size() * 4), cudaSuccess);
  cudaMemcpy(d, logits.data(), logits.size() * 4, cudaMemcpyHostToDevice);
  std::vector<cuda::DeviceSampleParams> params(rows);
  std::vector<int32_t> want(rows), got(rows);
  for (int r = 0; r < rows; ++r) {
    SamplingParams sp;
    sp.seed = 9 + r;
    if (r > 0) {
      sp.temperature = 0.9f;
      sp.top_k = 50 * r;
      sp.top_p = 0.8f;
    }
    Sampler s(sp);
    std::vector<float> row(logits.begin() + r * vocab, logits.begin() + (r + 1) * vocab);
    want[r] = s.Sample(row.data(), vocab, {}, 0);
    std::mt19937_64 u(sp.seed);
    auto dp = cuda::ToDeviceSampleParams(sp, double(u() >> 11) * (1.0 / 9007199254740992.0));
    ASSERT_TRUE(dp.ok()) << dp.status().ToString();
    params[r] = *dp;
  }
  cuda::CudaSampler sampler;
  ASSERT_TRUE(sampler.Sample(d, rows, vocab, params, got.data(), nullptr).ok());
  cudaFree(d);
  EXPECT_EQ(got, want);
}

}  // namespace
}  // namespace kvrelay::engine
