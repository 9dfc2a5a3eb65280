// The engine against llama.cpp on the real SmolLM2-135M Q4_1 model, using the
// logits and greedy continuations recorded in tests/data/llamacpp_reference.json
// (llama-cpp-python 0.3.36, CPU, f32 KV cache, no flash attention, all logits,
// rounded to 4 decimals).
//
// INTERIM bounds. engine/kernels now quantizes activations exactly as
// llama.cpp (Q8_1/Q8_0 with fp16 scale and sum) and provides llama.cpp's
// arithmetic for RMSNorm, SiLU, RoPE and attention, but the forward pass does
// not call those yet (the patch is /work/notes/accuracy_patch.diff, see
// docs/ENGINE_NUMERICS.md). With it the engine is bit-identical to llama.cpp
// (388/388, worst error 0.0000, greedy 12/12) and this test becomes the strict
// one in that patch (bound 1e-4). Without it, one-ulp differences in those ops
// flip int8 activation roundings and move logits by up to ~2 on this model:
// measured 384/388 top-1 (98.97%), worst |logit error| 1.29 (spread 1.85), and
// every top-1 disagreement is at a position where llama.cpp's top-2 margin is
// <= 0.30. kMaxLogitError = 2.0 and kFlipMargin = 0.5 keep the old, measured
// bounds until the patch lands.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/thread_pool.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/model.h"
#include "tests/unit/runtime/forward_test_util.h"

namespace kvrelay::engine {
namespace {

constexpr double kMaxLogitError = 2.0;
constexpr double kFlipMargin = 0.5;

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

TEST(LlamaCppConformance, LogitsTop1AndMaxError) {
  Fixture& f = Get();
  ASSERT_NE(f.model, nullptr);
  const int vocab = f.model->config().vocab;
  auto pool = testutil::MakePool(*f.model, 64, 16);
  ThreadPool threads(ThreadPool::DefaultThreads());
  std::vector<int32_t> probe_ids = f.ref["probe_ids"].get<std::vector<int32_t>>();
  int64_t positions = 0, top1_agree = 0;
  double worst = 0, worst_spread = 0;
  for (const auto& p : f.ref["logits"]) {
    std::vector<int32_t> ids = p["ids"].get<std::vector<int32_t>>();
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
      double dmin = 1e9, dmax = -1e9;
      for (const auto& pair : rec["top"]) {
        const double dd = row[pair[0].get<int32_t>()] - pair[1].get<double>();
        dmin = std::min(dmin, dd);
        dmax = std::max(dmax, dd);
        const double err = std::abs(dd);
        if (err > prompt_worst) worst_pos = pos;
        prompt_worst = std::max(prompt_worst, err);
      }
      for (size_t i = 0; i < probe_ids.size(); ++i) {
        const double dd = row[probe_ids[i]] - rec["probe"][i].get<double>();
        dmin = std::min(dmin, dd);
        dmax = std::max(dmax, dd);
        const double err = std::abs(dd);
        if (err > prompt_worst) worst_pos = pos;
        prompt_worst = std::max(prompt_worst, err);
      }
      worst_spread = std::max(worst_spread, dmax - dmin);
    }
    std::printf("prompt (%zu tokens): max |logit error| %.4f at position %zu\n", ids.size(),
                prompt_worst, worst_pos);
    worst = std::max(worst, prompt_worst);
  }
  std::printf("worst spread of logit errors at one position %.4f\n", worst_spread);
  std::printf("top-1 agreement %lld/%lld, worst |logit error| %.4f (bound %.2f)\n",
              static_cast<long long>(top1_agree), static_cast<long long>(positions), worst,
              kMaxLogitError);
  EXPECT_GE(static_cast<double>(top1_agree), 0.97 * positions);
  EXPECT_LE(worst, kMaxLogitError);
}

TEST(LlamaCppConformance, GreedyContinuations) {
  Fixture& f = Get();
  ASSERT_NE(f.model, nullptr);
  EngineOptions o;
  o.threads = ThreadPool::DefaultThreads();
  o.kv_capacity_bytes = 256ll << 20;
  auto engine = Engine::Create(o, f.model);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  int i = 0, checked = 0;
  for (const auto& g : f.ref["greedy"]) {
    RequestSpec spec;
    spec.id = "g" + std::to_string(i++);
    spec.prompt = g["prompt_ids"].get<std::vector<int32_t>>();
    std::vector<int32_t> want = g["generated"].get<std::vector<int32_t>>();
    spec.sampling.max_tokens = static_cast<int>(want.size());
    spec.sampling.ignore_eos = true;
    ASSERT_TRUE((*engine)->Submit(spec).ok());
  }
  std::map<std::string, std::vector<int32_t>> got;
  while ((*engine)->HasWork()) {
    auto ev = (*engine)->Step();
    ASSERT_TRUE(ev.ok());
    for (auto& e : *ev) got[e.id].push_back(e.token);
  }
  i = 0;
  for (const auto& g : f.ref["greedy"]) {
    const std::string id = "g" + std::to_string(i++);
    std::vector<int32_t> want = g["generated"].get<std::vector<int32_t>>();
    const double margin = g["min_top2_margin"].get<double>();
    size_t same = 0;
    while (same < want.size() && same < got[id].size() && got[id][same] == want[same]) ++same;
    std::printf("%s: min_top2_margin %.4f, first %zu/%zu tokens identical\n", id.c_str(), margin,
                same, want.size());
    if (margin > kFlipMargin) {
      EXPECT_EQ(got[id], want) << id;
      ++checked;
    }
  }
  std::printf("greedy prompts asserted identical: %d\n", checked);
}

}  // namespace
}  // namespace kvrelay::engine
