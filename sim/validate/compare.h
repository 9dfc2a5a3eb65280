// sim validate's comparison: a real run's bench serve report against the
// simulation of the same requests, per (topology, rate) point, and the
// statistics over the table's cells. Pure functions over reports and
// simulation results; nothing here runs a process.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "sim/calibrate/serve_harness.h"
#include "sim/cluster_sim.h"
#include "sim/profile.h"

namespace kvrelay::sim::validate {

using nlohmann::json;

// |sim - real| / |real|; for real == 0: 0 when sim is 0 too, else 1.
double RelErr(double sim, double real);
double Median(std::vector<double> v);  // 0 for none

// The compared figures, in this order.
inline constexpr int kMetrics = 5;
inline constexpr const char* kMetricNames[kMetrics] = {"ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms",
                                                       "tpot_p90_ms", "output_tok_s"};

// One (topology, rate) point: its real runs (one per repeat) and their replays.
struct Compared {
  std::string topology;
  double rate = 0;
  std::vector<json> real;
  std::vector<SimResult> sim;  // per repeat, heartbeat phase 0 and jitter seed 0
  // The compared figures: TTFT / TPOT p50 and p90 over the point's requests
  // of every repeat pooled (the simulated ones: of every repeat and phase),
  // and the median output throughput over the repeats (over repeats and
  // phases).
  double real_m[kMetrics] = {}, sim_m[kMetrics] = {};
  double sim_as_given_m[kMetrics] = {};  // the same, with the profile as given
  // Each repeat's own figures, medians over the repeats (the simulated: of
  // the per-phase medians): the statistic before pooling.
  double real_by_repeat_m[kMetrics] = {}, sim_by_repeat_m[kMetrics] = {};
  double real_spread[kMetrics] = {};  // (max - min) / median of the repeats' own figures
};

// The five compared figures of a real run and of its simulation.
void RealMetrics(const json& report, double* m);
void SimMetrics(const SimResult& r, double* m);

// Request latencies pooled over runs, in ms: TTFT and TPOT as bench serve
// computes them ((e2e - TTFT) / (output - 1); 0 for one token).
struct Pooled {
  std::vector<double> ttft, tpot;
  void AddReal(const json& report);
  void AddSim(const SimResult& r);
  // m[0..3]: TTFT p50, p90, TPOT p50, p90.
  void Quantiles(double* m);
};

// Low-load runs pooled into one report (requests concatenated; TTFT / TPOT
// p50 of them all): what the re-timing fits a point's profile from.
json PoolLowLoad(const std::vector<const json*>& runs);

// The requests of a real run, arriving when bench serve actually sent them
// (workload order kept: index i of the result is request i of the run);
// `in` / `out` stand for a request whose report lacks its token counts.
std::vector<SimRequest> ReplayOf(const json& report, int64_t in, int64_t out);

// Cells within 15 % and the largest relative error, over a table's cells.
struct CellsWithin {
  int64_t within = 0, cells = 0;
  double max_err = 0;
};
// `real_of` / `sim_of` pick a row's kMetrics figures (e.g. real_m / sim_m).
template <typename RealOf, typename SimOf>
CellsWithin CountCellsWithin(const std::vector<Compared>& rows, RealOf real_of, SimOf sim_of) {
  CellsWithin c;
  for (const auto& row : rows) {
    for (int k = 0; k < kMetrics; ++k) {
      const double e = RelErr(sim_of(row)[k], real_of(row)[k]);
      c.max_err = std::max(c.max_err, e);
      c.within += e <= 0.15;
      ++c.cells;
    }
  }
  return c;
}

// The sampling floor: the real system against itself, each point's pooled
// requests split into even and odd ones (the same minutes of the machine,
// half the requests each), over the TTFT / TPOT cells. No model can be
// expected closer to the pooled figures than the halves are to each other,
// divided by about sqrt(2).
struct SamplingFloor {
  int64_t within = 0, cells = 0;  // within 15 %
  double median = 0, max = 0;
};
SamplingFloor ComputeSamplingFloor(const std::vector<Compared>& rows);

// Requests that had the cluster to themselves (no other request in flight
// at any time during theirs) depend on nothing but the calibrated costs:
// their real / simulated medians per topology show the profile's drift
// apart from the queueing and contention the other cells test.
struct AloneDrift {
  std::string topology;
  size_t n = 0;
  double ttft_ratio = 0, tpot_ratio = 0;  // medians of real / simulated
};
std::vector<AloneDrift> ComputeAloneDrift(const std::vector<Compared>& rows);  // topology order

// One row of the --json report: the cells, the first repeat's requests real
// vs simulated ("requests") and every repeat's ("requests_by_repeat").
json RowReport(const Compared& row);

}  // namespace kvrelay::sim::validate
