// The cluster simulator against cases whose answer is known in closed form:
// exact ones (deterministic arrivals, a single request through the prefill ->
// link -> decode pipeline, continuous batching and chunked prefill with
// dyadic costs, so every sum is exact in binary floating point) and one
// statistical one (M/D/1 mean wait, with a tolerance the test derives from
// its own batch means).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>

#include "sim/busy_fit.h"
#include "sim/cluster_sim.h"
#include "sim/event_queue.h"
#include "sim/planner.h"
#include "sim/profile.h"
#include "sim/workload.h"

namespace kvrelay::sim {
namespace {

// A profile whose step costs `base` seconds plus `per_token` per token.
Profile Simple(double base, double per_token = 0) {
  Profile p;
  p.name = "test";
  p.layers = 4;
  p.block_tokens = 16;
  p.kv_bytes_per_token = 1024;
  p.kv_pool_blocks = 4096;
  p.max_step_tokens = 512;
  p.max_running = 64;
  p.layerwise_transfer = false;
  p.step = {base, 0, per_token, 0, 0, 0, "test", {}, ""};
  p.transports["tcp"] = {0, 1e12, "test"};
  p.store_restore = {0, 1e12, "test"};
  p.colocated.source = p.prefill.source = p.decode.source = "test";
  return p;
}

ClusterConfig Colocated(int n) {
  ClusterConfig c;
  c.colocated = n;
  c.prefill = c.decode = 0;
  return c;
}

std::vector<SimRequest> Evenly(int n, double gap, int64_t prompt, int64_t output) {
  std::vector<SimRequest> w;
  for (int i = 0; i < n; ++i) w.push_back({gap * i, prompt, output, -1, 0});
  return w;
}

TEST(EventQueueTest, TimeOrderThenPushOrder) {
  EventQueue q;
  q.Push(2.0, 1, 0, 10);
  q.Push(1.0, 1, 0, 20);
  q.Push(1.0, 1, 0, 30);
  q.Push(0.5, 1, 0, 40);
  std::vector<uint64_t> order;
  while (!q.empty()) order.push_back(q.Pop().arg);
  EXPECT_EQ(order, (std::vector<uint64_t>{40, 20, 30, 10}));
  EXPECT_EQ(q.now(), 2.0);
  q.Push(1.0, 1, 0, 50);  // in the past: clamped to now
  EXPECT_EQ(q.Pop().time, 2.0);
}

// D/D/1: requests every a seconds, each served in D > a seconds by one
// worker that runs one request at a time; request k waits exactly k (D - a).
TEST(ClosedFormTest, DeterministicArrivalsQueueExactly) {
  Profile p = Simple(0.5);
  p.max_running = 1;
  auto w = Evenly(40, 0.375, 32, 1);
  auto r = Simulate(p, Colocated(1), w);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->completed, 40);
  for (int k = 0; k < 40; ++k) {
    const auto& t = r->requests[k];
    EXPECT_EQ(t.prefill_start_s - t.arrival_s, k * 0.125) << k;
    EXPECT_EQ(t.ttft_s(), k * 0.125 + 0.5) << k;
  }
  // Under capacity (a > D) nobody waits.
  auto idle = Simulate(p, Colocated(1), Evenly(10, 0.625, 32, 1));
  ASSERT_TRUE(idle.ok());
  for (const auto& t : idle->requests) EXPECT_EQ(t.ttft_s(), 0.5);
}

// A closed loop (SimRequest::after, bench serve --max-concurrency 1): each
// request arrives its delay after the one before it finishes. 0.5 s steps,
// 3 output tokens (a prefill step, two decode steps): request k arrives at
// k (1.5 + 0.25) and finishes 1.5 later; an open-loop request at 0.125 on a
// second worker does not move the loop.
TEST(ClosedFormTest, ClosedLoopArrivesWhenItsPredecessorEnds) {
  Profile p = Simple(0.5);
  std::vector<SimRequest> w = {{0, 16, 3}, {0.125, 16, 3}};
  for (int k = 1; k < 4; ++k) {
    SimRequest q{0.25, 16, 3};
    q.after = k == 1 ? 0 : static_cast<int64_t>(w.size()) - 1;
    w.push_back(q);
  }
  auto r = Simulate(p, Colocated(2), w);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->completed, 5);
  for (int k = 0; k < 4; ++k) {
    const auto& t = r->requests[k == 0 ? 0 : k + 1];
    EXPECT_EQ(t.arrival_s, 1.75 * k) << k;
    EXPECT_EQ(t.finish_s, 1.75 * k + 1.5) << k;
  }
  EXPECT_EQ(r->requests[1].finish_s, 1.625);
  EXPECT_EQ(r->duration_s, 1.75 * 3 + 1.5);
  // A request that follows itself or a later one is an error.
  w[2].after = 2;
  EXPECT_FALSE(Simulate(p, Colocated(2), w).ok());
}

// M/D/1: Poisson arrivals at rate lambda, deterministic service D, one server:
// mean wait in queue Wq = rho D / (2 (1 - rho)). The estimate's standard error
// comes from 20 batch means (batches of 10,000 requests are far longer than
// the queue's correlation time at rho = 0.5, so they are close to
// independent); the test requires the error to be within 4 standard errors
// and the standard error itself to be under 3% of Wq (so the check is tight).
TEST(ClosedFormTest, MD1MeanWait) {
  const double d = 0.5, rho = 0.5;
  Profile p = Simple(d);
  p.max_running = 1;
  WorkloadOptions wo;
  wo.rate = rho / d;
  wo.num_requests = 200'000;
  wo.prompt_tokens = 32;
  wo.output_tokens = 1;
  wo.seed = 12345;
  auto w = GenerateWorkload(wo);
  ASSERT_TRUE(w.ok());
  ClusterConfig c = Colocated(1);
  c.coordinator_max_queue = 1'000'000;
  auto r = Simulate(p, c, *w);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->completed, wo.num_requests);
  const int batches = 20;
  const size_t per = r->requests.size() / batches;
  std::vector<double> means(batches, 0);
  double mean = 0;
  for (size_t i = 0; i < per * batches; ++i) {
    const double wait = r->requests[i].prefill_start_s - r->requests[i].arrival_s;
    means[i / per] += wait / static_cast<double>(per);
    mean += wait / static_cast<double>(per * batches);
  }
  double var = 0;
  for (double m : means) var += (m - mean) * (m - mean) / (batches - 1);
  const double se = std::sqrt(var / batches);
  const double theory = rho * d / (2 * (1 - rho));
  EXPECT_LT(se, 0.03 * theory);
  EXPECT_NEAR(mean, theory, 4 * se) << "se " << se;
}

// One request through prefill -> KV link -> decode: every latency is the sum
// of its stages.
TEST(ClosedFormTest, TransferPipelineIsTheSumOfItsStages) {
  Profile p = Simple(0.25);
  p.kv_bytes_per_token = 1 << 20;
  p.transports["tcp"] = {0.125, static_cast<double>(64 << 20), "test"};  // 64 tokens: 1 s
  p.prefill.ttft_s = 0.0625;
  p.decode.ttft_s = 0.03125;
  ClusterConfig c;  // 1P + 1D
  auto r = Simulate(p, c, {{0.0, 32, 5, -1, 0}});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const auto& t = r->requests[0];
  EXPECT_EQ(t.ttft_s(), 0.25 + 0.0625);                   // one prefill step + hand-off
  EXPECT_EQ(t.kv_ready_s, 0.25 + 0.125 + 0.5 + 0.03125);  // + latency + 32 MiB / 64 MiB/s + admit
  // 4 more tokens, one step each, seen ttft_s late as the first one was
  // (what of a TTFT does not hold the prefill worker delays every token).
  EXPECT_EQ(t.finish_s, t.kv_ready_s + 4 * 0.25 + 0.0625);
  EXPECT_EQ(r->transfers, 1);
  EXPECT_EQ(r->transfer_bytes, 32.0 * (1 << 20));

  // Layer-wise streaming: the link starts with the prefill, so only the
  // later of (prefill + latency + last layer) and (link busy + latency) is left.
  p.layerwise_transfer = true;  // 4 layers
  auto lw = Simulate(p, c, {{0.0, 32, 5, -1, 0}});
  ASSERT_TRUE(lw.ok());
  EXPECT_EQ(lw->requests[0].kv_ready_s, std::max(0.25 + 0.125 + 0.5 / 4, 0.5 + 0.125) + 0.03125);
  p.transports["tcp"].bytes_per_s = static_cast<double>(1024ll << 20);  // a fast link: hidden
  auto fast = Simulate(p, c, {{0.0, 32, 5, -1, 0}});
  ASSERT_TRUE(fast.ok());
  EXPECT_EQ(fast->requests[0].kv_ready_s, 0.25 + 0.125 + 0.03125 / 4 + 0.03125);
}

// Continuous batching: a worker starts a step as soon as it has work; what
// arrives during a step joins the next one, and then the two share steps.
TEST(ClosedFormTest, ContinuousBatchingSharesSteps) {
  Profile p = Simple(0.25, 1.0 / 128);
  std::vector<SimRequest> w = {{0.0, 16, 3, -1, 0}, {0.0625, 16, 3, -1, 0}};
  auto r = Simulate(p, Colocated(1), w);
  ASSERT_TRUE(r.ok());
  const double s1 = 0.25 + 16.0 / 128;  // A's prompt
  const double s2 = 0.25 + 17.0 / 128;  // A's 2nd token + B's prompt
  const double s3 = 0.25 + 2.0 / 128;   // A's 3rd + B's 2nd
  const double s4 = 0.25 + 1.0 / 128;   // B's 3rd
  const auto& a = r->requests[0];
  const auto& b = r->requests[1];
  EXPECT_EQ(a.first_token_s, s1);
  EXPECT_EQ(a.finish_s, s1 + s2 + s3);
  EXPECT_EQ(a.tpot_s(), (s2 + s3) / 2);
  EXPECT_EQ(b.first_token_s, s1 + s2);
  EXPECT_EQ(b.finish_s, s1 + s2 + s3 + s4);
}

// Chunked prefill: a 1,000-token prompt is computed in chunks of what the
// 512-token step budget leaves after the decoding sequence's one token
// (decode first, as the engine schedules).
TEST(ClosedFormTest, ChunkedPrefillBudget) {
  Profile p = Simple(0.25, 1.0 / 1024);
  std::vector<SimRequest> w = {{0.0, 16, 4, -1, 0}, {0.0, 1000, 1, -1, 0}};
  auto r = Simulate(p, Colocated(1), w);
  ASSERT_TRUE(r.ok());
  const double s1 = 0.25 + 16.0 / 1024;   // A's prompt (B arrives during it)
  const double s2 = 0.25 + 512.0 / 1024;  // A: 1, B: 511
  const double s3 = 0.25 + 490.0 / 1024;  // A: 1, B: the last 489
  const double s4 = 0.25 + 1.0 / 1024;    // A: 1
  EXPECT_EQ(r->requests[0].first_token_s, s1);
  EXPECT_EQ(r->requests[1].first_token_s, s1 + s2 + s3);
  EXPECT_EQ(r->requests[0].finish_s, s1 + s2 + s3 + s4);
}

// A decode-only step costs the measured cost of its batch size
// (StepCost::decode_batch_s), a step with a prefill chunk the linear model.
// Hand-computed with 0.25 s steps and batch 2 measured at 0.5 s, A at 0 and
// B at 0.125 (3 tokens each): A's prefill (0.25); A's 2nd token with B's
// prompt (a prefill chunk: linear, 0.25, ends 0.5); both decoding (batch 2,
// 0.5: A done at 1.0); B alone (batch 1, 0.25): 1.25. The linear model: four
// steps of 0.25, A done at 0.75, B at 1.0.
TEST(ClosedFormTest, DecodeOnlyStepsCostTheirMeasuredBatch) {
  Profile p = Simple(0.25);
  p.step.decode_batch_s = {{1, 0.25}, {2, 0.5}};
  p.step.decode_batch_source = "test";
  const std::vector<SimRequest> w = {{0.0, 16, 3, -1, 0}, {0.125, 16, 3, -1, 0}};
  auto r = Simulate(p, Colocated(1), w);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->requests[0].first_token_s, 0.25);
  EXPECT_EQ(r->requests[1].first_token_s, 0.5);
  EXPECT_EQ(r->requests[0].finish_s, 1.0);
  EXPECT_EQ(r->requests[1].finish_s, 1.25);
  EXPECT_EQ(r->requests[1].tpot_s(), 0.375);
  p.step.decode_batch_s.clear();  // the linear model
  auto linear = Simulate(p, Colocated(1), w);
  ASSERT_TRUE(linear.ok());
  EXPECT_EQ(linear->requests[0].finish_s, 0.75);
  EXPECT_EQ(linear->requests[1].finish_s, 1.0);
}

// Prefix reuse and the real router's prefix-aware policy: requests of one
// group, one after another, hit the blocks the first one computed and are
// routed to the worker that holds them.
TEST(SimulatorTest, PrefixCacheHitsAndPrefixAwareRouting) {
  Profile p = Simple(0.25, 1.0 / 1024);
  std::vector<SimRequest> w;
  for (int i = 0; i < 8; ++i) w.push_back({10.0 * i, 80, 2, i % 2, 64});
  ClusterConfig c;
  c.prefill = 2;
  c.decode = 1;
  auto r = Simulate(p, c, w);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->requests[0].cached_tokens, 0);
  EXPECT_EQ(r->requests[1].cached_tokens, 0);
  for (int i = 2; i < 8; ++i) {
    EXPECT_EQ(r->requests[i].cached_tokens, 64) << i;
    // prefix_aware keeps each group on the worker that caches it.
    EXPECT_EQ(r->requests[i].prefill_worker, r->requests[i - 2].prefill_worker) << i;
  }
  // A full-prompt hit still computes the last block's tokens (16 of them, the
  // engine keeps at least one prompt token to sample from).
  auto same = Simulate(p, Colocated(1), {{0.0, 64, 1, 0, 64}, {10.0, 64, 1, 0, 64}});
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(same->requests[1].cached_tokens, 48);
}

// Worker processes sharing one host, as a fluid model: while more processes
// step than there are cores, each advances at cores / busy of its solo speed,
// and every start or end of a step re-rates the others' remaining work.
// Hand-computed: A (0.5 s of work) starts at 0, B (0.5 s) at 0.25 on one
// core. A alone does 0.25 by 0.25; then both run at rate 1/2, so A's last
// 0.25 takes 0.5 s (ends 0.75) while B does 0.25; B's last 0.25 runs alone
// (ends 1.0).
TEST(ContentionTest, SharedCoresAreAFluidShare) {
  Profile p = Simple(0.5);
  ClusterConfig c = Colocated(2);
  c.router = coordinator::RouterPolicy::kRoundRobin;
  c.shared_host_cores = 1;
  auto r = Simulate(p, c, Evenly(2, 0.25, 16, 1));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->requests[0].first_token_s, 0.75);
  EXPECT_EQ(r->requests[1].first_token_s, 1.0);
  EXPECT_NE(r->requests[0].prefill_worker, r->requests[1].prefill_worker);
  // Both at once: both at half speed throughout.
  auto same = Simulate(p, c, Evenly(2, 0.0, 16, 1));
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(same->requests[0].ttft_s(), 1.0);
  EXPECT_EQ(same->requests[1].ttft_s(), 1.0);
  // A core each and no contention: as if alone.
  c.shared_host_cores = 2;
  auto roomy = Simulate(p, c, Evenly(2, 0.25, 16, 1));
  ASSERT_TRUE(roomy.ok());
  EXPECT_EQ(roomy->requests[0].ttft_s(), 0.5);
  EXPECT_EQ(roomy->requests[1].ttft_s(), 0.5);
}

// Contention between processes that each have a core: a step runs
// 1 + alpha x (other busy cores) slower, alpha weighted by the step's fixed /
// decode part (decode_alpha) and prefill part (prefill_alpha).
// Hand-computed on 2 cores: A (1 s of work) from 0, B (1 s) from 0.5. Each
// step is 0.5 s fixed + 0.5 s prefill, so alpha = (0.5 x 1.5 + 0.5 x 0.5) / 1
// = 1 and both run at rate 1 / (1 + 1) = 1/2 while both step: A's last 0.5
// ends at 1.5, B has done 0.5 by then and its last 0.5 runs alone (ends 2.0).
TEST(ContentionTest, AlphaSlowsConcurrentStepsByTheirMix) {
  Profile p = Simple(0.5, 1.0 / 64);  // a 32-token prompt: 0.5 s fixed + 0.5 s prefill
  p.contention = {1.5, 0.5, "test"};
  ClusterConfig c = Colocated(2);
  c.router = coordinator::RouterPolicy::kRoundRobin;
  c.shared_host_cores = 2;
  auto r = Simulate(p, c, Evenly(2, 0.5, 32, 1));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->requests[0].first_token_s, 1.5);
  EXPECT_EQ(r->requests[1].first_token_s, 2.0);
  // Apart in time: no contention at all.
  auto apart = Simulate(p, c, Evenly(2, 1.0, 32, 1));
  ASSERT_TRUE(apart.ok());
  EXPECT_EQ(apart->requests[0].ttft_s(), 1.0);
  EXPECT_EQ(apart->requests[1].ttft_s(), 1.0);
  // Without a shared host the profile's contention does not apply.
  c.shared_host_cores = 0;
  auto own = Simulate(p, c, Evenly(2, 0.5, 32, 1));
  ASSERT_TRUE(own.ok());
  EXPECT_EQ(own->requests[0].ttft_s(), 1.0);
  EXPECT_EQ(own->requests[1].ttft_s(), 1.0);
}

// Max-min fair shares, by hand: what fits is given whole; the rest is split
// evenly among those that want more than their even part.
TEST(ContentionTest, FairLevelIsTheWaterLevel) {
  const double kAll = std::numeric_limits<double>::infinity();
  std::vector<CoreDemand> fits = {{1, 1}, {1, 1}};
  EXPECT_EQ(FairLevel(fits, 2), kAll);
  std::vector<CoreDemand> tp = {{1.4, 1}, {1, 1}};  // a TP 2 group next to a prefill, 2 cores
  EXPECT_EQ(FairLevel(tp, 2), 1);
  std::vector<CoreDemand> three = {{1, 1}, {1, 1}, {1, 1}};  // two workers and the coordinator
  EXPECT_DOUBLE_EQ(FairLevel(three, 2), 2.0 / 3);
  std::vector<CoreDemand> mixed = {{0.5, 1}, {2, 1}, {3, 1}};  // 0.5 whole, then 3.5 / 2 each
  EXPECT_EQ(FairLevel(mixed, 4), 1.75);
  // Weighted: the group (weight 1.5) gets 1.5 x level = 1.2, the prefill 0.8.
  std::vector<CoreDemand> weighted = {{1.4, 1.5}, {1, 1}};
  EXPECT_DOUBLE_EQ(FairLevel(weighted, 2), 0.8);
  // A weight that lets the group's whole demand fit below the level: it
  // takes its 1.2 and the prefill the remaining 0.8.
  std::vector<CoreDemand> whole = {{1.2, 2}, {1, 1}};
  EXPECT_DOUBLE_EQ(FairLevel(whole, 2), 0.8);
  std::vector<CoreDemand> none;
  EXPECT_EQ(FairLevel(none, 2), kAll);
}

// 1P+1D TP 2 on a 2-core host, 0.25 s steps, a 1 GiB/s link: A (3 tokens)
// at 0, B (1 token) at the instant A's KV lands (kTpKv).
constexpr double kTpKv = 0.25 + 1.0 / (1 << 15);
void TpTwoOnTwoCores(Profile* p, ClusterConfig* c, std::vector<SimRequest>* w) {
  *p = Simple(0.25);
  p->transports["tcp"] = {0, static_cast<double>(1 << 30), "test"};
  p->tp[2].source = "test";
  c->tp = 2;
  c->shared_host_cores = 2;
  *w = {{0.0, 32, 3, -1, 0}, {kTpKv, 32, 1, -1, 0}};
}

// A TP group keeps profile.tp[T].cores busy while it steps (its ranks wait
// in the collectives), T when not given. 1P+1D TP 2 on 2 cores, 0.25 s steps:
// A's prefill [0, 0.25], its KV lands 2^-15 s later (32 KiB at 1 GiB/s) and
// its two decode steps start then, B's prefill at the same instant. With
// cores = 1 the host is not oversubscribed (1 + 1 = 2): B's TTFT is 0.25 and
// A finishes 0.5 after its KV. With cores = 2 (the default) 3 cores are
// wanted of 2, shared max-min fairly: B's prefill keeps its core (TTFT 0.25)
// and the group gets the other, half its 2 (0.125 of its step done by
// kv + 0.25, the rest alone by kv + 0.375), then A's last step alone.
// Scaling both by 2/3 instead gave B 0.375.
TEST(ContentionTest, TpGroupCoresAndBusyAlpha) {
  Profile p;
  ClusterConfig c;
  std::vector<SimRequest> w;
  TpTwoOnTwoCores(&p, &c, &w);
  p.tp[2].cores = 1.0;
  const double kv = kTpKv;
  auto one = Simulate(p, c, w);
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  EXPECT_EQ(one->requests[0].kv_ready_s, kv);
  EXPECT_EQ(one->requests[1].ttft_s(), 0.25);
  EXPECT_EQ(one->requests[0].finish_s, kv + 0.5);
  p.tp[2].cores = 0;  // = T
  auto two = Simulate(p, c, w);
  ASSERT_TRUE(two.ok());
  EXPECT_EQ(two->requests[1].ttft_s(), 0.25);
  EXPECT_NEAR(two->requests[0].finish_s, kv + 0.375 + 0.25, 1e-12);
  // share_weight 3 gives the group 3 x the level 0.5 = 1.5 cores (rate 3/4)
  // and B's prefill 0.5 (rate 1/2): B's TTFT 0.5; A's first decode step ends
  // at kv + 1/3, its second does 0.125 by kv + 0.5 and the rest alone.
  p.tp[2].share_weight = 3;
  auto weighted = Simulate(p, c, w);
  ASSERT_TRUE(weighted.ok());
  EXPECT_NEAR(weighted->requests[1].ttft_s(), 0.5, 1e-12);
  EXPECT_NEAR(weighted->requests[0].finish_s, kv + 0.625, 1e-12);
  p.tp[2].share_weight = 1;
  // busy_alpha 1 with cores 1: the group's step runs at 1/2 while B's prefill
  // holds the other core (0.125 of it done by kv + 0.25), the rest alone
  // (kv + 0.375), then its last step; B's prefill is not slowed (its own
  // alpha is the profile's contention, 0).
  p.tp[2].cores = 1;
  p.tp[2].busy_alpha = 1;
  auto gang = Simulate(p, c, w);
  ASSERT_TRUE(gang.ok());
  EXPECT_EQ(gang->requests[1].ttft_s(), 0.25);
  EXPECT_EQ(gang->requests[0].finish_s, kv + 0.375 + 0.25);
  // The prefill role's busy_alpha (measured next to a TP 1 decode worker)
  // does not apply next to a TP group, nor the decode role's to the group.
  p.prefill.busy_alpha = p.decode.busy_alpha = 1;
  p.prefill.busy_source = p.decode.busy_source = "test";
  auto roles = Simulate(p, c, w);
  ASSERT_TRUE(roles.ok());
  EXPECT_EQ(roles->requests[1].ttft_s(), 0.25);
  EXPECT_EQ(roles->requests[0].finish_s, kv + 0.375 + 0.25);
  // The group's prefill_busy_alpha does: 1 slows B's prefill to 1/2 next to
  // the group's step (also at 1/2): both end at kv + 0.5, A's last step alone.
  p.tp[2].prefill_busy_alpha = 1;
  auto prefill = Simulate(p, c, w);
  ASSERT_TRUE(prefill.ok());
  EXPECT_EQ(prefill->requests[1].ttft_s(), 0.5);
  EXPECT_EQ(prefill->requests[0].finish_s, kv + 0.75);
}

// FitTpSharing's terms, put back into the fluid model of two processes (the
// group and one that wants a core), give both measured slowdowns.
TEST(ContentionTest, TpSharingFitReproducesBothProbes) {
  auto check = [](double n, double c_alone, double sd, double sp) {
    const TpSharing t = FitTpSharing(n, c_alone, sd, sp);
    EXPECT_LE(t.cores, c_alone);
    std::vector<CoreDemand> wants = {{1.0, 1.0}, {t.cores, t.share_weight}};
    const double level = FairLevel(wants, n);
    const double group = std::min(1.0, t.share_weight * level / t.cores) /
                         (1 + t.busy_alpha * std::min(1.0, n - t.cores));
    const double single =
        std::min(1.0, level) / (1 + t.prefill_busy_alpha * std::min(t.cores, n - 1));
    EXPECT_NEAR(1 / group, std::max(1.0, sd), 1e-12) << n << " " << c_alone << " " << sd;
    EXPECT_NEAR(1 / single, std::max(1.0, sp), 1e-12) << n << " " << c_alone << " " << sp;
    return t;
  };
  // Oversubscribed, the group's demand below what it keeps busy alone: the
  // fair share alone gives both (weight 2 x 1.17 - 1 = 1.34, demand 1.34).
  TpSharing t = check(2, 1.42, 1.17, 1.17);
  EXPECT_NEAR(t.share_weight, 1.34, 1e-12);
  EXPECT_NEAR(t.cores, 1.34, 1e-12);
  EXPECT_NEAR(t.busy_alpha, 0, 1e-12);
  EXPECT_NEAR(t.prefill_busy_alpha, 0, 1e-12);
  // The demand capped at 1.42: the rest of the group's slowdown is its alpha.
  t = check(2, 1.42, 1.5, 1.1);
  EXPECT_EQ(t.cores, 1.42);
  EXPECT_GT(t.busy_alpha, 0);
  // Room for both (4 cores): whole shares, the slowdowns are the alphas.
  t = check(4, 1.42, 1.2, 1.1);
  EXPECT_EQ(t.share_weight, 1);
  EXPECT_NEAR(t.busy_alpha, 0.2, 1e-12);
  EXPECT_NEAR(t.prefill_busy_alpha, 0.1 / 1.42, 1e-12);
  // No slowdown measured (noise below 1): each gets what it wants, the
  // group's demand the one core left.
  t = check(2, 1.42, 0.98, 0.99);
  EXPECT_NEAR(t.cores, 1, 1e-12);
  EXPECT_NEAR(t.busy_alpha, 0, 1e-12);
  EXPECT_NEAR(t.prefill_busy_alpha, 0, 1e-12);
}

// A disaggregated role's busy_alpha replaces the contention mix for its
// steps. 1P+1D on 2 cores, 0.25 s steps, A's KV lands at kv, when B arrives:
// A's decode steps and B's prefill then hold a core each (others = 1).
//  * prefill.busy_alpha 1, decode.busy_alpha 0 (contention 1 1 ignored): A's
//    first decode step at full speed (kv + 0.25) while B's prefill runs at
//    1/2 (0.125 done), its second (kv + 0.5) next to B's last 0.125 at 1/2:
//    A finishes at kv + 0.5, B's TTFT is 0.5.
//  * Not measured (-1): the contention mix, alpha 1 for both: A's first
//    step and B's prefill at 1/2 both end at kv + 0.5, A's second alone.
TEST(ContentionTest, DisaggregatedRolesBusyAlpha) {
  Profile p = Simple(0.25);
  p.transports["tcp"] = {0, static_cast<double>(1 << 30), "test"};
  p.contention = {1, 1, "test"};
  p.prefill.busy_alpha = 1;
  p.decode.busy_alpha = 0;
  p.prefill.busy_source = p.decode.busy_source = "test";
  ClusterConfig c;
  c.shared_host_cores = 2;
  const double kv = 0.25 + 1.0 / (1 << 15);
  const std::vector<SimRequest> w = {{0.0, 32, 3, -1, 0}, {kv, 32, 1, -1, 0}};
  auto roles = Simulate(p, c, w);
  ASSERT_TRUE(roles.ok()) << roles.status().ToString();
  EXPECT_EQ(roles->requests[0].kv_ready_s, kv);
  EXPECT_EQ(roles->requests[1].ttft_s(), 0.5);
  EXPECT_EQ(roles->requests[0].finish_s, kv + 0.5);
  p.prefill.busy_alpha = p.decode.busy_alpha = -1;
  auto mix = Simulate(p, c, w);
  ASSERT_TRUE(mix.ok());
  EXPECT_EQ(mix->requests[1].ttft_s(), 0.5);
  EXPECT_EQ(mix->requests[0].finish_s, kv + 0.75);
}

// The pairs probe (BusyProbe::pairs), hand-computed. 1P+1D on 2 cores, a
// prefill of 32 tokens P = 1/1024 + 32/128 s, prefill busy_alpha a (decode
// 0), KV transfers and the serving path instant: a pair's first one arrives
// at an idle cluster, so its TTFT is P; the second waits for it, then
// prefills next to its 63 decode steps (longer than it) at 1 / (1 + a): first
// tokens P (1 + a) apart. The figure is 1 + a (to 1e-6).
TEST(ContentionTest, PairsProbeIsAQueuedPrefillNextToADecode) {
  Profile p = Simple(1.0 / 1024, 1.0 / 128);
  p.prefill.busy_source = "test";
  BusyProbe pairs;
  pairs.pairs = true;
  pairs.fg_prompts = 5;
  pairs.fg_in = 32, pairs.fg_out = 64;
  pairs.pair_gap_s = 0.05, pairs.pair_period_s = 2;
  const auto trace = PairTrace(pairs);
  ASSERT_EQ(trace.size(), 10u);
  EXPECT_EQ(trace[3].arrival_s, 2.05);
  EXPECT_EQ(trace[3].output_tokens, 64);
  for (double a : {0.0, 0.25}) {
    p.prefill.busy_alpha = a;
    auto s = SimulatedSlowdown(p, pairs, 2);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_NEAR(*s, 1 + a, 1e-6) << a;
  }
  // Pairs (arrival, first token): (0, 1) (0.05, 1.5) | (3, 4) (3.1, 4.25) |
  // (6, 7) (6.2, 8) | a pair with its second lost | (12, 12.5) (12.1, 13):
  // gaps 0.5 0.25 1 0.5 -> upper median 0.5; first TTFTs 1 1 1 0.5 -> 1.
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const PairFigures f = PairsFigures({0, 0.05, 3, 3.1, 6, 6.2, 9, 9.1, 12, 12.1},
                                     {1, 1.5, 4, 4.25, 7, 8, 10, nan, 12.5, 13});
  EXPECT_EQ(f.pairs, 4u);
  EXPECT_EQ(f.gap_s, 0.5);
  EXPECT_EQ(f.lead_ttft_s, 1);
  EXPECT_EQ(f.slowdown, 0.5);
  EXPECT_EQ(f.decode_slowdown, 0);  // no TPOTs given
  EXPECT_EQ(PairsFigures({}, {}).slowdown, 0);
  // The decode side of the same pairs: TPOTs (first, second) (0.02, 0.01)
  // (0.03, 0.01) (0.024, 0.012) | the lost pair's (1, 1) | (0.018, none):
  // the pairs with both: firsts' median 0.024 over seconds' 0.01.
  const PairFigures d = PairsFigures({0, 0.05, 3, 3.1, 6, 6.2, 9, 9.1, 12, 12.1},
                                     {1, 1.5, 4, 4.25, 7, 8, 10, nan, 12.5, 13},
                                     {0.02, 0.01, 0.03, 0.01, 0.024, 0.012, 1, 1, 0.018, nan});
  EXPECT_EQ(d.slowdown, 0.5);
  EXPECT_DOUBLE_EQ(d.decode_slowdown, 0.024 / 0.01);
  pairs.pair_period_s = 0.01;  // below the gap
  EXPECT_FALSE(SimulatedSlowdown(p, pairs, 2).ok());
}

// ttft_s from a short and a long alone TTFT: with TTFT = outside + k x model
// the two give back outside exactly, whatever the host's scale k; bad pairs
// fall back to the short TTFT less its model, and never go below 0.
TEST(ContentionTest, TtftOutsideWorkerSolvesTheTwoTtfts) {
  for (const double k : {0.8, 1.0, 1.25}) {
    for (const double outside : {0.0, 0.004, 0.03}) {
      const double short_model = 0.027, long_model = 0.62;
      EXPECT_NEAR(TtftOutsideWorker(outside + k * short_model, short_model,
                                    outside + k * long_model, long_model),
                  outside, 1e-12)
          << "k " << k << ", outside " << outside;
    }
  }
  // The long TTFT not above the short one: k = 1.
  EXPECT_NEAR(TtftOutsideWorker(0.05, 0.02, 0.04, 0.6), 0.03, 1e-12);
  // The long model not above the short one: k = 1.
  EXPECT_NEAR(TtftOutsideWorker(0.05, 0.02, 0.7, 0.02), 0.03, 1e-12);
  // A short TTFT below its model at the solved k: 0, not negative.
  EXPECT_EQ(TtftOutsideWorker(0.01, 0.02, 0.6, 0.6), 0.0);
}

// sim calibrate's fit of the roles' busy_alpha (sim/busy_fit.h): slowdowns
// simulated with known alphas are fitted back to those alphas, and each
// fitted alpha reproduces its slowdown. Decode steps (~1 ms) are short next to
// a prefill step (~63 ms), so the KV hand-off's wait for a step boundary
// moves a TTFT by little. A slowdown the simulator exceeds without the alpha
// (here: a speed-up) gives 0.
TEST(ContentionTest, RoleBusyAlphaFitReproducesItsSlowdown) {
  Profile p = Simple(1.0 / 4096, 1.0 / 1024);
  p.prefill.busy_source = p.decode.busy_source = "test";
  BusyProbe pre, dec;
  pre.fg_prompts = 6;  // pairs, each second one prefilling next to the first one's 127 decode steps
  dec.fg_prompts = 9;
  pre.fg_in = dec.fg_in = 64;
  pre.fg_out = 128;
  dec.fg_out = 8;
  pre.pairs = true;
  pre.pair_gap_s = 0.01, pre.pair_period_s = 1;
  dec.bg_prompts = 40, dec.bg_in = 64, dec.bg_out = 1, dec.tpot = true;
  p.prefill.busy_alpha = 0.3;
  p.decode.busy_alpha = 0.15;
  auto sp = SimulatedSlowdown(p, pre, 2);
  auto sd = SimulatedSlowdown(p, dec, 2);
  ASSERT_TRUE(sp.ok() && sd.ok()) << sp.status().ToString() << sd.status().ToString();
  EXPECT_GT(*sp, 1.2);
  EXPECT_GT(*sd, 1.1);
  Profile q = p;
  q.prefill.busy_alpha = q.decode.busy_alpha = 0;
  auto fit = FitRoleBusyAlphas(&q, pre, *sp, dec, *sd, 2);
  ASSERT_TRUE(fit.ok()) << fit.status().ToString();
  EXPECT_NEAR(fit->prefill_alpha, 0.3, 0.01) << fit->log;
  EXPECT_NEAR(fit->decode_alpha, 0.15, 0.01) << fit->log;
  EXPECT_EQ(q.prefill.busy_alpha, fit->prefill_alpha);
  EXPECT_NEAR(fit->prefill_slowdown / *sp, 1, 0.005) << fit->log;
  EXPECT_NEAR(fit->decode_slowdown / *sd, 1, 0.005) << fit->log;
  auto none = FitRoleBusyAlphas(&q, pre, 0.9, dec, 0.9, 2);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->prefill_alpha, 0);
  EXPECT_EQ(none->decode_alpha, 0);
  EXPECT_FALSE(FitRoleBusyAlphas(&q, pre, 0, dec, 1.0, 2).ok());
}

// The serving path's CPU (coordinator, client) takes its share of a shared
// host's cores. Hand-computed with 0.5 s steps on 1 core:
//  * the coordinator charges 0.25 s per request at its arrival (0): it and
//    the prefill step share the core at 1/2 each until the coordinator's
//    0.25 s is done (0.5), the step's last 0.25 runs alone: TTFT 0.75.
//  * the client charges 0.25 s per token: the first token (0.5) and the
//    decode step that starts then share the core until 1.0, the step's last
//    0.25 runs alone: the second token at 1.25.
// On 2 cores a worker and a serving process each have one, and the serving
// process is not an engine step: the profile's contention does not slow the
// worker for it. Without a shared host it costs nothing.
TEST(ContentionTest, ServingCpuTakesItsShareOfTheCores) {
  Profile p = Simple(0.5);
  p.serving_cpu = {0.25, 0, 0, 0, "test"};
  ClusterConfig c = Colocated(1);
  c.shared_host_cores = 1;
  auto r = Simulate(p, c, Evenly(1, 0, 16, 1));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->requests[0].ttft_s(), 0.75);
  EXPECT_EQ(r->serving_cpu_s, 0.25);
  EXPECT_EQ(r->worker_cpu_s, 0.5);
  p.serving_cpu = {0, 0, 0, 0.25, "test"};
  auto tok = Simulate(p, c, Evenly(1, 0, 16, 2));
  ASSERT_TRUE(tok.ok());
  EXPECT_EQ(tok->requests[0].ttft_s(), 0.5);
  EXPECT_EQ(tok->requests[0].finish_s, 1.25);
  EXPECT_EQ(tok->serving_cpu_s, 0.5);  // two tokens
  // 2 cores, contention alpha 1 between engine steps: no slowdown.
  p.serving_cpu = {0.25, 0, 0, 0.25, "test"};
  p.contention = {1, 1, "test"};
  c.shared_host_cores = 2;
  auto roomy = Simulate(p, c, Evenly(1, 0, 16, 2));
  ASSERT_TRUE(roomy.ok());
  EXPECT_EQ(roomy->requests[0].ttft_s(), 0.5);
  EXPECT_EQ(roomy->requests[0].finish_s, 1.0);
  // Both serving processes busy next to the step on 2 cores: 3 want 2, all
  // at 2/3 until the two 0.25 s are done (0.375), then the step's last 0.25.
  p.serving_cpu = {0.25, 0, 0.25, 0, "test"};
  auto three = Simulate(p, c, Evenly(1, 0, 16, 1));
  ASSERT_TRUE(three.ok());
  EXPECT_NEAR(three->requests[0].ttft_s(), 0.625, 1e-12);
  EXPECT_EQ(three->serving_cpu_s, 0.5);
  // Machines of their own: nothing charged.
  c.shared_host_cores = 0;
  auto own = Simulate(p, c, Evenly(1, 0, 16, 1));
  ASSERT_TRUE(own.ok());
  EXPECT_EQ(own->requests[0].ttft_s(), 0.5);
  EXPECT_EQ(own->serving_cpu_s, 0);
}

// The router sees what heartbeats carried (ticks every 0.5 s here) plus the
// prompt tokens the coordinator routed since the last tick; a worker
// publishes its state after each step and (prefill, colocated) at each step's
// start, and a prompt leaves its queued count when its prefill ends.
// Hand-computed with 0.25 s steps of 16 tokens:
//  * A at 0, B at 0.125: A's 16 routed tokens show on worker 0 until the next
//    tick, so B goes to worker 1 (as with exact inputs).
//  * A at 0.375, B at 0.5: the 0.5 tick replaced the accounting with worker
//    0's publication at the start of A's step (16 queued, 1 running), so B
//    goes to worker 1. Were the worker to publish after its steps only (the
//    simulator before), the tick would carry nothing and B would tie and go
//    to worker 0, behind A: TTFT 0.625 + 0.25 - 0.5 instead of 0.25.
//  * A has 48 tokens (3 chunks, ends 0.75; publishes 48, 32, 16 queued at
//    0, 0.25, 0.5 and 0 at 0.75); B at 0.875 sees the 0.5 tick's 16 on worker
//    0 and goes to worker 1, where exact inputs (both idle) pick worker 0.
//    With ticks at 0.25 + k/2, B sees the 0.75 tick: worker 0 idle, worker 0.
TEST(SimulatorTest, HeartbeatStaleRouterInputs) {
  Profile p = Simple(0.25);
  p.max_step_tokens = 16;
  ClusterConfig c = Colocated(2);
  c.heartbeat_s = 0.5;
  auto within = Simulate(p, c, {{0.0, 16, 1, -1, 0}, {0.125, 16, 1, -1, 0}});
  ASSERT_TRUE(within.ok()) << within.status().ToString();
  EXPECT_EQ(within->requests[1].prefill_worker, 1);
  EXPECT_EQ(within->requests[1].ttft_s(), 0.25);

  const std::vector<SimRequest> herd = {{0.375, 16, 1, -1, 0}, {0.5, 16, 1, -1, 0}};
  auto during = Simulate(p, c, herd);
  ASSERT_TRUE(during.ok());
  EXPECT_EQ(during->requests[1].prefill_worker, 1);
  EXPECT_EQ(during->requests[1].ttft_s(), 0.25);
  c.heartbeat_phase_s = 0.5;  // not in [0, heartbeat_s)
  EXPECT_FALSE(Simulate(p, c, herd).ok());
  c.heartbeat_phase_s = 0;
  const std::vector<SimRequest> busy = {{0.0, 48, 1, -1, 0}, {0.875, 16, 1, -1, 0}};
  auto seen = Simulate(p, c, busy);
  ASSERT_TRUE(seen.ok());
  EXPECT_EQ(seen->requests[0].ttft_s(), 0.75);
  EXPECT_EQ(seen->requests[1].prefill_worker, 1);
  c.heartbeat_phase_s = 0.25;  // ticks at 0.25, 0.75: the 0.75 one saw A done
  auto shifted = Simulate(p, c, busy);
  ASSERT_TRUE(shifted.ok());
  EXPECT_EQ(shifted->requests[1].prefill_worker, 0);
  c.heartbeat_phase_s = 0;

  c.heartbeat_s = 0;  // exact inputs
  auto exact = Simulate(p, c, herd);
  ASSERT_TRUE(exact.ok());
  EXPECT_EQ(exact->requests[1].prefill_worker, 1);
  EXPECT_EQ(exact->requests[1].ttft_s(), 0.25);
  auto idle = Simulate(p, c, busy);
  ASSERT_TRUE(idle.ok());
  EXPECT_EQ(idle->requests[1].prefill_worker, 0);
}

TEST(SimulatorTest, DeterministicForASeed) {
  Profile p = Simple(0.01, 1.0 / 4096);
  WorkloadOptions wo;
  wo.rate = 20;
  wo.num_requests = 2000;
  wo.shared_prefix = 64;
  wo.prefix_groups = 5;
  ClusterConfig c;
  c.prefill = 2;
  c.decode = 3;
  auto run = [&](uint64_t seed) {
    wo.seed = seed;
    auto w = GenerateWorkload(wo);
    EXPECT_TRUE(w.ok());
    auto r = Simulate(p, c, *w);
    EXPECT_TRUE(r.ok());
    return *r;
  };
  SimResult a = run(7), b = run(7), other = run(8);
  ASSERT_EQ(a.requests.size(), b.requests.size());
  for (size_t i = 0; i < a.requests.size(); ++i) {
    EXPECT_EQ(a.requests[i].finish_s, b.requests[i].finish_s);
    EXPECT_EQ(a.requests[i].prefill_worker, b.requests[i].prefill_worker);
    EXPECT_EQ(a.requests[i].decode_worker, b.requests[i].decode_worker);
  }
  EXPECT_EQ(a.events, b.events);
  EXPECT_NE(a.ttft_ms.mean, other.ttft_ms.mean);
}

TEST(SimulatorTest, AdmissionRefusesBeyondTheQueue) {
  Profile p = Simple(1.0);
  ClusterConfig c = Colocated(1);
  c.coordinator_max_running = 1;
  c.coordinator_max_queue = 2;
  auto r = Simulate(p, c, Evenly(5, 0.0, 16, 1));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->completed, 3);
  EXPECT_EQ(r->rejected, 2);
  EXPECT_EQ(r->requests[2].ttft_s(), 3.0);  // served one after another
}

TEST(SimulatorTest, BadInputIsAnError) {
  Profile p = Simple(0.25);
  ClusterConfig c;
  c.tp = 2;  // no tp cost in the profile
  EXPECT_FALSE(Simulate(p, c, Evenly(1, 0, 16, 1)).ok());
  EXPECT_FALSE(Simulate(p, ClusterConfig{.colocated = 0, .prefill = 0}, Evenly(1, 0, 16, 1)).ok());
  EXPECT_FALSE(Simulate(p, Colocated(1), {}).ok());
  EXPECT_FALSE(Simulate(p, Colocated(1), Evenly(1, 0, 16 * 5000, 1)).ok());  // over the pool
}

TEST(ProfileTest, JsonRoundTripAndNamedErrors) {
  Profile p = Simple(0.25, 0.001);
  p.tp[2].step_scale = 0.75;
  p.tp[2].per_step_s = 0.002;
  p.tp[2].source = "test";
  p.tp[2].cores = 1.25;
  p.tp[2].busy_alpha = 0.5;
  p.contention = {0.125, 0.0625, "test"};
  auto back = ProfileFromJson(ProfileToJson(p));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->step.per_token_s, 0.001);
  EXPECT_EQ(back->tp.at(2).step_scale, 0.75);
  EXPECT_EQ(back->tp.at(2).cores, 1.25);
  EXPECT_EQ(back->tp.at(2).busy_alpha, 0.5);
  EXPECT_EQ(back->tp.at(2).prefill_busy_alpha, -1);  // not measured: left out, read back as such
  p.tp[2].prefill_busy_alpha = 0.25;
  auto measured = ProfileFromJson(ProfileToJson(p));
  ASSERT_TRUE(measured.ok()) << measured.status().ToString();
  EXPECT_EQ(measured->tp.at(2).prefill_busy_alpha, 0.25);
  EXPECT_EQ(back->contention.decode_alpha, 0.125);
  EXPECT_EQ(back->contention.prefill_alpha, 0.0625);
  p.serving_cpu = {0.5, 0.25, 0.125, 0.0625, "test"};
  auto serving = ProfileFromJson(ProfileToJson(p));
  ASSERT_TRUE(serving.ok()) << serving.status().ToString();
  EXPECT_EQ(serving->serving_cpu.coordinator_per_request_s, 0.5);
  EXPECT_EQ(serving->serving_cpu.coordinator_per_token_s, 0.25);
  EXPECT_EQ(serving->serving_cpu.client_per_request_s, 0.125);
  EXPECT_EQ(serving->serving_cpu.client_per_token_s, 0.0625);
  Profile negative = p;
  negative.serving_cpu.client_per_token_s = -1;
  EXPECT_FALSE(negative.Validate().ok());
  Profile unsourced_cpu = p;
  unsourced_cpu.serving_cpu.source.clear();
  EXPECT_FALSE(unsourced_cpu.Validate().ok());
  p.serving_cpu = {};  // optional: a profile without it costs nothing
  ASSERT_TRUE(p.Validate().ok());
  Profile wide = p;
  wide.tp[2].cores = 3;  // more cores than ranks
  EXPECT_FALSE(wide.Validate().ok());
  Profile unsourced = p;
  unsourced.contention.source.clear();
  EXPECT_FALSE(unsourced.Validate().ok());
  auto bad = ProfileFromJson(R"({"name": "x", "layers": 2})");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("kv_bytes_per_token"), std::string::npos);
  p.step.source.clear();
  EXPECT_FALSE(ProfileFromJson(ProfileToJson(p)).ok());  // every number has a source
}

// The decode-only step by batch size: exact at the measured sizes, linear
// between them and beyond along the last segment (below the smallest along
// the first), the decode attention added; one size: the linear model's
// slope through it; none: the linear model.
TEST(ProfileTest, DecodeBatchCurveAndRoundTrip) {
  Profile p = Simple(0.25, 0.125);
  p.step.per_decode_attn_s = 1.0 / 1024;
  EXPECT_EQ(p.step.DecodeOnlySeconds(3, 512), 0.25 + 3 * 0.125 + 0.5);  // linear
  p.step.decode_batch_s = {{2, 0.5}, {4, 0.75}, {8, 1.0}};
  p.step.decode_batch_source = "test";
  EXPECT_EQ(p.step.DecodeOnlySeconds(2, 0), 0.5);
  EXPECT_EQ(p.step.DecodeOnlySeconds(4, 1024), 0.75 + 1);
  EXPECT_EQ(p.step.DecodeOnlySeconds(3, 0), 0.625);
  EXPECT_EQ(p.step.DecodeOnlySeconds(6, 0), 0.875);
  EXPECT_EQ(p.step.DecodeOnlySeconds(16, 0), 1.5);   // 1.0 + 8 x 0.25 / 4
  EXPECT_EQ(p.step.DecodeOnlySeconds(1, 0), 0.375);  // 0.5 - 0.25 / 2
  Profile one = p;
  one.step.decode_batch_s = {{2, 0.5}};
  EXPECT_EQ(one.step.DecodeOnlySeconds(4, 0), 0.5 + 2 * 0.125);  // per_seq 0 + per_token
  p.prefill.busy_alpha = 0.5;
  p.decode.busy_alpha = 0.25;
  p.prefill.busy_source = p.decode.busy_source = "test";
  auto back = ProfileFromJson(ProfileToJson(p));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->step.decode_batch_s, p.step.decode_batch_s);
  EXPECT_EQ(back->step.decode_batch_source, "test");
  EXPECT_EQ(back->prefill.busy_alpha, 0.5);
  EXPECT_EQ(back->decode.busy_alpha, 0.25);
  EXPECT_EQ(back->colocated.busy_alpha, -1);  // not measured
  Profile unsourced = p;
  unsourced.step.decode_batch_source.clear();
  EXPECT_FALSE(unsourced.Validate().ok());
  Profile zero = p;
  zero.step.decode_batch_s[16] = 0;
  EXPECT_FALSE(zero.Validate().ok());
  Profile colocated = p;
  colocated.colocated.busy_alpha = 1;
  colocated.colocated.busy_source = "test";
  EXPECT_FALSE(colocated.Validate().ok());
  Profile busy_unsourced = p;
  busy_unsourced.decode.busy_source.clear();
  EXPECT_FALSE(busy_unsourced.Validate().ok());
  auto bad_key = ProfileFromJson(R"({"name": "x", "layers": 2, "kv_bytes_per_token": 1,
      "kv_pool_blocks": 8, "step": {"base_s": 1, "per_seq_s": 0, "per_token_s": 0,
      "per_attn_s": 0, "source": "t"}, "decode_batch": {"seconds": {"two": 1}},
      "transports": {"tcp": {"latency_s": 0, "bytes_per_s": 1, "source": "t"}}})");
  ASSERT_FALSE(bad_key.ok());
  EXPECT_NE(bad_key.status().message().find("decode_batch"), std::string::npos);
}

// The serving terms a low-load run fixes, hand-computed: base 0.1 s, the
// model's prefill pass 0.3 s (prefill part 0.2) and decode step 0.02 s.
TEST(ProfileTest, FitServingTermsFromALowLoadRun) {
  Profile p = Simple(0.1);
  p.tp[2].source = "test";
  // Colocated: TPOT 0.03 -> step_scale 1.5; TTFT 0.45 = 1.5 x 0.1 + 0.2 x 1.5.
  FitServingTerms(true, 1, 0.45, 0.03, 0.3, 0.02, false, &p);
  EXPECT_DOUBLE_EQ(p.colocated.step_scale, 1.5);
  EXPECT_DOUBLE_EQ(p.colocated.prefill_scale, 1.5);
  EXPECT_EQ(p.decode.step_scale, 1.0);
  // 1P+1D: TTFT 0.5 = 0.1 + 0.2 x 2; TPOT 0.025 -> decode 1.25.
  FitServingTerms(false, 1, 0.5, 0.025, 0.3, 0.02, false, &p);
  EXPECT_DOUBLE_EQ(p.prefill.prefill_scale, 2.0);
  EXPECT_DOUBLE_EQ(p.decode.step_scale, 1.25);
  EXPECT_EQ(p.prefill.step_scale, 1.0);
  // TP 2: TPOT 0.04 over 1.25 x 0.02 -> 1.6; the prefill's kept unless refit.
  FitServingTerms(false, 2, 0.7, 0.04, 0.3, 0.02, false, &p);
  EXPECT_DOUBLE_EQ(p.tp[2].step_scale, 1.6);
  EXPECT_DOUBLE_EQ(p.prefill.prefill_scale, 2.0);
  FitServingTerms(false, 2, 0.7, 0.04, 0.3, 0.02, true, &p);
  EXPECT_DOUBLE_EQ(p.prefill.prefill_scale, 3.0);  // 0.1 + 0.2 x 3
  EXPECT_DOUBLE_EQ(p.decode.step_scale, 1.25);
  // The prefill role's ttft_s is outside its steps: 0.5 = 0.1 + 0.1 + 0.2 x 1.5.
  p.prefill.ttft_s = 0.1;
  FitServingTerms(false, 1, 0.5, 0.025, 0.3, 0.02, false, &p);
  EXPECT_DOUBLE_EQ(p.prefill.prefill_scale, 1.5);
  p.prefill.ttft_s = 0;
  // Absurd low-load figures stay positive scales.
  FitServingTerms(true, 1, 0.0, 0.0, 0.3, 0.02, false, &p);
  EXPECT_EQ(p.colocated.step_scale, 0.05);
  EXPECT_EQ(p.colocated.prefill_scale, 0.05);
  EXPECT_TRUE(p.Validate().ok());
}

// Request-to-request variation, hand-computed. Ratios to the median of
// {1, 2, 3, 4, 10}: {1/3, 2/3, 1, 4/3, 10/3}; the quantile is linear between
// them. One colocated request of 0.5 s steps (prefill, then one decode step
// for its second token): with every TTFT ratio 2 its service part (0.5 s)
// takes 1.0, its last token shifting with it; with every TPOT ratio 3 its
// token interval (0.5 s) takes 1.5. The disaggregated roles draw the TTFT
// ratio from the prefill role and the TPOT one from the decode role.
TEST(ProfileTest, JitterRatiosQuantilesAndTheirEffect) {
  const std::vector<double> r = JitterRatios({10, 3, 1, 4, 2});
  ASSERT_EQ(r.size(), 5u);
  EXPECT_DOUBLE_EQ(r[0], 1.0 / 3);
  EXPECT_DOUBLE_EQ(r[2], 1.0);
  EXPECT_DOUBLE_EQ(r[4], 10.0 / 3);
  EXPECT_DOUBLE_EQ(JitterQuantile(r, 0.5), 1.0);
  EXPECT_DOUBLE_EQ(JitterQuantile(r, 0.875), (4.0 / 3 + 10.0 / 3) / 2);
  EXPECT_DOUBLE_EQ(JitterQuantile(r, 1.0), 10.0 / 3);
  EXPECT_DOUBLE_EQ(JitterQuantile(r, 0.0), 1.0 / 3);
  EXPECT_EQ(JitterQuantile({}, 0.3), 1.0);
  EXPECT_TRUE(JitterRatios({}).empty());

  Profile p = Simple(0.5);
  p.colocated.ttft_jitter = {2, 2};
  auto a = Simulate(p, Colocated(1), Evenly(1, 0, 16, 2));
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->requests[0].ttft_s(), 1.0);
  EXPECT_EQ(a->requests[0].finish_s, 1.5);
  p.colocated.tpot_jitter = {3};
  auto b = Simulate(p, Colocated(1), Evenly(1, 0, 16, 2));
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->requests[0].ttft_s(), 1.0);
  EXPECT_EQ(b->requests[0].tpot_s(), 1.5);
  EXPECT_EQ(b->requests[0].finish_s, 2.5);
  // The roles: the colocated ratios do not apply to them.
  ClusterConfig d;  // 1P+1D
  auto plain = Simulate(p, d, Evenly(1, 0, 16, 2));
  ASSERT_TRUE(plain.ok());
  p.prefill.ttft_jitter = {2};
  p.decode.tpot_jitter = {3};
  auto roles = Simulate(p, d, Evenly(1, 0, 16, 2));
  ASSERT_TRUE(roles.ok());
  const RequestTiming& x = plain->requests[0];
  const RequestTiming& y = roles->requests[0];
  EXPECT_DOUBLE_EQ(y.first_token_s, x.first_token_s + (x.first_token_s - x.prefill_start_s));
  EXPECT_DOUBLE_EQ(y.finish_s - y.first_token_s, 3 * (x.finish_s - x.first_token_s));
  // The draws are a function of (jitter_seed, request index): the same seed
  // the same figures, seed 0 the default's; another seed other draws from
  // the same ratios. Ratios {1, 2}: a draw u gives 1 + u on the service part.
  {
    Profile q = Simple(0.5);
    q.colocated.ttft_jitter = {1, 2};
    const auto w = Evenly(64, 10, 16, 1);  // apart: each request alone
    auto base = Simulate(q, Colocated(1), w);
    SimOptions o0;
    o0.jitter_seed = 0;
    auto zero = Simulate(q, Colocated(1), w, o0);
    SimOptions o7;
    o7.jitter_seed = 7;
    auto seven = Simulate(q, Colocated(1), w, o7);
    auto again = Simulate(q, Colocated(1), w, o7);
    ASSERT_TRUE(base.ok() && zero.ok() && seven.ok() && again.ok());
    int differ = 0;
    for (size_t i = 0; i < w.size(); ++i) {
      EXPECT_EQ(zero->requests[i].ttft_s(), base->requests[i].ttft_s());
      EXPECT_EQ(again->requests[i].ttft_s(), seven->requests[i].ttft_s());
      EXPECT_GE(seven->requests[i].ttft_s(), 0.5);
      EXPECT_LE(seven->requests[i].ttft_s(), 1.0);
      differ += seven->requests[i].ttft_s() != base->requests[i].ttft_s();
    }
    EXPECT_EQ(differ, 64);
  }
  // JSON round trip; unsorted or non-positive ratios are refused.
  auto back = ProfileFromJson(ProfileToJson(p));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->colocated.ttft_jitter, p.colocated.ttft_jitter);
  EXPECT_EQ(back->decode.tpot_jitter, p.decode.tpot_jitter);
  p.colocated.ttft_jitter = {2, 1};
  EXPECT_FALSE(p.Validate().ok());
  p.colocated.ttft_jitter = {0, 1};
  EXPECT_FALSE(p.Validate().ok());
}

TEST(ProfileTest, NonNegativeLeastSquaresRecoversCoefficients) {
  // b = 2 + 3 x (exact), and a column that would fit negative is fixed at 0.
  std::vector<double> a, b, w;
  for (int x = 0; x < 6; ++x) {
    a.insert(a.end(), {1.0, static_cast<double>(x), x % 2 == 0 ? 1.0 : 0.0});
    b.push_back(2 + 3.0 * x - (x % 2 == 0 ? 0.001 : 0));
    w.push_back(1);
  }
  auto fit = NonNegativeLeastSquares(a, 3, b, w);
  ASSERT_TRUE(fit.ok());
  EXPECT_EQ((*fit)[2], 0.0);
  EXPECT_NEAR((*fit)[1], 3.0, 1e-3);
  EXPECT_FALSE(NonNegativeLeastSquares({1, 1}, 2, {1}, {1}).ok());
}

TEST(WorkloadTest, TraceRoundTripAndErrors) {
  const auto dir = std::filesystem::temp_directory_path() / "kvrelay_sim_test";
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "trace.csv").string();
  WorkloadOptions wo;
  wo.num_requests = 50;
  wo.shared_prefix = 32;
  wo.prefix_groups = 3;
  auto w = GenerateWorkload(wo);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(SaveTrace(path, *w).ok());
  auto back = LoadTrace(path);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ASSERT_EQ(back->size(), w->size());
  for (size_t i = 0; i < w->size(); ++i) {
    EXPECT_NEAR((*back)[i].arrival_s, (*w)[i].arrival_s, 1e-9);
    EXPECT_EQ((*back)[i].prefix_group, (*w)[i].prefix_group);
  }
  {
    std::ofstream f(path);
    f << "0.0,10,5\n1.0,abc,5\n";
  }
  auto bad = LoadTrace(path);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find(":2"), std::string::npos);
  {
    std::ofstream f(path);
    f << "1.0,10,5\n0.5,10,5\n";
  }
  EXPECT_FALSE(LoadTrace(path).ok());  // arrivals go backwards
  EXPECT_FALSE(LoadTrace((dir / "missing.csv").string()).ok());
  std::filesystem::remove_all(dir);
}

TEST(PlannerTest, FindsTheRateWhereTheSloBreaks) {
  // One colocated worker serving one request at a time in 0.25 s: TTFT p90
  // stays under 1 s up to a rate below 4 req/s; the planner's max rate is
  // positive, below capacity, and per node it halves for two nodes of half use.
  Profile p = Simple(0.25);
  p.max_running = 1;
  PlanOptions o;
  o.workload.prompt_tokens = 16;
  o.workload.output_tokens = 1;
  o.ttft_slo_s = 1.0;
  o.tpot_slo_s = 1.0;
  o.requests_per_node = 1000;
  int64_t sims = 0;
  auto rate = MaxRate(p, Colocated(1), o, &sims);
  ASSERT_TRUE(rate.ok());
  EXPECT_GT(*rate, 1.0);
  EXPECT_LT(*rate, 4.0);
  EXPECT_GT(sims, 5);
}

// The planner's configurations see what the real router sees: heartbeats
// every 500 ms unless told otherwise (0 = exact inputs).
TEST(PlannerTest, RouterInputsAreTheHeartbeatsByDefault) {
  Profile p = Simple(0.25);
  p.max_running = 1;
  PlanOptions o;
  o.workload.prompt_tokens = 16;
  o.workload.output_tokens = 1;
  o.max_nodes = 2;
  o.include_disaggregated = false;
  o.requests_per_node = 1000;
  o.bisection_steps = 2;
  EXPECT_EQ(o.heartbeat_s, kDefaultHeartbeatS);
  EXPECT_EQ(kDefaultHeartbeatS, 0.5);
  auto plan = Plan(p, o);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ASSERT_FALSE(plan->ranked.empty());
  for (const auto& c : plan->ranked) EXPECT_EQ(c.config.heartbeat_s, 0.5);
  o.heartbeat_s = 0;
  auto exact = Plan(p, o);
  ASSERT_TRUE(exact.ok());
  for (const auto& c : exact->ranked) EXPECT_EQ(c.config.heartbeat_s, 0);
  o.heartbeat_s = -1;
  EXPECT_FALSE(o.Validate().ok());
}

}  // namespace
}  // namespace kvrelay::sim
