// The local launcher: the whole cluster topology as processes on one machine,
// over TCP, without MPI (`kvrelay launch`). Starts one coordinator in cluster
// mode, P prefill workers, D decode workers and C colocated workers, waits
// until /health says ready, then supervises: a process that exits (kill -9,
// a crash) is started again with the same arguments after a backoff, and
// re-registers (a worker) or is re-registered with (the coordinator); a TP
// decode group is restarted as a whole. A process that keeps dying (more than
// max_restarts within restart_window_s) ends supervision with an error naming
// it, and the caller stops the rest.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"
#include "deploy/process_group.h"
#include "engine/kv_cache/kv_cache.h"

namespace kvrelay::deploy {

struct LaunchOptions {
  std::string model_path = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  std::string host = "127.0.0.1";
  uint16_t port = 8080;       // HTTP API; 0 = pick a free port
  uint16_t control_port = 0;  // 0 = pick a free port
  int prefill = 1;
  int decode = 1;
  int tp = 1;                     // decode tensor-parallel size (ranks per decode group)
  std::string tp_mode = "exact";  // exact | reduce (engine::TpMode)
  int colocated = 0;
  int threads_per_worker = 1;  // engine threads of each worker
  // Engine threads of each prefill worker; 0 = threads_per_worker. A prefill
  // worker is compute-bound while the decode ranks wait for its KV, so on one
  // machine it may get all the cores (the pool's dynamic chunks keep the
  // oversubscription cheap when both run).
  int prefill_threads = 0;
  std::string kv_dtype{engine::KvDtypeName(engine::kDefaultKvDtype)};
  // --device of the workers: cpu | cuda[:N]. Colocated workers take
  // decode_device. A TP group given plain "cuda" puts rank r on cuda:r (one
  // GPU per rank); "cuda:N" puts every rank on N.
  std::string prefill_device = "cpu";
  std::string decode_device = "cpu";
  int64_t kv_capacity_mb = 256;
  // RocksDB prefix tier per prefill/colocated worker, in <kv_store_dir>/<worker id>
  // (RocksDB allows one process per database, so workers never share one);
  // empty = none. `kvrelay launch` defaults it to "kvstore" (--no-kv-store: off).
  std::string kv_store_dir;
  // Workers' --kv-timeout-ms (how long a decode worker waits for a request's
  // KV, among others); 0 = the workers' default (30 s). A cold prefill of a
  // long prompt on a loaded CPU can take longer.
  int64_t kv_timeout_ms = 0;
  // The coordinator's --heartbeat-ms (a worker is lost after 3 missed
  // intervals); 0 = its default (500 ms).
  int64_t heartbeat_ms = 0;
  // Silent-fault deadlines, each 0 = that process's default: the
  // coordinator's --heartbeat-timeout-ms (a silent worker is dropped), and
  // every worker's --tp-step-timeout-ms (a silent TP rank breaks its group),
  // --kv-progress-timeout-ms (a KV stream that moves nothing fails) and
  // --coordinator-timeout-ms (a silent coordinator: re-register).
  int64_t heartbeat_timeout_ms = 0;
  int64_t tp_step_timeout_ms = 0;
  int64_t kv_progress_timeout_ms = 0;
  int64_t coordinator_timeout_ms = 0;
  std::string router = "prefix_aware";
  std::string bin_dir;  // where kvrelay-coordinator etc. live; empty = next to this binary
  int ready_timeout_ms = 120'000;
  // The cluster secret every process proves on the internal ports. Empty: with
  // a kv_store_dir, <kv_store_dir>/cluster.key (generated once, mode 0600), so
  // the sealed prefix store is reused by the next launch; without one, a
  // fresh key for this launch (in a private temporary directory removed by
  // Stop()).
  std::string cluster_key_file;
  // Mutual TLS on the control plane: a directory as scripts/make-cluster-
  // certs.sh writes it (ca.crt, coordinator.crt/.key, worker.crt/.key); the
  // coordinator gets --control-tls-* with its pair, every worker its own.
  // Empty = plaintext control links (loopback only here).
  std::string control_tls_dir;
  // Supervise's restart policy. restart = false: the first exit ends
  // supervision (the cluster is stopped). Otherwise a dead process (for a TP
  // group: the whole group, its survivors stopped first, since a group cannot
  // take in a new member) is started again after restart_backoff_ms, doubled
  // for each earlier restart of it still inside the window, capped at
  // restart_backoff_max_ms; a process restarted max_restarts times within
  // restart_window_s and dying again ends supervision with an error.
  // The coordinator's admission control (kvrelay-coordinator --max-running,
  // --max-queue-delay-ms). max_running 0 = its default; the delay bound
  // -1 = its default, 0 = no bound.
  int coordinator_max_running = 0;
  int coordinator_max_queue_delay_ms = -1;
  // Arguments appended verbatim to the coordinator's command line (kvrelay
  // launch --coordinator-arg, repeatable): every kvrelay-coordinator option
  // the launcher has no flag of its own for (--api-keys, --cors-allow-origin,
  // --model-name, --default-max-tokens, ...). Validate() refuses the flags
  // the launcher sets itself (--port, --cluster-key-file, ...), naming the
  // launch flag to use instead.
  std::vector<std::string> coordinator_args;
  bool restart = true;
  int max_restarts = 5;
  int restart_window_s = 60;
  int restart_backoff_ms = 250;
  int restart_backoff_max_ms = 8000;

  Status Validate() const;
};

// The --device one worker process gets: `device`, except plain "cuda" on TP
// rank r > 0, which becomes "cuda:r".
std::string WorkerDevice(const std::string& device, int tp_rank);

class LocalLauncher {
 public:
  explicit LocalLauncher(LaunchOptions options) : options_(std::move(options)) {}
  ~LocalLauncher() { Stop(); }
  LocalLauncher(const LocalLauncher&) = delete;
  LocalLauncher& operator=(const LocalLauncher&) = delete;

  // Spawns every process and waits until the coordinator reports healthy.
  Status Start();
  uint16_t http_port() const { return http_port_; }
  uint16_t control_port() const { return control_port_; }
  // Restarts children that exit, under LaunchOptions' restart policy, until
  // `stop` is set (OK) or a child exits that may not be restarted (the error
  // names it and why). Run it on the thread that called Start and that lives
  // until Stop (PR_SET_PDEATHSIG of a restarted child follows the thread that
  // spawned it, see process_group.h).
  Status Supervise(const std::atomic<bool>& stop);
  // Restarts done by Supervise so far (a TP group counts once per restart).
  int restarts() const { return restarts_.load(); }
  // SIGTERM to every child, SIGKILL to those still running after 15 s: a
  // worker drains its prefix store's write queue to disk on SIGTERM. Then the
  // generated cluster key (if any) is removed.
  void Stop();
  // The key file the processes were given (generated or LaunchOptions').
  const std::string& cluster_key_file() const { return key_file_; }
  // Children by name: "coordinator", "prefill-<i>", "decode-<i>", "worker-<i>".
  // Not thread-safe against Supervise/Stop running concurrently.
  const ProcessGroup& processes() const { return group_; }

 private:
  std::vector<std::string> CoordinatorArgv(const std::string& bin, uint16_t http,
                                           uint16_t control) const;
  // Until the coordinator answers HTTP (any status), or fails if a child exits.
  Status WaitForHttp(const Deadline& deadline);

  LaunchOptions options_;
  ProcessGroup group_;
  // Restart units: a unit's name ("prefill-0", "decode-1" for every rank of a
  // TP group) -> its members in spawn order, and each child's unit.
  std::map<std::string, std::vector<std::string>> units_;
  std::map<std::string, std::string> unit_of_;
  std::atomic<int> restarts_{0};
  uint16_t http_port_ = 0;
  uint16_t control_port_ = 0;
  std::string key_file_;
  std::string key_dir_;  // generated: removed by Stop()
};

// A TCP port on 127.0.0.1 that was free a moment ago.
Result<uint16_t> PickFreePort();

}  // namespace kvrelay::deploy
