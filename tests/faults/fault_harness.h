// The fault matrix's cluster: `kvrelay launch` run as a real subprocess (the
// launcher supervises and restarts its workers). The client, the /metrics
// readers and the greedy reference are in cluster_client.h.
//
// Every wait has a deadline; conditions are polled until they hold or the
// deadline passes (no sleeps that win races).
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>

#include "common/status.h"
#include "tests/faults/cluster_client.h"

namespace kvrelay::faults {

// `kvrelay launch` as a child process in its own process group, its stderr
// (every process's log) in a file. Stop() (and the destructor) ends it:
// SIGTERM, then SIGKILL to the group after a deadline.
class LaunchedCluster {
 public:
  struct Options {
    int prefill = 1;
    int decode = 1;
    int heartbeat_ms = 200;
    // Silent-fault deadlines (kvrelay launch --heartbeat-timeout-ms,
    // --tp-step-timeout-ms, --kv-progress-timeout-ms, --coordinator-
    // timeout-ms); 0 = the defaults.
    int heartbeat_timeout_ms = 0;
    int tp_step_timeout_ms = 0;
    int kv_progress_timeout_ms = 0;
    int coordinator_timeout_ms = 0;  // --coordinator-timeout-ms
    int kv_timeout_ms = 10'000;
    int max_restarts = 5;
    // deploy/mpirun/launch.sh -X tcp -R max_restarts instead of kvrelay launch.
    bool mpirun = false;
    std::vector<std::string> extra;  // more launcher flags
  };
  static Result<std::unique_ptr<LaunchedCluster>> Start(const Options& options);
  ~LaunchedCluster() { Stop(); }
  LaunchedCluster(const LaunchedCluster&) = delete;
  LaunchedCluster& operator=(const LaunchedCluster&) = delete;

  uint16_t http_port() const { return http_port_; }
  // The pid of the newest process the launcher started as `name`
  // ("coordinator", "prefill-0", "decode-0", "decode-0-tp1"), read from the
  // launcher's "started NAME (pid N)" log lines (launch.sh: from the pid field
  // of the newest "registered as NAME" or coordinator log line); -1 when none.
  pid_t Pid(const std::string& name) const;
  // Number of restarts the launcher logged.
  int Restarts() const;
  // Number of log lines (every process's) containing `text`.
  int CountInLog(const std::string& text) const;
  const std::string& log_path() const { return log_path_; }
  // The last `bytes` of the log (for failure messages).
  std::string LogTail(size_t bytes = 4000) const;
  void Stop();

 private:
  LaunchedCluster() = default;
  bool mpirun_ = false;
  pid_t launcher_ = -1;
  uint16_t http_port_ = 0;
  std::string dir_;
  std::string log_path_;
};

}  // namespace kvrelay::faults
