// This process's CPU time, memory and file descriptors, read from /proc (the
// figures Prometheus client libraries export as process_*): the coordinator
// exports its own, each worker sends its own on its heartbeat.
#pragma once

#include <cstdint>

namespace kvrelay {

struct ProcessStats {
  double cpu_seconds = 0;         // user + system, since the process started
  int64_t resident_bytes = 0;     // RSS
  int64_t virtual_bytes = 0;      // address space
  int64_t open_fds = 0;           // entries of /proc/self/fd
  double start_time_seconds = 0;  // since the Unix epoch
};

// Zeros where /proc cannot be read (not Linux, or a restricted /proc).
ProcessStats ReadProcessStats();

}  // namespace kvrelay
