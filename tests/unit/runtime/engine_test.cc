// The request-level engine on a synthetic model: scheduling must never change
// what a request generates (batching, interleaving, chunked prefill, prefix
// reuse, preemption, disaggregated prefill/decode), and every block must come
// back to the pool on every path.
#include "engine/runtime/engine.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>

#include "engine/runtime/model.h"
#include "engine/tokenizer/tokenizer.h"
#include "tests/testing/synthetic_model.h"
#include "tests/unit/runtime/forward_test_util.h"

namespace kvrelay::engine {
namespace {

std::shared_ptr<const Model> SharedModel() {
  static std::shared_ptr<const Model> model = [] {
    testing::SyntheticModelOptions o;
    o.matrix_type = GgmlType::kQ8_0;
    auto path = testing::WriteTempSyntheticModel(o);
    EXPECT_TRUE(path.ok());
    auto m = Model::Load(*path);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    std::remove(path->c_str());
    return m.ok() ? std::shared_ptr<const Model>(std::move(m).value()) : nullptr;
  }();
  return model;
}

std::vector<int32_t> RandomPrompt(int n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(n);
  // Byte tokens only: never an end-of-generation control token.
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % 256);
  return t;
}

// Tests name requests by string; the engine numbers them (1, 2, ... in order
// of first use).
std::vector<std::string>& Names() {
  static std::vector<std::string> names;
  return names;
}
RequestId Id(const std::string& name) {
  auto& names = Names();
  auto it = std::find(names.begin(), names.end(), name);
  if (it == names.end()) it = names.insert(names.end(), name);
  return static_cast<RequestId>(it - names.begin()) + 1;
}
const std::string& Name(RequestId id) { return Names().at(id - 1); }

RequestSpec Spec(const std::string& id, std::vector<int32_t> prompt, int max_tokens) {
  RequestSpec s;
  s.id = Id(id);
  s.prompt = std::move(prompt);
  s.sampling.max_tokens = max_tokens;
  s.sampling.ignore_eos = true;  // fixed lengths make comparisons exact
  return s;
}

EngineOptions Options(int64_t blocks = 256, int block_tokens = 8) {
  EngineOptions o;
  o.block_tokens = block_tokens;
  o.threads = 2;
  o.max_step_tokens = 32;
  const KvLayout l = SharedModel()->MakeKvLayout(KvDtype::kF32, block_tokens);
  o.kv_capacity_bytes = blocks * l.BlockBytes();
  return o;
}

std::unique_ptr<Engine> MakeEngine(const EngineOptions& o) {
  auto e = Engine::Create(o, SharedModel());
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(e).value() : nullptr;
}

struct Outcome {
  std::vector<int32_t> tokens;
  FinishReason reason = FinishReason::kNone;
  int64_t cached = 0;
};

// Steps until idle, collecting tokens per request.
std::map<std::string, Outcome> RunToEnd(Engine& e, std::map<std::string, Outcome> acc = {}) {
  for (int guard = 0; e.HasWork() && guard < 10000; ++guard) {
    auto events = e.Step();
    EXPECT_TRUE(events.ok()) << events.status().ToString();
    if (!events.ok()) break;
    for (const TokenEvent& ev : *events) {
      Outcome& o = acc[Name(ev.id)];
      if (ev.token >= 0) o.tokens.push_back(ev.token);
      if (ev.finished) o.reason = ev.finish_reason;
      o.cached = ev.cached_prompt_tokens;
    }
  }
  return acc;
}

// Every block is unreferenced (free or only in the prefix cache).
void ExpectAllBlocksReturned(Engine& e) {
  KvBlockPool* p = e.pool();
  EXPECT_EQ(p->available_blocks(), p->total_blocks());
  for (BlockId b = 0; b < p->total_blocks(); ++b) ASSERT_EQ(p->refcount(b), 0) << "block " << b;
}

// Greedy decoding by hand with the forward pass (no scheduler): the yardstick.
std::vector<int32_t> GreedyByHand(std::vector<int32_t> prompt, int n) {
  const Model& m = *SharedModel();
  auto pool = testutil::MakePool(m, 64, 8);
  ThreadPool threads(1);
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    auto l = testutil::ChunkedLogits(m, pool.get(), &threads, prompt,
                                     static_cast<int64_t>(prompt.size()), 1);
    EXPECT_TRUE(l.ok());
    const int vocab = m.config().vocab;
    const int32_t t = testutil::ArgMax(l->data() + l->size() - vocab, vocab);
    out.push_back(t);
    prompt.push_back(t);
  }
  return out;
}

TEST(EngineTest, GreedyMatchesForwardByHand) {
  auto e = MakeEngine(Options());
  ASSERT_NE(e, nullptr);
  auto prompt = RandomPrompt(21, 1);
  ASSERT_TRUE(e->Submit(Spec("a", prompt, 12)).ok());
  auto r = RunToEnd(*e);
  EXPECT_EQ(r["a"].tokens, GreedyByHand(prompt, 12));
  EXPECT_EQ(r["a"].reason, FinishReason::kLength);
  ExpectAllBlocksReturned(*e);
}

TEST(EngineTest, InterleavedAndBatchedEqualAlone) {
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 8; ++i) prompts.push_back(RandomPrompt(5 + 7 * i, 50 + i));
  std::vector<std::vector<int32_t>> alone;
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto e = MakeEngine(Options());
    ASSERT_TRUE(e->Submit(Spec("r", prompts[i], 10)).ok());
    alone.push_back(RunToEnd(*e)["r"].tokens);
    ASSERT_EQ(alone.back().size(), 10u);
  }
  // All 8 together (chunked prefill of several prompts + batched decode).
  {
    auto e = MakeEngine(Options());
    for (size_t i = 0; i < prompts.size(); ++i) {
      ASSERT_TRUE(e->Submit(Spec("r" + std::to_string(i), prompts[i], 10)).ok());
    }
    auto r = RunToEnd(*e);
    for (size_t i = 0; i < prompts.size(); ++i) {
      EXPECT_EQ(r["r" + std::to_string(i)].tokens, alone[i]) << "prompt " << i;
    }
    ExpectAllBlocksReturned(*e);
  }
  // Interleaved: the second arrives while the first is decoding.
  {
    auto e = MakeEngine(Options());
    ASSERT_TRUE(e->Submit(Spec("x", prompts[2], 10)).ok());
    std::map<std::string, Outcome> acc;
    for (int i = 0; i < 4; ++i) {
      auto ev = e->Step();
      ASSERT_TRUE(ev.ok());
      for (auto& t : *ev) acc[Name(t.id)].tokens.push_back(t.token);
    }
    ASSERT_TRUE(e->Submit(Spec("y", prompts[5], 10)).ok());
    auto r = RunToEnd(*e, acc);
    EXPECT_EQ(r["x"].tokens, alone[2]);
    EXPECT_EQ(r["y"].tokens, alone[5]);
    ExpectAllBlocksReturned(*e);
  }
}

TEST(EngineTest, PrefixCacheHitEqualsScratch) {
  auto base = RandomPrompt(40, 3);
  auto second = base;
  for (int32_t t : RandomPrompt(9, 4)) second.push_back(t);
  auto fresh = MakeEngine(Options());
  ASSERT_TRUE(fresh->Submit(Spec("s", second, 8)).ok());
  auto want = RunToEnd(*fresh)["s"];
  EXPECT_EQ(want.cached, 0);

  auto e = MakeEngine(Options());
  ASSERT_TRUE(e->Submit(Spec("first", base, 4)).ok());
  RunToEnd(*e);
  ASSERT_TRUE(e->Submit(Spec("s", second, 8)).ok());
  auto got = RunToEnd(*e)["s"];
  EXPECT_EQ(got.cached, 40);  // 5 full blocks of 8
  EXPECT_EQ(got.tokens, want.tokens);
  // The whole prompt cached: the last token is recomputed into a copy of the
  // shared block (copy-on-write), and the result is still identical.
  ASSERT_TRUE(e->Submit(Spec("again", base, 4)).ok());
  ASSERT_TRUE(e->Submit(Spec("again2", base, 4)).ok());
  auto r = RunToEnd(*e);
  auto solo = MakeEngine(Options());
  ASSERT_TRUE(solo->Submit(Spec("b", base, 4)).ok());
  auto want_base = RunToEnd(*solo)["b"].tokens;
  EXPECT_EQ(r["again"].cached, 39);
  EXPECT_EQ(r["again"].tokens, want_base);
  EXPECT_EQ(r["again2"].tokens, want_base);
  // Another tenant never hits these blocks.
  auto other = Spec("t2", base, 2);
  other.tenant_salt = "tenant-2";
  ASSERT_TRUE(e->Submit(other).ok());
  EXPECT_EQ(RunToEnd(*e)["t2"].cached, 0);
  ExpectAllBlocksReturned(*e);
}

TEST(EngineTest, PreemptionByRecomputeKeepsOutputAndReturnsBlocks) {
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::vector<int32_t>> alone;
  for (int i = 0; i < 4; ++i) {
    prompts.push_back(RandomPrompt(20, 200 + i));
    auto e = MakeEngine(Options());
    ASSERT_TRUE(e->Submit(Spec("r", prompts[i], 20)).ok());
    alone.push_back(RunToEnd(*e)["r"].tokens);
  }
  // 12 blocks of 8 tokens: each request needs 5 at the end, 4 do not fit.
  auto e = MakeEngine(Options(12, 8));
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(e->Submit(Spec(std::to_string(i), prompts[i], 20)).ok());
  auto r = RunToEnd(*e);
  EXPECT_GT(e->stats().preemptions, 0);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(r[std::to_string(i)].tokens, alone[i]) << i;
    EXPECT_EQ(r[std::to_string(i)].reason, FinishReason::kLength);
  }
  ExpectAllBlocksReturned(*e);
}

TEST(EngineTest, CancelReturnsBlocks) {
  auto e = MakeEngine(Options());
  ASSERT_TRUE(e->Submit(Spec("a", RandomPrompt(30, 5), 50)).ok());
  ASSERT_TRUE(e->Submit(Spec("b", RandomPrompt(30, 6), 50)).ok());
  ASSERT_TRUE(e->Submit(Spec("queued", RandomPrompt(3, 7), 50)).ok());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(e->Step().ok());
  EXPECT_LT(e->pool()->available_blocks(), e->pool()->total_blocks());
  ASSERT_TRUE(e->Cancel(Id("a")).ok());
  ASSERT_TRUE(e->Cancel(Id("queued")).ok());
  EXPECT_EQ(e->Cancel(Id("nope")).code(), StatusCode::kNotFound);
  auto r = RunToEnd(*e);
  EXPECT_EQ(r["a"].reason, FinishReason::kCancelled);
  EXPECT_EQ(r["queued"].reason, FinishReason::kCancelled);
  EXPECT_EQ(r["b"].reason, FinishReason::kLength);
  ExpectAllBlocksReturned(*e);
}

// The prefill role's side of the connector, as a test sees it: counts the
// layers it is asked to save and keeps the finished request's prompt blocks.
class KeepingConnector : public KvConnector {
 public:
  void SaveLayer(int layer, const StepPlan& plan) override {
    EXPECT_EQ(layer, layers_saved % SharedModel()->config().n_layers);
    EXPECT_EQ(plan.seqs.size(), 1u);
    ++layers_saved;
  }
  bool RequestFinished(const TokenEvent& ev, BlockTable& blocks) override {
    EXPECT_EQ(ev.finish_reason, FinishReason::kPrefilled);
    kept = std::move(blocks);
    return true;
  }
  int layers_saved = 0;
  BlockTable kept;
};

// The decode role's side: records where the prompt's KV must go; the test
// fills those blocks and then reports the load done.
class LoadingConnector : public KvConnector {
 public:
  Status StartRemoteLoad(const RequestSpec& request, const KvCacheGroups& groups,
                         std::span<const std::vector<BlockId>> tables) override {
    EXPECT_EQ(groups.size(), 1);  // the default model: one group of every layer
    id = request.id;
    dst = tables[0];
    return Status::Ok();
  }
  std::vector<RemoteLoadDone> PollRemoteLoads() override {
    ++polls;
    std::vector<RemoteLoadDone> out;
    if (first_token >= 0) out.push_back({id, Status::Ok(), first_token});
    first_token = -1;
    return out;
  }
  void CancelRemoteLoad(RequestId r) override { cancelled.push_back(r); }
  RequestId id = 0;
  std::vector<BlockId> dst;
  int32_t first_token = -1;
  int polls = 0;
  std::vector<RequestId> cancelled;
};

TEST(EngineTest, DisaggregatedPrefillThenDecodeEqualsColocated) {
  auto prompt = RandomPrompt(27, 9);
  auto colo = MakeEngine(Options());
  ASSERT_TRUE(colo->Submit(Spec("c", prompt, 12)).ok());
  auto want = RunToEnd(*colo)["c"].tokens;

  auto prefill = MakeEngine(Options());
  auto decode = MakeEngine(Options());
  KeepingConnector saver;
  LoadingConnector loader;
  prefill->SetKvConnector(&saver);
  decode->SetKvConnector(&loader);
  auto spec = Spec("p", prompt, 12);
  spec.mode = RequestMode::kPrefillOnly;
  ASSERT_TRUE(prefill->Submit(spec).ok());
  auto pr = RunToEnd(*prefill)["p"];
  ASSERT_EQ(pr.tokens.size(), 1u);
  EXPECT_EQ(pr.reason, FinishReason::kPrefilled);
  EXPECT_EQ(pr.tokens[0], want[0]);
  EXPECT_GT(saver.layers_saved, 0);
  EXPECT_EQ(saver.layers_saved % SharedModel()->config().n_layers, 0);
  ASSERT_EQ(saver.kept.size(), 4);  // ceil(27 / 8)

  // The decode side reserves the prompt's blocks at Submit.
  auto remote = Spec("p", prompt, 12);
  remote.mode = RequestMode::kRemotePrompt;
  const int64_t before = decode->pool()->available_blocks();
  ASSERT_TRUE(decode->Submit(remote).ok());
  ASSERT_EQ(loader.dst.size(), 4u);
  EXPECT_EQ(decode->pool()->available_blocks(), before - 4);
  EXPECT_EQ(decode->loading(), 1);
  EXPECT_FALSE(decode->HasWork());
  // Nothing is decoded before the load reports done.
  ASSERT_TRUE(decode->Step().ok());
  EXPECT_EQ(decode->loading(), 1);
  // "Transfer": copy every layer of every block into the decode pool.
  for (int64_t i = 0; i < saver.kept.size(); ++i) {
    for (int l = 0; l < SharedModel()->config().n_layers; ++l) {
      auto src = prefill->pool()->LayerData(saver.kept[i], l);
      auto out = decode->pool()->LayerData(loader.dst[i], l);
      std::copy(src.begin(), src.end(), out.begin());
    }
  }
  saver.kept.Release();
  ExpectAllBlocksReturned(*prefill);
  loader.first_token = pr.tokens[0];
  auto admitted = decode->Step();  // admits the loaded request and decodes its next token
  ASSERT_TRUE(admitted.ok());
  EXPECT_EQ(decode->loading(), 0);
  std::vector<int32_t> got;
  for (const TokenEvent& ev : *admitted) {
    if (ev.token >= 0) got.push_back(ev.token);
  }
  auto rest = RunToEnd(*decode)["p"].tokens;
  got.insert(got.end(), rest.begin(), rest.end());
  got.insert(got.begin(), pr.tokens[0]);
  EXPECT_EQ(got, want);
  EXPECT_TRUE(loader.cancelled.empty());
  ExpectAllBlocksReturned(*decode);
}

// A worker re-runs a request under the same id (the coordinator moved it
// after a lost peer): the earlier attempt is cancelled and the new one
// submitted before the next step, which then reports both the stale cancel
// and, once its prompt is done, the new attempt's first token. The connector
// is handed the new attempt's own event (kPrefilled, its transfer id), not
// the stale cancel of the same id: fault_matrix stop_decode once failed
// requests with "the KV hand-over ... has no delivery" so.
TEST(EngineTest, ARerunUnderTheSameIdHandsTheConnectorItsOwnEvent) {
  struct Recorder : KvConnector {
    bool RequestFinished(const TokenEvent& ev, BlockTable& blocks) override {
      seen.push_back(ev);
      kept = std::move(blocks);
      return true;
    }
    std::vector<TokenEvent> seen;
    BlockTable kept;
  };
  auto e = MakeEngine(Options());
  Recorder rec;
  e->SetKvConnector(&rec);
  const auto prompt = RandomPrompt(20, 12);  // one step (max_step_tokens 32)
  auto first = Spec("rerun", prompt, 12);
  first.mode = RequestMode::kPrefillOnly;
  first.kv_transfer_id = 101;
  ASSERT_TRUE(e->Submit(first).ok());
  ASSERT_TRUE(e->Cancel(first.id).ok());
  auto again = first;
  again.kv_transfer_id = 102;
  ASSERT_TRUE(e->Submit(again).ok());
  auto events = e->Step();
  ASSERT_TRUE(events.ok()) << events.status().ToString();
  std::vector<FinishReason> reasons;
  for (const TokenEvent& ev : *events) {
    if (ev.id == first.id) reasons.push_back(ev.finish_reason);
  }
  // The step carries both: the stale cancel first, then the first token.
  ASSERT_EQ(reasons,
            (std::vector<FinishReason>{FinishReason::kCancelled, FinishReason::kPrefilled}));
  ASSERT_EQ(rec.seen.size(), 1u);
  EXPECT_EQ(rec.seen[0].finish_reason, FinishReason::kPrefilled);
  EXPECT_EQ(rec.seen[0].kv_transfer_id, 102u);
  EXPECT_GE(rec.seen[0].token, 0);
  EXPECT_EQ(rec.kept.size(), 3);  // ceil(20 / 8): the new attempt's prompt blocks
  rec.kept.Release();
  ExpectAllBlocksReturned(*e);
}

TEST(EngineTest, CancelWhileLoadingStopsTheLoadAndReturnsTheBlocks) {
  auto decode = MakeEngine(Options());
  LoadingConnector loader;
  decode->SetKvConnector(&loader);
  auto remote = Spec("l", RandomPrompt(20, 3), 4);
  remote.mode = RequestMode::kRemotePrompt;
  ASSERT_TRUE(decode->Submit(remote).ok());
  ASSERT_TRUE(decode->Cancel(Id("l")).ok());
  EXPECT_EQ(loader.cancelled, std::vector<RequestId>{Id("l")});
  auto r = RunToEnd(*decode);
  EXPECT_EQ(r["l"].reason, FinishReason::kCancelled);
  ExpectAllBlocksReturned(*decode);
  // Without a connector a remote prompt is refused, nothing held.
  auto bare = MakeEngine(Options());
  auto again = Spec("l2", RandomPrompt(20, 3), 4);
  again.mode = RequestMode::kRemotePrompt;
  EXPECT_EQ(bare->Submit(again).code(), StatusCode::kFailedPrecondition);
  ExpectAllBlocksReturned(*bare);
}

// A lower tier that holds every block of one earlier prompt (bytes copied
// from another engine's pool): admission loads them instead of computing.
class TierConnector : public KvConnector {
 public:
  void LoadPrefix(const RequestSpec&, const PrefixLookup& prefix, const KvCacheGroups& groups,
                  std::span<BlockTable> tables) override {
    EXPECT_EQ(groups.size(), 1);  // the default model: one group of every layer
    BlockTable& loaded = tables[0];
    for (const BlockHash& h : prefix.missing()) {
      auto it = store.find(h);
      if (it == store.end()) break;
      auto b = loaded.pool()->Allocate();
      if (!b.ok()) break;
      for (size_t l = 0; l < it->second.size(); ++l) {
        auto out = loaded.pool()->LayerData(*b, static_cast<int>(l));
        std::copy(it->second[l].begin(), it->second[l].end(), out.begin());
      }
      loaded.Adopt(*b);
      ++this->loaded;
    }
  }
  std::map<BlockHash, std::vector<std::vector<uint8_t>>> store;
  int64_t loaded = 0;
};

TEST(EngineTest, PrefixLoadedFromATierAtAdmissionEqualsComputed) {
  auto prompt = RandomPrompt(35, 21);
  auto first = MakeEngine(Options());
  ASSERT_TRUE(first->Submit(Spec("t1", prompt, 6)).ok());
  auto want = RunToEnd(*first)["t1"];
  // Copy the first engine's cached prompt blocks into the "tier".
  TierConnector tier;
  const auto hashes = HashPrefixBlocks(prompt, 8, SharedModel()->fingerprint(), "");
  ASSERT_EQ(hashes.size(), 4u);  // 35 / 8
  auto held = first->pool()->MatchPrefix(hashes);
  ASSERT_EQ(held.size(), 4u);
  for (size_t i = 0; i < held.size(); ++i) {
    auto& layers = tier.store[hashes[i]];
    for (int l = 0; l < SharedModel()->config().n_layers; ++l) {
      auto d = first->pool()->LayerData(held[i], l);
      layers.emplace_back(d.begin(), d.end());
    }
    first->pool()->Release(held[i]);
  }
  auto second = MakeEngine(Options());
  second->SetKvConnector(&tier);
  ASSERT_TRUE(second->Submit(Spec("t2", prompt, 6)).ok());
  auto got = RunToEnd(*second)["t2"];
  EXPECT_EQ(tier.loaded, 4);
  EXPECT_EQ(got.cached, 32);
  EXPECT_EQ(got.tokens, want.tokens);
  ExpectAllBlocksReturned(*second);
  // Loaded blocks were committed: a third request hits them in the pool.
  tier.loaded = 0;
  ASSERT_TRUE(second->Submit(Spec("t3", prompt, 6)).ok());
  EXPECT_EQ(RunToEnd(*second)["t3"].tokens, want.tokens);
  EXPECT_EQ(tier.loaded, 0);
}

TEST(EngineTest, SubmitRejectsBadRequests) {
  auto e = MakeEngine(Options(8, 8));
  EXPECT_EQ(e->Submit(Spec("e", {}, 4)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(e->Submit(Spec("v", {1, 99999}, 4)).code(), StatusCode::kInvalidArgument);
  auto bad = Spec("t", {1, 2}, 4);
  bad.sampling.top_p = 0;
  EXPECT_EQ(e->Submit(bad).code(), StatusCode::kInvalidArgument);
  // 8 blocks x 8 tokens = 64 positions: 60 + 10 can never fit.
  EXPECT_EQ(e->Submit(Spec("big", RandomPrompt(60, 1), 10)).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(e->Submit(Spec("ctx", RandomPrompt(600, 1), 1)).code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(e->Submit(Spec("ok", {1, 2}, 4)).ok());
  EXPECT_EQ(e->Submit(Spec("ok", {1, 2}, 4)).code(), StatusCode::kAlreadyExists);
  RunToEnd(*e);
  ExpectAllBlocksReturned(*e);
}

TEST(EngineTest, TopK1SamplingEqualsGreedyAndStopStringsCut) {
  auto e = MakeEngine(Options());
  auto prompt = RandomPrompt(10, 12);
  ASSERT_TRUE(e->Submit(Spec("g", prompt, 6)).ok());
  auto greedy = RunToEnd(*e)["g"].tokens;
  ASSERT_EQ(greedy.size(), 6u);
  auto spec = Spec("k1", prompt, 6);
  spec.sampling.temperature = 0.8f;
  spec.sampling.top_k = 1;
  spec.sampling.seed = 42;
  ASSERT_TRUE(e->Submit(spec).ok());
  EXPECT_EQ(RunToEnd(*e)["k1"].tokens, greedy);
  // A stop string equal to the text of greedy tokens 3..4 ends the request
  // at token 4 with reason stop, and the text before it is released.
  const Tokenizer* tok = SharedModel()->tokenizer();
  ASSERT_NE(tok, nullptr);
  const std::string stop = tok->TokenToPiece(greedy[2]) + tok->TokenToPiece(greedy[3]);
  auto stop_spec = Spec("s", prompt, 6);
  stop_spec.sampling.stop = {stop};
  ASSERT_TRUE(e->Submit(stop_spec).ok());
  std::string text;
  int n = 0;
  FinishReason reason = FinishReason::kNone;
  while (e->HasWork()) {
    auto ev = e->Step();
    ASSERT_TRUE(ev.ok());
    for (auto& t : *ev) {
      text += t.text;
      ++n;
      if (t.finished) reason = t.finish_reason;
    }
  }
  EXPECT_EQ(reason, FinishReason::kStop);
  // The stop text may already appear earlier in the output; then it stops sooner.
  const std::string full = tok->Decode(greedy);
  const size_t at = full.find(stop);
  ASSERT_NE(at, std::string::npos);
  EXPECT_EQ(text, full.substr(0, at));
  EXPECT_LE(n, 4);
  ExpectAllBlocksReturned(*e);
}

}  // namespace
}  // namespace kvrelay::engine
