// Ranks 1..T-1 of a tensor-parallel decode group. A follower has no
// coordinator link and no scheduler: it joins rank 0 over the TP link
// (tp_group.h), mirrors rank 0's pool size, repeats every step plan rank 0
// publishes (engine::TpFollower) and receives its own KV heads of each
// request from the prefill worker rank 0 names (TpExpectKv), acknowledging
// each one (TpKvDone). It stops when rank 0 says so or its link breaks.
#pragma once

#include <atomic>

#include "common/status.h"
#include "worker/worker_options.h"

namespace kvrelay::decode_worker {

Status RunTpFollower(const worker::WorkerOptions& options, const std::atomic<bool>& stop);

}  // namespace kvrelay::decode_worker
