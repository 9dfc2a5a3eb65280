// Summary statistics shared by the simulator, validation and the planner.
#pragma once

#include <vector>

namespace kvrelay::sim {

struct Percentiles {
  double mean = 0, p50 = 0, p90 = 0, p99 = 0;
};

// Linear interpolation between closest ranks (numpy's default), as
// `kvrelay bench serve` reports them. Sorts `v`. 0 for an empty vector.
double Percentile(std::vector<double>* v, double q);
Percentiles Summarize(std::vector<double> v);

}  // namespace kvrelay::sim
