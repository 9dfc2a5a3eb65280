// A periodic line of serving statistics at info level, as vLLM prints one:
//   stats: prompt 812.3 tok/s, generation 95.1 tok/s, running 3, queued 1024 tokens,
//   KV use 12.5%, prefix hit rate 41.0%
// computed from the backend's worker snapshots (their cumulative engine
// totals, carried by heartbeats). Nothing is logged while the cluster is idle.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/backend.h"

namespace kvrelay::coordinator {

class StatsLogger {
 public:
  // Logs every `interval` (> 0) until destroyed. `backend` outlives it.
  StatsLogger(Backend* backend, std::chrono::milliseconds interval);
  ~StatsLogger();
  StatsLogger(const StatsLogger&) = delete;
  StatsLogger& operator=(const StatsLogger&) = delete;

  // The line for the change from `before` to `after`, `seconds` apart;
  // nullopt when nothing ran, was queued or was computed in between. A worker
  // whose totals went down (it restarted) counts from zero.
  static std::optional<std::string> Line(const std::vector<WorkerInfo>& before,
                                         const std::vector<WorkerInfo>& after, double seconds);

 private:
  void Run();

  Backend* const backend_;
  const std::chrono::milliseconds interval_;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;  // guarded by mu_
  std::thread thread_;
};

}  // namespace kvrelay::coordinator
