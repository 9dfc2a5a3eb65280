#include "engine/cuda/nccl_communicator.h"

#include <nccl.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "common/logging.h"
#include "engine/cuda/cuda_util.h"
#include "engine/cuda/nccl_progress.h"

namespace kvrelay::engine::cuda {
namespace {

Status NcclStatus(ncclResult_t r, const char* what) {
  if (r == ncclSuccess || r == ncclInProgress) return Status::Ok();
  std::string m = std::string(what) + ": " + ncclGetErrorString(r);
  if (r == ncclRemoteError || r == ncclSystemError) return Unavailable(std::move(m));
  if (r == ncclInvalidArgument || r == ncclInvalidUsage) return InvalidArgument(std::move(m));
  return Internal(std::move(m));
}
#define KVR_NCCL_RETURN(expr) RETURN_IF_ERROR(NcclStatus((expr), #expr))

ncclComm_t Comm(void* c) { return static_cast<ncclComm_t>(c); }
cudaStream_t S(void* s) { return static_cast<cudaStream_t>(s); }

// Polling interval of the waits: short enough for decode steps, long enough
// not to burn a core.
void Pause() { std::this_thread::sleep_for(std::chrono::microseconds(20)); }

}  // namespace

Status CheckLinkedNcclVersion() {
  int runtime = 0;
  KVR_NCCL_RETURN(ncclGetVersion(&runtime));
  const char* allow = std::getenv("KVRELAY_NCCL_ALLOW_VERSION_MISMATCH");
  const bool allow_mismatch = allow != nullptr && std::string(allow) == "1";
  Status st = CheckNcclVersion(NCCL_VERSION_CODE, runtime, allow_mismatch);
  static std::atomic<bool> logged{false};  // once per process
  if (!logged.exchange(true)) {
    LOG_INFO << "NCCL: built against nccl.h " << NcclVersion::FromCode(NCCL_VERSION_CODE).ToString()
             << ", running with libnccl " << NcclVersion::FromCode(runtime).ToString()
             << (st.ok() ? "" : " (refused)");
  }
  return st;
}

Result<NcclUniqueId> CreateNcclUniqueId() {
  RETURN_IF_ERROR(CheckLinkedNcclVersion());
  ncclUniqueId id;
  KVR_NCCL_RETURN(ncclGetUniqueId(&id));
  static_assert(sizeof(id) == sizeof(NcclUniqueId::bytes));
  NcclUniqueId out;
  std::memcpy(out.bytes.data(), &id, sizeof(id));
  return out;
}

Result<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    const NcclCommunicatorOptions& options, const NcclUniqueId& id) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return InvalidArgument("NcclCommunicatorOptions: rank " + std::to_string(options.rank) +
                           " of size " + std::to_string(options.size));
  }
  RETURN_IF_ERROR(CheckLinkedNcclVersion());
  KVR_CUDA_RETURN(cudaSetDevice(options.device));
  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator(options));
  cudaStream_t s = nullptr;
  KVR_CUDA_RETURN(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  c->stream_ = s;
  ncclUniqueId nid;
  std::memcpy(&nid, id.bytes.data(), sizeof(nid));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every wait below has a deadline
  ncclComm_t comm = nullptr;
  KVR_NCCL_RETURN(ncclCommInitRankConfig(&comm, options.size, nid, options.rank, &config));
  c->comm_ = comm;
  const Deadline deadline = Deadline::After(options.timeout);
  for (;;) {
    ncclResult_t state = ncclSuccess;
    KVR_NCCL_RETURN(ncclCommGetAsyncError(comm, &state));
    if (state == ncclSuccess) break;
    if (state != ncclInProgress) return c->Abort(NcclStatus(state, "ncclCommInitRankConfig"));
    if (deadline.Expired()) {
      return c->Abort(DeadlineExceeded("NCCL communicator init: not every rank joined within " +
                                       std::to_string(options.timeout.count()) + " ms"));
    }
    Pause();
  }
  return c;
}

NcclCommunicator::~NcclCommunicator() {
  if (comm_ != nullptr) {
    if (broken_.ok()) {
      ncclCommDestroy(Comm(comm_));
    } else {
      ncclCommAbort(Comm(comm_));
    }
  }
  if (dbuf_ != nullptr) cudaFree(dbuf_);
  if (stream_ != nullptr) cudaStreamDestroy(S(stream_));
}

Status NcclCommunicator::Abort(Status why) {
  if (broken_.ok()) broken_ = why;
  if (comm_ != nullptr) {
    ncclCommAbort(Comm(comm_));
    comm_ = nullptr;
  }
  return why;
}

Result<NcclCommState> NcclCommunicator::CheckAsync() {
  if (!broken_.ok()) return broken_;
  ncclResult_t state = ncclSuccess;
  const ncclResult_t r = ncclCommGetAsyncError(Comm(comm_), &state);
  if (r != ncclSuccess) return Abort(NcclStatus(r, "ncclCommGetAsyncError"));
  if (state == ncclInProgress) return NcclCommState::kInProgress;
  if (state != ncclSuccess) return Abort(NcclStatus(state, "NCCL communicator (a peer failed?)"));
  return NcclCommState::kSuccess;
}

Status NcclCommunicator::WaitEnqueued(Deadline deadline) {
  for (;;) {
    ASSIGN_OR_RETURN(NcclCommState state, CheckAsync());
    if (state == NcclCommState::kSuccess) return Status::Ok();
    if (deadline.Expired()) {
      return Abort(DeadlineExceeded("NCCL operation was not enqueued by its deadline (rank " +
                                    std::to_string(options_.rank) + " of " +
                                    std::to_string(options_.size) + "); communicator aborted"));
    }
    Pause();
  }
}

Status NcclCommunicator::Accepted(int r, const char* what) {
  const auto result = static_cast<ncclResult_t>(r);
  if (result == ncclSuccess) return Status::Ok();
  if (result != ncclInProgress) return Abort(NcclStatus(result, what));
  // Inside an open group nothing is launched until the outermost GroupEnd.
  if (group_depth_ > 0) return Status::Ok();
  return WaitEnqueued(Deadline::After(options_.timeout));
}

Result<bool> NcclCommunicator::Poll(void* stream) {
  ASSIGN_OR_RETURN(NcclCommState comm, CheckAsync());
  const cudaError_t e = cudaStreamQuery(S(stream));
  StreamState ss = StreamState::kIdle;
  if (e == cudaErrorNotReady) {
    ss = StreamState::kBusy;
  } else if (e != cudaSuccess) {
    return Abort(CudaStatus(e, "cudaStreamQuery"));
  }
  return ClassifyNcclProgress(comm, ss) == NcclOpProgress::kDone;
}

Status NcclCommunicator::Wait(void* stream, Deadline deadline) {
  for (;;) {
    ASSIGN_OR_RETURN(bool done, Poll(stream));
    if (done) return Status::Ok();
    if (deadline.Expired()) {
      return Abort(DeadlineExceeded("NCCL operation did not finish by its deadline (rank " +
                                    std::to_string(options_.rank) + " of " +
                                    std::to_string(options_.size) + "); communicator aborted"));
    }
    Pause();
  }
}

Status NcclCommunicator::GroupStart() {
  RETURN_IF_ERROR(broken_);
  KVR_NCCL_RETURN(ncclGroupStart());
  ++group_depth_;
  return Status::Ok();
}
Status NcclCommunicator::GroupEnd() {
  if (group_depth_ > 0) --group_depth_;
  // The outermost GroupEnd launches the group; on this non-blocking
  // communicator it may return ncclInProgress before the work is on the
  // streams (nccl_progress.h, rule 1): wait until it is.
  return Accepted(ncclGroupEnd(), "ncclGroupEnd");
}

Status NcclCommunicator::SendDevice(const void* data, size_t bytes, int peer, void* stream) {
  RETURN_IF_ERROR(broken_);
  return Accepted(ncclSend(data, bytes, ncclUint8, peer, Comm(comm_), S(stream)), "ncclSend");
}
Status NcclCommunicator::RecvDevice(void* data, size_t bytes, int peer, void* stream) {
  RETURN_IF_ERROR(broken_);
  return Accepted(ncclRecv(data, bytes, ncclUint8, peer, Comm(comm_), S(stream)), "ncclRecv");
}

Status NcclCommunicator::AllReduceSumDevice(float* data, int64_t n, void* stream) {
  RETURN_IF_ERROR(broken_);
  // NCCL's ring sum is not "added in rank order"; TpCollective asks for
  // bit-identical results on every rank, which NCCL's reductions give (every
  // rank receives the same reduced bytes).
  RETURN_IF_ERROR(Accepted(ncclAllReduce(data, data, static_cast<size_t>(n), ncclFloat32, ncclSum,
                                         Comm(comm_), S(stream)),
                           "ncclAllReduce"));
  return Wait(stream, Deadline::After(options_.timeout));
}

Status NcclCommunicator::AllGatherDevice(const float* local, int64_t n_local, float* out,
                                         void* stream) {
  RETURN_IF_ERROR(broken_);
  RETURN_IF_ERROR(Accepted(
      ncclAllGather(local, out, static_cast<size_t>(n_local), ncclFloat32, Comm(comm_), S(stream)),
      "ncclAllGather"));
  return Wait(stream, Deadline::After(options_.timeout));
}

Status NcclCommunicator::AllReduceSum(float* data, int64_t n) {
  RETURN_IF_ERROR(broken_);
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  if (bytes > dbuf_bytes_) {
    if (dbuf_ != nullptr) cudaFree(dbuf_);
    dbuf_ = nullptr;
    dbuf_bytes_ = 0;
    KVR_CUDA_RETURN(cudaMalloc(&dbuf_, bytes));
    dbuf_bytes_ = bytes;
  }
  KVR_CUDA_RETURN(cudaMemcpyAsync(dbuf_, data, bytes, cudaMemcpyHostToDevice, S(stream_)));
  RETURN_IF_ERROR(AllReduceSumDevice(static_cast<float*>(dbuf_), n, stream_));
  KVR_CUDA_RETURN(cudaMemcpyAsync(data, dbuf_, bytes, cudaMemcpyDeviceToHost, S(stream_)));
  return Wait(stream_, Deadline::After(options_.timeout));
}

Status NcclCommunicator::AllGather(const float* local, int64_t n_local, float* out, int64_t n_out) {
  RETURN_IF_ERROR(broken_);
  if (n_out != n_local * options_.size) {
    // NCCL's all-gather needs equal pieces; uneven TP splits are padded by
    // the caller or use the TCP group.
    return InvalidArgument("NCCL AllGather needs equal pieces: n_out " + std::to_string(n_out) +
                           " != " + std::to_string(options_.size) + " x " +
                           std::to_string(n_local));
  }
  const size_t in_bytes = static_cast<size_t>(n_local) * sizeof(float);
  const size_t bytes = in_bytes + static_cast<size_t>(n_out) * sizeof(float);
  if (bytes > dbuf_bytes_) {
    if (dbuf_ != nullptr) cudaFree(dbuf_);
    dbuf_ = nullptr;
    dbuf_bytes_ = 0;
    KVR_CUDA_RETURN(cudaMalloc(&dbuf_, bytes));
    dbuf_bytes_ = bytes;
  }
  float* din = static_cast<float*>(dbuf_);
  float* dout = din + n_local;
  KVR_CUDA_RETURN(cudaMemcpyAsync(din, local, in_bytes, cudaMemcpyHostToDevice, S(stream_)));
  RETURN_IF_ERROR(AllGatherDevice(din, n_local, dout, stream_));
  KVR_CUDA_RETURN(cudaMemcpyAsync(out, dout, static_cast<size_t>(n_out) * sizeof(float),
                                  cudaMemcpyDeviceToHost, S(stream_)));
  return Wait(stream_, Deadline::After(options_.timeout));
}

}  // namespace kvrelay::engine::cuda
