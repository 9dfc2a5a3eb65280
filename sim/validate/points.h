// sim validate's points: a topology's real runs at each (rate, repeat) point
// (run with bench serve or read from a saved set), the profile each point is
// simulated with (re-timed from the low-load runs next to it), and the
// simulation of the same requests. Layering: sim/validate depends on
// sim/calibrate's harness (sim/calibrate/serve_harness.h) and the simulator.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/status.h"
#include "sim/calibrate/serve_harness.h"
#include "sim/profile.h"
#include "sim/validate/compare.h"

namespace kvrelay::sim::validate {

// The points of a validation. Point k = rep * rates.size() + rate index.
struct PointPlan {
  std::vector<double> rates;
  size_t repeats = 1;
  int64_t num_prompts = 0;  // > 0: this many requests a point, else by duration
  double seconds_per_point = 40;
  int64_t min_prompts = 16;
  int64_t input_len = 128, output_len = 32;
  bool retime = true;     // low-load runs next to the points re-time the profile
  bool per_point = true;  // low-load runs around every point, else one per repeat
  // Per point: the N low-load runs nearest the point, N / 2 before it and
  // N / 2 after (fewer at the ends), pooled: 2 follows the machine closest,
  // more are less at the mercy of one run's slow spell.
  int64_t retime_lows = 2;

  size_t points() const { return rates.size() * repeats; }
  // Requests per point: the same duration at every rate (unless num_prompts).
  int64_t PromptsAt(double rate) const;
  // Point k's low-load runs (indices into RealRuns::lows).
  std::vector<size_t> LowsOf(size_t k) const;
};

// Where a saved set keeps one run: KEY-rateR-repN.json for a point's,
// KEY-low-I.json around the points (per point), KEY-low-repN.json before
// each repeat (per repeat). KEY: "colocated", "1p1d", "1p1d-tp2".
std::string RealRunPath(const std::string& dir, const std::string& key, double rate, size_t rep);
std::string LowRunPath(const std::string& dir, const std::string& key, size_t i);
std::string LowRepRunPath(const std::string& dir, const std::string& key, size_t rep);

// One topology's bench serve reports.
struct RealRuns {
  std::vector<nlohmann::json> reals;  // point k
  std::vector<nlohmann::json> lows;   // per_point: points() + 1; else one per repeat; or none
  bool per_point = true;              // how `lows` is laid out
};

// A saved set: its low-load runs as it has them (around every point, before
// every repeat, or none for sets from before re-timing; none unless
// plan.retime).
Result<RealRuns> LoadRealRuns(const std::string& dir, const std::string& key,
                              const PointPlan& plan);

struct ServeSetup {
  std::string model;
  int threads = 1;
  std::string kv_dtype = "f16";
};
// Runs the points on topology `t` (repeats interleaved: rate 1, 2, 3, 1, 2,
// 3, ...) with the plan's low-load runs; saves every report under save_dir
// unless it is empty.
Result<RealRuns> RunRealPoints(const calibrate::Topology& t, const std::string& key,
                               const PointPlan& plan, const ServeSetup& setup,
                               const std::string& save_dir);

// --no-jitter: every request its model's cost (no request-to-request variation).
void DropJitter(Profile* p);

// One point's re-timing: the low-load runs' medians and the two re-fitted
// scales (the decode step's: colocated the step's, a TP group's; and the
// prefill's), as given and re-timed.
struct Retimed {
  bool refit = false;  // false: the point keeps the profile as given
  calibrate::ServePoint low;
  double step_given = 0, prefill_given = 0, step = 0, prefill = 0;
};
struct RetimeResult {
  std::vector<Profile> timed;   // point k's profile
  std::vector<Retimed> points;  // point k's re-timing
  const char* step_name = "";   // which step scale `step` is
};
// The profile each point is simulated with: re-timed from its low-load runs
// (the profile as given without them).
RetimeResult RetimePoints(const Profile& given, const calibrate::Topology& t, const RealRuns& runs,
                          const PointPlan& plan, bool no_jitter);

// Replays each point's real runs in the simulator: each repeat at `phases`
// evenly spaced heartbeat phases (every 500 ms, kvrelay launch's default),
// each with its own draws of the request-to-request variation, with the
// point's re-timed profile and (when re-timed) the profile as given.
Result<std::vector<Compared>> SimulatePoints(const calibrate::Topology& t, const RealRuns& runs,
                                             const RetimeResult& timed, const Profile& given,
                                             const PointPlan& plan, int64_t phases);

}  // namespace kvrelay::sim::validate
