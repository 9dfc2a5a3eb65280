// The decode role: receives prompt KV from prefill workers and decodes in a
// continuous batch; rank 0 of a tensor-parallel group also leads the group.
//
// The message flow for one request (coordinator/cluster/cluster_backend.h):
//   ReserveBlocks  -> the role submits a kRemotePrompt request whose kv_peer
//                     is the prefill rank; the engine reserves the prompt's
//                     blocks (held by the request from now on) and calls
//                     StartRemoteLoad, where the role posts a layer-stream
//                     receive of its own heads (and has every TP follower
//                     post one for theirs) and the receive of the hand-over
//                     frame. Nothing is replied unless the engine refuses.
//   (KV arrives)   -> the streams name blocks by position in the prompt;
//                     the hand-over frame, their last transfer, carries the
//                     first token. PollRemoteLoads reports the load done once
//                     every layer of every rank is verified and the frame is
//                     in; the engine then decodes it with the running batch.
//   HandOverDue    -> (only for a slow hand-over) the prefill side is done:
//                     silence for kv_progress_timeout now fails the load.
// A deadline (kv_timeout), a cancel or a broken TP link fails the load; the
// engine's request owns the blocks, so they go back on every path.
//
// Each request is one record of the worker's RequestTable
// (worker/request_table.h): kReserved -> kReceiving -> kRunning; its
// receives are the record's work (Incoming) while it is kReceiving.
#pragma once

#include <atomic>
#include <map>
#include <memory>

#include "common/clock.h"
#include "decode_worker/mpi_tp_collective.h"
#include "decode_worker/tp_leader.h"
#include "engine/runtime/kv_connector.h"
#include "kv_transfer/hand_over_frame.h"
#include "kv_transfer/layer_stream.h"
#include "worker/role.h"

namespace kvrelay::decode_worker {

class DecodeRole final : public worker::Role, public engine::KvConnector {
 public:
  DecodeRole() = default;
  ~DecodeRole() override;

  // --- worker::Role ---
  Status Init(worker::WorkerContext& ctx) override;
  engine::Engine* engine() override { return engine_.get(); }
  void DescribeRegistration(proto::RegisterWorker* reg) const override;
  Status OnControlFrame(const protocols::Frame& frame) override;
  void Progress() override;
  bool polling() const override;
  Status health() const override;
  protocols::PortSecurityCounters tp_security_counters() const override {
    return tp_ ? tp_->security_counters() : protocols::PortSecurityCounters{};
  }
  protocols::PortSecurityCounters follower_kv_port_counters() const override {
    return tp_ ? tp_->follower_kv_port_counters() : protocols::PortSecurityCounters{};
  }
  uint64_t kv_integrity_failures() const override { return kv_integrity_failures_.load(); }
  // Closes the KV data connections (this rank's and, through rank 0, the
  // followers') that carried the last registration's streams.
  void OnRegistrationEnded() override;
  void Shutdown() override;

  // --- engine::KvConnector (load side) ---
  // Every KV cache group's table (a gemma3 model's sliding-window layers
  // hold only their window once the request decodes); TP followers mirror
  // the groups (TpSetup) and get every table.
  Status StartRemoteLoad(const engine::RequestSpec& request, const engine::KvCacheGroups& groups,
                         std::span<const std::vector<engine::BlockId>> tables) override;
  std::vector<RemoteLoadDone> PollRemoteLoads() override;
  void CancelRemoteLoad(engine::RequestId id) override;

 private:
  // A remote prompt on its way into blocks the engine reserved.
  struct Incoming final : worker::RequestWork {
    // One per segment of the prompt's blocks (worker/kv_streams.h).
    std::vector<std::unique_ptr<kv_transfer::LayerStreamReceiver>> receivers;
    // The hand-over frame: the prefill side's first token, sent after every
    // layer was posted.
    std::unique_ptr<kv_transfer::HandOverFrame> hand_over;
    int64_t blocks = 0;
    int32_t first_token = -1;
    TimePoint first_token_at;  // the frame arrived: the KV wait left counts from here
    TimePoint due_at;          // HandOverDue arrived (the prefill is done): likewise
    Deadline deadline;
    int follower_acks_pending = 0;  // TP: followers still receiving their heads
    Status follower_error;
    // Layers verified here minus follower acks pending, and when it last
    // changed (the no-progress deadline, kv_progress_timeout; -1: not polled
    // yet, the first poll sets both).
    int64_t progress = -1;
    TimePoint progress_at;
  };

  void OnReserveBlocks(const proto::ReserveBlocks& m);
  void ApplyFollowerAcks();
  // Posts what every load needs beyond its streams (the TP followers' part,
  // the hand-over frame) into `in`.
  Status PostRest(const engine::RequestSpec& request, Incoming& in,
                  std::span<const std::vector<engine::BlockId>> tables);
  // The table's Release: drops the record's transfers (receives cancelled
  // before the blocks go back).
  void DropIncoming(worker::Request& r);
  // Polls the load of `r`: OK with *first_token >= 0 once it is complete,
  // or why it failed.
  Status PollLoad(worker::Request& r, Incoming& in, int32_t* first_token);

  worker::WorkerContext ctx_;
  std::unique_ptr<MpiTpCollective> mpi_collective_;  // TP over MPI only
  std::unique_ptr<TpLeader> tp_;                     // TP size > 1 only
  // KV streams failed by an integrity check (DataLoss); read by heartbeats.
  std::atomic<uint64_t> kv_integrity_failures_{0};
  // Hand-over frames whose receive ended kAborted: the transport owns their
  // slots for its life (transport.h), so they are kept, never freed.
  std::vector<std::unique_ptr<kv_transfer::HandOverFrame>> quarantined_frames_;
  // Declared last, destroyed first: the engine cancels its loads through
  // this connector while the role is still whole.
  std::unique_ptr<engine::Engine> engine_;
};

}  // namespace kvrelay::decode_worker
