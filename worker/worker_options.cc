#include "worker/worker_options.h"

#include "engine/runtime/tensor_parallel.h"
#include "kv_transfer/transport_factory.h"

namespace kvrelay::worker {

Result<RoleKind> ParseRoleKind(std::string_view name) {
  if (name == "prefill") return RoleKind::kPrefill;
  if (name == "decode") return RoleKind::kDecode;
  if (name == "colocated") return RoleKind::kColocated;
  return InvalidArgument("unknown worker role '" + std::string(name) +
                         "' (expected prefill, decode or colocated)");
}

std::string_view RoleKindName(RoleKind role) {
  switch (role) {
    case RoleKind::kPrefill:
      return "prefill";
    case RoleKind::kDecode:
      return "decode";
    case RoleKind::kColocated:
      return "colocated";
  }
  return "?";
}

bool WorkerOptions::tp_over_mpi() const {
  if (tp_size < 2 || !kv_transfer::LaunchedByMpirun()) return false;
  if (tp_comm == "mpi") return true;
  return tp_comm == "auto" && (kv_transport == "mpi" || kv_transport == "auto");
}

Status WorkerOptions::Validate() const {
  if (worker_id.empty()) return InvalidArgument("worker id is empty");
  if (cluster_key.empty()) {
    return InvalidArgument(
        "a cluster key is required (--cluster-key-file, the coordinator's file)");
  }
  if (control_tls.enabled() && (control_tls.cert_file.empty() || control_tls.key_file.empty() ||
                                control_tls.ca_file.empty())) {
    return InvalidArgument(
        "control link TLS needs all of --control-tls-cert, --control-tls-key and "
        "--control-tls-ca");
  }
  if (rank < 0 || rank >= world_size) {
    return InvalidArgument("rank " + std::to_string(rank) + " is outside world size " +
                           std::to_string(world_size));
  }
  if (coordinator_timeout.count() < 0) {
    return InvalidArgument("--coordinator-timeout-ms must be >= 0 (0 = 3 heartbeat intervals)");
  }
  if (kv_timeout.count() <= 0 || kv_progress_timeout.count() <= 0) {
    return InvalidArgument("--kv-timeout-ms and --kv-progress-timeout-ms must be positive");
  }
  if (tp_step_timeout.count() <= 0) {
    return InvalidArgument("--tp-step-timeout-ms must be positive");
  }
  if (tp_size < 1 || tp_rank < 0 || tp_rank >= tp_size) {
    return InvalidArgument("TP rank " + std::to_string(tp_rank) + " is outside TP size " +
                           std::to_string(tp_size));
  }
  if (tp_size > 1) {
    if (role != RoleKind::kDecode) {
      return InvalidArgument("tensor parallelism (--tp-size " + std::to_string(tp_size) +
                             ") is for decode workers only");
    }
    if (!kv_store_path.empty()) {
      return InvalidArgument(
          "a tensor-parallel decode group cannot use --kv-store (the prefix "
          "tier lives on prefill workers)");
    }
    if (tp_rank > 0 && tp_port == 0) {
      return InvalidArgument("TP rank " + std::to_string(tp_rank) +
                             " needs --tp-leader HOST:PORT of rank 0");
    }
    RETURN_IF_ERROR(engine::CheckTensorParallelDtype(engine.kv_dtype));
    if (tp_comm != "auto" && tp_comm != "tcp" && tp_comm != "mpi") {
      return InvalidArgument("--tp-comm must be tcp, mpi or auto, got '" + tp_comm + "'");
    }
  }
  return engine.Validate();
}

}  // namespace kvrelay::worker
