// Reading a cluster's per-worker Prometheus series in tests: GET /metrics on
// the coordinator and the values of one metric by its `worker` label.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <map>
#include <sstream>
#include <string>

#include "coordinator/http_client.h"

namespace kvrelay::testing {

// Values of `name` by the `worker` label (empty when /metrics does not answer 200).
inline std::map<std::string, double> WorkerGauge(uint16_t port, const std::string& name,
                                                 int timeout_ms = 10'000) {
  std::map<std::string, double> out;
  coordinator::HttpCallSpec spec;
  spec.port = port;
  spec.target = "/metrics";
  spec.timeout_ms = timeout_ms;
  auto r = coordinator::HttpCall(spec);
  if (!r.ok() || r->status != 200) return out;
  std::istringstream in(r->body);
  std::string line;
  const std::string prefix = name + "{";
  while (std::getline(in, line)) {
    if (line.rfind(prefix, 0) != 0) continue;
    auto w = line.find("worker=\"");
    auto close = line.find('}');
    if (w == std::string::npos || close == std::string::npos) continue;
    auto wend = line.find('"', w + 8);
    out[line.substr(w + 8, wend - (w + 8))] = std::strtod(line.c_str() + close + 1, nullptr);
  }
  return out;
}

}  // namespace kvrelay::testing
