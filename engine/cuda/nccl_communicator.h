// NCCL communicator of a tensor-parallel decode group on GPUs (one rank per
// process and GPU), implementing the engine's TpCollective.
//
// Bootstrap: rank 0 calls CreateNcclUniqueId() and sends the 128 opaque bytes
// to the other ranks over the control plane (the TP group's TCP link, the
// coordinator); every rank then calls Create with the same id.
//
// Deadlines: the communicator is created non-blocking and every wait (init,
// each collective, each send/receive) polls cudaStreamQuery and
// ncclCommGetAsyncError until its deadline; at the deadline, or on an
// asynchronous error (a peer died), the communicator is aborted with
// ncclCommAbort and every later call fails fast with the first error. NCCL
// cannot recover a communicator, so the caller rebuilds the group.
//
// Thread-compatible: one owner thread.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "common/clock.h"
#include "common/status.h"
#include "engine/cuda/nccl_progress.h"
#include "engine/runtime/tp_collective.h"

namespace kvrelay::engine::cuda {

struct NcclUniqueId {
  std::array<uint8_t, 128> bytes{};  // ncclUniqueId, opaque
};
Result<NcclUniqueId> CreateNcclUniqueId();
// ncclGetVersion against NCCL_VERSION_CODE (nccl_progress.h, rule 2), logged
// once per process; Create and CreateNcclUniqueId call it.
Status CheckLinkedNcclVersion();

struct NcclCommunicatorOptions {
  int rank = 0;
  int size = 1;
  int device = 0;  // CUDA ordinal of this rank
  // Deadline of each wait (init, one collective, one point-to-point op).
  std::chrono::milliseconds timeout{30000};
};

class NcclCommunicator final : public TpCollective {
 public:
  static Result<std::unique_ptr<NcclCommunicator>> Create(const NcclCommunicatorOptions& options,
                                                          const NcclUniqueId& id);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return options_.rank; }
  int size() const override { return options_.size; }
  // TpCollective on host floats: staged through device buffers (the CUDA
  // backend's host-staged TP path and tests use these).
  Status AllReduceSum(float* data, int64_t n) override;
  Status AllGather(const float* local, int64_t n_local, float* out, int64_t n_out) override;

  // The same on device memory, enqueued on `stream` (a cudaStream_t) and
  // waited for with the communicator's deadline before returning.
  Status AllReduceSumDevice(float* data, int64_t n, void* stream);
  Status AllGatherDevice(const float* local, int64_t n_local, float* out, void* stream);
  // Point-to-point bytes of device memory (the nccl KV transport). Enqueued
  // on `stream`; completion is observed with Wait / Poll.
  Status SendDevice(const void* data, size_t bytes, int peer, void* stream);
  Status RecvDevice(void* data, size_t bytes, int peer, void* stream);
  // Groups several Send/RecvDevice calls into one NCCL launch.
  Status GroupStart();
  Status GroupEnd();
  // Waits until the work enqueued on `stream` is done (or the deadline:
  // then the communicator is aborted, DeadlineExceeded).
  Status Wait(void* stream, Deadline deadline);
  // true: done; false: in flight; error: the communicator failed (aborted).
  Result<bool> Poll(void* stream);
  // The first error that broke the communicator (OK while healthy).
  Status health() const { return broken_; }

 private:
  NcclCommunicator(const NcclCommunicatorOptions& options) : options_(options) {}
  Status Abort(Status why);
  // The communicator's asynchronous state; an error aborts it.
  Result<NcclCommState> CheckAsync();
  // Until the state leaves ncclInProgress (nccl_progress.h, rule 1).
  Status WaitEnqueued(Deadline deadline);
  // The result `r` (an ncclResult_t) of a call that enqueues work: an error
  // aborts; ncclInProgress outside a group waits until the work is enqueued.
  Status Accepted(int r, const char* what);

  NcclCommunicatorOptions options_;
  void* comm_ = nullptr;    // ncclComm_t
  void* stream_ = nullptr;  // cudaStream_t for the host-staged calls
  void* dbuf_ = nullptr;    // device staging
  size_t dbuf_bytes_ = 0;
  Status broken_;
  int group_depth_ = 0;  // open GroupStart calls (NCCL groups nest)
};

}  // namespace kvrelay::engine::cuda
