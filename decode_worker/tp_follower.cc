#include "decode_worker/tp_follower.h"

#include <map>

#include "common/logging.h"
#include "decode_worker/mpi_tp_collective.h"
#include "decode_worker/tp_group.h"
#include "decode_worker/tp_plan_codec.h"
#include "engine/runtime/tensor_parallel.h"
#include "kv_transfer/layer_stream.h"
#include "kv_transfer/mpi_session.h"
#include "protocols/control.pb.h"
#include "worker/kv_streams.h"
#include "worker/worker.h"

namespace kvrelay::decode_worker {
namespace {

using engine::BlockId;

class Follower {
 public:
  Follower(const worker::WorkerOptions& options, worker::ProcessBase base)
      : options_(options), base_(std::move(base)) {}

  Status Join();
  Status Run(const std::atomic<bool>& stop);

 private:
  // Heads of one request's KV arriving from a prefill worker.
  struct Incoming {
    std::vector<std::unique_ptr<kv_transfer::LayerStreamReceiver>> receivers;  // per segment
    // kv_timeout from the last layer verified (or the expectation): a long
    // prompt that keeps streaming while its prefill computes is not cut.
    Deadline deadline;
    int layers = 0;
  };
  void ExpectKv(const proto::TpExpectKv& m);
  void Progress();
  void Ack(engine::RequestId id, const Status& s);
  // Rank 0 lost its coordinator link: the receives end (unacknowledged: rank
  // 0 dropped their requests) and the KV data connections close, so that the
  // next registration's streams do not meet the prefill side's late close.
  void DropKvConnections();

  const worker::WorkerOptions& options_;
  worker::ProcessBase base_;
  std::unique_ptr<TcpTpGroup> group_;
  std::unique_ptr<MpiTpCollective> mpi_;  // TP over MPI only
  std::unique_ptr<engine::TpFollower> follower_;
  std::map<engine::RequestId, Incoming> incoming_;  // destroyed before follower_'s pool
};

Status Follower::Join() {
  TpGroupOptions g;
  g.tp_rank = options_.tp_rank;
  g.tp_size = options_.tp_size;
  g.leader_host = options_.tp_host;
  g.leader_port = options_.tp_port;
  g.timeout = options_.tp_step_timeout;
  g.cluster_key = options_.cluster_key;
  const Deadline deadline = Deadline::After(options_.connect_timeout);
  proto::TpHello hello;
  hello.set_tp_rank(static_cast<uint32_t>(options_.tp_rank));
  hello.set_tp_size(static_cast<uint32_t>(options_.tp_size));
  protocols::ToProto(base_.peer_config, hello.mutable_config());
  hello.set_kv_address(base_.transport->conn_info());
  hello.set_data_rank(static_cast<uint32_t>(options_.rank));
  hello.set_tp_mode(static_cast<uint32_t>(options_.tp_mode));
  ASSIGN_OR_RETURN(group_, TcpTpGroup::Connect(g, hello.SerializeAsString(), deadline));
  // This process has no coordinator link: its pongs carry its KV port's
  // refusals to rank 0, whose heartbeat reports them.
  group_->SetKvPortCounters([this] { return base_.transport->security_counters(); });
  ASSIGN_OR_RETURN(TpMessage m, group_->ReceiveFromLeader(deadline));
  proto::TpSetup setup;
  if (m.type != TpMsg::kSetup || !setup.ParseFromString(m.payload)) {
    return DataLoss("TP rank 0 did not answer with a setup message");
  }
  if (!setup.accepted()) return FailedPrecondition("TP rank 0 refused: " + setup.reason());
  engine::TpCollective* collective = group_.get();
  if (options_.tp_over_mpi()) {
    ASSIGN_OR_RETURN(mpi_, MpiTpCollective::Create(kv_transfer::MpiSession::tp_comm(),
                                                   options_.tp_step_timeout));
    collective = mpi_.get();
  }
  // Rank 0's KV cache groups, rebuilt from this shard's own layer windows
  // and checked layer by layer: a follower that would group differently
  // (another model file, another grouping rule) must not join.
  const engine::ModelConfig& c = base_.model->config();
  engine::KvCacheGroups groups = engine::KvCacheGroups::One(c.n_layers);
  if (setup.kv_group_of_layer_size() > 0) {
    std::vector<int> windows;
    for (int l = 0; l < c.n_layers; ++l) windows.push_back(c.LayerWindow(l));
    groups = engine::KvCacheGroups::FromLayerWindows(windows, /*split=*/true);
    std::vector<int> want(setup.kv_group_of_layer().begin(), setup.kv_group_of_layer().end());
    if (want != groups.group_of) {
      return FailedPrecondition("TP rank 0's KV cache groups (" +
                                std::to_string(setup.kv_group_of_layer_size()) +
                                " layers) differ from this rank's " + groups.DebugString());
    }
  }
  ASSIGN_OR_RETURN(follower_, engine::TpFollower::Create(options_.engine, base_.model, groups,
                                                         static_cast<int64_t>(setup.total_blocks()),
                                                         collective));
  LOG_INFO << "joined TP group as rank " << options_.tp_rank << " of " << options_.tp_size
           << " (kv heads [" << base_.model->kv_head_range().begin << ", "
           << base_.model->kv_head_range().end << "), kv data " << base_.transport->conn_info()
           << ", KV cache " << groups.DebugString() << ")";
  return Status::Ok();
}

void Follower::Ack(engine::RequestId id, const Status& s) {
  proto::TpKvDone done;
  done.set_request_id(id);
  done.set_tp_rank(static_cast<uint32_t>(options_.tp_rank));
  done.set_ok(s.ok());
  if (!s.ok()) done.set_error(s.ToString());
  (void)group_->SendToLeader(TpMsg::kKvDone, done.SerializeAsString());
}

void Follower::ExpectKv(const proto::TpExpectKv& m) {
  const engine::RequestId id = m.request_id();
  const uint64_t transfer = m.kv_transfer_id() != 0 ? m.kv_transfer_id() : id;  // its streams' id
  const engine::KvCacheGroups& groups = follower_->kv_groups();
  std::vector<std::vector<BlockId>> tables;
  tables.emplace_back(m.block_ids().begin(), m.block_ids().end());
  for (const auto& t : m.group_block_ids())
    tables.emplace_back(t.blocks().begin(), t.blocks().end());
  if (static_cast<int>(tables.size()) != groups.size()) {
    Ack(id, InvalidArgument("KV expectation with " + std::to_string(tables.size()) +
                            " block tables for a KV cache of " + std::to_string(groups.size()) +
                            " groups"));
    return;
  }
  for (const auto& table : tables) {
    if (table.size() != tables[0].size()) {
      Ack(id, InvalidArgument("KV expectation with block tables of unequal length"));
      return;
    }
    for (BlockId b : table) {
      if (b < 0 || b >= follower_->pool()->total_blocks()) {
        Ack(id, InvalidArgument("block id " + std::to_string(b) + " is outside the pool"));
        return;
      }
    }
  }
  const kv_transfer::HeadRange own{base_.model->kv_head_range().begin,
                                   base_.model->kv_head_range().end};
  Incoming in;
  in.deadline = Deadline::After(options_.kv_timeout);
  // As DecodeRole::OnReserveBlocks: the coordinator routed this to a
  // registered (so live, maybe restarted) prefill rank.
  base_.transport->PeerRejoined(static_cast<int>(m.prefill_rank()));
  auto receivers = worker::StartSegmentReceivers(
      base_.transport.get(), static_cast<int>(m.prefill_rank()), follower_->pool(), groups,
      base_.model->fingerprint(), transfer, tables, own);
  if (!receivers.ok()) {
    Ack(id, receivers.status());
    return;
  }
  in.receivers = std::move(receivers).value();
  incoming_[id] = std::move(in);
}

void Follower::DropKvConnections() {
  incoming_.clear();  // receivers cancel their receives
  const Status why = Unavailable(
      "TP rank 0 lost its coordinator link; the connections of its last registration are closed");
  worker::AbandonAllPeers(*base_.transport, why);
}

void Follower::Progress() {
  for (auto it = incoming_.begin(); it != incoming_.end();) {
    Incoming& in = it->second;
    Status s;
    bool complete = true;
    int layers = 0;
    for (auto& receiver : in.receivers) {
      if (s.ok()) s = receiver->Progress();
      complete = complete && receiver->complete();
      layers += receiver->layers_complete();
    }
    if (layers != in.layers) {
      in.layers = layers;
      in.deadline = Deadline::After(options_.kv_timeout);
    }
    if (s.ok() && !complete && in.deadline.Expired()) {
      s = DeadlineExceeded("KV heads did not arrive within " +
                           std::to_string(options_.kv_timeout.count()) + " ms of the last layer");
    }
    if (s.ok() && !complete) {
      ++it;
      continue;
    }
    in.receivers.clear();
    Ack(it->first, s);
    it = incoming_.erase(it);
  }
}

Status Follower::Run(const std::atomic<bool>& stop) {
  while (!stop.load()) {
    const auto wait =
        incoming_.empty() ? std::chrono::milliseconds(100) : std::chrono::milliseconds(1);
    auto m = group_->ReceiveFromLeader(Deadline::After(wait));
    if (!m.ok()) {
      if (m.status().code() != StatusCode::kDeadlineExceeded) {
        return Unavailable("TP rank 0 is gone: " + m.status().message());
      }
      Progress();
      continue;
    }
    switch (m->type) {
      case TpMsg::kPlan: {
        proto::TpStepPlan pm;
        if (!pm.ParseFromString(m->payload)) return DataLoss("unparseable TP step plan");
        // A failed step means the group has diverged or a link broke: stop.
        RETURN_IF_ERROR(follower_->Execute(FromProto(pm)).WithContext("TP follower step"));
        break;
      }
      case TpMsg::kExpectKv: {
        proto::TpExpectKv e;
        if (!e.ParseFromString(m->payload)) return DataLoss("unparseable TP KV expectation");
        ExpectKv(e);
        break;
      }
      case TpMsg::kCancelKv: {
        proto::TpCancelKv c;
        if (!c.ParseFromString(m->payload)) break;
        if (c.drop_connections()) {
          DropKvConnections();
        } else {
          incoming_.erase(c.request_id());
        }
        break;
      }
      case TpMsg::kPing:
        // Rank 0's liveness check between steps: answered at once.
        RETURN_IF_ERROR(group_->SendToLeader(TpMsg::kPong, group_->Pong(m->payload)));
        break;
      case TpMsg::kShutdown:
        return Status::Ok();
      default:
        return DataLoss("unexpected TP message type " +
                        std::to_string(static_cast<uint32_t>(m->type)));
    }
    Progress();
  }
  return Status::Ok();
}

}  // namespace

Status RunTpFollower(const worker::WorkerOptions& options, const std::atomic<bool>& stop) {
  ASSIGN_OR_RETURN(worker::ProcessBase base, worker::LoadProcessBase(options));
  Follower f(options, std::move(base));
  RETURN_IF_ERROR(f.Join());
  return f.Run(stop);
}

}  // namespace kvrelay::decode_worker
