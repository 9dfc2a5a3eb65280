// The runtime on the real SmolLM2-135M Q4_1 model: cache equivalence under
// different prefill chunkings, and a sensible chat answer.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <functional>

#include "common/thread_pool.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/kv_connector.h"
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

// The prefill side keeps a finished prompt's blocks and treats the pool as a
// layer stream sender does (PrefillRole::SaveLayer): at layer 0 of the step
// that ends the prompt it takes every layer's address (LayerAddress, which
// changes nothing), and at each layer's hook it seals that layer of every
// block (LayerData) before sending it. The decode side records where the
// prompt's KV must go and reports the load done when told.
class KeepBlocks : public KvConnector {
 public:
  void SaveLayer(int layer, const StepPlan& plan) override {
    if (pool == nullptr) return;
    for (const SeqStep& q : plan.seqs) {
      if (q.end() != prompt_tokens) continue;  // the prompt's last chunk sends
      for (BlockId b : q.blocks) {
        if (layer == 0) {
          for (int l = 0; l < pool->layout().layers; ++l)
            addresses += pool->LayerAddress(b, l) != nullptr;
        }
        (void)std::as_const(*pool).LayerData(b, layer);
      }
    }
  }
  bool RequestFinished(const TokenEvent&, BlockTable& blocks) override {
    kept = std::move(blocks);
    return true;
  }
  const KvBlockPool* pool = nullptr;
  int64_t prompt_tokens = 0;
  int64_t addresses = 0;
  BlockTable kept;
};
class LoadBlocks : public KvConnector {
 public:
  Status StartRemoteLoad(const RequestSpec& request, const KvCacheGroups&,
                         std::span<const std::vector<BlockId>> tables) override {
    id = request.id;
    dst = tables[0];
    return Status::Ok();
  }
  std::vector<RemoteLoadDone> PollRemoteLoads() override {
    std::vector<RemoteLoadDone> out;
    if (first_token >= 0) out.push_back({id, Status::Ok(), first_token});
    first_token = -1;
    return out;
  }
  RequestId id = 0;
  std::vector<BlockId> dst;
  int32_t first_token = -1;
};

std::vector<int32_t> Greedy(Engine& e, RequestSpec spec) {
  EXPECT_TRUE(e.Submit(spec).ok());
  std::vector<int32_t> out;
  for (int guard = 0; (e.HasWork() || e.loading() > 0) && guard < 10000; ++guard) {
    auto ev = e.Step();
    EXPECT_TRUE(ev.ok()) << ev.status().ToString();
    if (!ev.ok()) break;
    for (const TokenEvent& t : *ev) {
      if (t.token >= 0) out.push_back(t.token);
    }
  }
  return out;
}

// Quantized KV handed from a prefill engine to a decode engine (every
// layer's bytes of every prompt block, as the layer streams move them)
// decodes to the single engine's greedy tokens, on prompts whose last block
// is partly filled, computed in one step or in chunks that end mid-block.
// (A sender that quantized a KIVI layer before the step's attention read it,
// or a staged tail before the last chunk wrote it, made the decode side
// differ after a few tokens: the KIVI-4 hand-over bug of the cluster tests.)
TEST(RealModel, QuantizedHandOverEqualsOneEngine) {
  auto m = RealModel();
  ASSERT_NE(m, nullptr);
  for (KvDtype dtype : {KvDtype::kInt8, KvDtype::kKivi4}) {
    for (int step : {512, 6}) {
      for (const char* text :
           {"The capital of France is", "My favourite recipe for a rainy afternoon is",
            "Once upon a time, in a small village by the river, there lived"}) {
        const std::vector<int32_t> prompt = m->tokenizer()->Encode(text, true, false);
        EngineOptions o;
        o.kv_dtype = dtype;
        o.kv_capacity_bytes = 128ll << 20;
        o.threads = 1;
        o.max_step_tokens = step;
        RequestSpec spec;
        spec.id = 1;
        spec.prompt = prompt;
        spec.sampling.max_tokens = 16;
        spec.sampling.ignore_eos = true;
        auto one = Engine::Create(o, m);
        ASSERT_TRUE(one.ok());
        const std::vector<int32_t> want = Greedy(**one, spec);
        auto prefill = Engine::Create(o, m);
        auto decode = Engine::Create(o, m);
        ASSERT_TRUE(prefill.ok() && decode.ok());
        KeepBlocks keep;
        LoadBlocks load;
        (*prefill)->SetKvConnector(&keep);
        keep.pool = (*prefill)->pool();
        keep.prompt_tokens = static_cast<int64_t>(prompt.size());
        (*decode)->SetKvConnector(&load);
        RequestSpec p = spec;
        p.mode = RequestMode::kPrefillOnly;
        const std::vector<int32_t> first = Greedy(**prefill, p);
        ASSERT_EQ(first.size(), 1u);
        EXPECT_GT(keep.addresses, 0);
        RequestSpec d = spec;
        d.mode = RequestMode::kRemotePrompt;
        ASSERT_TRUE((*decode)->Submit(d).ok());
        ASSERT_EQ(static_cast<int64_t>(load.dst.size()), keep.kept.size());
        for (int64_t i = 0; i < keep.kept.size(); ++i) {
          for (int l = 0; l < m->config().n_layers; ++l) {
            auto src = (*prefill)->pool()->LayerData(keep.kept[i], l);
            auto dst = (*decode)->pool()->LayerData(load.dst[static_cast<size_t>(i)], l);
            std::copy(src.begin(), src.end(), dst.begin());
          }
        }
        keep.kept.Release();
        load.first_token = first[0];
        std::vector<int32_t> got = first;
        for (int guard = 0; ((*decode)->HasWork() || (*decode)->loading() > 0) && guard < 1000;
             ++guard) {
          auto ev = (*decode)->Step();
          ASSERT_TRUE(ev.ok());
          for (const TokenEvent& t : *ev) {
            if (t.token >= 0) got.push_back(t.token);
          }
        }
        EXPECT_EQ(got, want) << KvDtypeName(dtype) << ", " << prompt.size() << "-token prompt '"
                             << text << "' in steps of " << step;
      }
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
