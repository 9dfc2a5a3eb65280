// Tensor parallelism on the real SmolLM2-135M model, ranks as threads of one
// process (InProcessTpGroup): a sharded forward equals the whole model's, and
// a TP engine (rank 0 Engine + TpFollower ranks repeating its step plans)
// generates exactly the tokens a single engine does.
#include "engine/runtime/tensor_parallel.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <mutex>
#include <thread>

#include "common/thread_pool.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/forward.h"
#include "engine/runtime/model.h"
#include "engine/tokenizer/tokenizer.h"
#include "tests/testing/skip.h"
#include "tests/unit/runtime/forward_test_util.h"

namespace kvrelay::engine {
namespace {

std::string SourceDir() {
  const char* s = std::getenv("KVRELAY_SOURCE_DIR");
  return s ? s : ".";
}
std::string ModelPath() { return SourceDir() + "/models/SmolLM2-135M-Instruct.Q4_1.gguf"; }
std::string GemmaPath() { return SourceDir() + "/models/gemma-3-270m-q4_k_m.gguf"; }

std::shared_ptr<const Model> LoadShard(int rank, int size, TpMode mode = TpMode::kExact,
                                       const std::string& path = ModelPath()) {
  ModelLoadOptions o;
  o.shard = {rank, size, mode};
  auto m = Model::Load(path, o);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return m.ok() ? std::shared_ptr<const Model>(std::move(m).value()) : nullptr;
}

TEST(TensorParallel, ShardShapes) {
  auto whole = LoadShard(0, 1);
  ASSERT_NE(whole, nullptr);
  const ModelConfig& f = whole->config();
  int heads = 0, kv_heads = 0, ffn = 0;
  for (int r = 0; r < 2; ++r) {
    auto s = LoadShard(r, 2, TpMode::kReduce);
    ASSERT_NE(s, nullptr);
    auto exact = LoadShard(r, 2, TpMode::kExact);
    ASSERT_NE(exact, nullptr);
    EXPECT_EQ(exact->layers()[0].wo->Cols(), f.q_dim());  // whole output projections
    EXPECT_EQ(exact->layers()[0].ffn_down->Cols(), f.ffn_dim);
    EXPECT_EQ(exact->layers()[0].wq->Rows(), s->config().q_dim());
    EXPECT_EQ(s->full_config().n_kv_heads, f.n_kv_heads);
    EXPECT_EQ(s->fingerprint(), whole->fingerprint());
    EXPECT_EQ(s->config().n_heads / s->config().n_kv_heads, f.n_heads / f.n_kv_heads);
    heads += s->config().n_heads;
    kv_heads += s->config().n_kv_heads;
    ffn += s->config().ffn_dim;
    EXPECT_EQ(s->layers()[0].wo->Cols(), s->config().q_dim());
    EXPECT_EQ(s->layers()[0].ffn_down->Cols(), s->config().ffn_dim);
  }
  EXPECT_EQ(heads, f.n_heads);
  EXPECT_EQ(kv_heads, f.n_kv_heads);
  EXPECT_EQ(ffn, f.ffn_dim);
  ModelLoadOptions too_many;
  too_many.shard = {0, f.n_kv_heads + 1};
  auto bad = Model::Load(ModelPath(), too_many);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("exceeds"), std::string::npos) << bad.status().ToString();
}

// Logits of every position from T ranks vs the whole model's.
// kExact: every output element is the same dot product over the same inputs
// as in one process, so the logits must be bit-identical.
// kReduce: attn_output and ffn_down are summed as T partial dot products; the
// float re-association (~1e-5 relative) changes which way a few activations
// round when the next layer quantizes them to 8 bits, and that grows through
// 30 layers: measured max ~1.2 logits. The bound is the one the llama.cpp
// conformance test justifies for two engines that round differently (2.0).
TEST(TensorParallel, ShardedForwardMatchesWholeModel) {
  auto whole = LoadShard(0, 1);
  ASSERT_NE(whole, nullptr);
  const int vocab = whole->config().vocab;
  std::vector<int32_t> ids = whole->tokenizer()->Encode(
      "Tensor parallelism splits attention heads and feed-forward columns across ranks, "
      "then sums the partial outputs.",
      false, false);
  const int64_t n = static_cast<int64_t>(ids.size());
  auto pool = testutil::MakePool(*whole, 16);
  ThreadPool threads(1);
  auto want = testutil::ChunkedLogits(*whole, pool.get(), &threads, ids, n, n);
  ASSERT_TRUE(want.ok());
  for (auto [tp, mode] : {std::pair{2, TpMode::kExact}, std::pair{3, TpMode::kExact},
                          std::pair{2, TpMode::kReduce}}) {
    InProcessTpGroup group(tp, std::chrono::seconds(60));
    std::vector<std::vector<float>> got(tp);
    std::vector<Status> status(tp);
    std::vector<std::thread> ranks;
    for (int r = 0; r < tp; ++r) {
      ranks.emplace_back([&, r, tp, mode] {
        auto shard = LoadShard(r, tp, mode);
        if (shard == nullptr) {
          status[r] = Internal("load");
          return;
        }
        auto p = testutil::MakePool(*shard, 16);
        ThreadPool t(1);
        // The whole prompt in one chunk, then ... every rank runs the same plan.
        std::vector<BlockId> blocks;
        for (int64_t i = 0; i < (n + 15) / 16; ++i) blocks.push_back(*p->Allocate());
        ForwardPass fwd(*shard, p.get(), &t);
        fwd.SetCollective(group.rank(r));
        SeqStep s;
        s.blocks.assign(blocks.begin(), blocks.end());
        s.tokens.assign(ids.begin(), ids.end());
        s.logits = r == 0 ? LogitRows::kAll : LogitRows::kNone;
        ForwardOutput out;
        status[r] = fwd.Run(std::span<const SeqStep>(&s, 1), &out);
        got[r] = std::move(out.logits);
        for (BlockId b : blocks) p->Release(b);
      });
    }
    for (auto& t : ranks) t.join();
    for (int r = 0; r < tp; ++r) ASSERT_TRUE(status[r].ok()) << status[r].ToString();
    ASSERT_EQ(got[0].size(), want->size());
    EXPECT_TRUE(got[1].empty());
    double diff = 0;
    for (size_t i = 0; i < want->size(); ++i) {
      diff = std::max<double>(diff, std::abs(got[0][i] - (*want)[i]));
    }
    int agree = 0;
    for (int64_t p = 0; p < n; ++p) {
      agree += testutil::ArgMax(got[0].data() + p * vocab, vocab) ==
               testutil::ArgMax(want->data() + p * vocab, vocab);
    }
    std::printf("tp=%d %s: max |logit diff| vs whole model %.3g, top-1 agreement %d/%lld\n", tp,
                mode == TpMode::kExact ? "exact" : "reduce", diff, agree,
                static_cast<long long>(n));
    if (mode == TpMode::kExact) {
      EXPECT_EQ(diff, 0.0) << "tp=" << tp;
      EXPECT_EQ(agree, n);
    } else {
      EXPECT_LE(diff, 2.0) << "tp=" << tp;
    }
  }
}

// Runs rank 0's Engine on this thread and followers on their own threads,
// feeding them the published plans through queues.
class TpHarness {
 public:
  TpHarness(int tp, EngineOptions options, const std::string& path = ModelPath())
      : group_(tp, std::chrono::seconds(60)) {
    auto leader_model = LoadShard(0, tp, TpMode::kExact, path);
    auto e = Engine::Create(options, leader_model);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    engine_ = std::move(e).value();
    queues_.resize(tp);
    for (int r = 1; r < tp; ++r) {
      // Followers mirror rank 0's KV cache groups (as TpSetup tells them).
      auto f =
          TpFollower::Create(options, LoadShard(r, tp, TpMode::kExact, path), engine_->kv_groups(),
                             engine_->pool()->total_blocks(), group_.rank(r));
      EXPECT_TRUE(f.ok()) << f.status().ToString();
      followers_.push_back(std::move(f).value());
    }
    TensorParallelHooks hooks;
    hooks.collective = group_.rank(0);
    hooks.publish = [this](const StepPlan& plan) {
      std::lock_guard lock(mu_);
      for (auto& q : queues_) q.push_back(plan);
      cv_.notify_all();
      return Status::Ok();
    };
    Status s = engine_->SetTensorParallel(hooks);
    EXPECT_TRUE(s.ok()) << s.ToString();
    for (int r = 1; r < tp; ++r) {
      threads_.emplace_back([this, r] {
        while (true) {
          StepPlan plan;
          {
            std::unique_lock lock(mu_);
            if (!cv_.wait_for(lock, std::chrono::seconds(60),
                              [&] { return stop_ || !queues_[r].empty(); })) {
              follower_status_ = DeadlineExceeded("follower waited 60 s for a plan");
              return;
            }
            if (queues_[r].empty()) return;  // stop
            plan = std::move(queues_[r].front());
            queues_[r].pop_front();
          }
          Status s = followers_[r - 1]->Execute(plan);
          if (!s.ok()) {
            std::lock_guard lock(mu_);
            follower_status_ = s;
            return;
          }
        }
      });
    }
  }
  ~TpHarness() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
      cv_.notify_all();
    }
    for (auto& t : threads_) t.join();
  }
  Engine& engine() { return *engine_; }
  Status follower_status() {
    std::lock_guard lock(mu_);
    return follower_status_;
  }

 private:
  InProcessTpGroup group_;
  std::unique_ptr<Engine> engine_;
  std::vector<std::unique_ptr<TpFollower>> followers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::deque<StepPlan>> queues_;  // guarded by mu_
  bool stop_ = false;                         // guarded by mu_
  Status follower_status_;                    // guarded by mu_
  std::vector<std::thread> threads_;
};

std::map<RequestId, std::vector<int32_t>> RunAll(Engine& e, const std::vector<RequestSpec>& reqs) {
  std::map<RequestId, std::vector<int32_t>> out;
  for (const auto& r : reqs) EXPECT_TRUE(e.Submit(r).ok());
  for (int steps = 0; e.HasWork() && steps < 10000; ++steps) {
    auto ev = e.Step();
    EXPECT_TRUE(ev.ok());
    if (!ev.ok()) break;
    for (const auto& x : *ev) {
      EXPECT_NE(x.finish_reason, FinishReason::kError) << x.error.ToString();
      if (x.token >= 0) out[x.id].push_back(x.token);
    }
  }
  return out;
}

TEST(TensorParallel, EngineGeneratesTheSameTokensAsOneRank) {
  auto whole = LoadShard(0, 1);
  ASSERT_NE(whole, nullptr);
  EngineOptions o;
  o.threads = 1;
  o.kv_capacity_bytes = 64ll << 20;
  o.max_step_tokens = 24;  // several prefill chunks, mixed with decode steps
  std::vector<RequestSpec> reqs;
  const char* prompts[] = {"The capital of Japan is",
                           "def fibonacci(n):", "Water boils at a temperature of"};
  for (int i = 0; i < 3; ++i) {
    RequestSpec r;
    r.id = static_cast<RequestId>(i + 1);
    r.prompt = whole->tokenizer()->Encode(prompts[i], false, false);
    r.sampling.max_tokens = 24;
    r.sampling.ignore_eos = true;
    reqs.push_back(r);
  }
  auto single = Engine::Create(o, whole);
  ASSERT_TRUE(single.ok());
  auto want = RunAll(**single, reqs);
  for (int tp : {2, 3}) {
    TpHarness h(tp, o);
    const int64_t free_before = h.engine().pool()->free_blocks();
    auto got = RunAll(h.engine(), reqs);
    EXPECT_TRUE(h.follower_status().ok()) << h.follower_status().ToString();
    for (const auto& r : reqs) {
      EXPECT_EQ(got[r.id], want[r.id]) << "tp=" << tp << " request " << r.id;
      EXPECT_EQ(got[r.id].size(), 24u);
    }
    EXPECT_EQ(h.engine().pool()->available_blocks(), free_before) << "blocks leaked, tp=" << tp;
  }
}

TEST(TensorParallel, RefusesWhatItCannotMirror) {
  EngineOptions o;
  o.threads = 1;
  o.kv_capacity_bytes = 8ll << 20;
  InProcessTpGroup group(2, std::chrono::seconds(5));
  // KIVI keeps staging state per block that a follower cannot mirror.
  o.kv_dtype = KvDtype::kKivi4;
  auto shard1 = LoadShard(1, 2);
  auto f = TpFollower::Create(o, shard1, 100, group.rank(1));
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kUnimplemented) << f.status().ToString();
  o.kv_dtype = KvDtype::kF16;
  // A whole model cannot be rank 0 of a group of 2.
  auto e = Engine::Create(o, LoadShard(0, 1));
  ASSERT_TRUE(e.ok());
  TensorParallelHooks hooks{group.rank(0), [](const StepPlan&) { return Status::Ok(); }};
  Status s = (*e)->SetTensorParallel(hooks);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  // A plan naming blocks outside the pool is rejected before anything is written.
  auto follower = TpFollower::Create(o, shard1, 100, group.rank(1));
  ASSERT_TRUE(follower.ok());
  StepPlan bad;
  bad.copies.push_back({0, 100});
  EXPECT_EQ((*follower)->Execute(bad).code(), StatusCode::kInvalidArgument);
  StepPlan bad_seq;
  bad_seq.seqs.push_back({0, {7, 1000}, 16, {1, 2}});
  EXPECT_EQ((*follower)->Execute(bad_seq).code(), StatusCode::kInvalidArgument);
  // A cache length whose end wraps past the int64 limit (found by the
  // tp_plan fuzz target: it crashed the follower) is refused too.
  StepPlan wrap;
  wrap.seqs.push_back({0, {7}, std::numeric_limits<int64_t>::max() - 1, {1, 2}});
  EXPECT_EQ((*follower)->Execute(wrap).code(), StatusCode::kInvalidArgument);
}

// Gemma 3 270M (scripts/fetch-model.sh gemma3-270m; skipped without it) has
// one KV head for four query heads: with TP = 2 each rank computes two query
// heads and holds a replica of the KV head (ShardAttentionHeads). A prompt
// longer than the sliding window (512 on 15 of 18 layers), prefilled in
// chunks and decoded past the window, gives exactly the single engine's
// tokens, and a sharded forward pass its logits bit for bit (kExact).
TEST(TensorParallelGemma3, ReplicatedKvHeadMatchesOneRank) {
  if (!std::filesystem::exists(GemmaPath())) {
    KVRELAY_SKIP_OR_FAIL() << "models/gemma-3-270m-q4_k_m.gguf absent: run scripts/fetch-model.sh "
                              "gemma3-270m (scripts/test.sh does)";
  }
  auto whole = LoadShard(0, 1, TpMode::kExact, GemmaPath());
  ASSERT_NE(whole, nullptr);
  const ModelConfig& f = whole->config();
  ASSERT_EQ(f.n_kv_heads, 1);
  ASSERT_EQ(f.n_heads, 4);
  for (int r = 0; r < 2; ++r) {
    auto s = LoadShard(r, 2, TpMode::kExact, GemmaPath());
    ASSERT_NE(s, nullptr);
    EXPECT_EQ(s->config().n_kv_heads, 1);
    EXPECT_EQ(s->config().n_heads, 2);
    EXPECT_EQ(s->kv_head_range().begin, 0);
    EXPECT_EQ(s->kv_head_range().end, 1);
    EXPECT_EQ(s->q_head_range().begin, 2 * r);
    EXPECT_EQ(s->q_head_range().end, 2 * r + 2);
    EXPECT_EQ(s->layers()[0].wq->Rows(), 2 * f.head_dim);
    EXPECT_EQ(s->layers()[0].wk->Rows(), f.head_dim);
  }
  ModelLoadOptions three;
  three.shard = {0, 3};
  auto bad = Model::Load(GemmaPath(), three);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("replicating"), std::string::npos)
      << bad.status().ToString();

  std::ifstream in(SourceDir() + "/tests/data/kjv_genesis_exodus.txt");
  ASSERT_TRUE(in.good());
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<int32_t> long_prompt = whole->tokenizer()->Encode(text.substr(0, 4000), true, false);
  ASSERT_GT(static_cast<int>(long_prompt.size()), 600);
  long_prompt.resize(600);
  ASSERT_GT(600, f.sliding_window);

  // Sharded forward of a short prompt: the logits of the whole model, bit for bit.
  {
    const std::vector<int32_t> ids(long_prompt.begin(), long_prompt.begin() + 40);
    const int64_t n = static_cast<int64_t>(ids.size());
    auto pool = testutil::MakePool(*whole, 8);
    ThreadPool threads(1);
    auto want = testutil::ChunkedLogits(*whole, pool.get(), &threads, ids, n, n);
    ASSERT_TRUE(want.ok()) << want.status().ToString();
    InProcessTpGroup group(2, std::chrono::seconds(60));
    std::vector<std::vector<float>> got(2);
    std::vector<Status> status(2);
    std::vector<std::thread> ranks;
    for (int r = 0; r < 2; ++r) {
      ranks.emplace_back([&, r] {
        auto shard = LoadShard(r, 2, TpMode::kExact, GemmaPath());
        if (shard == nullptr) {
          status[r] = Internal("load");
          return;
        }
        auto p = testutil::MakePool(*shard, 8);
        ThreadPool t(1);
        std::vector<BlockId> blocks;
        for (int64_t i = 0; i < (n + 15) / 16; ++i) blocks.push_back(*p->Allocate());
        ForwardPass fwd(*shard, p.get(), &t);
        fwd.SetCollective(group.rank(r));
        SeqStep s;
        s.blocks.assign(blocks.begin(), blocks.end());
        s.tokens.assign(ids.begin(), ids.end());
        s.logits = r == 0 ? LogitRows::kAll : LogitRows::kNone;
        ForwardOutput out;
        status[r] = fwd.Run(std::span<const SeqStep>(&s, 1), &out);
        got[r] = std::move(out.logits);
        for (BlockId b : blocks) p->Release(b);
      });
    }
    for (auto& t : ranks) t.join();
    for (int r = 0; r < 2; ++r) ASSERT_TRUE(status[r].ok()) << status[r].ToString();
    ASSERT_EQ(got[0].size(), want->size());
    EXPECT_EQ(std::memcmp(got[0].data(), want->data(), 4 * want->size()), 0)
        << "TP = 2 logits differ from the whole model's";
  }

  // The engine, chunked prefill (several 128-token chunks, mixed with the
  // short request's decode steps), 48 tokens past the window.
  EngineOptions o;
  o.threads = 1;
  o.kv_dtype = KvDtype::kF32;
  o.kv_capacity_bytes = 64ll << 20;
  o.max_step_tokens = 128;
  std::vector<RequestSpec> reqs(2);
  reqs[0].id = 1;
  reqs[0].prompt = whole->tokenizer()->Encode("The capital of France is", true, false);
  reqs[1].id = 2;
  reqs[1].prompt = long_prompt;
  for (RequestSpec& r : reqs) {
    r.sampling.max_tokens = 48;
    r.sampling.ignore_eos = true;
  }
  // The single engine and the TP group both with their default KV cache
  // groups (sliding layers hold only their window; the followers run every
  // group's table from the plan).
  auto single = Engine::Create(o, whole);
  ASSERT_TRUE(single.ok()) << single.status().ToString();
  auto want = RunAll(**single, reqs);
  TpHarness h(2, o, GemmaPath());
  ASSERT_EQ(h.engine().kv_groups().size(), 6) << h.engine().kv_groups().DebugString();
  const int64_t free_before = h.engine().pool()->free_blocks();
  auto got = RunAll(h.engine(), reqs);
  EXPECT_TRUE(h.follower_status().ok()) << h.follower_status().ToString();
  for (const RequestSpec& r : reqs) {
    EXPECT_EQ(got[r.id], want[r.id]) << "request " << r.id;
    EXPECT_EQ(got[r.id].size(), 48u);
  }
  EXPECT_EQ(h.engine().pool()->available_blocks(), free_before) << "blocks leaked";
  // Rank 0 held per group what the single engine held: its sliding groups
  // within their window, the full group every position.
  EXPECT_EQ(h.engine().stats().peak_group_blocks, (*single)->stats().peak_group_blocks);
  const KvCacheGroups& groups = h.engine().kv_groups();
  const std::vector<int64_t> peaks = h.engine().stats().peak_group_blocks;
  ASSERT_EQ(peaks.size(), 6u);
  for (int g = 1; g < groups.size(); ++g) {
    const int w = groups.window[static_cast<size_t>(g)];
    EXPECT_LE(peaks[static_cast<size_t>(g)], (w + o.block_tokens - 1) / o.block_tokens + 1);
  }
  EXPECT_GT(peaks[0], peaks[1]);
}

}  // namespace
}  // namespace kvrelay::engine
