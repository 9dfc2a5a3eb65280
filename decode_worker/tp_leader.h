// Rank 0's side of a tensor-parallel decode group: accepts the followers
// (each TpHello checked against rank 0's configuration, naming a mismatch),
// wires the engine to publish every step's plan and to use the group's
// collective, tells followers which KV to expect for a request and collects
// their acknowledgements. Used on the worker's run thread only.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "decode_worker/tp_group.h"
#include "engine/runtime/engine.h"
#include "protocols/handshake.h"
#include "worker/worker_options.h"

namespace kvrelay::decode_worker {

class TpLeader {
 public:
  // Listens on options.tp_host:tp_port, accepts the tp_size - 1 followers
  // within connect_timeout and installs the TP hooks on `engine`. The
  // forward's collectives run on `collective` (the group's MPI
  // sub-communicator; not owned, must outlive the leader) or, when null, on
  // the TCP link itself.
  static Result<std::unique_ptr<TpLeader>> Start(const worker::WorkerOptions& options,
                                                 const protocols::PeerConfig& config,
                                                 const std::string& kv_conn_info, int data_rank,
                                                 engine::Engine* engine,
                                                 engine::TpCollective* collective);

  // Every rank's data-plane peer index and KV conn info, in TP order.
  const std::vector<uint32_t>& data_ranks() const { return data_ranks_; }
  const std::vector<std::string>& kv_conn_infos() const { return kv_conn_infos_; }

  // Every follower receives its heads of request `id` (its KV streams'
  // `transfer_id`) from `prefill_rank` into the same block ids: tables[g] for
  // KV cache group g of the engine's groups, which the followers mirror
  // since TpSetup (one table with one group).
  Status ExpectKv(engine::RequestId id, uint64_t transfer_id, uint32_t prefill_rank,
                  std::span<const std::vector<engine::BlockId>> tables);
  void CancelKv(engine::RequestId id);
  // Every follower closes its KV data connections (DecodeRole::
  // OnRegistrationEnded).
  void DropKvConnections();
  struct KvAck {
    engine::RequestId request = 0;
    int tp_rank = 0;
    Status status;
  };
  // Acknowledgements that arrived (never blocks). A broken link shows in status().
  std::vector<KvAck> PollAcks();
  // Liveness between steps (every loop turn; never blocks beyond a short
  // send): pings every follower every step_timeout / 4 and, when a follower
  // has not answered the last ping within step_timeout (SIGSTOPped, stalled,
  // its host gone quiet without closing the link), breaks the group. Steps
  // themselves are bounded by the collective's own step_timeout; this catches
  // a follower that stops while the group is idle or only receiving KV.
  void CheckFollowers();
  // OK while every follower's link (and the MPI collective) works and every
  // follower answers its pings.
  Status status() const;
  // Tells the followers to stop (best effort, bounded by a short deadline: a
  // broken link or a stopped follower is fine).
  void Shutdown();
  // What the group's TP port refused while it formed.
  protocols::PortSecurityCounters security_counters() const { return group_->security_counters(); }
  // What the followers' KV data ports refused, summed, as their last pongs
  // said (CheckFollowers pings every step_timeout / 4).
  protocols::PortSecurityCounters follower_kv_port_counters() const;

 private:
  TpLeader(std::unique_ptr<TcpTpGroup> group, std::chrono::milliseconds step_timeout)
      : group_(std::move(group)), step_timeout_(step_timeout) {}
  void OnPong(int rank, const std::string& payload);

  std::unique_ptr<TcpTpGroup> group_;
  engine::TpCollective* collective_ = nullptr;  // the forward's; group_ when not MPI
  std::vector<uint32_t> data_ranks_;
  std::vector<std::string> kv_conn_infos_;
  const std::chrono::milliseconds step_timeout_;
  uint64_t ping_seq_ = 0;           // the last ping sent (0: none yet)
  TimePoint ping_sent_at_;          // when it was sent
  std::vector<uint64_t> pong_seq_;  // per rank: the last ping it answered
  // Per rank: its KV data port's refusals, from its last pong.
  std::vector<protocols::PortSecurityCounters> follower_kv_ports_;
  Status liveness_;                  // sticky: a follower missed its ping deadline
  std::vector<KvAck> pending_acks_;  // read by CheckFollowers, returned by PollAcks
};

}  // namespace kvrelay::decode_worker
