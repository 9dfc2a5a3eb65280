// The worker process shell shared by the three roles:
//   prefill    runs prompts (kPrefillOnly) and streams each layer's KV to the
//              decode worker named in the task, then reports the first token;
//   decode     reserves blocks, receives and verifies KV layer by layer,
//              admits the sequence into its continuous batch and streams tokens;
//   colocated  does both in one engine (the baseline, and small deployments).
// See coordinator/cluster_backend.h for the message flow.
//
// One Worker owns: an engine::Engine (its KV pool), an optional TieredCache
// over a RocksDB tier (prefix KV survives restarts), a TCP KV transport, and
// the control connection to the coordinator. Everything runs on the thread
// that calls Run(); the loop sleeps in the control connection's Receive when
// there is nothing to compute, so an idle worker uses no CPU.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>

#include "common/status.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/model.h"

namespace kvrelay::worker {

enum class Role { kPrefill, kDecode, kColocated };
Result<Role> ParseRole(std::string_view name);  // "prefill" | "decode" | "colocated"
std::string_view RoleName(Role role);

struct WorkerOptions {
  std::string worker_id;  // unique in the cluster, e.g. "prefill-0"
  Role role = Role::kColocated;
  std::string coordinator_host = "127.0.0.1";
  uint16_t coordinator_port = 9000;
  engine::EngineOptions engine;
  // KV data plane (TCP): this worker's peer index and the number of indices.
  int rank = 0;
  int world_size = 2;
  std::string kv_host = "127.0.0.1";
  uint16_t kv_port = 0;  // 0 = ephemeral
  // RocksDB prefix tier; empty = none. Blocks evicted from the pool are
  // spilled there and restored on a later prefix hit, across restarts.
  std::string kv_store_path;
  int64_t kv_store_capacity_bytes = 2ll << 30;
  int64_t kv_ram_tier_bytes = 256ll << 20;
  // Tensor-parallel decode group (role decode only): this process is rank
  // tp_rank of tp_size. Rank 0 registers with the coordinator for the whole
  // group and listens on tp_host:tp_port; the others connect there and follow
  // its step plans (engine/runtime/tensor_parallel.h, worker/tp_group.h).
  int tp_size = 1;
  int tp_rank = 0;
  std::string tp_host = "127.0.0.1";
  uint16_t tp_port = 0;
  engine::TpMode tp_mode = engine::TpMode::kExact;
  std::chrono::milliseconds connect_timeout{30000};
  std::chrono::milliseconds kv_timeout{30000};  // a KV stream must complete within this

  Status Validate() const;
};

class Worker {
 public:
  static Result<std::unique_ptr<Worker>> Create(WorkerOptions options);
  ~Worker();

  // Connects, handshakes, registers and serves until `stop` becomes true or
  // the coordinator goes away (returns Unavailable then). Every request still
  // held is released before it returns.
  Status Run(const std::atomic<bool>& stop);

  class Impl;

 private:
  explicit Worker(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// main() of kvrelay-prefill / kvrelay-decode / kvrelay-worker: parses flags,
// installs SIGINT/SIGTERM handlers, runs a Worker of `role`.
int WorkerMain(Role role, int argc, char** argv);

}  // namespace kvrelay::worker
