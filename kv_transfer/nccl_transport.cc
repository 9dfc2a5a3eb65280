#include "kv_transfer/nccl_transport.h"

#include <cuda_runtime.h>

#include <cstring>
#include <thread>

#include "engine/cuda/cuda_util.h"
#include "kv_transfer/regions.h"

namespace kvrelay::kv_transfer {
namespace {

using engine::cuda::CudaStatus;

struct WireHeader {
  uint64_t request_id;
  uint32_t tag;
  uint32_t pad;
  uint64_t bytes;
};
static_assert(sizeof(WireHeader) == 24);

}  // namespace

struct NcclTransport::Op {
  bool is_send = false;
  TransferDesc desc;
  std::vector<Region> regions;
  size_t total = 0;
  cudaStream_t stream = nullptr;
  uint8_t* staging = nullptr;  // device: header, then the payload when staged
  bool staged = false;
  bool finished = false;
  Status status;
  ~Op() {
    if (stream != nullptr) {
      cudaStreamSynchronize(stream);
      cudaStreamDestroy(stream);
    }
    if (staging != nullptr) cudaFree(staging);
  }
};

Result<std::unique_ptr<NcclTransport>> NcclTransport::Create(const NcclTransportOptions& options) {
  if (options.comm == nullptr) return InvalidArgument("NcclTransportOptions.comm is null");
  if (options.max_inflight < 1)
    return InvalidArgument("NcclTransportOptions.max_inflight must be >= 1");
  RETURN_IF_ERROR(options.comm->health());
  return std::unique_ptr<NcclTransport>(new NcclTransport(options));
}

NcclTransport::NcclTransport(const NcclTransportOptions& options) : options_(options) {}

NcclTransport::~NcclTransport() {
  std::lock_guard<std::mutex> lock(mu_);
  ops_.clear();  // each Op synchronises its stream (the communicator's deadline bounds it)
}

Result<TransferHandle> NcclTransport::PostSend(const TransferDesc& desc) {
  return Post(desc, true);
}
Result<TransferHandle> NcclTransport::PostRecv(const TransferDesc& desc) {
  return Post(desc, false);
}

Result<TransferHandle> NcclTransport::Post(const TransferDesc& desc, bool is_send) {
  RETURN_IF_ERROR(ValidateDesc(desc, world_size()));
  if (desc.layout.memory != MemoryKind::kDevice) {
    return InvalidArgument("nccl transport moves device memory only (layout.memory = kDevice)");
  }
  std::lock_guard<std::mutex> lock(mu_);
  RETURN_IF_ERROR(options_.comm->health());
  if (static_cast<int>(ops_.size()) >= options_.max_inflight) {
    return ResourceExhausted("nccl transport: " + std::to_string(ops_.size()) +
                             " transfers in flight");
  }
  auto op = std::make_unique<Op>();
  op->is_send = is_send;
  op->desc = desc;
  op->regions = ResolveRegions(desc);
  op->total = TotalBytes(op->regions);
  op->staged = op->regions.size() > 1;
  RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&op->stream, cudaStreamNonBlocking),
                             "cudaStreamCreate"));
  const size_t staging = sizeof(WireHeader) + (op->staged ? op->total : 0);
  RETURN_IF_ERROR(CudaStatus(cudaMalloc(&op->staging, staging), "cudaMalloc(nccl staging)"));
  uint8_t* payload = op->staged ? op->staging + sizeof(WireHeader)
                                : (op->regions.empty() ? nullptr : op->regions[0].data);
  if (is_send) {
    WireHeader h{desc.request_id, desc.tag, 0, op->total};
    RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(op->staging, &h, sizeof(h), cudaMemcpyHostToDevice, op->stream), "header"));
    if (op->staged) {
      size_t off = 0;
      for (const Region& r : op->regions) {
        RETURN_IF_ERROR(CudaStatus(
            cudaMemcpyAsync(payload + off, r.data, r.bytes, cudaMemcpyDeviceToDevice, op->stream),
            "gather"));
        off += r.bytes;
      }
    }
  }
  auto* comm = options_.comm;
  RETURN_IF_ERROR(comm->GroupStart());
  Status st = is_send ? comm->SendDevice(op->staging, sizeof(WireHeader), desc.peer, op->stream)
                      : comm->RecvDevice(op->staging, sizeof(WireHeader), desc.peer, op->stream);
  if (st.ok() && op->total > 0) {
    st = is_send ? comm->SendDevice(payload, op->total, desc.peer, op->stream)
                 : comm->RecvDevice(payload, op->total, desc.peer, op->stream);
  }
  Status end = comm->GroupEnd();
  RETURN_IF_ERROR(st);
  RETURN_IF_ERROR(end);
  const TransferHandle h = next_handle_++;
  ops_[h] = std::move(op);
  return h;
}

Status NcclTransport::FinishLocked(Op& op) {
  op.finished = true;
  if (op.is_send) return op.status = Status::Ok();
  WireHeader h{};
  Status st = CudaStatus(cudaMemcpy(&h, op.staging, sizeof(h), cudaMemcpyDeviceToHost), "header");
  if (st.ok() &&
      (h.request_id != op.desc.request_id || h.tag != op.desc.tag || h.bytes != op.total)) {
    st =
        DataLoss("nccl transfer from peer " + std::to_string(op.desc.peer) + ": expected request " +
                 std::to_string(op.desc.request_id) + " tag " + std::to_string(op.desc.tag) + " (" +
                 std::to_string(op.total) + " bytes), got request " + std::to_string(h.request_id) +
                 " tag " + std::to_string(h.tag) + " (" + std::to_string(h.bytes) +
                 " bytes): posts out of order");
  }
  if (st.ok() && op.staged) {
    size_t off = 0;
    for (const Region& r : op.regions) {
      st = CudaStatus(cudaMemcpyAsync(r.data, op.staging + sizeof(WireHeader) + off, r.bytes,
                                      cudaMemcpyDeviceToDevice, op.stream),
                      "scatter");
      if (!st.ok()) break;
      off += r.bytes;
    }
    if (st.ok()) st = CudaStatus(cudaStreamSynchronize(op.stream), "scatter");
  }
  return op.status = st;
}

Result<bool> NcclTransport::Poll(TransferHandle handle) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ops_.find(handle);
  if (it == ops_.end()) return NotFound("nccl transport: unknown handle " + std::to_string(handle));
  Result<bool> done = options_.comm->Poll(it->second->stream);
  if (done.ok() && !*done) return false;
  Status st = done.ok() ? FinishLocked(*it->second) : done.status();
  ops_.erase(it);
  if (!st.ok()) return st;
  return true;
}

Status NcclTransport::Wait(TransferHandle handle, Deadline deadline) {
  // Polls under the mutex (NCCL communicators are not thread-safe) so other
  // threads can post meanwhile; at the deadline the communicator is aborted
  // (NCCL cannot cancel one operation).
  for (;;) {
    Result<bool> done = Poll(handle);
    if (!done.ok()) return done.status();
    if (*done) return Status::Ok();
    if (deadline.Expired()) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = ops_.find(handle);
      Status st = DeadlineExceeded("nccl transfer did not finish by its deadline");
      if (it != ops_.end()) {
        st = options_.comm->Wait(it->second->stream, Deadline::AfterMs(0));  // aborts
        if (st.ok()) st = FinishLocked(*it->second);
        ops_.erase(it);
      }
      return st;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

Status NcclTransport::Cancel(TransferHandle handle) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = ops_.find(handle);
  if (it == ops_.end()) return NotFound("nccl transport: unknown handle " + std::to_string(handle));
  Result<bool> done = options_.comm->Poll(it->second->stream);
  if (done.ok() && !*done) {
    // Releasing the buffers of an unfinished NCCL operation requires
    // aborting the communicator.
    static_cast<void>(options_.comm->Wait(it->second->stream, Deadline::AfterMs(0)));
  }
  ops_.erase(it);
  return Status::Ok();
}

int NcclTransport::inflight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(ops_.size());
}

}  // namespace kvrelay::kv_transfer
