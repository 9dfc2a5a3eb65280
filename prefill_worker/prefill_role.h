// The prefill role: runs prompts and hands their KV to decode groups.
//
// A PrefillTask with a decode target runs as a kPrefillOnly request: the
// role is the engine's KvConnector — the save side. The prompt's KV goes out
// in segments of blocks (worker/kv_streams.h): as soon as a prefill chunk
// completes a segment, each layer of that segment is streamed right after the
// layer is computed, to every rank of the decode group (each rank gets only
// its KV heads; kv_transfer/layer_stream.h). Every chunk is streamed while the
// next computes, not only the prompt's last. When the first token is
// sampled the engine hands the prompt's blocks to the role
// (RequestFinished), which keeps them until the streams are delivered and
// starts the delivery there. The first token goes to the coordinator at once
// (TTFT, the EventReporter) and to the decode group's rank 0 as the hand-over
// frame, posted after every layer (kv_transfer/hand_over_frame.h): the decode
// side starts on its own.
//
// Each request is one record of the worker's RequestTable
// (worker/request_table.h): kQueued -> kComputing -> kStreaming ->
// kDelivered; its streams are the record's work (Outgoing).
//
// A task without a decode target runs to completion here: that is the
// colocated worker (kvrelay-worker), the same role.
//
// With --kv-store the role is also the load side for the prefix tiers (host
// RAM, RocksDB): at admission the engine asks it for the prompt blocks the
// pool lacks, and restored blocks belong to the request from the start.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/kv_cache/block_table.h"
#include "engine/runtime/kv_connector.h"
#include "kv_store/host_ram_tier.h"
#include "kv_store/rocksdb_tier.h"
#include "kv_store/tiered_cache.h"
#include "kv_transfer/hand_over_frame.h"
#include "kv_transfer/layer_stream.h"
#include "worker/kv_streams.h"
#include "worker/role.h"

namespace kvrelay::prefill_worker {

class PrefillRole final : public worker::Role, public engine::KvConnector {
 public:
  PrefillRole() = default;
  ~PrefillRole() override;

  // --- worker::Role ---
  Status Init(worker::WorkerContext& ctx) override;
  engine::Engine* engine() override { return engine_.get(); }
  Status OnControlFrame(const protocols::Frame& frame) override;
  bool polling() const override;
  // Set while a decode rank's data connection has failed for
  // kv_progress_timeout (every try since, tasks still coming).
  std::string data_plane_error() const override;
  void OnPeersLost(std::span<const int> ranks) override;
  // Not OK once the KV data plane is wedged (see wedged_): the worker leaves.
  Status health() const override { return wedged_; }
  void Shutdown() override;
  // A (re)registered coordinator learns every prefix this worker's store holds.
  void OnRegistered() override {
    if (tiered_) tiered_->AnnounceAll();
  }
  void Progress() override;
  bool FillPrefixStore(proto::PrefixStoreCounters* out) const override;
  bool OnPoolEvent(const engine::KvEvent& ev) override {
    if (!tiered_) return false;
    tiered_->OnPoolEvent(ev);
    return true;
  }

  // --- engine::KvConnector ---
  // The store's blocks of every KV cache group (TieredCache::LoadPrefix).
  void LoadPrefix(const engine::RequestSpec& request, const engine::PrefixLookup& prefix,
                  const engine::KvCacheGroups& groups,
                  std::span<engine::BlockTable> tables) override;
  // Streams each layer of every segment the step completed, gathering each
  // model layer from its group's block.
  void SaveLayer(int layer, const engine::StepPlan& plan) override;
  bool RequestFinished(const engine::TokenEvent& ev, engine::BlockTable& prompt_blocks) override;

 private:
  // A prefill-only request whose KV goes to a decode group (the record's
  // peers, in TP order): one stream per decode TP rank, each carrying that
  // rank's heads.
  struct Outgoing final : worker::RequestWork {
    // Declared first, destroyed last: the senders read these blocks until
    // they are finished or cancelled. `pinned` holds a reference on every
    // block of a started segment, so a preemption of the request cannot
    // free (and reuse) a block a send still reads.
    engine::BlockTable pinned;
    engine::BlockTable blocks;  // the prompt's blocks, once the engine finished the request
    // Per KV cache group, the prompt's blocks as the steps computed them
    // (kNoBlock: never held), each one pinned.
    std::vector<std::vector<engine::BlockId>> tables;
    // senders[segment][tp rank]; empty until the segment's blocks are computed.
    std::vector<std::vector<std::unique_ptr<kv_transfer::LayerStreamSender>>> senders;
    uint64_t transfer_id = 0;   // its streams' and hand-over frame's id (this attempt's)
    int64_t prompt_blocks = 0;  // blocks the streams carry (named by position)
    int64_t prompt_tokens = 0;
    // Set when the first token is sampled (the record is then kStreaming):
    // the first token, to the decode group's rank 0 once every layer has
    // been posted (the last frame of the streams). The senders and the
    // frame are polled by Progress until every send finished or
    // `deliver_by` passed.
    std::unique_ptr<kv_transfer::HandOverFrame> hand_over;
    // Set while its decode group refuses connections: the task, tried again
    // from Progress, failed after connect_by (ConnectAndSubmit).
    std::unique_ptr<proto::PrefillTask> parked;
    Deadline connect_by;
    Deadline deliver_by;
    TimePoint deliver_start;
    // Sends still unfinished per decode peer at the last poll (the
    // no-progress deadline, WorkerOptions::kv_progress_timeout).
    std::map<int, int> unfinished;
  };

  void OnPrefillTask(const proto::PrefillTask& task);
  // Connects `r` to its task's decode group and submits it; parks the task
  // in r's Outgoing while the group refuses connections (RetryParked).
  void ConnectAndSubmit(worker::Request& r, const proto::PrefillTask& task);
  // Submits `task` (r's) to the engine; a refusal ends r with the error.
  void Submit(worker::Request& r, const proto::PrefillTask& task);
  // Tries the parked tasks whose retry time came (Progress).
  void RetryParked();
  // Seals `layer` of blocks `r` before it is sent: a KIVI layer still staged
  // is quantized (the prompt's partial tail block); nothing for other dtypes.
  void SealLayer(const Outgoing& out, worker::BlockRange r, int layer);
  // Connects the data plane to every rank of `target`, in TP order.
  // *refused: it failed because a rank refused or reset the connection at
  // once (worth trying again soon).
  Result<std::vector<int>> ConnectDecodeGroup(const proto::DecodeTarget& target, bool* refused);
  // Records (and pins) the step's blocks of every KV cache group.
  void RecordGroupBlocks(const engine::SeqStep& seq, Outgoing& out);
  // Starts segment `g`'s senders of request `r` from its tables.
  Status StartSegment(const worker::Request& r, Outgoing& out, int64_t g);
  // Segment `g`'s sender to each decode rank (`ranks`), with the buffers
  // `buffers` gives for that rank's heads.
  Status AddSenders(
      std::span<const int> ranks, Outgoing& out, int64_t g,
      const std::function<kv_transfer::StreamBuffers(const kv_transfer::HeadRange&)>& buffers);
  void OnCancel(const proto::Cancel& c);
  // The table's Release: ends `r`'s streams (cancelling what is unfinished)
  // before its blocks go back. When a send ended kAborted (its decode peer
  // was abandoned while MPI owned the buffers) the whole Outgoing — senders
  // with their manifest slots, pinned and prompt blocks — moves to
  // quarantine_ instead and is never reused.
  void Retire(worker::Request& r);
  // A request whose KV was delivered (every byte handed to the transport)
  // stays kDelivered for kv_timeout: a decode side that then times out
  // receiving it (a Cancel "peer failed: DEADLINE_EXCEEDED") saw the bytes
  // vanish on a connection that reports no error, which is dropped.
  void ExpireDelivered();
  // Polls the deliveries in flight (kStreaming); each one that ended
  // becomes kDelivered, or fails the request.
  void PollDeliveries();
  // Polls the delivery of `r`: OK with *done, or why it failed.
  Status PollDelivery(const worker::Request& r, Outgoing& out, bool* done);
  // Posts the sends of requests still computing that back-pressure deferred.
  void PostDeferredSends();
  // Drops `peer`'s data connection, which moves no bytes (a cut without a
  // reset): every send queued on it fails now and the next request connects
  // again. Requests already delivered into it end by the decode side's
  // no-progress deadline (a Finish from here could reach the coordinator
  // after it re-ran the same request id, and end the new attempt).
  void AbandonStalledPeer(int peer, const Status& why);

  // The least time between two connects to an address that refused one.
  static constexpr std::chrono::milliseconds kConnectRetry{50};

  worker::WorkerContext ctx_;
  std::unique_ptr<engine::Engine> engine_;
  std::unique_ptr<kv_store::HostRamTier> ram_tier_;
  std::unique_ptr<kv_store::RocksDbTier> disk_tier_;
  std::unique_ptr<kv_store::TieredCache> tiered_;
  // Zeros of one block layer, read in place of a never-held sliding-window
  // block. Declared before quarantine_: destroyed after it (and Shutdown
  // drops the table's work first).
  std::vector<uint8_t> hole_layer_;
  // Kept until the role goes (see Retire).
  std::vector<std::unique_ptr<worker::RequestWork>> quarantine_;
  // Per decode peer: when a delivery's send to it last finished (or a
  // delivery to it started). A delivery whose peer has not moved for
  // kv_progress_timeout is stuck on a path cut without a reset.
  std::map<int, TimePoint> peer_progress_;
  // Per decode peer: when its data connection was last dropped as stalled.
  // A request created before that sent on the dropped connection.
  std::map<int, TimePoint> abandoned_at_;
  // Set when decode peers died while the transport still owned sends to
  // them (their blocks were quarantined): what died, for the message below.
  // Open MPI 4.1 gives no guarantee for such a process ("will likely now
  // behave unpredictably (it may even hang or crash)", its own words): seen
  // here, its ob1/TCP stack then aborts the process, or never again moves a
  // send to a live decode rank (multinode "decode worker kill -9", about 1
  // run in 6). A later no-progress stall to a live peer is taken as the
  // latter: wedged_ is set and the worker leaves the cluster rather than
  // fail (and quarantine the blocks of) every request routed to it.
  std::string died_mid_send_;
  Status wedged_;
  // Decode KV addresses whose connect just failed: not tried again before
  // `until`; `refused`: it was refused or reset, not timed out
  // (ConnectDecodeGroup).
  struct Unreachable {
    TimePoint until;
    bool refused = false;
  };
  std::map<std::string, Unreachable> unreachable_;
  // Decode KV addresses whose connects fail: since when (the first failure
  // after the last success), the last try or refusal, and why. A success
  // or the rank's loss clears it; one not tried for kFailingTtl is dropped.
  struct Failing {
    int rank = -1;
    TimePoint since;
    TimePoint last;
    std::string error;
  };
  std::map<std::string, Failing> failing_;
  // Some record may hold a parked task (RetryParked clears it when none does).
  bool parked_ = false;
  static constexpr std::chrono::seconds kFailingTtl{10};
};

}  // namespace kvrelay::prefill_worker
