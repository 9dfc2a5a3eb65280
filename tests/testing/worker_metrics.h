// Reading a cluster's per-worker Prometheus series in tests: GET /metrics on
// the coordinator and the values of one metric by its `worker` label.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "common/http_client.h"

namespace kvrelay::testing {

// The coordinator's /metrics text, one line per element (empty when it does
// not answer 200 within timeout_ms).
inline std::vector<std::string> MetricsLines(uint16_t port, int timeout_ms) {
  std::vector<std::string> lines;
  HttpCallSpec spec;
  spec.port = port;
  spec.target = "/metrics";
  spec.timeout_ms = timeout_ms;
  auto r = HttpCall(spec);
  if (!r.ok() || r->status != 200) return lines;
  std::istringstream in(r->body);
  for (std::string line; std::getline(in, line);) lines.push_back(std::move(line));
  return lines;
}

// The value of label `key` in one series line (empty when it has none).
inline std::string MetricLabel(const std::string& line, const std::string& key) {
  auto at = line.find(key + "=\"");
  if (at == std::string::npos) return "";
  at += key.size() + 2;
  return line.substr(at, line.find('"', at) - at);
}

// A metric's values by worker. Reading a worker whose series is missing gives
// NaN, not 0 (std::map's operator[] would insert a 0): every comparison with
// NaN is false, so a check such as `g["decode-0"] == 0` or `>= 1` fails on a
// missing series or an empty /metrics instead of passing.
class GaugeMap : public std::map<std::string, double> {
 public:
  double operator[](const std::string& worker) const {
    auto it = find(worker);
    return it == end() ? std::numeric_limits<double>::quiet_NaN() : it->second;
  }
};

// Values of `name` by the `worker` label (empty when /metrics does not answer 200).
inline GaugeMap WorkerGauge(uint16_t port, const std::string& name, int timeout_ms = 10'000) {
  GaugeMap out;
  const std::string prefix = name + "{";
  for (const std::string& line : MetricsLines(port, timeout_ms)) {
    if (line.rfind(prefix, 0) != 0) continue;
    const auto close = line.find('}');
    const std::string worker = MetricLabel(line, "worker");
    if (close == std::string::npos || worker.empty()) continue;
    out.insert_or_assign(worker, std::strtod(line.c_str() + close + 1, nullptr));
  }
  return out;
}

// One worker's kvrelay_worker_kv_group_peak_blocks series, by group index:
// {window (0 = full attention), the most blocks one sequence held there}.
struct KvGroupPeak {
  int window = 0;
  double blocks = 0;
};
inline std::map<std::string, std::vector<KvGroupPeak>> WorkerKvGroupPeaks(uint16_t port,
                                                                          int timeout_ms = 10'000) {
  std::map<std::string, std::vector<KvGroupPeak>> out;
  const std::string prefix = "kvrelay_worker_kv_group_peak_blocks{";
  for (const std::string& line : MetricsLines(port, timeout_ms)) {
    if (line.rfind(prefix, 0) != 0) continue;
    const auto close = line.find('}');
    const std::string worker = MetricLabel(line, "worker");
    const std::string group = MetricLabel(line, "group");
    const std::string window = MetricLabel(line, "window");
    if (close == std::string::npos || worker.empty() || group.empty() || window.empty()) continue;
    const size_t g = static_cast<size_t>(std::strtoul(group.c_str(), nullptr, 10));
    auto& groups = out[worker];
    if (groups.size() <= g) groups.resize(g + 1);
    groups[g] = {static_cast<int>(std::strtol(window.c_str(), nullptr, 10)),
                 std::strtod(line.c_str() + close + 1, nullptr)};
  }
  return out;
}

}  // namespace kvrelay::testing
