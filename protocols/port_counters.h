// What an internal port (control, KV data, TP link) refused, counted the same
// way on every one of them so /metrics reads alike.
#pragma once

#include <cstdint>

namespace kvrelay::protocols {

struct PortSecurityCounters {
  uint64_t auth_failures = 0;        // connections that failed the cluster-key challenge-response
  uint64_t refused_connections = 0;  // closed at accept (connection limits)
  uint64_t oversized_frames = 0;     // connections closed at a header over its size limit
  uint64_t foreign_frames = 0;       // an authenticated peer speaking for another identity
};

}  // namespace kvrelay::protocols
