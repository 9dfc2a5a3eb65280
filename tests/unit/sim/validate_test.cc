// sim/validate/'s comparison pieces (compare.h, points.h): pure functions
// over bench serve reports and simulation results.

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "sim/validate/compare.h"
#include "sim/validate/points.h"

namespace kvrelay::sim::validate {
namespace {

using nlohmann::json;

// A bench serve report of requests at `starts`, each `ttft` ms to its first
// token and `tpot` ms a token after, `out` tokens.
json Report(const std::vector<double>& starts, double ttft, double tpot, int out = 5) {
  json r = {{"requests", json::array()}};
  for (double s : starts) {
    r["requests"].push_back({{"ok", true},
                             {"start_s", s},
                             {"prompt_tokens", 16},
                             {"output_tokens", out},
                             {"ttft_ms", ttft},
                             {"e2e_ms", ttft + tpot * (out - 1)}});
  }
  return r;
}

TEST(ValidateCompareTest, RelErrAndMedian) {
  EXPECT_DOUBLE_EQ(RelErr(110, 100), 0.1);
  EXPECT_DOUBLE_EQ(RelErr(0, 0), 0);
  EXPECT_DOUBLE_EQ(RelErr(1, 0), 1);
  EXPECT_DOUBLE_EQ(Median({}), 0);
  EXPECT_DOUBLE_EQ(Median({3, 1, 2}), 2);
  EXPECT_DOUBLE_EQ(Median({4, 1, 2, 3}), 2.5);
}

TEST(ValidateCompareTest, ReplayKeepsArrivalsAndFillsMissingLengths) {
  json r = Report({0.5, 1.25}, 100, 10);
  r["requests"][1].erase("prompt_tokens");
  const auto w = ReplayOf(r, 128, 32);
  ASSERT_EQ(w.size(), 2u);
  EXPECT_DOUBLE_EQ(w[0].arrival_s, 0.5);
  EXPECT_EQ(w[0].prompt_tokens, 16);
  EXPECT_EQ(w[1].prompt_tokens, 128);
  EXPECT_EQ(w[1].output_tokens, 5);
}

TEST(ValidateCompareTest, PoolLowLoadConcatenatesAndTakesMedians) {
  const json a = Report({0, 1}, 100, 10), b = Report({0, 1}, 200, 20);
  const json pooled = PoolLowLoad({&a, &b});
  EXPECT_EQ(pooled["requests"].size(), 4u);
  EXPECT_NEAR(pooled["ttft_ms"].value("p50", 0.0), 150, 50);
  EXPECT_GT(pooled["tpot_ms"].value("p50", 0.0), 0);
}

TEST(ValidateCompareTest, IdenticalHalvesHaveNoSamplingFloor) {
  Compared row;
  row.real.push_back(Report({0, 1, 2, 3}, 100, 10));
  const SamplingFloor f = ComputeSamplingFloor({row});
  EXPECT_EQ(f.cells, 4);
  EXPECT_EQ(f.within, 4);
  EXPECT_DOUBLE_EQ(f.max, 0);
}

TEST(ValidateCompareTest, CountCellsWithinFifteenPercent) {
  Compared row;
  for (int k = 0; k < kMetrics; ++k) {
    row.real_m[k] = 100;
    row.sim_m[k] = k == 0 ? 150 : 105;
  }
  const CellsWithin c = CountCellsWithin(
      {row}, [](const Compared& r) { return r.real_m; }, [](const Compared& r) { return r.sim_m; });
  EXPECT_EQ(c.cells, kMetrics);
  EXPECT_EQ(c.within, kMetrics - 1);
  EXPECT_DOUBLE_EQ(c.max_err, 0.5);
}

TEST(ValidatePointsTest, PromptsAndLowLoadRunsOfAPoint) {
  PointPlan plan;
  plan.rates = {0.5, 1};
  plan.repeats = 2;
  plan.seconds_per_point = 40;
  plan.min_prompts = 16;
  EXPECT_EQ(plan.PromptsAt(0.25), 16);
  EXPECT_EQ(plan.PromptsAt(1), 40);
  plan.num_prompts = 7;
  EXPECT_EQ(plan.PromptsAt(1), 7);
  // Per point, 2 runs: the one before point k and the one after it.
  EXPECT_EQ(plan.LowsOf(0), (std::vector<size_t>{0, 1}));
  EXPECT_EQ(plan.LowsOf(3), (std::vector<size_t>{3, 4}));
  plan.retime_lows = 4;
  EXPECT_EQ(plan.LowsOf(0), (std::vector<size_t>{0, 1, 2}));
  plan.per_point = false;  // one before each repeat
  EXPECT_EQ(plan.LowsOf(3), (std::vector<size_t>{1}));
  EXPECT_EQ(RealRunPath("d", "1p1d", 0.5, 1), "d/1p1d-rate0.5-rep1.json");
  EXPECT_EQ(LowRunPath("d", "colocated", 2), "d/colocated-low-2.json");
}

}  // namespace
}  // namespace kvrelay::sim::validate
