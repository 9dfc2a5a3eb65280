// Workloads for the cluster simulator: a list of requests with arrival times,
// prompt and output lengths and an optional shared-prefix group, either
// generated (seeded Poisson or evenly spaced arrivals, the same shape as
// `kvrelay bench serve`'s) or read from a trace file.
//
// Trace file (CSV, '#' starts a comment, a header line is allowed):
//   arrival_s,prompt_tokens,output_tokens[,prefix_group[,prefix_tokens]]
// prefix_group -1 (or absent) means no shared prefix; prefix_tokens is how
// many leading prompt tokens the request shares with its group (absent: 0).
// Rows must be in non-decreasing arrival order.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace kvrelay::sim {

struct SimRequest {
  double arrival_s = 0;
  int64_t prompt_tokens = 1;  // >= 1
  int64_t output_tokens = 1;  // >= 1 (ignore_eos: exactly this many are generated)
  int64_t prefix_group = -1;  // -1: none
  int64_t prefix_tokens = 0;  // leading prompt tokens shared with the group (<= prompt_tokens)
  // Closed loop (a client that sends its next request when the last one
  // ends, as bench serve --max-concurrency does): >= 0, an earlier request's
  // index; this one then arrives arrival_s seconds after that one finishes
  // (or is refused), instead of at arrival_s. Open-loop requests (-1) keep
  // their arrival order among themselves; the first request is one.
  int64_t after = -1;
};

struct WorkloadOptions {
  enum class Arrivals { kPoisson, kUniform };
  Arrivals arrivals = Arrivals::kPoisson;
  double rate = 1.0;  // requests per second (> 0)
  int64_t num_requests = 100;
  int64_t prompt_tokens = 128;
  int64_t output_tokens = 32;
  int64_t shared_prefix = 0;  // leading tokens shared within a group
  int64_t prefix_groups = 1;  // with shared_prefix > 0: groups picked uniformly at random
  uint64_t seed = 0;

  Status Validate() const;
};

// Deterministic for a seed. Poisson: exponential gaps with mean 1/rate, the
// first request at t = 0 (as bench serve schedules them).
Result<std::vector<SimRequest>> GenerateWorkload(const WorkloadOptions& options);

Result<std::vector<SimRequest>> LoadTrace(const std::string& path);
Status SaveTrace(const std::string& path, const std::vector<SimRequest>& requests);

}  // namespace kvrelay::sim
