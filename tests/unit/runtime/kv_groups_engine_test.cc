// The engine with several KV cache groups (engine/kv_cache/kv_groups.h) on a
// synthetic gemma3-shaped model (6 layers, every 3rd global, window 12,
// blocks of 4 tokens: 1 full-attention group and 2 sliding-window groups of
// 2 layers each). Splitting must never change a token (batching, chunked
// prefill, prefix hits, preemption), a sliding-window group must hold at
// most ceil(window / B) + 1 blocks per sequence between steps, and every
// block comes back.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>

#include "engine/runtime/engine.h"
#include "engine/runtime/model.h"
#include "tests/testing/synthetic_model.h"

namespace kvrelay::engine {
namespace {

constexpr int kWindow = 12;
constexpr int kBlock = 4;
constexpr int64_t kWindowBlocks = (kWindow + kBlock - 1) / kBlock + 1;  // 4

std::shared_ptr<const Model> MixedModel() {
  static std::shared_ptr<const Model> model = [] {
    testing::SyntheticModelOptions o;
    o.arch = "gemma3";
    o.layers = 6;
    o.sliding_window = kWindow;
    o.sliding_window_pattern = 3;  // layers 2 and 5 global
    o.kv_heads = 1;
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
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % 256);  // byte tokens: never EOS
  return t;
}

RequestSpec Spec(RequestId id, std::vector<int32_t> prompt, int max_tokens) {
  RequestSpec s;
  s.id = id;
  s.prompt = std::move(prompt);
  s.sampling.max_tokens = max_tokens;
  s.sampling.ignore_eos = true;
  return s;
}

// `blocks` pool blocks of the one-group layout's size (so both modes get the
// same bytes).
std::unique_ptr<Engine> MakeEngine(bool split, int64_t blocks = 512, int step = 8,
                                   KvDtype dtype = KvDtype::kF32) {
  EngineOptions o;
  o.kv_dtype = dtype;
  o.block_tokens = kBlock;
  o.threads = 2;
  o.max_step_tokens = step;
  o.split_kv_groups = split;
  o.kv_capacity_bytes = blocks * MixedModel()->MakeKvLayout(KvDtype::kF32, kBlock).BlockBytes();
  auto e = Engine::Create(o, MixedModel());
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(e).value() : nullptr;
}

struct Outcome {
  std::map<RequestId, std::vector<int32_t>> tokens;
  std::map<RequestId, int64_t> cached;
  int64_t most_window_held = 0;  // over sliding groups, decoding sequences, between steps
};

// Steps to the end; after every step checks each live request's blocks.
Outcome RunToEnd(Engine& e, const std::vector<RequestId>& ids, Outcome r = {},
                 int max_steps = 10000) {
  const KvCacheGroups& g = e.kv_groups();
  for (int guard = 0; (e.HasWork() || e.loading() > 0) && guard < max_steps; ++guard) {
    auto events = e.Step();
    EXPECT_TRUE(events.ok()) << events.status().ToString();
    if (!events.ok()) break;
    for (const TokenEvent& ev : *events) {
      if (ev.token >= 0) r.tokens[ev.id].push_back(ev.token);
      r.cached[ev.id] = ev.cached_prompt_tokens;
    }
    for (RequestId id : ids) {
      auto held = e.HeldBlocks(id);
      if (!held.ok()) continue;  // finished or not submitted
      EXPECT_EQ(static_cast<int>(held->size()), g.size());
      for (int k = 1; k < g.size(); ++k) {
        if (g.sliding(k)) r.most_window_held = std::max(r.most_window_held, (*held)[k]);
      }
    }
  }
  return r;
}

void ExpectAllBlocksReturned(Engine& e) {
  KvBlockPool* p = e.pool();
  EXPECT_EQ(p->available_blocks(), p->total_blocks());
  for (BlockId b = 0; b < p->total_blocks(); ++b) ASSERT_EQ(p->refcount(b), 0) << "block " << b;
}

TEST(KvGroupsEngineTest, MixedModelSplitsOthersDoNot) {
  auto grouped = MakeEngine(/*split=*/true);
  ASSERT_NE(grouped, nullptr);
  const KvCacheGroups& g = grouped->kv_groups();
  ASSERT_EQ(g.size(), 3);
  EXPECT_EQ(g.layers_per_block(), 2);
  EXPECT_EQ(g.layers[0], (std::vector<int>{2, 5}));
  EXPECT_EQ(grouped->pool()->layout().layers, 2);
  auto one = MakeEngine(/*split=*/false);
  ASSERT_NE(one, nullptr);
  EXPECT_EQ(one->kv_groups().size(), 1);
  EXPECT_EQ(one->pool()->layout().layers, 6);
  // The same bytes hold three times as many (three times smaller) blocks.
  EXPECT_EQ(grouped->pool()->total_blocks(), 3 * one->pool()->total_blocks());
}

// Prompts shorter and longer than the window, decoded far past it, batched
// with chunked prefill: the same tokens as one group; the sliding-window
// groups stay bounded while the full-attention group grows.
TEST(KvGroupsEngineTest, SameTokensAsOneGroupAndBoundedWindowBlocks) {
  const std::vector<std::vector<int32_t>> prompts = {RandomPrompt(5, 1), RandomPrompt(30, 2),
                                                     RandomPrompt(13, 3)};
  std::vector<RequestId> ids;
  auto run = [&](bool split) {
    auto e = MakeEngine(split);
    EXPECT_NE(e, nullptr);
    ids.clear();
    for (size_t i = 0; i < prompts.size(); ++i) {
      ids.push_back(i + 1);
      EXPECT_TRUE(e->Submit(Spec(i + 1, prompts[i], 60)).ok());
    }
    // Mid-run: the long request's full-attention table grows with its length.
    Outcome r = RunToEnd(*e, ids, {}, 20);
    auto mid = e->HeldBlocks(2);
    EXPECT_TRUE(mid.ok());
    r = RunToEnd(*e, ids, std::move(r));
    if (mid.ok() && split) {
      EXPECT_GT((*mid)[0], kWindowBlocks);  // > the window: the full group keeps everything
      for (int k = 1; k < e->kv_groups().size(); ++k) EXPECT_LE((*mid)[k], kWindowBlocks);
    }
    ExpectAllBlocksReturned(*e);
    return r;
  };
  const Outcome one = run(/*split=*/false);
  const Outcome grouped = run(/*split=*/true);
  for (RequestId id : ids) {
    EXPECT_EQ(grouped.tokens.at(id).size(), 60u);
    EXPECT_EQ(grouped.tokens.at(id), one.tokens.at(id)) << "request " << id;
  }
  EXPECT_GT(grouped.most_window_held, 0);
  EXPECT_LE(grouped.most_window_held, kWindowBlocks);
}

// KIVI KV: a prompt's partial tail block is quantized when its prefill ends
// (every layer of it, in every group's table: layer slots, not model
// layers), so split groups give one group's tokens.
TEST(KvGroupsEngineTest, KiviPromptTailsAreSealedInEveryGroup) {
  {
    // A 6-token prompt (a 2-token tail block) prefilled in one step: no
    // layer of the tail, in any group, is left in f32 staging.
    auto e = MakeEngine(/*split=*/true, 512, 8, KvDtype::kKivi4);
    ASSERT_NE(e, nullptr);
    const int64_t free_before = e->pool()->staging_slots_free();
    ASSERT_GT(free_before, 0);
    ASSERT_TRUE(e->Submit(Spec(1, RandomPrompt(6, 10), 4)).ok());
    auto first = e->Step();
    ASSERT_TRUE(first.ok()) << first.status().ToString();
    ASSERT_EQ(first->size(), 1u);
    EXPECT_EQ(e->pool()->staging_slots_free(), free_before);
    RunToEnd(*e, {1});
    ExpectAllBlocksReturned(*e);
  }
  const std::vector<std::vector<int32_t>> prompts = {RandomPrompt(6, 11), RandomPrompt(19, 12)};
  auto run = [&](bool split) {
    auto e = MakeEngine(split, 512, 8, KvDtype::kKivi4);
    EXPECT_NE(e, nullptr);
    std::vector<RequestId> ids;
    for (size_t i = 0; i < prompts.size(); ++i) {
      ids.push_back(i + 1);
      EXPECT_TRUE(e->Submit(Spec(i + 1, prompts[i], 24)).ok());
    }
    Outcome r = RunToEnd(*e, ids);
    ExpectAllBlocksReturned(*e);
    return r;
  };
  const Outcome one = run(/*split=*/false);
  const Outcome grouped = run(/*split=*/true);
  for (RequestId id : {RequestId{1}, RequestId{2}}) {
    ASSERT_EQ(grouped.tokens.at(id).size(), 24u);
    EXPECT_EQ(grouped.tokens.at(id), one.tokens.at(id)) << "request " << id;
  }
}

// A prefix hit on a grouped engine: the full-attention group's blocks of the
// whole prefix and the sliding-window groups' blocks inside the window at the
// hit point are reused; the rest is computed; the tokens are a fresh run's.
TEST(KvGroupsEngineTest, PrefixHitNeedsOnlyTheWindowAndEqualsScratch) {
  const std::vector<int32_t> prefix = RandomPrompt(40, 7);
  std::vector<int32_t> longer = prefix;
  for (int32_t t : RandomPrompt(9, 8)) longer.push_back(t);
  auto fresh = MakeEngine(/*split=*/false);
  ASSERT_NE(fresh, nullptr);
  ASSERT_TRUE(fresh->Submit(Spec(1, longer, 20)).ok());
  const Outcome want = RunToEnd(*fresh, {1});

  auto e = MakeEngine(/*split=*/true);
  ASSERT_NE(e, nullptr);
  ASSERT_TRUE(e->Submit(Spec(1, prefix, 30)).ok());  // its blocks stay in the prefix cache
  (void)RunToEnd(*e, {1});
  ASSERT_TRUE(e->Submit(Spec(2, longer, 20)).ok());
  const Outcome got = RunToEnd(*e, {2});
  EXPECT_EQ(got.cached.at(2), 40) << "the 10 full blocks of the prefix";
  EXPECT_EQ(got.tokens.at(2), want.tokens.at(1));
  // The same prompt again: a hit over the whole prompt (last token recomputed).
  ASSERT_TRUE(e->Submit(Spec(3, longer, 20)).ok());
  const Outcome again = RunToEnd(*e, {3});
  EXPECT_EQ(again.cached.at(3), 48);
  EXPECT_EQ(again.tokens.at(3), want.tokens.at(1));
  ExpectAllBlocksReturned(*e);
}

// Too few blocks for three long sequences at once: preemption by recompute
// on a grouped engine keeps every output.
TEST(KvGroupsEngineTest, PreemptionKeepsOutputs) {
  std::vector<RequestId> ids = {1, 2, 3};
  auto run = [&](bool split, int64_t blocks) {
    auto e = MakeEngine(split, blocks);
    EXPECT_NE(e, nullptr);
    for (RequestId id : ids) {
      EXPECT_TRUE(e->Submit(Spec(id, RandomPrompt(20, 10 + id), 40)).ok());
    }
    Outcome r = RunToEnd(*e, ids);
    ExpectAllBlocksReturned(*e);
    return std::make_pair(r, e->stats().preemptions);
  };
  const auto [one, one_pre] = run(/*split=*/false, 512);
  // 18 one-group blocks = 54 grouped blocks: a 60-token sequence holds 15 of
  // the full group plus at most 2 x 5 sliding ones, so three cannot run at once.
  const auto [grouped, preemptions] = run(/*split=*/true, 18);
  EXPECT_EQ(one_pre, 0);
  EXPECT_GT(preemptions, 0);
  for (RequestId id : ids) EXPECT_EQ(grouped.tokens.at(id), one.tokens.at(id)) << id;
}

// Disaggregated: a one-group prefill engine computes the prompt (longer than
// the window); a grouped decode engine receives every layer of every block
// into its group tables (as worker::StartSegmentReceivers lays the
// stream out), decodes past the window with bounded sliding-window blocks and
// gives the colocated tokens.
class GroupedLoader : public KvConnector {
 public:
  Status StartRemoteLoad(const RequestSpec& request, const KvCacheGroups& groups,
                         std::span<const std::vector<BlockId>> t) override {
    id = request.id;
    tables.assign(t.begin(), t.end());
    EXPECT_EQ(static_cast<int>(t.size()), groups.size());
    return Status::Ok();
  }
  std::vector<RemoteLoadDone> PollRemoteLoads() override {
    std::vector<RemoteLoadDone> out;
    if (first_token >= 0) out.push_back({id, Status::Ok(), first_token});
    first_token = -1;
    return out;
  }
  RequestId id = 0;
  std::vector<std::vector<BlockId>> tables;
  int32_t first_token = -1;
};

class Keeper : public KvConnector {
 public:
  bool RequestFinished(const TokenEvent&, BlockTable& blocks) override {
    kept = std::move(blocks);
    return true;
  }
  BlockTable kept;
};

TEST(KvGroupsEngineTest, DisaggregatedIntoGroupsEqualsColocated) {
  const std::vector<int32_t> prompt = RandomPrompt(26, 21);  // 7 blocks, past the window
  auto colo = MakeEngine(/*split=*/true);
  ASSERT_NE(colo, nullptr);
  ASSERT_TRUE(colo->Submit(Spec(1, prompt, 40)).ok());
  const Outcome want = RunToEnd(*colo, {1});

  auto prefill = MakeEngine(/*split=*/false);
  auto decode = MakeEngine(/*split=*/true);
  ASSERT_NE(prefill, nullptr);
  ASSERT_NE(decode, nullptr);
  Keeper keeper;
  GroupedLoader loader;
  prefill->SetKvConnector(&keeper);
  decode->SetKvConnector(&loader);
  RequestSpec p = Spec(1, prompt, 40);
  p.mode = RequestMode::kPrefillOnly;
  ASSERT_TRUE(prefill->Submit(p).ok());
  const Outcome first = RunToEnd(*prefill, {1});
  ASSERT_EQ(first.tokens.at(1).size(), 1u);
  ASSERT_EQ(keeper.kept.size(), 7);

  RequestSpec r = Spec(1, prompt, 40);
  r.mode = RequestMode::kRemotePrompt;
  ASSERT_TRUE(decode->Submit(r).ok());
  const KvCacheGroups& g = decode->kv_groups();
  ASSERT_EQ(loader.tables.size(), 3u);
  auto loading = decode->HeldBlocks(1);
  ASSERT_TRUE(loading.ok());
  EXPECT_EQ(*loading, (std::vector<int64_t>{7, 7, 7}));  // the whole prompt while it loads
  for (int64_t i = 0; i < 7; ++i) {
    for (int l = 0; l < g.n_layers(); ++l) {
      auto src = prefill->pool()->LayerData(keeper.kept[i], l);
      auto dst = decode->pool()->LayerData(loader.tables[g.group_of[l]][i], g.slot_of[l]);
      ASSERT_EQ(src.size(), dst.size());
      std::copy(src.begin(), src.end(), dst.begin());
    }
  }
  keeper.kept.Release();
  loader.first_token = first.tokens.at(1)[0];
  Outcome got = RunToEnd(*decode, {1});
  got.tokens[1].insert(got.tokens[1].begin(), first.tokens.at(1)[0]);
  EXPECT_EQ(got.tokens.at(1), want.tokens.at(1));
  EXPECT_GT(got.most_window_held, 0);
  EXPECT_LE(got.most_window_held, kWindowBlocks);
  ExpectAllBlocksReturned(*decode);
  ExpectAllBlocksReturned(*prefill);
}

struct NullConnector : KvConnector {};

// A connector that loads nothing serves a grouped engine as no connector
// does (every engine addresses its groups; no connector is refused), and one
// that cannot load remote KV fails a remote prompt with a clear error, its
// blocks returned.
TEST(KvGroupsEngineTest, AConnectorThatLoadsNothingChangesNothing) {
  const std::vector<int32_t> prompt = RandomPrompt(26, 5);
  auto bare = MakeEngine(/*split=*/true);
  ASSERT_NE(bare, nullptr);
  ASSERT_TRUE(bare->Submit(Spec(1, prompt, 12)).ok());
  const Outcome want = RunToEnd(*bare, {1});

  auto e = MakeEngine(/*split=*/true);
  ASSERT_NE(e, nullptr);
  ASSERT_GT(e->kv_groups().size(), 1);
  NullConnector c;
  e->SetKvConnector(&c);
  ASSERT_TRUE(e->Submit(Spec(1, prompt, 12)).ok());
  EXPECT_EQ(RunToEnd(*e, {1}).tokens.at(1), want.tokens.at(1));

  RequestSpec r = Spec(2, prompt, 12);
  r.mode = RequestMode::kRemotePrompt;
  const Status s = e->Submit(r);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  EXPECT_NE(s.message().find("cannot load remote KV"), std::string::npos) << s.ToString();
  ExpectAllBlocksReturned(*e);
}

}  // namespace
}  // namespace kvrelay::engine
