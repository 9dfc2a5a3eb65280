// sim validate's printed report: the re-timing lines, the comparison
// table (with each request of a row's first repeat, real vs simulated) and
// the real repeats' spread per cell, as text.
#pragma once

#include <string>
#include <vector>

#include "sim/calibrate/serve_harness.h"
#include "sim/validate/compare.h"
#include "sim/validate/points.h"

namespace kvrelay::sim::validate {

// One line per re-timed point of topology `t`.
std::string FormatRetimed(const calibrate::Topology& t, const PointPlan& plan,
                          const RetimeResult& r);

// The comparison table: real / simulated per cell and the relative error;
// with per_request, each request of a row's first repeat under the row, where
// the simulator put them and the CPU the real run spent.
std::string FormatTable(const std::vector<Compared>& rows, bool per_request);

// The real system against itself, per cell: (max - min) / median over the
// repeats, starred where a cell's error exceeds 15 % but not this spread.
std::string FormatSpreads(const std::vector<Compared>& rows, size_t repeats);

}  // namespace kvrelay::sim::validate
