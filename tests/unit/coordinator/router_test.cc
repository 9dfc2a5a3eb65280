#include "coordinator/cluster/router.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <map>
#include <random>
#include <set>

namespace kvrelay::coordinator {
namespace {

PrefixBlockHash H(uint8_t v) {
  PrefixBlockHash h{};
  h.fill(v);
  return h;
}

WorkerInfo Prefill(std::string id, int64_t queued_tokens, int64_t running = 0) {
  WorkerInfo w;
  w.id = std::move(id);
  w.role = WorkerRole::kPrefill;
  w.queued_tokens = queued_tokens;
  w.running = running;
  w.block_tokens = 16;
  return w;
}

WorkerInfo Decode(std::string id, int64_t free_blocks, int64_t total, int64_t running,
                  int64_t max_batch) {
  WorkerInfo w;
  w.id = std::move(id);
  w.role = WorkerRole::kDecode;
  w.free_kv_blocks = free_blocks;
  w.total_kv_blocks = total;
  w.running = running;
  w.max_batch = max_batch;
  w.block_tokens = 16;
  return w;
}

TEST(RouterTest, ParsesPolicies) {
  EXPECT_EQ(*ParseRouterPolicy("round_robin"), RouterPolicy::kRoundRobin);
  EXPECT_EQ(*ParseRouterPolicy("least_loaded"), RouterPolicy::kLeastLoaded);
  EXPECT_EQ(*ParseRouterPolicy("prefix_aware"), RouterPolicy::kPrefixAware);
  auto bad = ParseRouterPolicy("random");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("random"), std::string::npos);
}

// #42: the workers report what they cached with their heartbeats (500 ms), so
// a prompt repeated right after the first used to find nothing cached and go
// to the least loaded worker. The router now counts a routed chain as cached
// where it sent it, until the deadline or the worker's eviction says otherwise.
TEST(RouterTest, AnImmediateRepeatGoesWhereThePrefixWasJustSent) {
  Router r({RouterPolicy::kPrefixAware});
  std::vector<PrefixBlockHash> chain;  // a 1,251-token prompt: 78 full blocks
  for (int i = 0; i < 78; ++i) chain.push_back(H(static_cast<uint8_t>(i + 1)));
  RouteRequest req;
  req.prefix_blocks = chain;
  req.prompt_tokens = 1251;
  std::vector<WorkerInfo> ws = {Prefill("p-0", 0), Prefill("p-1", 0)};
  auto first = r.PickPrefill(req, ws);
  ASSERT_TRUE(first.ok());
  ASSERT_EQ(*first, "p-0");  // the tie goes to the lower id
  r.NoteRouted(*first, chain, Clock::now() + std::chrono::hours(1));
  // p-0 now looks busier (other work arrived there), but holds the prefix.
  ws[0].queued_tokens = 400;
  EXPECT_EQ(r.MatchedBlocks("p-0", chain), 78);
  EXPECT_EQ(r.MatchedBlocks("p-1", chain), 0);
  EXPECT_EQ(*r.PickPrefill(req, ws), "p-0");
  // A shorter prompt sharing the first 10 blocks matches those 10.
  RouteRequest shorter;
  shorter.prefix_blocks = std::span<const PrefixBlockHash>(chain).first(10);
  EXPECT_EQ(r.MatchedBlocks("p-0", shorter.prefix_blocks), 10);

  // The worker's eviction of block 40 corrects the note at once.
  r.OnEvicted("p-0", chain[40]);
  EXPECT_EQ(r.MatchedBlocks("p-0", chain), 40);
  // A reported store is kept when the note goes (the worker died: both go).
  r.prefix_index().OnStored("p-1", chain[0]);
  r.RemoveWorker("p-0");
  EXPECT_EQ(r.MatchedBlocks("p-0", chain), 0);
  EXPECT_EQ(r.MatchedBlocks("p-1", chain), 1);
}

TEST(RouterTest, AnOptimisticPrefixExpiresAtItsDeadline) {
  Router r({RouterPolicy::kPrefixAware});
  const std::vector<PrefixBlockHash> chain = {H(1), H(2), H(3)};
  const TimePoint now = Clock::now();
  r.NoteRouted("p-0", chain, now - std::chrono::milliseconds(1));  // already past
  EXPECT_EQ(r.MatchedBlocks("p-0", chain), 0);
  // A later note of the same blocks keeps them until its own deadline, even
  // when an earlier note of them expires.
  r.NoteRouted("p-1", chain, now + std::chrono::hours(1));
  r.NoteRouted("p-1", std::span<const PrefixBlockHash>(chain).first(1),
               now - std::chrono::milliseconds(1));
  EXPECT_EQ(r.MatchedBlocks("p-1", chain), 3);
  // What the worker reported stays after a note of it expires.
  r.prefix_index().OnStored("p-2", H(1));
  r.NoteRouted("p-2", chain, now - std::chrono::milliseconds(1));
  EXPECT_EQ(r.MatchedBlocks("p-2", chain), 1);
}

TEST(RouterTest, RoundRobinCyclesOverHealthyPrefillWorkers) {
  Router r({RouterPolicy::kRoundRobin});
  std::vector<WorkerInfo> ws = {Prefill("p-b", 0), Prefill("p-a", 0), Prefill("p-c", 0),
                                Decode("d-0", 10, 10, 0, 4)};
  ws[2].healthy = false;  // p-c is skipped
  std::map<std::string, int> counts;
  std::vector<std::string> order;
  for (int i = 0; i < 6; ++i) {
    auto w = r.PickPrefill({}, ws);
    ASSERT_TRUE(w.ok());
    counts[*w]++;
    order.push_back(*w);
  }
  EXPECT_EQ(counts["p-a"], 3);
  EXPECT_EQ(counts["p-b"], 3);
  EXPECT_EQ(counts.count("p-c"), 0u);
  EXPECT_EQ(counts.count("d-0"), 0u);
  for (size_t i = 1; i < order.size(); ++i) EXPECT_NE(order[i], order[i - 1]);
}

TEST(RouterTest, LeastLoadedPicksFewestQueuedTokensThenRunning) {
  Router r({RouterPolicy::kLeastLoaded});
  std::vector<WorkerInfo> ws = {Prefill("p-0", 500), Prefill("p-1", 100, 3),
                                Prefill("p-2", 100, 1)};
  EXPECT_EQ(*r.PickPrefill({}, ws), "p-2");
  ws[2].queued_tokens = 1000;
  EXPECT_EQ(*r.PickPrefill({}, ws), "p-1");
}

TEST(RouterTest, PrefixAwarePrefersCachedPrefixMinusQueuedWork) {
  Router r({RouterPolicy::kPrefixAware});
  std::vector<PrefixBlockHash> chain = {H(1), H(2), H(3), H(4)};
  // p-1 caches the first 3 blocks (48 tokens), p-0 only the first one.
  r.prefix_index().OnStored("p-0", H(1));
  r.prefix_index().OnStored("p-0", H(3));  // not a leading run: does not count
  for (uint8_t v : {1, 2, 3}) r.prefix_index().OnStored("p-1", H(v));
  EXPECT_EQ(r.prefix_index().MatchedBlocks("p-0", chain), 1);
  EXPECT_EQ(r.prefix_index().MatchedBlocks("p-1", chain), 3);
  std::vector<WorkerInfo> ws = {Prefill("p-0", 0), Prefill("p-1", 20)};
  RouteRequest req;
  req.prefix_blocks = chain;
  // p-0: 16 - 0 = 16; p-1: 48 - 20 = 28.
  EXPECT_EQ(*r.PickPrefill(req, ws), "p-1");
  // Enough queued work on p-1 outweighs its cache: 48 - 40 = 8 < 16.
  ws[1].queued_tokens = 40;
  EXPECT_EQ(*r.PickPrefill(req, ws), "p-0");
  // Eviction removes the advantage.
  ws[1].queued_tokens = 20;
  r.prefix_index().OnEvicted("p-1", H(2));
  EXPECT_EQ(r.prefix_index().MatchedBlocks("p-1", chain), 1);
  EXPECT_EQ(*r.PickPrefill(req, ws), "p-0");  // 16 - 0 vs 16 - 20
  // A worker that leaves forgets its blocks.
  r.prefix_index().RemoveWorker("p-1");
  EXPECT_EQ(r.prefix_index().BlockCount("p-1"), 0);
  // No cache anywhere: least queued wins.
  Router fresh({RouterPolicy::kPrefixAware});
  ws[0].queued_tokens = 30;
  EXPECT_EQ(*fresh.PickPrefill(req, ws), "p-1");
  // Equal scores and queues (idle right after a heartbeat): the smaller
  // running batch wins, not the lowest id.
  ws[0].queued_tokens = 0;
  ws[1].queued_tokens = 0;
  ws[0].running = 3;
  ws[1].running = 1;
  EXPECT_EQ(*fresh.PickPrefill(req, ws), "p-1");
  ws[1].running = 3;
  EXPECT_EQ(*fresh.PickPrefill(req, ws), "p-0");
}

TEST(RouterTest, NoHealthyWorkerIsUnavailable) {
  Router r({RouterPolicy::kPrefixAware});
  std::vector<WorkerInfo> ws = {Prefill("p-0", 0)};
  ws[0].healthy = false;
  EXPECT_EQ(r.PickPrefill({}, ws).status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(r.PickDecode({}, ws).status().code(), StatusCode::kUnavailable);
}

TEST(RouterTest, DecodePlacementByFreeBlocksAndBatch) {
  Router r({RouterPolicy::kRoundRobin});
  RouteRequest req;
  req.prompt_tokens = 100;
  req.max_new_tokens = 60;  // 160 tokens = 10 blocks of 16
  std::vector<WorkerInfo> ws = {
      Decode("d-0", 50, 100, 2, 8),   // 0.50 - 0.25 = 0.25
      Decode("d-1", 80, 100, 6, 8),   // 0.80 - 0.75 = 0.05
      Decode("d-2", 9, 10, 0, 8),     // 9 free < 10 needed: infeasible despite 0.9
      Decode("d-3", 100, 100, 8, 8),  // batch full: infeasible
  };
  EXPECT_EQ(*r.PickDecode(req, ws), "d-0");
  ws[0].running = 7;  // 0.50 - 0.875 < 0.05
  EXPECT_EQ(*r.PickDecode(req, ws), "d-1");
  req.max_new_tokens = 2000;  // needs 132 blocks: nobody has them
  EXPECT_EQ(r.PickDecode(req, ws).status().code(), StatusCode::kResourceExhausted);
}

TEST(RouterTest, ColocatedWorkersServeBothRoles) {
  Router r({RouterPolicy::kLeastLoaded});
  WorkerInfo w;
  w.id = "local";
  w.role = WorkerRole::kColocated;
  std::vector<WorkerInfo> ws = {w};
  EXPECT_EQ(*r.PickPrefill({}, ws), "local");
  EXPECT_EQ(*r.PickDecode({}, ws), "local");
}

// The index against a plain reference (worker -> set of blocks, the per-worker
// scan it replaced), under random stores, evictions and removals over a small
// pool of blocks so that many workers share blocks and chains.
struct ReferenceIndex {
  std::map<std::string, std::set<PrefixBlockHash>> by_worker;
  int64_t Matched(const std::string& w, std::span<const PrefixBlockHash> chain) const {
    auto it = by_worker.find(w);
    if (it == by_worker.end()) return 0;
    int64_t n = 0;
    for (const auto& h : chain) {
      if (!it->second.count(h)) break;
      ++n;
    }
    return n;
  }
};

// The prefix-aware choice as the per-candidate loop made it (same score, same
// tie-breaks, same candidate order).
std::string ReferencePick(const ReferenceIndex& ref, std::span<const PrefixBlockHash> chain,
                          const std::vector<const WorkerInfo*>& candidates) {
  const WorkerInfo* best = nullptr;
  int64_t best_score = std::numeric_limits<int64_t>::min();
  for (const WorkerInfo* w : candidates) {
    int64_t score = ref.Matched(w->id, chain) * w->block_tokens - w->queued_tokens;
    if (best == nullptr || score > best_score ||
        (score == best_score &&
         (w->queued_tokens != best->queued_tokens ? w->queued_tokens < best->queued_tokens
                                                  : w->running < best->running))) {
      best = w;
      best_score = score;
    }
  }
  return best->id;
}

TEST(PrefixIndexTest, MatchesAReferenceUnderRandomStoresEvictionsAndRemovals) {
  std::mt19937_64 rng(12345);
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  constexpr int kWorkers = 12;  // more holders of one block than fit in place
  std::vector<PrefixBlockHash> pool;
  for (int i = 0; i < 48; ++i) {
    PrefixBlockHash h{};
    for (auto& b : h) b = static_cast<uint8_t>(rng());
    pool.push_back(h);
  }
  // Chains are prefixes of a few base sequences (shared prompt prefixes), with
  // a random tail now and then, and the odd repeated block.
  std::vector<std::vector<PrefixBlockHash>> bases(4);
  for (auto& b : bases) {
    for (int i = 0; i < 10; ++i) b.push_back(pool[pick(pool.size())]);
  }
  auto random_chain = [&] {
    std::vector<PrefixBlockHash> c(bases[pick(bases.size())]);
    c.resize(pick(c.size() + 1));
    if (pick(3) == 0) {
      for (size_t i = pick(4); i > 0; --i) c.push_back(pool[pick(pool.size())]);
    }
    return c;
  };
  auto worker = [&] { return "p-" + std::to_string(pick(kWorkers)); };
  std::vector<WorkerInfo> infos;
  for (int i = 0; i < kWorkers; ++i) infos.push_back(Prefill("p-" + std::to_string(i), 0));
  std::vector<const WorkerInfo*> candidates = RoutingCandidates(infos, WorkerRole::kPrefill);

  Router router({RouterPolicy::kPrefixAware});
  PrefixIndex& index = router.prefix_index();
  ReferenceIndex ref;
  int deep = 0;     // queries where a worker matched 3 blocks or more
  int crowded = 0;  // queries where 5 workers or more matched
  for (int step = 0; step < 20000; ++step) {
    const size_t op = pick(100);
    if (op < 50) {  // store, mostly blocks of a base chain so that chains match
      std::string w = worker();
      const auto& b = bases[pick(bases.size())];
      PrefixBlockHash h = pick(4) == 0 ? pool[pick(pool.size())] : b[pick(b.size())];
      index.OnStored(w, h);
      ref.by_worker[w].insert(h);
    } else if (op < 85) {  // evict, sometimes a block the worker does not hold
      std::string w = worker();
      auto it = ref.by_worker.find(w);
      PrefixBlockHash h = pool[pick(pool.size())];
      if (it != ref.by_worker.end() && !it->second.empty() && pick(4) != 0) {
        h = *std::next(it->second.begin(), static_cast<long>(pick(it->second.size())));
      }
      index.OnEvicted(w, h);
      if (it != ref.by_worker.end()) it->second.erase(h);
    } else if (op < 87) {
      std::string w = worker();
      index.RemoveWorker(w);
      ref.by_worker.erase(w);
    } else {
      const std::vector<PrefixBlockHash> chain = random_chain();
      std::vector<PrefixMatch> want;
      for (const auto& [w, blocks] : ref.by_worker) {
        if (int64_t n = ref.Matched(w, chain); n > 0) want.push_back({w, n});
      }
      const std::vector<PrefixMatch> got = index.MatchedBlocksAll(chain);
      deep +=
          std::any_of(want.begin(), want.end(), [](const PrefixMatch& m) { return m.blocks >= 3; });
      crowded += want.size() >= 5;
      ASSERT_EQ(got.size(), want.size()) << "step " << step;
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(got[i].worker, want[i].worker) << "step " << step;
        EXPECT_EQ(got[i].blocks, want[i].blocks) << "step " << step << " " << got[i].worker;
      }
      for (const WorkerInfo& w : infos) {
        ASSERT_EQ(index.MatchedBlocks(w.id, chain), ref.Matched(w.id, chain)) << "step " << step;
        auto it = ref.by_worker.find(w.id);
        ASSERT_EQ(index.BlockCount(w.id),
                  it == ref.by_worker.end() ? 0 : static_cast<int64_t>(it->second.size()));
      }
      // The router's choice is the per-candidate loop's, in id order and in
      // any other candidate order (ties go to the first in that order).
      for (WorkerInfo& w : infos) {
        w.queued_tokens = static_cast<int64_t>(pick(5) * 16);
        w.running = static_cast<int64_t>(pick(3));
      }
      RouteRequest req;
      req.prefix_blocks = chain;
      ASSERT_EQ(*router.PickPrefillAmong(req, candidates), ReferencePick(ref, chain, candidates))
          << "step " << step;
      std::vector<const WorkerInfo*> shuffled = candidates;
      std::shuffle(shuffled.begin(), shuffled.end(), rng);
      ASSERT_EQ(*router.PickPrefillAmong(req, shuffled), ReferencePick(ref, chain, shuffled))
          << "step " << step;
    }
  }
  // The walk was exercised where it matters: long runs, many holders.
  EXPECT_GT(deep, 100);
  EXPECT_GT(crowded, 100);
}

TEST(PrefixIndexTest, RemovedWorkerSlotIsReusedCleanly) {
  PrefixIndex index;
  std::vector<PrefixBlockHash> chain = {H(1), H(2), H(3)};
  for (uint8_t v : {1, 2, 3}) index.OnStored("a", H(v));
  for (uint8_t v : {1, 2}) index.OnStored("b", H(v));
  index.RemoveWorker("a");
  index.OnStored("c", H(1));  // takes a's slot
  EXPECT_EQ(index.MatchedBlocks("a", chain), 0);
  EXPECT_EQ(index.MatchedBlocks("c", chain), 1);
  EXPECT_EQ(index.BlockCount("c"), 1);
  std::vector<PrefixMatch> all = index.MatchedBlocksAll(chain);
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].worker, "b");
  EXPECT_EQ(all[0].blocks, 2);
  EXPECT_EQ(all[1].worker, "c");
  EXPECT_EQ(all[1].blocks, 1);
  // Evicting and storing again, twice over, counts each block once.
  index.OnStored("b", H(2));
  index.OnEvicted("b", H(1));
  index.OnEvicted("b", H(1));
  index.OnStored("b", H(1));
  EXPECT_EQ(index.BlockCount("b"), 2);
  EXPECT_EQ(index.MatchedBlocks("b", chain), 2);
  EXPECT_TRUE(index.MatchedBlocksAll({}).empty());
}

}  // namespace
}  // namespace kvrelay::coordinator
