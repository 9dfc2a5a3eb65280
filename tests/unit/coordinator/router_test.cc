#include "coordinator/router.h"

#include <gtest/gtest.h>

#include <map>

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

}  // namespace
}  // namespace kvrelay::coordinator
