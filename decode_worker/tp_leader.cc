#include "decode_worker/tp_leader.h"

#include <algorithm>
#include <cstring>

#include "common/logging.h"
#include "decode_worker/mpi_tp_collective.h"
#include "decode_worker/tp_plan_codec.h"
#include "engine/runtime/tensor_parallel.h"
#include "protocols/control.pb.h"

namespace kvrelay::decode_worker {

Result<std::unique_ptr<TpLeader>> TpLeader::Start(const worker::WorkerOptions& options,
                                                  const protocols::PeerConfig& config,
                                                  const std::string& kv_conn_info, int data_rank,
                                                  engine::Engine* engine,
                                                  engine::TpCollective* collective) {
  TpGroupOptions g;
  g.tp_rank = 0;
  g.tp_size = options.tp_size;
  g.leader_host = options.tp_host;
  g.leader_port = options.tp_port;
  g.timeout = options.tp_step_timeout;
  g.cluster_key = options.cluster_key;
  ASSIGN_OR_RETURN(std::unique_ptr<TcpTpGroup> group, TcpTpGroup::Listen(g));
  std::unique_ptr<TpLeader> leader(new TpLeader(std::move(group), options.tp_step_timeout));
  leader->pong_seq_.assign(options.tp_size, 0);
  leader->kv_conn_infos_.assign(options.tp_size, "");
  leader->data_ranks_.assign(options.tp_size, 0);
  leader->kv_conn_infos_[0] = kv_conn_info;
  leader->data_ranks_[0] = static_cast<uint32_t>(data_rank);
  LOG_INFO << "TP rank 0 waiting for " << options.tp_size - 1 << " follower(s) on "
           << options.tp_host << ":" << leader->group_->port();
  const int64_t total_blocks = engine->pool()->total_blocks();
  // Followers mirror rank 0's KV cache groups (empty: one group).
  std::vector<uint32_t> group_of_layer;
  if (engine->kv_groups().size() > 1) {
    for (int g : engine->kv_groups().group_of) group_of_layer.push_back(static_cast<uint32_t>(g));
  }
  TpLeader* self = leader.get();
  auto check = [&](const std::string& payload) -> Result<TcpTpGroup::SetupAnswer> {
    proto::TpHello hello;
    if (!hello.ParseFromString(payload)) return InvalidArgument("unparseable TP hello");
    ASSIGN_OR_RETURN(protocols::PeerConfig peer, protocols::FromProto(hello.config()));
    protocols::CompatibilityOptions compat;
    compat.require_same_tp = true;
    protocols::PeerConfig mine = config;
    mine.tp_rank = peer.tp_rank;  // ranks differ by design
    RETURN_IF_ERROR(protocols::CheckPeerCompatible(mine, peer, compat));
    if (hello.tp_mode() != static_cast<uint32_t>(options.tp_mode)) {
      return FailedPrecondition(
          "TP mode mismatch: rank 0 uses " + std::to_string(static_cast<int>(options.tp_mode)) +
          ", rank " + std::to_string(hello.tp_rank()) + " uses " + std::to_string(hello.tp_mode()));
    }
    const int r = static_cast<int>(hello.tp_rank());
    if (r >= 1 && r < options.tp_size) {
      self->kv_conn_infos_[r] = hello.kv_address();
      self->data_ranks_[r] = hello.data_rank();
    }
    proto::TpSetup setup;
    setup.set_accepted(true);
    setup.set_total_blocks(static_cast<uint64_t>(total_blocks));
    setup.mutable_kv_group_of_layer()->Add(group_of_layer.begin(), group_of_layer.end());
    return TcpTpGroup::SetupAnswer{r, setup.SerializeAsString()};
  };
  auto refusal = [](const Status& why) {
    proto::TpSetup setup;
    setup.set_accepted(false);
    setup.set_reason(why.ToString());
    return setup.SerializeAsString();
  };
  RETURN_IF_ERROR(
      leader->group_->Accept(Deadline::After(options.connect_timeout), check, refusal).status());
  engine::TensorParallelHooks hooks;
  leader->collective_ = collective != nullptr ? collective : leader->group_.get();
  hooks.collective = leader->collective_;
  hooks.publish = [self](const engine::StepPlan& plan) {
    return self->group_->Broadcast(TpMsg::kPlan, ToProto(plan).SerializeAsString());
  };
  RETURN_IF_ERROR(engine->SetTensorParallel(hooks));
  LOG_INFO << "TP group of " << options.tp_size << " ranks is complete";
  return leader;
}

Status TpLeader::ExpectKv(engine::RequestId id, uint64_t transfer_id, uint32_t prefill_rank,
                          std::span<const std::vector<engine::BlockId>> tables) {
  proto::TpExpectKv e;
  e.set_request_id(id);
  e.set_kv_transfer_id(transfer_id);
  e.set_prefill_rank(prefill_rank);
  if (!tables.empty()) e.mutable_block_ids()->Add(tables[0].begin(), tables[0].end());
  for (size_t g = 1; g < tables.size(); ++g) {
    e.add_group_block_ids()->mutable_blocks()->Add(tables[g].begin(), tables[g].end());
  }
  return group_->Broadcast(TpMsg::kExpectKv, e.SerializeAsString());
}

void TpLeader::CancelKv(engine::RequestId id) {
  proto::TpCancelKv c;
  c.set_request_id(id);
  (void)group_->Broadcast(TpMsg::kCancelKv, c.SerializeAsString());
}

void TpLeader::DropKvConnections() {
  proto::TpCancelKv c;
  c.set_drop_connections(true);
  (void)group_->Broadcast(TpMsg::kCancelKv, c.SerializeAsString());
}

std::vector<TpLeader::KvAck> TpLeader::PollAcks() {
  std::vector<KvAck> acks = std::move(pending_acks_);
  pending_acks_.clear();
  while (true) {
    auto m = group_->PollFollowers(Deadline::After(std::chrono::nanoseconds(0)));
    if (!m.ok() || !m->has_value()) break;  // a broken link shows in status()
    auto& [rank, msg] = **m;
    if (msg.type == TpMsg::kPong) {
      OnPong(rank, msg.payload);
      continue;
    }
    if (msg.type != TpMsg::kKvDone) continue;
    proto::TpKvDone done;
    if (!done.ParseFromString(msg.payload)) continue;
    acks.push_back({done.request_id(), rank,
                    done.ok()
                        ? Status::Ok()
                        : Unavailable("TP rank " + std::to_string(rank) + ": " + done.error())});
  }
  return acks;
}

void TpLeader::OnPong(int rank, const std::string& payload) {
  uint64_t seq = 0;
  protocols::PortSecurityCounters kv_port;
  if (rank < 1 || rank >= static_cast<int>(pong_seq_.size()) ||
      !DecodePong(payload, &seq, &kv_port)) {
    return;
  }
  if (seq > ping_seq_ || seq < pong_seq_[rank]) return;  // not a ping of ours, or stale
  pong_seq_[rank] = seq;
  follower_kv_ports_.resize(pong_seq_.size());
  follower_kv_ports_[static_cast<size_t>(rank)] = kv_port;
}

protocols::PortSecurityCounters TpLeader::follower_kv_port_counters() const {
  protocols::PortSecurityCounters sum;
  for (const auto& c : follower_kv_ports_) {
    sum.auth_failures += c.auth_failures;
    sum.refused_connections += c.refused_connections;
    sum.oversized_frames += c.oversized_frames;
    sum.foreign_frames += c.foreign_frames;
  }
  return sum;
}

void TpLeader::CheckFollowers() {
  if (!liveness_.ok() || !group_->status().ok()) return;
  // Pongs already here (also those queued during a step) count first.
  for (auto& ack : PollAcks()) pending_acks_.push_back(std::move(ack));
  const auto now = Clock::now();
  if (ping_seq_ > 0) {
    for (int r = 1; r < static_cast<int>(pong_seq_.size()); ++r) {
      if (pong_seq_[r] >= ping_seq_) continue;
      if (now - ping_sent_at_ <= step_timeout_) return;  // still in time
      liveness_ = DeadlineExceeded("TP rank " + std::to_string(r) + " did not answer within " +
                                   std::to_string(step_timeout_.count()) +
                                   " ms (--tp-step-timeout-ms): it is stopped, stalled or gone");
      LOG_ERROR << liveness_.message();
      return;
    }
  }
  if (ping_seq_ > 0 && now - ping_sent_at_ < step_timeout_ / 4) return;
  ++ping_seq_;
  ping_sent_at_ = now;
  std::string payload(sizeof(ping_seq_), '\0');
  std::memcpy(payload.data(), &ping_seq_, sizeof(ping_seq_));
  // A send that cannot even be queued in time breaks the link (status()).
  (void)group_->Broadcast(TpMsg::kPing, payload);
}

Status TpLeader::status() const {
  RETURN_IF_ERROR(liveness_);
  RETURN_IF_ERROR(group_->status());
  if (auto* mpi = dynamic_cast<const MpiTpCollective*>(collective_)) return mpi->status();
  return Status::Ok();
}

void TpLeader::Shutdown() {
  (void)group_->Broadcast(TpMsg::kShutdown, "", Deadline::After(std::chrono::milliseconds(200)));
}

}  // namespace kvrelay::decode_worker
