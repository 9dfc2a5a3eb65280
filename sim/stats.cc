#include "sim/stats.h"

#include <algorithm>
#include <cmath>

namespace kvrelay::sim {

double Percentile(std::vector<double>* v, double q) {
  if (v->empty()) return 0;
  if (!std::is_sorted(v->begin(), v->end())) std::sort(v->begin(), v->end());
  const double pos = q / 100.0 * static_cast<double>(v->size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, v->size() - 1);
  return (*v)[lo] + ((*v)[hi] - (*v)[lo]) * (pos - static_cast<double>(lo));
}

Percentiles Summarize(std::vector<double> v) {
  Percentiles s;
  if (v.empty()) return s;
  double sum = 0;
  for (double x : v) sum += x;
  s.mean = sum / static_cast<double>(v.size());
  s.p50 = Percentile(&v, 50);
  s.p90 = Percentile(&v, 90);
  s.p99 = Percentile(&v, 99);
  return s;
}

}  // namespace kvrelay::sim
