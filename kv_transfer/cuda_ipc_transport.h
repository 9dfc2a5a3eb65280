// cuda_ipc: KV between two processes that share one node (and usually one
// GPU: NCCL refuses two ranks on the same device, CUDA IPC does not), e.g. a
// prefill and a decode worker colocated on one GPU.
//
// The sender exports the device memory its sends read from once
// (RegisterMemory: cudaIpcGetMemHandle on the base of an allocation, e.g. the
// device KV pool slab) and, per PostSend, offers (request_id, tag, byte
// count, and the (handle, offset, length) pieces in wire order) over a
// control socket. The receiver opens each handle once (cudaIpcOpenMemHandle),
// copies the pieces straight into its receive regions on its own stream
// (device to device, or to host memory), records an event, and when the
// event completes answers "done" (or the error) on the socket; the send
// finishes when that answer arrives. So the sender's buffers are read only
// between PostSend and the answer, as transport.h requires.
//
// Matching: a send and a receive match by (request_id, tag) and must carry
// the same byte count (else both fail with InvalidArgument). Offers that
// arrive before their receive are kept (no bytes move until it is posted).
//
// Failure: the control socket closing (peer exit) fails every unfinished
// transfer with Unavailable. Every wait has a deadline; Cancel of a send
// asks the receiver to stop and waits for its answer up to
// options.cancel_timeout (then the peer is declared lost and the socket
// closed, so no later copy can be started).
//
// Thread-safe. One background thread ("ipc-ctl") reads the socket and drives
// the receive copies to completion.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kv_transfer/transport.h"

namespace kvrelay::kv_transfer {

struct CudaIpcTransportOptions {
  int rank = 0;  // 0 or 1; the peer is 1 - rank
  // A connected stream socket (AF_UNIX socketpair or accepted connection) to
  // the peer's transport; the transport owns and closes it.
  int control_fd = -1;
  int device = 0;  // CUDA ordinal both processes use
  int max_inflight = 4096;
  std::chrono::milliseconds cancel_timeout{5000};
};

class CudaIpcTransport final : public Transport {
 public:
  static Result<std::unique_ptr<CudaIpcTransport>> Create(const CudaIpcTransportOptions& options);
  ~CudaIpcTransport() override;
  CudaIpcTransport(const CudaIpcTransport&) = delete;
  CudaIpcTransport& operator=(const CudaIpcTransport&) = delete;

  // Device memory sends may read: `base` must be the start of a cudaMalloc
  // allocation (CUDA IPC exports whole allocations) of `bytes` bytes, alive
  // until the transport is destroyed.
  Status RegisterMemory(const void* base, size_t bytes);

  std::string_view name() const override { return "cuda_ipc"; }
  bool SupportsDeviceMemory() const override { return true; }
  int max_inflight() const override { return options_.max_inflight; }
  int rank() const override { return options_.rank; }
  int world_size() const override { return 2; }

  // Sends: layout.memory must be kDevice and every region inside registered
  // memory. Receives: device or host memory.
  Result<TransferHandle> PostSend(const TransferDesc& desc) override;
  Result<TransferHandle> PostRecv(const TransferDesc& desc) override;
  Result<bool> Poll(TransferHandle handle) override;
  Status Wait(TransferHandle handle, Deadline deadline) override;
  Status Cancel(TransferHandle handle) override;
  int inflight() const override;

 private:
  struct Piece {
    std::array<uint8_t, 64> handle;  // cudaIpcMemHandle_t
    uint64_t offset = 0;
    uint64_t bytes = 0;
  };
  struct Offer {
    uint64_t total = 0;
    std::vector<Piece> pieces;
  };
  struct Registered {
    uintptr_t base = 0;
    size_t bytes = 0;
    std::array<uint8_t, 64> handle;
  };
  struct Op;
  using Key = std::pair<uint64_t, uint32_t>;  // (request_id, tag)

  explicit CudaIpcTransport(const CudaIpcTransportOptions& options);
  Result<TransferHandle> Post(const TransferDesc& desc, bool is_send);
  void ReaderLoop();
  // Both with mu_ held.
  void StartCopyLocked(const std::shared_ptr<Op>& op, const Offer& offer);
  void ProgressLocked();
  void FinishLocked(const std::shared_ptr<Op>& op, Status status);
  void PeerLostLocked(const Status& why);
  Status SendMessageLocked(uint32_t type, const Key& key, uint64_t total, const Status& status,
                           const std::vector<Piece>& pieces);

  const CudaIpcTransportOptions options_;
  void* stream_ = nullptr;  // cudaStream_t of the receive copies
  std::atomic<bool> stop_{false};
  std::thread reader_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  // All guarded by mu_.
  int fd_ = -1;
  Status lost_;  // set once the peer is gone
  TransferHandle next_handle_ = 1;
  std::map<TransferHandle, std::shared_ptr<Op>> ops_;
  std::map<Key, std::shared_ptr<Op>> sends_;  // posted sends awaiting the answer
  std::map<Key, std::shared_ptr<Op>> recvs_;  // posted receives not yet matched
  std::map<Key, Offer> offers_;               // offers not yet matched
  std::vector<std::shared_ptr<Op>> copying_;  // receives whose copies are in flight
  std::vector<Registered> registered_;
  std::map<std::array<uint8_t, 64>, void*> opened_;  // peer handles -> mapped pointer
};

}  // namespace kvrelay::kv_transfer
