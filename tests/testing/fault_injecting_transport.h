// A Transport wrapper that injects faults into sends, for tests of the
// integrity and failure paths (NIXL-style error injection). Faults are picked
// per send by a caller-supplied rule.
//   kCorrupt: the bytes are copied to a staging buffer, one byte is flipped,
//             and the staging copy is sent (the caller's buffer is untouched).
//   kDrop:    nothing is sent; the send reports success (a lost message).
// Receives, Poll, Wait and Cancel are forwarded.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "kv_transfer/transport.h"

namespace kvrelay::kv_transfer {

enum class Fault { kNone, kCorrupt, kDrop };

class FaultInjectingTransport final : public Transport {
 public:
  using Rule = std::function<Fault(const TransferDesc& desc)>;
  // `inner` must outlive this wrapper.
  FaultInjectingTransport(Transport* inner, Rule rule) : inner_(inner), rule_(std::move(rule)) {}

  std::string_view name() const override { return inner_->name(); }
  bool SupportsDeviceMemory() const override { return false; }
  int max_inflight() const override { return inner_->max_inflight(); }
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  std::string conn_info() const override { return inner_->conn_info(); }
  void PeerRejoined(int peer) override { inner_->PeerRejoined(peer); }
  Status ConnectPeer(int peer, std::string_view conn_info, Deadline deadline) override {
    return inner_->ConnectPeer(peer, conn_info, deadline);
  }

  void AbandonPeer(int peer, const Status& why) override { inner_->AbandonPeer(peer, why); }
  int64_t quarantined_bytes() const override { return inner_->quarantined_bytes(); }
  Result<TransferHandle> PostSend(const TransferDesc& desc) override;
  Result<TransferHandle> PostRecv(const TransferDesc& desc) override {
    return inner_->PostRecv(desc);
  }
  Result<bool> Poll(TransferHandle handle) override;
  Status Wait(TransferHandle handle, Deadline deadline) override;
  Status Cancel(TransferHandle handle) override;
  int inflight() const override { return inner_->inflight(); }

  int corrupted() const;
  int dropped() const;

 private:
  static constexpr TransferHandle kDroppedBit = TransferHandle{1} << 63;
  void Release(TransferHandle handle);
  Transport* inner_;
  Rule rule_;
  mutable std::mutex mutex_;
  std::unordered_map<TransferHandle, std::string> staging_;  // guarded by mutex_
  TransferHandle next_dropped_ = 1;                          // guarded by mutex_
  int corrupted_ = 0;                                        // guarded by mutex_
  int dropped_ = 0;                                          // guarded by mutex_
};

}  // namespace kvrelay::kv_transfer
