#include "worker/worker.h"

#include <map>
#include <optional>
#include <set>

#include "common/logging.h"
#include "engine/runtime/model.h"
#include "engine/runtime/tensor_parallel.h"
#include "engine/tokenizer/tokenizer.h"
#include "kv_store/host_ram_tier.h"
#include "kv_store/rocksdb_tier.h"
#include "kv_store/tiered_cache.h"
#include "kv_transfer/head_sharding.h"
#include "kv_transfer/layer_stream.h"
#include "kv_transfer/tcp_transport.h"
#include "protocols/control.pb.h"
#include "protocols/framed_connection.h"
#include "protocols/handshake.h"
#include "protocols/messages.h"
#include "protocols/peer_handshake.h"
#include "worker/tp_group.h"

namespace kvrelay::worker {

using engine::BlockId;
using protocols::MessageType;

Result<Role> ParseRole(std::string_view name) {
  if (name == "prefill") return Role::kPrefill;
  if (name == "decode") return Role::kDecode;
  if (name == "colocated") return Role::kColocated;
  return InvalidArgument("unknown worker role '" + std::string(name) +
                         "' (expected prefill, decode or colocated)");
}

std::string_view RoleName(Role role) {
  switch (role) {
    case Role::kPrefill:
      return "prefill";
    case Role::kDecode:
      return "decode";
    case Role::kColocated:
      return "colocated";
  }
  return "?";
}

Status WorkerOptions::Validate() const {
  if (worker_id.empty()) return InvalidArgument("worker id is empty");
  if (rank < 0 || rank >= world_size) {
    return InvalidArgument("rank " + std::to_string(rank) + " is outside world size " +
                           std::to_string(world_size));
  }
  if (tp_size < 1 || tp_rank < 0 || tp_rank >= tp_size) {
    return InvalidArgument("TP rank " + std::to_string(tp_rank) + " is outside TP size " +
                           std::to_string(tp_size));
  }
  if (tp_size > 1) {
    if (role != Role::kDecode) {
      return InvalidArgument("tensor parallelism (--tp-size " + std::to_string(tp_size) +
                             ") is for decode workers only");
    }
    if (!kv_store_path.empty()) {
      return InvalidArgument(
          "a tensor-parallel decode group cannot use --kv-store (the prefix "
          "tier lives on prefill workers)");
    }
    if (tp_rank > 0 && tp_port == 0) {
      return InvalidArgument("TP rank " + std::to_string(tp_rank) +
                             " needs --tp-leader HOST:PORT of rank 0");
    }
    RETURN_IF_ERROR(engine::CheckTensorParallelDtype(engine.kv_dtype));
  }
  return engine.Validate();
}

namespace {

proto::WorkerRole ToProto(Role r) {
  switch (r) {
    case Role::kPrefill:
      return proto::WORKER_ROLE_PREFILL;
    case Role::kDecode:
      return proto::WORKER_ROLE_DECODE;
    case Role::kColocated:
      return proto::WORKER_ROLE_COLOCATED;
  }
  return proto::WORKER_ROLE_UNSPECIFIED;
}

proto::Finish::Reason ToProto(engine::FinishReason r) {
  switch (r) {
    case engine::FinishReason::kStop:
      return proto::Finish::REASON_STOP;
    case engine::FinishReason::kLength:
      return proto::Finish::REASON_LENGTH;
    case engine::FinishReason::kCancelled:
      return proto::Finish::REASON_CANCELLED;
    default:
      return proto::Finish::REASON_ERROR;
  }
}

engine::SamplingParams FromProto(const proto::SamplingParams& s) {
  engine::SamplingParams p;
  p.temperature = s.temperature();
  p.top_p = s.top_p() > 0 ? s.top_p() : 1.0f;
  p.top_k = static_cast<int>(s.top_k());
  p.seed = s.seed();
  p.max_tokens = static_cast<int>(s.max_tokens());
  p.ignore_eos = s.ignore_eos();
  p.min_p = s.min_p();
  p.repetition_penalty = s.repetition_penalty() > 0 ? s.repetition_penalty() : 1.0f;
  p.presence_penalty = s.presence_penalty();
  p.frequency_penalty = s.frequency_penalty();
  return p;
}

std::string RequestKey(uint64_t id) { return std::to_string(id); }

}  // namespace

class Worker::Impl {
 public:
  explicit Impl(WorkerOptions options) : options_(std::move(options)) {}

  Status Init();
  Status Run(const std::atomic<bool>& stop);
  bool follower() const { return options_.tp_size > 1 && options_.tp_rank > 0; }

 private:
  // A prefill-only request whose KV is being streamed to a decode group:
  // one stream per decode TP rank, each carrying that rank's heads.
  struct Outgoing {
    std::vector<std::unique_ptr<kv_transfer::LayerStreamSender>> senders;
    std::vector<int> decode_ranks;  // data-plane peers, in TP order
    std::vector<BlockId> dst_blocks;
    int64_t prompt_tokens = 0;
    int layers_sent = 0;
    bool prefilled = false;
  };
  // A decode-side reservation waiting for its KV and first token.
  struct Incoming {
    engine::RequestSpec spec;
    std::vector<BlockId> blocks;  // one reference each, held by the worker
    std::unique_ptr<kv_transfer::LayerStreamReceiver> receiver;
    int32_t first_token = -1;
    Deadline deadline;
    int follower_acks_pending = 0;  // TP rank 0: followers still receiving their heads
    Status follower_error;
  };
  // TP follower: its heads of one request's KV, arriving from a prefill worker.
  struct FollowerIncoming {
    std::unique_ptr<kv_transfer::LayerStreamReceiver> receiver;
    Deadline deadline;
  };

  template <typename Message>
  void Send(MessageType type, const Message& m) {
    std::string payload;
    m.SerializeToString(&payload);
    Status s = conn_->Send(type, payload);
    if (!s.ok()) LOG_WARNING << "control send failed: " << s.ToString();
  }
  void SendFinish(uint64_t id, proto::Finish::Reason reason, const Status& error,
                  int64_t prompt_tokens = 0, int64_t completion_tokens = 0);

  Status Connect();
  // One request's prompt KV for the model heads `heads` as a layer stream: the
  // sender names the decode side's blocks (dst), the receiver its own.
  kv_transfer::StreamSpec MakeStreamSpec(uint64_t id, const std::vector<BlockId>& dst,
                                         kv_transfer::HeadRange heads) const;
  // Where those blocks live in `pool`; `local` = the heads within the pool.
  kv_transfer::StreamBuffers MakeStreamBuffers(engine::KvBlockPool* pool,
                                               std::span<const BlockId> blocks,
                                               kv_transfer::HeadRange local) const;
  // This rank's own heads (all of them unless it is a TP shard).
  kv_transfer::HeadRange OwnHeads() const;
  // TP: rank 0 accepts the followers and wires the engine; followers join.
  Status InitTensorParallel();
  Status RunFollower(const std::atomic<bool>& stop);
  void FollowerExpectKv(const proto::TpExpectKv& m);
  void FollowerProgress();
  void LeaderPollFollowers();
  void CancelFollowerKv(uint64_t id);
  void HandleFrame(const protocols::Frame& frame);
  void OnPrefillTask(const proto::PrefillTask& task);
  void OnDecodeAdmission(const proto::DecodeAdmission& a);
  void OnCancel(const proto::Cancel& c);
  void OnLayer(int layer, std::span<const engine::StepSequence> seqs);
  void HandleEvents(const std::vector<engine::TokenEvent>& events);
  void ProgressIncoming();
  void FinishOutgoing(uint64_t id, Outgoing& out);
  void SendHeartbeat();
  void FlushCacheEvents();
  void ReleaseAll();

  WorkerOptions options_;
  std::shared_ptr<const engine::Model> model_;
  std::unique_ptr<engine::Engine> engine_;        // null on TP followers
  std::unique_ptr<engine::TpFollower> follower_;  // TP followers only
  std::unique_ptr<TcpTpGroup> tp_group_;
  std::vector<std::string> tp_kv_addresses_;  // rank 0: every rank's KV address
  std::vector<uint32_t> tp_data_ranks_;       // rank 0: every rank's data-plane index
  std::map<uint64_t, FollowerIncoming> follower_incoming_;
  engine::KvLayout layout_;
  protocols::PeerConfig peer_config_;
  std::unique_ptr<protocols::IoThread> io_;
  std::shared_ptr<protocols::FramedConnection> conn_;
  std::unique_ptr<kv_transfer::TcpTransport> transport_;
  std::unique_ptr<kv_store::HostRamTier> ram_tier_;
  std::unique_ptr<kv_store::RocksDbTier> disk_tier_;
  std::unique_ptr<kv_store::TieredCache> tiered_;
  std::set<int> connected_peers_;

  std::map<uint64_t, Outgoing> outgoing_;
  std::map<uint64_t, Incoming> incoming_;
  std::map<uint64_t, int64_t> generated_;  // tokens emitted per running request
  std::vector<BlockId> restore_refs_;      // held until the next Step admitted the request
  proto::TokenChunk chunk_;                // tokens batched within one loop iteration
  proto::PrefixCacheEvent cache_events_;
  std::chrono::milliseconds heartbeat_interval_{500};
  TimePoint next_heartbeat_;
  uint64_t heartbeat_seq_ = 0;
  int64_t queued_tokens_ = 0;
  int64_t transfer_bytes_ = 0;
  double transfer_seconds_ = 0;
};

Status Worker::Impl::Init() {
  RETURN_IF_ERROR(options_.Validate());
  engine::ModelLoadOptions load;
  load.shard = {options_.tp_rank, options_.tp_size, options_.tp_mode};
  ASSIGN_OR_RETURN(std::unique_ptr<engine::Model> model,
                   engine::Model::Load(options_.engine.model_path, load));
  model_ = std::move(model);
  layout_ = model_->MakeKvLayout(options_.engine.kv_dtype, options_.engine.block_tokens);
  peer_config_.model_fingerprint = model_->fingerprint();
  peer_config_.kv_dtype = layout_.dtype;
  peer_config_.block_tokens = layout_.block_tokens;
  peer_config_.layers = layout_.layers;
  peer_config_.kv_heads = model_->full_config().n_kv_heads;
  peer_config_.head_dim = layout_.head_dim;
  peer_config_.tp_size = options_.tp_size;
  peer_config_.tp_rank = options_.tp_rank;

  kv_transfer::TcpTransport::Options t;
  t.rank = options_.rank;
  t.world_size = options_.world_size;
  t.listen_host = options_.kv_host;
  t.listen_port = options_.kv_port;
  ASSIGN_OR_RETURN(transport_, kv_transfer::TcpTransport::Create(t));
  if (follower()) return InitTensorParallel();
  ASSIGN_OR_RETURN(engine_, engine::Engine::Create(options_.engine, model_));
  if (options_.tp_size > 1) RETURN_IF_ERROR(InitTensorParallel());

  if (!options_.kv_store_path.empty()) {
    kv_store::HostRamTier::Options ram;
    ram.capacity_bytes = options_.kv_ram_tier_bytes;
    ASSIGN_OR_RETURN(ram_tier_, kv_store::HostRamTier::Create(ram));
    kv_store::RocksDbTier::Options disk;
    disk.path = options_.kv_store_path;
    disk.capacity_bytes = options_.kv_store_capacity_bytes;
    ASSIGN_OR_RETURN(disk_tier_, kv_store::RocksDbTier::Open(disk));
    tiered_ = std::make_unique<kv_store::TieredCache>(kv_store::TieredCache::Options(),
                                                      ram_tier_.get(), disk_tier_.get());
    tiered_->Attach(engine_->pool());
  }
  engine_->pool()->SetEventListener([this](const engine::KvEvent& ev) {
    std::string h(ev.hash.begin(), ev.hash.end());
    if (ev.kind == engine::KvEvent::Kind::kStored) {
      cache_events_.add_stored_block_hashes(h);
    } else {
      cache_events_.add_evicted_block_hashes(h);
    }
  });
  engine_->SetLayerHook(
      [this](int layer, std::span<const engine::StepSequence> seqs) { OnLayer(layer, seqs); });
  io_ = std::make_unique<protocols::IoThread>("worker-ctl");
  return Status::Ok();
}

Status Worker::Impl::InitTensorParallel() {
  TpGroupOptions g;
  g.tp_rank = options_.tp_rank;
  g.tp_size = options_.tp_size;
  g.leader_host = options_.tp_host;
  g.leader_port = options_.tp_port;
  g.timeout = options_.kv_timeout;
  const Deadline deadline = Deadline::After(options_.connect_timeout);
  const std::string my_kv = options_.kv_host + ":" + std::to_string(transport_->port());
  if (follower()) {
    proto::TpHello hello;
    hello.set_tp_rank(static_cast<uint32_t>(options_.tp_rank));
    hello.set_tp_size(static_cast<uint32_t>(options_.tp_size));
    protocols::ToProto(peer_config_, hello.mutable_config());
    hello.set_kv_address(my_kv);
    hello.set_data_rank(static_cast<uint32_t>(options_.rank));
    hello.set_tp_mode(static_cast<uint32_t>(options_.tp_mode));
    ASSIGN_OR_RETURN(tp_group_, TcpTpGroup::Connect(g, hello.SerializeAsString(), deadline));
    ASSIGN_OR_RETURN(TpMessage m, tp_group_->ReceiveFromLeader(deadline));
    proto::TpSetup setup;
    if (m.type != TpMsg::kSetup || !setup.ParseFromString(m.payload)) {
      return DataLoss("TP rank 0 did not answer with a setup message");
    }
    if (!setup.accepted()) return FailedPrecondition("TP rank 0 refused: " + setup.reason());
    ASSIGN_OR_RETURN(follower_, engine::TpFollower::Create(
                                    options_.engine, model_,
                                    static_cast<int64_t>(setup.total_blocks()), tp_group_.get()));
    LOG_INFO << "joined TP group as rank " << options_.tp_rank << " of " << options_.tp_size
             << " (kv heads [" << model_->kv_head_range().begin << ", "
             << model_->kv_head_range().end << "), kv data on " << my_kv << ")";
    return Status::Ok();
  }
  ASSIGN_OR_RETURN(tp_group_, TcpTpGroup::Listen(g));
  tp_kv_addresses_.assign(options_.tp_size, "");
  tp_data_ranks_.assign(options_.tp_size, 0);
  tp_kv_addresses_[0] = my_kv;
  tp_data_ranks_[0] = static_cast<uint32_t>(options_.rank);
  LOG_INFO << "TP rank 0 waiting for " << options_.tp_size - 1 << " follower(s) on "
           << options_.tp_host << ":" << tp_group_->port();
  auto check = [&](const std::string& payload) -> Result<TcpTpGroup::SetupAnswer> {
    proto::TpHello hello;
    if (!hello.ParseFromString(payload)) return InvalidArgument("unparseable TP hello");
    ASSIGN_OR_RETURN(protocols::PeerConfig peer, protocols::FromProto(hello.config()));
    protocols::CompatibilityOptions compat;
    compat.require_same_tp = true;
    protocols::PeerConfig mine = peer_config_;
    mine.tp_rank = peer.tp_rank;  // ranks differ by design
    RETURN_IF_ERROR(protocols::CheckPeerCompatible(mine, peer, compat));
    if (hello.tp_mode() != static_cast<uint32_t>(options_.tp_mode)) {
      return FailedPrecondition(
          "TP mode mismatch: rank 0 uses " + std::to_string(static_cast<int>(options_.tp_mode)) +
          ", rank " + std::to_string(hello.tp_rank()) + " uses " + std::to_string(hello.tp_mode()));
    }
    const int r = static_cast<int>(hello.tp_rank());
    if (r >= 1 && r < options_.tp_size) {
      tp_kv_addresses_[r] = hello.kv_address();
      tp_data_ranks_[r] = hello.data_rank();
    }
    proto::TpSetup setup;
    setup.set_accepted(true);
    setup.set_total_blocks(static_cast<uint64_t>(engine_->pool()->total_blocks()));
    return TcpTpGroup::SetupAnswer{r, setup.SerializeAsString()};
  };
  auto refusal = [](const Status& why) {
    proto::TpSetup setup;
    setup.set_accepted(false);
    setup.set_reason(why.ToString());
    return setup.SerializeAsString();
  };
  RETURN_IF_ERROR(tp_group_->Accept(deadline, check, refusal).status());
  engine::TensorParallelHooks hooks;
  hooks.collective = tp_group_.get();
  hooks.publish = [this](const engine::StepPlan& plan) {
    proto::TpStepPlan m;
    for (const auto& c : plan.copies) {
      auto* pc = m.add_copies();
      pc->set_src(c.src);
      pc->set_dst(c.dst);
    }
    for (const auto& q : plan.seqs) {
      auto* ps = m.add_seqs();
      ps->mutable_blocks()->Add(q.blocks.begin(), q.blocks.end());
      ps->set_cache_len(q.cache_len);
      ps->mutable_tokens()->Add(q.tokens.begin(), q.tokens.end());
    }
    return tp_group_->Broadcast(TpMsg::kPlan, m.SerializeAsString());
  };
  RETURN_IF_ERROR(engine_->SetTensorParallel(hooks));
  LOG_INFO << "TP group of " << options_.tp_size << " ranks is complete";
  return Status::Ok();
}

kv_transfer::HeadRange Worker::Impl::OwnHeads() const {
  return {model_->kv_head_range().begin, model_->kv_head_range().end};
}

void Worker::Impl::FollowerExpectKv(const proto::TpExpectKv& m) {
  const uint64_t id = m.request_id();
  std::vector<BlockId> blocks(m.block_ids().begin(), m.block_ids().end());
  Status s;
  for (BlockId b : blocks) {
    if (b < 0 || b >= follower_->pool()->total_blocks()) {
      s = InvalidArgument("block id " + std::to_string(b) + " is outside the pool");
    }
  }
  FollowerIncoming in;
  in.deadline = Deadline::After(options_.kv_timeout);
  if (s.ok()) {
    const kv_transfer::HeadRange own = OwnHeads();
    in.receiver = std::make_unique<kv_transfer::LayerStreamReceiver>(
        transport_.get(), static_cast<int>(m.prefill_rank()), MakeStreamSpec(id, blocks, own),
        MakeStreamBuffers(follower_->pool(), blocks, {0, own.size()}));
    s = in.receiver->Start();
  }
  if (!s.ok()) {
    proto::TpKvDone done;
    done.set_request_id(id);
    done.set_tp_rank(static_cast<uint32_t>(options_.tp_rank));
    done.set_ok(false);
    done.set_error(s.ToString());
    (void)tp_group_->SendToLeader(TpMsg::kKvDone, done.SerializeAsString());
    return;
  }
  follower_incoming_[id] = std::move(in);
}

void Worker::Impl::FollowerProgress() {
  for (auto it = follower_incoming_.begin(); it != follower_incoming_.end();) {
    FollowerIncoming& in = it->second;
    Status s = in.receiver->Progress();
    if (s.ok() && !in.receiver->complete() && in.deadline.Expired()) {
      s = DeadlineExceeded("KV heads did not arrive within " +
                           std::to_string(options_.kv_timeout.count()) + " ms");
    }
    if (s.ok() && !in.receiver->complete()) {
      ++it;
      continue;
    }
    proto::TpKvDone done;
    done.set_request_id(it->first);
    done.set_tp_rank(static_cast<uint32_t>(options_.tp_rank));
    done.set_ok(s.ok());
    if (!s.ok()) done.set_error(s.ToString());
    if (s.ok())
      transfer_bytes_ += layout_.BlockBytes() * in.receiver->layers_complete() / layout_.layers;
    in.receiver.reset();
    (void)tp_group_->SendToLeader(TpMsg::kKvDone, done.SerializeAsString());
    it = follower_incoming_.erase(it);
  }
}

Status Worker::Impl::RunFollower(const std::atomic<bool>& stop) {
  while (!stop.load()) {
    const auto wait =
        follower_incoming_.empty() ? std::chrono::milliseconds(100) : std::chrono::milliseconds(1);
    auto m = tp_group_->ReceiveFromLeader(Deadline::After(wait));
    if (!m.ok()) {
      if (m.status().code() != StatusCode::kDeadlineExceeded) {
        follower_incoming_.clear();
        return Unavailable("TP rank 0 is gone: " + m.status().message());
      }
      FollowerProgress();
      continue;
    }
    switch (m->type) {
      case TpMsg::kPlan: {
        proto::TpStepPlan pm;
        if (!pm.ParseFromString(m->payload)) return DataLoss("unparseable TP step plan");
        engine::StepPlan plan;
        for (const auto& c : pm.copies()) plan.copies.push_back({c.src(), c.dst()});
        for (const auto& q : pm.seqs()) {
          plan.seqs.push_back({{q.blocks().begin(), q.blocks().end()},
                               q.cache_len(),
                               {q.tokens().begin(), q.tokens().end()}});
        }
        // A failed step means the group has diverged or a link broke: stop.
        RETURN_IF_ERROR(follower_->Execute(plan).WithContext("TP follower step"));
        break;
      }
      case TpMsg::kExpectKv: {
        proto::TpExpectKv e;
        if (!e.ParseFromString(m->payload)) return DataLoss("unparseable TP KV expectation");
        FollowerExpectKv(e);
        break;
      }
      case TpMsg::kCancelKv: {
        proto::TpCancelKv c;
        if (c.ParseFromString(m->payload)) follower_incoming_.erase(c.request_id());
        break;
      }
      case TpMsg::kShutdown:
        follower_incoming_.clear();
        return Status::Ok();
      default:
        return DataLoss("unexpected TP message type " +
                        std::to_string(static_cast<uint32_t>(m->type)));
    }
    FollowerProgress();
  }
  follower_incoming_.clear();
  return Status::Ok();
}

void Worker::Impl::LeaderPollFollowers() {
  while (true) {
    auto m = tp_group_->PollFollowers(Deadline::After(std::chrono::nanoseconds(0)));
    if (!m.ok() || !m->has_value()) return;  // a broken link shows up in the next step
    auto& [rank, msg] = **m;
    if (msg.type != TpMsg::kKvDone) continue;
    proto::TpKvDone done;
    if (!done.ParseFromString(msg.payload)) continue;
    auto it = incoming_.find(done.request_id());
    if (it == incoming_.end()) continue;  // cancelled meanwhile
    if (!done.ok()) {
      it->second.follower_error =
          Unavailable("TP rank " + std::to_string(rank) + ": " + done.error());
    } else {
      --it->second.follower_acks_pending;
    }
  }
}

void Worker::Impl::CancelFollowerKv(uint64_t id) {
  if (tp_group_ == nullptr) return;
  proto::TpCancelKv c;
  c.set_request_id(id);
  (void)tp_group_->Broadcast(TpMsg::kCancelKv, c.SerializeAsString());
}

kv_transfer::StreamSpec Worker::Impl::MakeStreamSpec(uint64_t id, const std::vector<BlockId>& dst,
                                                     kv_transfer::HeadRange heads) const {
  kv_transfer::StreamSpec spec;
  spec.request_id = id;
  spec.layers = layout_.layers;
  spec.dst_blocks = dst;
  spec.global_heads = heads;
  spec.block_tokens = layout_.block_tokens;
  spec.head_dim = layout_.head_dim;
  spec.dtype = layout_.dtype;
  spec.model_fingerprint = model_->fingerprint();
  return spec;
}

kv_transfer::StreamBuffers Worker::Impl::MakeStreamBuffers(engine::KvBlockPool* pool,
                                                           std::span<const BlockId> blocks,
                                                           kv_transfer::HeadRange local) const {
  kv_transfer::StreamBuffers buffers;
  buffers.layout.kv_heads = layout_.kv_heads;
  buffers.layout.slab_bytes = layout_.SlabBytes();
  buffers.local_heads = local;
  for (BlockId b : blocks) buffers.block_layer0.push_back(pool->LayerData(b, 0).data());
  if (layout_.layers > 1 && !blocks.empty()) {
    // Layers of one block are a fixed stride apart in the pool.
    buffers.layer_stride = pool->LayerData(blocks[0], 1).data() - buffers.block_layer0[0];
  }
  return buffers;
}

Status Worker::Impl::Connect() {
  Deadline deadline = Deadline::After(options_.connect_timeout);
  protocols::ConnectionOptions copts;
  copts.name = "coordinator";
  ASSIGN_OR_RETURN(
      conn_, protocols::FramedConnection::Connect(*io_, options_.coordinator_host,
                                                  options_.coordinator_port, copts, deadline));
  // Connect() has already started reading; a second Start() would run two
  // concurrent reads on one socket and corrupt the frame stream under load.
  RETURN_IF_ERROR(
      protocols::ClientHandshake(*conn_, options_.worker_id, peer_config_, {}, deadline).status());
  proto::RegisterWorker reg;
  reg.set_worker_id(options_.worker_id);
  reg.set_role(ToProto(options_.role));
  reg.set_rank(static_cast<uint32_t>(options_.rank));
  reg.set_tp_size(static_cast<uint32_t>(options_.tp_size));
  if (options_.tp_size > 1) {
    for (uint32_t r : tp_data_ranks_) reg.add_tp_ranks(r);
    for (const std::string& a : tp_kv_addresses_) reg.add_tp_kv_addresses(a);
  } else {
    reg.add_tp_ranks(static_cast<uint32_t>(options_.rank));
  }
  protocols::ToProto(peer_config_, reg.mutable_config());
  reg.set_capacity_blocks(static_cast<uint64_t>(engine_->pool()->total_blocks()));
  reg.set_kv_address(options_.kv_host + ":" + std::to_string(transport_->port()));
  Send(MessageType::kRegisterWorker, reg);
  ASSIGN_OR_RETURN(protocols::Frame frame, conn_->Receive(deadline));
  proto::RegisterReply reply;
  RETURN_IF_ERROR(protocols::DecodeMessage(frame, MessageType::kRegisterReply, &reply));
  if (!reply.accepted())
    return FailedPrecondition("coordinator refused registration: " + reply.reason());
  if (reply.heartbeat_interval_ms() > 0) {
    heartbeat_interval_ = std::chrono::milliseconds(reply.heartbeat_interval_ms());
  }
  LOG_INFO << "registered as " << options_.worker_id << " (" << RoleName(options_.role)
           << "), kv data on " << options_.kv_host << ":" << transport_->port();
  return Status::Ok();
}

void Worker::Impl::SendFinish(uint64_t id, proto::Finish::Reason reason, const Status& error,
                              int64_t prompt_tokens, int64_t completion_tokens) {
  proto::Finish f;
  f.set_request_id(id);
  f.set_reason(reason);
  if (!error.ok()) {
    f.set_status_code(static_cast<uint32_t>(error.code()));
    f.set_message(error.message());
  }
  f.set_prompt_tokens(static_cast<uint32_t>(prompt_tokens));
  f.set_completion_tokens(static_cast<uint32_t>(completion_tokens));
  Send(MessageType::kFinish, f);
}

void Worker::Impl::OnPrefillTask(const proto::PrefillTask& task) {
  const uint64_t id = task.request_id();
  engine::RequestSpec spec;
  spec.id = RequestKey(id);
  spec.prompt.assign(task.prompt_token_ids().begin(), task.prompt_token_ids().end());
  spec.sampling = FromProto(task.sampling());
  spec.tenant_salt = task.tenant_salt();
  const bool disaggregated = task.has_decode();
  spec.mode = disaggregated ? engine::RequestMode::kPrefillOnly : engine::RequestMode::kFull;
  if (disaggregated && options_.role == Role::kDecode) {
    SendFinish(id, proto::Finish::REASON_ERROR,
               FailedPrecondition("a decode worker cannot prefill"));
    return;
  }
  if (disaggregated) {
    const auto& target = task.decode();
    Outgoing out;
    const int tp = std::max(1, target.ranks_size());
    for (int i = 0; i < tp && target.ranks_size() > 0; ++i) {
      const int peer = static_cast<int>(target.ranks(i));
      const std::string addr =
          i < target.kv_addresses_size() ? target.kv_addresses(i) : target.kv_address();
      Status s;
      if (peer < 0 || peer >= options_.world_size) {
        s = InvalidArgument("decode target rank " + std::to_string(peer) + " is invalid");
      } else if (!connected_peers_.count(peer)) {
        auto colon = addr.rfind(':');
        s = colon == std::string::npos
                ? InvalidArgument("decode kv_address '" + addr + "' is not host:port")
                : transport_->ConnectPeer(peer, addr.substr(0, colon),
                                          static_cast<uint16_t>(std::stoi(addr.substr(colon + 1))),
                                          Deadline::After(options_.kv_timeout));
        if (s.ok()) connected_peers_.insert(peer);
      }
      if (!s.ok()) {
        SendFinish(id, proto::Finish::REASON_ERROR, s.WithContext("connecting to decode worker"));
        return;
      }
      out.decode_ranks.push_back(peer);
    }
    if (out.decode_ranks.empty()) {
      SendFinish(id, proto::Finish::REASON_ERROR, InvalidArgument("decode target has no ranks"));
      return;
    }
    out.dst_blocks.assign(target.block_ids().begin(), target.block_ids().end());
    out.prompt_tokens = static_cast<int64_t>(spec.prompt.size());
    const int64_t need = (out.prompt_tokens + layout_.block_tokens - 1) / layout_.block_tokens;
    if (static_cast<int64_t>(out.dst_blocks.size()) != need) {
      SendFinish(id, proto::Finish::REASON_ERROR,
                 InvalidArgument("decode target has " + std::to_string(out.dst_blocks.size()) +
                                 " blocks, the prompt needs " + std::to_string(need)));
      return;
    }
    outgoing_[id] = std::move(out);
  }
  if (tiered_) {
    std::vector<BlockId> table;
    auto restored = tiered_->RestorePrefix(
        engine_->pool(), spec.prompt, engine_->model().fingerprint(), spec.tenant_salt, &table);
    if (restored.ok()) {
      restore_refs_.insert(restore_refs_.end(), table.begin(), table.end());
    } else {
      LOG_WARNING << "prefix restore failed: " << restored.status().ToString();
    }
  }
  const int64_t prompt_tokens = static_cast<int64_t>(spec.prompt.size());
  Status s = engine_->Submit(std::move(spec));
  if (!s.ok()) {
    outgoing_.erase(id);
    SendFinish(id, proto::Finish::REASON_ERROR, s);
    return;
  }
  queued_tokens_ += prompt_tokens;
}

void Worker::Impl::OnLayer(int layer, std::span<const engine::StepSequence> seqs) {
  // A long step (a big prefill chunk on one thread) must not look like a dead
  // worker: heartbeats are due every interval even in the middle of a step.
  // Runs on the Run() thread (the hook is called inside Step), so Send is safe.
  if (Clock::now() >= next_heartbeat_) SendHeartbeat();
  for (const auto& seq : seqs) {
    const uint64_t id = std::stoull(*seq.id);
    auto it = outgoing_.find(id);
    if (it == outgoing_.end()) continue;
    Outgoing& out = it->second;
    if (seq.end < out.prompt_tokens) continue;  // not the prompt's last chunk yet
    if (out.senders.empty()) {
      const size_t n = out.dst_blocks.size();
      if (seq.blocks.size() < n) {
        LOG_ERROR << "request " << id << " holds " << seq.blocks.size() << " blocks, expected "
                  << n;
        continue;
      }
      // Decode rank r of a TP group of T receives only its heads.
      const int tp = static_cast<int>(out.decode_ranks.size());
      for (int r = 0; r < tp; ++r) {
        auto heads = kv_transfer::ShardHeads(layout_.kv_heads, tp, r);
        if (!heads.ok()) {
          LOG_ERROR << "request " << id << ": " << heads.status().ToString();
          out.senders.clear();
          break;
        }
        out.senders.push_back(std::make_unique<kv_transfer::LayerStreamSender>(
            transport_.get(), out.decode_ranks[r], MakeStreamSpec(id, out.dst_blocks, *heads),
            MakeStreamBuffers(engine_->pool(), std::span<const BlockId>(seq.blocks.data(), n),
                              *heads)));
      }
    }
    for (auto& sender : out.senders) {
      Status s = sender->SendLayer(layer);
      if (!s.ok())
        LOG_WARNING << "KV layer " << layer << " of request " << id << ": " << s.ToString();
    }
    ++out.layers_sent;
    transfer_bytes_ += layout_.LayerBytes() * static_cast<int64_t>(out.dst_blocks.size());
  }
}

void Worker::Impl::FinishOutgoing(uint64_t id, Outgoing& out) {
  auto start = Clock::now();
  const Deadline deadline = Deadline::After(options_.kv_timeout);
  Status s = out.senders.empty() ? Internal("no KV was streamed for request " + std::to_string(id))
                                 : Status::Ok();
  for (auto& sender : out.senders) {
    Status f = sender->Finish(deadline);
    if (s.ok()) s = f;
  }
  transfer_seconds_ += SecondsSince(start);
  if (!s.ok()) {
    LOG_WARNING << "KV stream of request " << id << " failed: " << s.ToString();
    SendFinish(id, proto::Finish::REASON_ERROR, s.WithContext("KV transfer to decode"));
  }
  (void)engine_->ReleaseRequest(RequestKey(id));
}

void Worker::Impl::OnDecodeAdmission(const proto::DecodeAdmission& a) {
  const uint64_t id = a.request_id();
  if (a.first_token() >= 0) {
    auto it = incoming_.find(id);
    if (it == incoming_.end()) return;  // cancelled or failed meanwhile
    it->second.first_token = a.first_token();
    return;
  }
  proto::BlockReservationReply reply;
  reply.set_request_id(id);
  Incoming in;
  in.spec.id = RequestKey(id);
  in.spec.prompt.assign(a.prompt_token_ids().begin(), a.prompt_token_ids().end());
  in.spec.sampling = FromProto(a.sampling());
  in.deadline = Deadline::After(options_.kv_timeout);
  const int64_t need = (static_cast<int64_t>(in.spec.prompt.size()) + layout_.block_tokens - 1) /
                       layout_.block_tokens;
  Status s;
  for (int64_t i = 0; i < need && s.ok(); ++i) {
    auto b = engine_->pool()->Allocate();
    if (b.ok()) {
      in.blocks.push_back(*b);
    } else {
      s = b.status();
    }
  }
  if (s.ok()) {
    const kv_transfer::HeadRange own = OwnHeads();
    in.receiver = std::make_unique<kv_transfer::LayerStreamReceiver>(
        transport_.get(), static_cast<int>(a.prefill_rank()), MakeStreamSpec(id, in.blocks, own),
        MakeStreamBuffers(engine_->pool(), in.blocks, {0, own.size()}));
    s = in.receiver->Start();
  }
  if (s.ok() && tp_group_ != nullptr) {
    // Every follower receives its own heads into the same block ids.
    proto::TpExpectKv e;
    e.set_request_id(id);
    e.set_prefill_rank(a.prefill_rank());
    for (BlockId b : in.blocks) e.add_block_ids(b);
    s = tp_group_->Broadcast(TpMsg::kExpectKv, e.SerializeAsString());
    in.follower_acks_pending = options_.tp_size - 1;
  }
  if (!s.ok()) {
    in.receiver.reset();
    for (BlockId b : in.blocks) engine_->pool()->Release(b);
    reply.set_ok(false);
    reply.set_reason(s.ToString());
    Send(MessageType::kBlockReservationReply, reply);
    return;
  }
  reply.set_ok(true);
  for (BlockId b : in.blocks) reply.add_block_ids(b);
  incoming_[id] = std::move(in);
  Send(MessageType::kBlockReservationReply, reply);
}

void Worker::Impl::ProgressIncoming() {
  if (tp_group_ != nullptr) LeaderPollFollowers();
  std::vector<uint64_t> done;
  for (auto& [id, in] : incoming_) {
    Status s = in.receiver->Progress();
    if (s.ok()) s = in.follower_error;
    const bool all_here = in.receiver->complete() && in.follower_acks_pending == 0;
    if (s.ok() && !all_here && in.deadline.Expired()) {
      s = DeadlineExceeded("KV of request " + std::to_string(id) + " did not arrive within " +
                           std::to_string(options_.kv_timeout.count()) + " ms");
    }
    if (!s.ok()) {
      in.receiver.reset();  // cancels outstanding receives before the blocks go back
      CancelFollowerKv(id);
      for (BlockId b : in.blocks) engine_->pool()->Release(b);
      SendFinish(id, proto::Finish::REASON_ERROR, s.WithContext("receiving KV"));
      done.push_back(id);
      continue;
    }
    if (!all_here || in.first_token < 0) continue;
    in.receiver.reset();
    transfer_bytes_ += layout_.BlockBytes() * static_cast<int64_t>(in.blocks.size());
    const int64_t prompt_tokens = static_cast<int64_t>(in.spec.prompt.size());
    Status admitted = engine_->AdmitPrefilled(std::move(in.spec), in.first_token, in.blocks);
    if (!admitted.ok()) {
      SendFinish(id, proto::Finish::REASON_ERROR, admitted, prompt_tokens);
    } else {
      generated_[id] = 1;
    }
    done.push_back(id);
  }
  for (uint64_t id : done) incoming_.erase(id);
}

void Worker::Impl::OnCancel(const proto::Cancel& c) {
  const uint64_t id = c.request_id();
  if (auto it = incoming_.find(id); it != incoming_.end()) {
    it->second.receiver.reset();
    CancelFollowerKv(id);
    for (BlockId b : it->second.blocks) engine_->pool()->Release(b);
    incoming_.erase(it);
    return;
  }
  if (auto it = outgoing_.find(id); it != outgoing_.end()) {
    it->second.senders.clear();  // cancels unfinished sends
    outgoing_.erase(it);
  }
  (void)engine_->Cancel(RequestKey(id));
  (void)engine_->ReleaseRequest(RequestKey(id));
}

void Worker::Impl::HandleFrame(const protocols::Frame& frame) {
  const auto type = static_cast<MessageType>(frame.type);
  Status s;
  switch (type) {
    case MessageType::kPrefillTask: {
      proto::PrefillTask task;
      s = protocols::DecodeMessage(frame, type, &task);
      if (s.ok()) OnPrefillTask(task);
      break;
    }
    case MessageType::kDecodeAdmission: {
      proto::DecodeAdmission a;
      s = protocols::DecodeMessage(frame, type, &a);
      if (s.ok()) OnDecodeAdmission(a);
      break;
    }
    case MessageType::kCancel: {
      proto::Cancel c;
      s = protocols::DecodeMessage(frame, type, &c);
      if (s.ok()) OnCancel(c);
      break;
    }
    default:
      s = InvalidArgument("unexpected control frame type " + std::to_string(frame.type));
  }
  if (!s.ok()) LOG_WARNING << "bad control frame: " << s.ToString();
}

void Worker::Impl::HandleEvents(const std::vector<engine::TokenEvent>& events) {
  for (const auto& ev : events) {
    const uint64_t id = std::stoull(ev.id);
    auto gen = generated_.find(id);
    const bool first = gen == generated_.end();
    if (first) {
      // The first token of a request computed here: TTFT ends now.
      queued_tokens_ = std::max<int64_t>(0, queued_tokens_ - ev.prompt_tokens);
      proto::PrefillDone done;
      done.set_request_id(id);
      done.set_first_token(ev.token);
      done.set_prompt_tokens(static_cast<uint32_t>(ev.prompt_tokens));
      done.set_cached_prompt_tokens(static_cast<uint32_t>(ev.cached_prompt_tokens));
      auto out = outgoing_.find(id);
      if (out != outgoing_.end()) {
        // Disaggregated: the KV must be on its way before the decode side is told.
        FinishOutgoing(id, out->second);
        outgoing_.erase(out);
        const bool ended = ev.finished && ev.finish_reason != engine::FinishReason::kPrefilled;
        done.set_finished(ended);
        if (ended) done.set_reason(ToProto(ev.finish_reason));
        Send(MessageType::kPrefillDone, done);
        continue;
      }
      if (ev.finish_reason == engine::FinishReason::kError ||
          ev.finish_reason == engine::FinishReason::kCancelled || ev.token < 0) {
        SendFinish(id, ToProto(ev.finish_reason), ev.error, ev.prompt_tokens);
        continue;
      }
      done.set_finished(ev.finished);
      if (ev.finished) done.set_reason(ToProto(ev.finish_reason));
      Send(MessageType::kPrefillDone, done);
      if (!ev.finished) generated_[id] = 1;
      continue;
    }
    // An end-of-generation token ends the request; it is not text to stream.
    const bool eog = ev.finish_reason == engine::FinishReason::kStop && ev.token >= 0 &&
                     model_->tokenizer() != nullptr &&
                     model_->tokenizer()->IsEndOfGeneration(ev.token);
    if (ev.token >= 0 && !eog) {
      auto* entry = chunk_.add_entries();
      entry->set_request_id(id);
      entry->add_token_ids(ev.token);
      entry->set_position(static_cast<uint32_t>(gen->second));
      ++gen->second;
    }
    if (ev.finished) {
      if (chunk_.entries_size() > 0) {
        Send(MessageType::kTokenChunk, chunk_);
        chunk_.Clear();
      }
      SendFinish(id, ToProto(ev.finish_reason), ev.error, ev.prompt_tokens, gen->second);
      generated_.erase(gen);
    }
  }
  if (chunk_.entries_size() > 0) {
    Send(MessageType::kTokenChunk, chunk_);
    chunk_.Clear();
  }
}

void Worker::Impl::FlushCacheEvents() {
  if (cache_events_.stored_block_hashes_size() == 0 &&
      cache_events_.evicted_block_hashes_size() == 0) {
    return;
  }
  cache_events_.set_worker_id(options_.worker_id);
  Send(MessageType::kPrefixCacheEvent, cache_events_);
  cache_events_.Clear();
}

void Worker::Impl::SendHeartbeat() {
  proto::Heartbeat hb;
  hb.set_worker_id(options_.worker_id);
  hb.set_free_blocks(static_cast<uint64_t>(engine_->pool()->available_blocks()));
  hb.set_capacity_blocks(static_cast<uint64_t>(engine_->pool()->total_blocks()));
  hb.set_running_requests(static_cast<uint32_t>(engine_->running()));
  hb.set_queued_tokens(static_cast<uint32_t>(queued_tokens_));
  hb.set_sequence(++heartbeat_seq_);
  hb.set_prefix_hit_tokens(static_cast<uint64_t>(engine_->stats().prompt_tokens_cached));
  hb.set_transfer_bytes(static_cast<uint64_t>(transfer_bytes_));
  hb.set_transfer_seconds(transfer_seconds_);
  Send(MessageType::kHeartbeat, hb);
  next_heartbeat_ = Clock::now() + heartbeat_interval_;
}

void Worker::Impl::ReleaseAll() {
  for (auto& [id, in] : incoming_) {
    in.receiver.reset();
    for (BlockId b : in.blocks) engine_->pool()->Release(b);
  }
  incoming_.clear();
  for (auto& [id, out] : outgoing_) {
    out.senders.clear();
    (void)engine_->Cancel(RequestKey(id));
    (void)engine_->ReleaseRequest(RequestKey(id));
  }
  outgoing_.clear();
  for (BlockId b : restore_refs_) engine_->pool()->Release(b);
  restore_refs_.clear();
  for (auto& [id, n] : generated_) (void)engine_->Cancel(RequestKey(id));
  generated_.clear();
  // Followers stop with their rank 0 (best effort: a broken link is fine).
  if (tp_group_ != nullptr) (void)tp_group_->Broadcast(TpMsg::kShutdown, "");
}

Status Worker::Impl::Run(const std::atomic<bool>& stop) {
  if (follower()) return RunFollower(stop);
  RETURN_IF_ERROR(Connect());
  SendHeartbeat();
  Status result;
  while (!stop.load()) {
    // Sleep in Receive unless there is compute or KV to make progress on.
    const bool busy = engine_->HasWork() || !incoming_.empty();
    auto wait =
        busy ? std::chrono::nanoseconds(incoming_.empty() || engine_->HasWork() ? 0 : 1000000)
             : std::chrono::nanoseconds(
                   std::max<int64_t>(0, (next_heartbeat_ - Clock::now()).count()));
    // Wake at least every 100 ms to notice `stop`.
    wait = std::min<std::chrono::nanoseconds>(wait, std::chrono::milliseconds(100));
    auto frame = conn_->Receive(Deadline::After(wait));
    while (frame.ok()) {
      HandleFrame(*frame);
      frame = conn_->Receive(Deadline::After(std::chrono::nanoseconds(0)));
    }
    if (frame.status().code() != StatusCode::kDeadlineExceeded) {
      result = Unavailable("coordinator connection lost: " + frame.status().message());
      break;
    }
    if (!incoming_.empty()) ProgressIncoming();
    if (engine_->HasWork()) {
      auto events = engine_->Step();
      for (BlockId b : restore_refs_) engine_->pool()->Release(b);
      restore_refs_.clear();
      if (!events.ok()) {
        LOG_ERROR << "engine step failed: " << events.status().ToString();
        result = events.status();
        break;
      }
      HandleEvents(*events);
      if (tp_group_ != nullptr && !tp_group_->status().ok()) {
        // A TP group cannot go on without a rank: the step's requests have
        // already failed; leave so the coordinator stops routing here.
        result = tp_group_->status().WithContext("tensor-parallel group broken");
        break;
      }
    }
    FlushCacheEvents();
    if (tp_group_ != nullptr) {
      // A follower that died while the group was idle shows up as a closed
      // link here: leave now rather than fail the next request.
      LeaderPollFollowers();
      if (!tp_group_->status().ok()) {
        result = tp_group_->status().WithContext("tensor-parallel group broken");
        break;
      }
    }
    if (Clock::now() >= next_heartbeat_) SendHeartbeat();
  }
  ReleaseAll();
  if (conn_) conn_->Close(Cancelled("worker stopping"));
  return result;
}

Worker::Worker(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Worker::~Worker() = default;

Result<std::unique_ptr<Worker>> Worker::Create(WorkerOptions options) {
  auto impl = std::make_unique<Impl>(std::move(options));
  RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<Worker>(new Worker(std::move(impl)));
}

Status Worker::Run(const std::atomic<bool>& stop) { return impl_->Run(stop); }

}  // namespace kvrelay::worker
