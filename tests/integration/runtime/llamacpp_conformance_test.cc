// The engine against llama.cpp on the real SmolLM2-135M Q4_1 model, using the
// logits and greedy continuations recorded in tests/data/llamacpp_reference.json
// (llama-cpp-python 0.3.36, CPU AVX2 build, f32 KV cache, no flash attention,
// all logits, rounded to 4 decimals; tools/reference/record_llamacpp.py).
//
// Error bound (derived, then measured). The forward pass runs on
// engine/kernels' llama.cpp arithmetic (docs/ENGINE_NUMERICS.md): activations
// quantized to Q8_1/Q8_0 as ggml does (multiplier 127/amax, fp16 scale and
// block sum), integer block dots accumulated in ggml's lanes, RMSNorm, SiLU,
// RoPE, softmax and both attention products with ggml's operations in ggml's
// order. So every float the engine computes is the one llama.cpp computes, and
// the error of the weight format (Q4_1 weights: |w - w^| <= d/2 per element;
// Q8_1 activations: |x - x^| <= 0.562 amax/127 per element) is the SAME error
// in both, which cancels. What is left is the recording: each logit is stored
// rounded to 4 decimals, |x - round4(x)| <= 5e-5, so
//   kMaxLogitError = 1e-4   (2x the recording's rounding).
// Top-1 can only differ where llama.cpp's top-2 margin is below the error of
// a difference, 2 * kMaxLogitError = kFlipMargin.
// Measured (AVX2): top-1 388/388, worst |logit error| 5e-5 (the recording's
// rounding, i.e. bit-identical).
//
// Greedy. llama.cpp itself computes a one-token batch with another summation
// order in attention than a longer batch (its sgemm needs 2+ columns), so its
// ordinary decode steps are not its own prompt-pass results; on this model
// that alone changes 6 of the 12 greedy continuations (the reference keeps
// both). The engine uses the prompt-pass arithmetic for every row, so that
// prefill chunking, prefix restores and decode give identical results, and it
// is compared with "generated": llama.cpp greedy where every step evaluates
// the new token in a 2-token batch. Asserted identical for every prompt whose
// minimum top-2 margin exceeds kFlipMargin (11 of 12; one has a margin of
// 1e-4). Measured: 12/12 identical (64 tokens each).
//
// Why not a loose bound with "close" arithmetic: on this model one ulp of
// difference in a single op (an exp, the order of one sum) flips the rounding
// of some int8 activation and the logits move by 0.5 to 2 (measured in
// docs/ENGINE_NUMERICS.md); with such kernels the old test needed a bound of
// 2.0 and reached 380/388 top-1. The reference is llama.cpp's AVX2 build; the
// AVX-512 and scalar paths return the AVX2 path's bits (tests/unit/kernels), and
// forced onto them (KVRELAY_KERNELS=avx512|scalar) this test passes unchanged.
// On a CPU without AVX2 it is skipped only because the scalar path is slow
// (5 minutes for this test on the shared 2-core machine).
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "common/thread_pool.h"
#include "engine/kernels/matmul.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/model.h"
#include "tests/unit/runtime/forward_test_util.h"

namespace kvrelay::engine {
namespace {

constexpr double kMaxLogitError = 1e-4;
constexpr double kFlipMargin = 2 * kMaxLogitError;

std::string SourceDir() {
  const char* s = std::getenv("KVRELAY_SOURCE_DIR");
  return s ? s : ".";
}

struct Fixture {
  std::shared_ptr<const Model> model;
  nlohmann::json ref;
};

Fixture& Get() {
  static Fixture f = [] {
    Fixture x;
    auto m = Model::Load(SourceDir() + "/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    if (m.ok()) x.model = std::move(m).value();
    std::ifstream in(SourceDir() + "/tests/data/llamacpp_reference.json");
    EXPECT_TRUE(in.good());
    if (in.good()) x.ref = nlohmann::json::parse(in);
    return x;
  }();
  return f;
}

// Every kernel path gives the AVX2 path's bits (tests/unit/kernels), so a
// forced path (KVRELAY_KERNELS) compares too; see the header for the skip.
bool SkipWithoutAvx2() { return !KernelPathSupported(KernelPath::kAvx2); }

TEST(LlamaCppConformance, ReferenceSettings) {
  Fixture& f = Get();
  // The bound above assumes the f32-cache, non-flash-attention recording.
  EXPECT_EQ(f.ref["settings"]["kv_cache_type"], "f32");
  EXPECT_EQ(f.ref["settings"]["flash_attn"], false);
  EXPECT_EQ(f.ref["llama_cpp_python_version"], "0.3.36");
}

TEST(LlamaCppConformance, LogitsTop1AndMaxError) {
  if (SkipWithoutAvx2())
    GTEST_SKIP() << "CPU without AVX2: the (bit-identical) scalar path is too slow";
  Fixture& f = Get();
  ASSERT_NE(f.model, nullptr);
  const int vocab = f.model->config().vocab;
  auto pool = testutil::MakePool(*f.model, 64, 16);
  ThreadPool threads(ThreadPool::DefaultThreads());
  std::vector<int32_t> probe_ids = f.ref["probe_ids"].get<std::vector<int32_t>>();
  int64_t positions = 0, top1_agree = 0;
  double worst = 0;
  for (const auto& p : f.ref["logits"]) {
    std::vector<int32_t> ids = p["ids"].get<std::vector<int32_t>>();
    // The whole prompt in one batch, as llama.cpp evaluated it.
    auto logits = testutil::ChunkedLogits(*f.model, pool.get(), &threads, ids,
                                          static_cast<int64_t>(ids.size()), 1);
    ASSERT_TRUE(logits.ok()) << logits.status().ToString();
    double prompt_worst = 0;
    size_t worst_pos = 0;
    for (size_t pos = 0; pos < ids.size(); ++pos) {
      const float* row = logits->data() + pos * vocab;
      const auto& rec = p["positions"][pos];
      ++positions;
      const int32_t ref_top = rec["top"][0][0].get<int32_t>();
      if (testutil::ArgMax(row, vocab) == ref_top) {
        ++top1_agree;
      } else {
        const double margin = p["top2_margin"][pos].get<double>();
        std::printf("  top-1 differs at position %zu: llama.cpp top-2 margin %.4f\n", pos, margin);
        EXPECT_LE(margin, kFlipMargin) << "top-1 differs at a clear position " << pos;
      }
      auto check = [&](int32_t id, double want) {
        const double err = std::abs(row[id] - want);
        if (err > prompt_worst) worst_pos = pos;
        prompt_worst = std::max(prompt_worst, err);
      };
      for (const auto& pair : rec["top"]) check(pair[0].get<int32_t>(), pair[1].get<double>());
      for (size_t i = 0; i < probe_ids.size(); ++i) {
        check(probe_ids[i], rec["probe"][i].get<double>());
      }
    }
    std::printf("prompt (%zu tokens): max |logit error| %.6f at position %zu\n", ids.size(),
                prompt_worst, worst_pos);
    worst = std::max(worst, prompt_worst);
  }
  std::printf("top-1 agreement %lld/%lld, worst |logit error| %.6f (bound %.0e)\n",
              static_cast<long long>(top1_agree), static_cast<long long>(positions), worst,
              kMaxLogitError);
  EXPECT_GE(static_cast<double>(top1_agree), 0.99 * positions);  // the target
  EXPECT_LE(worst, kMaxLogitError);
}

TEST(LlamaCppConformance, GreedyContinuations) {
  if (SkipWithoutAvx2())
    GTEST_SKIP() << "CPU without AVX2: the (bit-identical) scalar path is too slow";
  Fixture& f = Get();
  ASSERT_NE(f.model, nullptr);
  EngineOptions o;
  o.threads = ThreadPool::DefaultThreads();
  o.kv_capacity_bytes = 256ll << 20;
  o.kv_dtype = KvDtype::kF32;  // the reference's cache type
  auto engine = Engine::Create(o, f.model);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  // All prompts at once: prefill in one batch each, then batched decode of one
  // token per sequence (the engine's arithmetic does not depend on batching).
  int i = 0;
  for (const auto& g : f.ref["greedy"]) {
    RequestSpec spec;
    spec.id = static_cast<RequestId>(++i);
    spec.prompt = g["prompt_ids"].get<std::vector<int32_t>>();
    std::vector<int32_t> want = g["generated"].get<std::vector<int32_t>>();
    spec.sampling.max_tokens = static_cast<int>(want.size());
    spec.sampling.ignore_eos = true;
    ASSERT_TRUE((*engine)->Submit(spec).ok());
  }
  std::map<RequestId, std::vector<int32_t>> got;
  while ((*engine)->HasWork()) {
    auto ev = (*engine)->Step();
    ASSERT_TRUE(ev.ok());
    for (auto& e : *ev) got[e.id].push_back(e.token);
  }
  i = 0;
  int checked = 0, eligible = 0;
  for (const auto& g : f.ref["greedy"]) {
    const RequestId id = static_cast<RequestId>(++i);
    std::vector<int32_t> want = g["generated"].get<std::vector<int32_t>>();
    const double margin = g["min_top2_margin"].get<double>();
    size_t same = 0;
    while (same < want.size() && same < got[id].size() && got[id][same] == want[same]) ++same;
    const auto one = g["generated_one_token_steps"].get<std::vector<int32_t>>();
    size_t same_one = 0;
    while (same_one < one.size() && same_one < got[id].size() &&
           got[id][same_one] == one[same_one]) {
      ++same_one;
    }
    std::printf(
        "%s: min_top2_margin %.4f, first %zu/%zu tokens identical (llama.cpp one-token steps: "
        "%zu)\n",
        ("g" + std::to_string(id - 1)).c_str(), margin, same, want.size(), same_one);
    if (margin > kFlipMargin) {
      ++eligible;
      EXPECT_EQ(got[id], want) << id;
      if (got[id] == want) ++checked;
    }
  }
  std::printf("greedy prompts asserted identical: %d of %d eligible\n", checked, eligible);
  EXPECT_GT(eligible, 0);
}

}  // namespace
}  // namespace kvrelay::engine
