#include "worker/worker.h"

#include <map>
#include <optional>
#include <set>

#include "common/logging.h"
#include "engine/runtime/model.h"
#include "kv_store/host_ram_tier.h"
#include "kv_store/rocksdb_tier.h"
#include "kv_store/tiered_cache.h"
#include "kv_transfer/layer_stream.h"
#include "kv_transfer/tcp_transport.h"
#include "protocols/control.pb.h"
#include "protocols/framed_connection.h"
#include "protocols/handshake.h"
#include "protocols/messages.h"
#include "protocols/peer_handshake.h"

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
  return p;
}

std::string RequestKey(uint64_t id) { return std::to_string(id); }

}  // namespace

class Worker::Impl {
 public:
  explicit Impl(WorkerOptions options) : options_(std::move(options)) {}

  Status Init();
  Status Run(const std::atomic<bool>& stop);

 private:
  // A prefill-only request whose KV is being streamed to a decode worker.
  struct Outgoing {
    std::unique_ptr<kv_transfer::LayerStreamSender> sender;
    int decode_rank = 0;
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
  // The whole prompt's KV of one request, every head, as a layer stream: the
  // sender names the decode side's blocks (dst), the receiver its own.
  kv_transfer::StreamSpec MakeStreamSpec(uint64_t id, const std::vector<BlockId>& dst) const;
  // Where those blocks live in this worker's pool.
  kv_transfer::StreamBuffers MakeStreamBuffers(std::span<const BlockId> blocks) const;
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
  std::unique_ptr<engine::Engine> engine_;
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
  ASSIGN_OR_RETURN(engine_, engine::Engine::Create(options_.engine));
  const engine::Model& model = engine_->model();
  layout_ = engine_->pool()->layout();
  peer_config_.model_fingerprint = model.fingerprint();
  peer_config_.kv_dtype = layout_.dtype;
  peer_config_.block_tokens = layout_.block_tokens;
  peer_config_.layers = layout_.layers;
  peer_config_.kv_heads = layout_.kv_heads;
  peer_config_.head_dim = layout_.head_dim;

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

  kv_transfer::TcpTransport::Options t;
  t.rank = options_.rank;
  t.world_size = options_.world_size;
  t.listen_host = options_.kv_host;
  t.listen_port = options_.kv_port;
  ASSIGN_OR_RETURN(transport_, kv_transfer::TcpTransport::Create(t));
  io_ = std::make_unique<protocols::IoThread>("worker-ctl");
  return Status::Ok();
}

kv_transfer::StreamSpec Worker::Impl::MakeStreamSpec(uint64_t id,
                                                     const std::vector<BlockId>& dst) const {
  kv_transfer::StreamSpec spec;
  spec.request_id = id;
  spec.layers = layout_.layers;
  spec.dst_blocks = dst;
  spec.global_heads = {0, layout_.kv_heads};
  spec.block_tokens = layout_.block_tokens;
  spec.head_dim = layout_.head_dim;
  spec.dtype = layout_.dtype;
  spec.model_fingerprint = engine_->model().fingerprint();
  return spec;
}

kv_transfer::StreamBuffers Worker::Impl::MakeStreamBuffers(std::span<const BlockId> blocks) const {
  kv_transfer::StreamBuffers buffers;
  buffers.layout.kv_heads = layout_.kv_heads;
  buffers.layout.slab_bytes = layout_.SlabBytes();
  buffers.local_heads = {0, layout_.kv_heads};
  for (BlockId b : blocks) buffers.block_layer0.push_back(engine_->pool()->LayerData(b, 0).data());
  if (layout_.layers > 1 && !blocks.empty()) {
    // Layers of one block are a fixed stride apart in the pool.
    buffers.layer_stride =
        engine_->pool()->LayerData(blocks[0], 1).data() - buffers.block_layer0[0];
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
  reg.set_tp_size(1);
  reg.add_tp_ranks(static_cast<uint32_t>(options_.rank));
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
    const int peer = target.ranks_size() > 0 ? static_cast<int>(target.ranks(0)) : -1;
    if (peer < 0 || peer >= options_.world_size) {
      SendFinish(id, proto::Finish::REASON_ERROR,
                 InvalidArgument("decode target rank " + std::to_string(peer) + " is invalid"));
      return;
    }
    if (!connected_peers_.count(peer)) {
      const std::string& addr = target.kv_address();
      auto colon = addr.rfind(':');
      Status s =
          colon == std::string::npos
              ? InvalidArgument("decode kv_address '" + addr + "' is not host:port")
              : transport_->ConnectPeer(peer, addr.substr(0, colon),
                                        static_cast<uint16_t>(std::stoi(addr.substr(colon + 1))),
                                        Deadline::After(options_.kv_timeout));
      if (!s.ok()) {
        SendFinish(id, proto::Finish::REASON_ERROR, s.WithContext("connecting to decode worker"));
        return;
      }
      connected_peers_.insert(peer);
    }
    Outgoing out;
    out.decode_rank = peer;
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
    if (!out.sender) {
      const size_t n = out.dst_blocks.size();
      if (seq.blocks.size() < n) {
        LOG_ERROR << "request " << id << " holds " << seq.blocks.size() << " blocks, expected "
                  << n;
        continue;
      }
      kv_transfer::StreamSpec spec = MakeStreamSpec(id, out.dst_blocks);
      kv_transfer::StreamBuffers buffers =
          MakeStreamBuffers(std::span<const BlockId>(seq.blocks.data(), n));
      out.sender = std::make_unique<kv_transfer::LayerStreamSender>(
          transport_.get(), out.decode_rank, std::move(spec), std::move(buffers));
    }
    Status s = out.sender->SendLayer(layer);
    if (!s.ok())
      LOG_WARNING << "KV layer " << layer << " of request " << id << ": " << s.ToString();
    ++out.layers_sent;
    transfer_bytes_ += layout_.LayerBytes() * static_cast<int64_t>(out.dst_blocks.size());
  }
}

void Worker::Impl::FinishOutgoing(uint64_t id, Outgoing& out) {
  auto start = Clock::now();
  Status s = out.sender ? out.sender->Finish(Deadline::After(options_.kv_timeout))
                        : Internal("no KV was streamed for request " + std::to_string(id));
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
    kv_transfer::StreamSpec spec = MakeStreamSpec(id, in.blocks);
    kv_transfer::StreamBuffers buffers = MakeStreamBuffers(in.blocks);
    in.receiver = std::make_unique<kv_transfer::LayerStreamReceiver>(
        transport_.get(), static_cast<int>(a.prefill_rank()), std::move(spec), std::move(buffers));
    s = in.receiver->Start();
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
  std::vector<uint64_t> done;
  for (auto& [id, in] : incoming_) {
    Status s = in.receiver->Progress();
    if (s.ok() && !in.receiver->complete() && in.deadline.Expired()) {
      s = DeadlineExceeded("KV of request " + std::to_string(id) + " did not arrive within " +
                           std::to_string(options_.kv_timeout.count()) + " ms");
    }
    if (!s.ok()) {
      in.receiver.reset();  // cancels outstanding receives before the blocks go back
      for (BlockId b : in.blocks) engine_->pool()->Release(b);
      SendFinish(id, proto::Finish::REASON_ERROR, s.WithContext("receiving KV"));
      done.push_back(id);
      continue;
    }
    if (!in.receiver->complete() || in.first_token < 0) continue;
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
    for (BlockId b : it->second.blocks) engine_->pool()->Release(b);
    incoming_.erase(it);
    return;
  }
  if (auto it = outgoing_.find(id); it != outgoing_.end()) {
    it->second.sender.reset();  // cancels unfinished sends
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
    if (ev.token >= 0) {
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
    out.sender.reset();
    (void)engine_->Cancel(RequestKey(id));
    (void)engine_->ReleaseRequest(RequestKey(id));
  }
  outgoing_.clear();
  for (BlockId b : restore_refs_) engine_->pool()->Release(b);
  restore_refs_.clear();
  for (auto& [id, n] : generated_) (void)engine_->Cancel(RequestKey(id));
  generated_.clear();
}

Status Worker::Impl::Run(const std::atomic<bool>& stop) {
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
    }
    FlushCacheEvents();
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
