// What a worker process is told at startup: its role, the coordinator, the
// engine, the KV data plane, the prefix store and (decode) its TP group.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/model.h"
#include "protocols/cluster_auth.h"
#include "protocols/tls.h"

namespace kvrelay::worker {

// The three daemons. Colocated = prefill and decode in one engine (the
// baseline, and small deployments); it runs the prefill role to completion.
enum class RoleKind { kPrefill, kDecode, kColocated };
Result<RoleKind> ParseRoleKind(std::string_view name);  // "prefill" | "decode" | "colocated"
std::string_view RoleKindName(RoleKind role);

struct WorkerOptions {
  std::string worker_id;  // unique in the cluster, e.g. "prefill-0"
  RoleKind role = RoleKind::kColocated;
  std::string coordinator_host = "127.0.0.1";
  uint16_t coordinator_port = 9000;
  engine::EngineOptions engine;
  // KV data plane: the transport by name (kv_transfer/transport_factory.h),
  // this worker's peer index and the number of indices (mpi: world rank/size).
  std::string kv_transport = "tcp";
  int rank = 0;
  int world_size = 2;
  std::string kv_host = "127.0.0.1";  // tcp: listen address
  uint16_t kv_port = 0;               // tcp: 0 = ephemeral
  std::string advertise_host;         // tcp: the address peers dial (empty = kv_host)
  // RocksDB prefix tier; empty = none. Prefix blocks are written there and
  // loaded back at admission, across restarts.
  std::string kv_store_path;
  int64_t kv_store_capacity_bytes = 2ll << 30;
  int64_t kv_ram_tier_bytes = 256ll << 20;
  // Tensor-parallel decode group (role decode only): this process is rank
  // tp_rank of tp_size. Rank 0 registers with the coordinator for the whole
  // group and listens on tp_host:tp_port; the others connect there and follow
  // its step plans (engine/runtime/tensor_parallel.h, decode_worker/tp_group.h).
  int tp_size = 1;
  int tp_rank = 0;
  std::string tp_host = "127.0.0.1";
  uint16_t tp_port = 0;
  engine::TpMode tp_mode = engine::TpMode::kExact;
  // The group's collectives: "tcp" (the star link), "mpi" (the group's MPI
  // sub-communicator, non-blocking collectives with a deadline) or "auto"
  // (mpi when the KV data plane is mpi).
  std::string tp_comm = "auto";
  std::chrono::milliseconds connect_timeout{30000};
  std::chrono::milliseconds kv_timeout{30000};  // a KV stream must complete within this
  // The cluster secret (--cluster-key-file), proved on every internal port:
  // the control link, the TCP KV data plane, the TP link. Required.
  protocols::ClusterKey cluster_key;
  // Mutual TLS on the control link (--control-tls-cert/-key/-ca, protocols/
  // tls.h); off when none is set. The cluster key is still proved inside it.
  protocols::TlsOptions control_tls;

  bool tp_follower() const { return tp_size > 1 && tp_rank > 0; }
  // Whether this TP group's collectives run over MPI (see tp_comm).
  bool tp_over_mpi() const;
  Status Validate() const;
};

}  // namespace kvrelay::worker
