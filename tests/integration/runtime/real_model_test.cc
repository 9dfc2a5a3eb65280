// The runtime on the real SmolLM2-135M Q4_1 model: cache equivalence under
// different prefill chunkings, and a sensible chat answer.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <functional>

#include "common/thread_pool.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/model.h"
#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/tokenizer.h"
#include "tests/unit/runtime/forward_test_util.h"

namespace kvrelay::engine {
namespace {

std::shared_ptr<const Model> RealModel() {
  static std::shared_ptr<const Model> model = [] {
    const char* s = std::getenv("KVRELAY_SOURCE_DIR");
    auto m = Model::Load(std::string(s ? s : ".") + "/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    return m.ok() ? std::shared_ptr<const Model>(std::move(m).value()) : nullptr;
  }();
  return model;
}

// Full causal pass == prefill k then decode one by one, k = 1, 4, all.
// The only difference between the paths is how many tokens one MatMul call
// sees; our kernels compute each output as one dot product per token, so the
// results may differ only by float32 summation order inside a kernel tile:
// we allow 1e-3 absolute on logits of magnitude <= ~30 (3e-5 relative, i.e.
// a few hundred ulps accumulated over 30 layers) and require the same argmax.
TEST(RealModel, CacheEquivalence) {
  auto m = RealModel();
  ASSERT_NE(m, nullptr);
  const int vocab = m->config().vocab;
  std::vector<int32_t> ids = m->tokenizer()->Encode(
      "The quick brown fox jumps over the lazy dog. Then it ran away into "
      "the forest, where nobody could find it again.",
      false, false);
  ASSERT_GT(ids.size(), 20u);
  auto pool = testutil::MakePool(*m, 16, 16);
  ThreadPool threads(ThreadPool::DefaultThreads());
  const int64_t n = static_cast<int64_t>(ids.size());
  auto full = testutil::ChunkedLogits(*m, pool.get(), &threads, ids, n, n);
  ASSERT_TRUE(full.ok()) << full.status().ToString();
  for (int64_t k : {int64_t{1}, int64_t{4}, n}) {
    auto part = testutil::ChunkedLogits(*m, pool.get(), &threads, ids, k, 1);
    ASSERT_TRUE(part.ok());
    double diff = 0;
    for (size_t i = 0; i < full->size(); ++i) {
      diff = std::max<double>(diff, std::abs((*part)[i] - (*full)[i]));
    }
    std::printf("k=%lld: max |logit diff| %.3g\n", static_cast<long long>(k), diff);
    EXPECT_LE(diff, 1e-3) << "k=" << k;
    for (int64_t p = 0; p < n; ++p) {
      EXPECT_EQ(testutil::ArgMax(part->data() + p * vocab, vocab),
                testutil::ArgMax(full->data() + p * vocab, vocab));
    }
  }
}

// Runs one chat turn greedily and returns (first-token top-2 margin, answer).
std::pair<double, std::string> Chat(const std::string& question, FinishReason* reason) {
  auto m = RealModel();
  auto text = m->chat_template()->Render({{"user", question}}, true);
  EXPECT_TRUE(text.ok());
  std::vector<int32_t> prompt = m->tokenizer()->Encode(*text, false, true);
  auto pool = testutil::MakePool(*m, 8, 16);
  ThreadPool threads(ThreadPool::DefaultThreads());
  auto logits = testutil::ChunkedLogits(*m, pool.get(), &threads, prompt,
                                        static_cast<int64_t>(prompt.size()), 1);
  EXPECT_TRUE(logits.ok());
  const int vocab = m->config().vocab;
  std::vector<float> last(logits->end() - vocab, logits->end());
  std::partial_sort(last.begin(), last.begin() + 2, last.end(), std::greater<float>());
  EngineOptions o;
  o.kv_capacity_bytes = 64ll << 20;
  auto e = Engine::Create(o, m);
  EXPECT_TRUE(e.ok());
  RequestSpec spec;
  spec.id = 1;
  spec.prompt = prompt;
  spec.sampling.max_tokens = 40;
  EXPECT_TRUE((*e)->Submit(spec).ok());
  std::string answer;
  while ((*e)->HasWork()) {
    auto ev = (*e)->Step();
    EXPECT_TRUE(ev.ok());
    for (auto& t : *ev) {
      answer += t.text;
      if (t.finished) *reason = t.finish_reason;
    }
  }
  std::printf("Q: %s\nA: %s\n(first-token top-2 margin %.3f)\n", question.c_str(), answer.c_str(),
              last[0] - last[1]);
  return {last[0] - last[1], answer};
}

// A factual chat turn ends with <|im_end|> and names the right answer.
TEST(RealModel, ChatAnswersCapitalOfJapan) {
  ASSERT_NE(RealModel(), nullptr);
  FinishReason reason = FinishReason::kNone;
  auto [margin, answer] = Chat("What is the capital of Japan?", &reason);
  EXPECT_NE(answer.find("Tokyo"), std::string::npos) << answer;
  EXPECT_EQ(reason, FinishReason::kStop);
}

// Known: this 135M Q4_1 model answers the France question with French
// landmarks instead of "Paris" under greedy decoding (see the printed margin).
// Recorded, not asserted on content; it must still produce text.
TEST(RealModel, ChatCapitalOfFranceProducesText) {
  ASSERT_NE(RealModel(), nullptr);
  FinishReason reason = FinishReason::kNone;
  auto [margin, answer] = Chat("What is the capital of France?", &reason);
  EXPECT_FALSE(answer.empty());
}

}  // namespace
}  // namespace kvrelay::engine
