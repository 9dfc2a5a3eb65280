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
  // Nothing from the coordinator for this long (it heartbeats every
  // interval) and the worker drops its link, ends its requests there and
  // re-registers with backoff (--coordinator-timeout-ms): a SIGSTOPped or
  // cut-off coordinator keeps its sockets open, so without it a worker would
  // wait forever. 0 = 3 of the heartbeat intervals the coordinator announces,
  // at least 2 s (1.5 s -> 2 s at the default 500 ms). No hurry is needed:
  // while the coordinator is silent no request reaches this worker or its
  // clients, and the coordinator ends the requests it holds itself; a false
  // positive costs this worker's streaming requests, and a coordinator can be
  // scheduled hundreds of ms late on a loaded host.
  std::chrono::milliseconds coordinator_timeout{0};
  std::chrono::milliseconds kv_timeout{30000};  // a KV stream must complete within this
  // A KV stream whose sender has handed every byte to its transport (decode
  // side: the hand-over frame arrived; prefill side: a delivery in flight) moves at
  // link speed: ms for this model's prompts. No byte for this long means the
  // path is cut without a reset (a link down, a relay that stops forwarding),
  // which no socket error reports: the request fails then, its blocks go back
  // and the sender drops the dead data connection (the next send reconnects),
  // instead of everything waiting for kv_timeout. 2 s = 4 default heartbeat
  // intervals (500 ms): far above a live link's gaps on a loaded host, well
  // under kv_timeout.
  std::chrono::milliseconds kv_progress_timeout{2000};
  // The deadline of every wait inside a TP group for a peer's part of one
  // step (a collective's contribution, a step plan or ping sent). A normal
  // decode step of this model takes ~5-50 ms even on a loaded 2-core host, and
  // a rank answers a ping within one loop turn (<= 100 ms), so a rank silent
  // for 2 s (>= 40 normal steps) is stopped, stalled or dead: rank 0 then ends
  // every request of the group with an error, returns their blocks, leaves the
  // coordinator and exits, and the supervisor (kvrelay launch, launch.sh -R)
  // restarts the group. Short enough that every request has its final status
  // well inside the 30 s kv_timeout the group used before.
  std::chrono::milliseconds tp_step_timeout{2000};
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
