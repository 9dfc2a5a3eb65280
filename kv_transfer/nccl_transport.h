// nccl: GPU-to-GPU KV between ranks of one NCCL communicator
// (engine/cuda/nccl_communicator.h), one GPU per rank.
//
// Each transfer is one ncclSend / ncclRecv of its bytes, preceded by a
// 24-byte header (request_id, tag, byte count) in the same NCCL group, on a
// stream of its own. Slices are gathered into (scattered from) a contiguous
// device staging buffer when there is more than one region, so the sender's
// and the receiver's slice boundaries may differ (TP re-sharding), as
// transport.h allows.
//
// NCCL matches point-to-point operations by order, not by key: transfers
// with a given peer must be posted in the same order on both sides (the layer
// stream posts them layer by layer) and with the same byte count; the
// receiver checks the header and fails a transfer whose (request_id, tag,
// bytes) is not the one it posted (DataLoss). Device memory only.
//
// Failure and deadlines: Wait uses the communicator's deadline machinery; an
// expired wait, an asynchronous NCCL error or a Cancel of an unfinished
// transfer (NCCL cannot cancel one operation) aborts the communicator, and
// every unfinished transfer fails; the group must then be rebuilt.
//
// Thread-safe (one mutex; NCCL calls are made under it).
#pragma once

#include <map>
#include <memory>
#include <mutex>

#include "engine/cuda/nccl_communicator.h"
#include "kv_transfer/transport.h"

namespace kvrelay::kv_transfer {

struct NcclTransportOptions {
  engine::cuda::NcclCommunicator* comm = nullptr;  // not owned; outlives the transport
  int max_inflight = 1024;
};

class NcclTransport final : public Transport {
 public:
  static Result<std::unique_ptr<NcclTransport>> Create(const NcclTransportOptions& options);
  ~NcclTransport() override;

  std::string_view name() const override { return "nccl"; }
  bool SupportsDeviceMemory() const override { return true; }
  int max_inflight() const override { return options_.max_inflight; }
  int rank() const override { return options_.comm->rank(); }
  int world_size() const override { return options_.comm->size(); }

  Result<TransferHandle> PostSend(const TransferDesc& desc) override;
  Result<TransferHandle> PostRecv(const TransferDesc& desc) override;
  Result<bool> Poll(TransferHandle handle) override;
  Status Wait(TransferHandle handle, Deadline deadline) override;
  Status Cancel(TransferHandle handle) override;
  int inflight() const override;

 private:
  struct Op;
  explicit NcclTransport(const NcclTransportOptions& options);
  Result<TransferHandle> Post(const TransferDesc& desc, bool is_send);
  // Done: scatter / header check for receives. mu_ held.
  Status FinishLocked(Op& op);

  const NcclTransportOptions options_;
  mutable std::mutex mu_;
  TransferHandle next_handle_ = 1;                     // guarded by mu_
  std::map<TransferHandle, std::unique_ptr<Op>> ops_;  // guarded by mu_
};

}  // namespace kvrelay::kv_transfer
