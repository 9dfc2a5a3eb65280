#include "coordinator/cluster_backend.h"

#include <boost/asio/steady_timer.hpp>

#include "common/logging.h"
#include "protocols/control.pb.h"
#include "protocols/messages.h"

namespace kvrelay::coordinator {

using protocols::FramedConnection;
using protocols::MessageType;

namespace {

enum class Phase { kReserving, kPrefilling, kDecoding };

struct WorkerEntry {
  WorkerInfo info;
  std::shared_ptr<FramedConnection> conn;
  uint32_t rank = 0;
  std::string kv_address;
  // A TP decode group: every rank's data-plane index and KV address, in TP order
  // (empty for TP = 1).
  std::vector<uint32_t> tp_ranks;
  std::vector<std::string> tp_kv_addresses;
  TimePoint last_seen;
};

struct RequestEntry {
  GenerationRequest request;
  TokenSink sink;
  std::string prefill_id;
  std::string decode_id;  // == prefill_id for a colocated worker
  Phase phase = Phase::kReserving;
  std::vector<int32_t> decode_blocks;
  int prompt_tokens = 0;
  int cached_tokens = 0;
  int reroutes = 0;  // times re-run elsewhere after losing a worker before any token
};

// Sink calls collected under the lock and made after it is released, so a
// sink may call Cancel without deadlocking.
using PendingEvents = std::vector<std::pair<TokenSink, TokenEvent>>;

void Deliver(PendingEvents& events) {
  for (auto& [sink, event] : events) sink(event);
  events.clear();
}

void ToProto(const SamplingParams& s, proto::SamplingParams* out) {
  out->set_temperature(s.temperature);
  out->set_top_p(s.top_p);
  out->set_top_k(static_cast<uint32_t>(std::max(0, s.top_k)));
  out->set_seed(s.has_seed ? s.seed : 0);
  out->set_max_tokens(static_cast<uint32_t>(s.max_new_tokens));
  out->set_ignore_eos(s.ignore_eos);
  out->set_min_p(s.min_p);
  out->set_repetition_penalty(s.repetition_penalty);
  out->set_presence_penalty(s.presence_penalty);
  out->set_frequency_penalty(s.frequency_penalty);
}

FinishReason FromProto(proto::Finish::Reason r) {
  switch (r) {
    case proto::Finish::REASON_STOP:
      return FinishReason::kStop;
    case proto::Finish::REASON_LENGTH:
      return FinishReason::kLength;
    case proto::Finish::REASON_CANCELLED:
      return FinishReason::kCancelled;
    default:
      return FinishReason::kError;
  }
}

WorkerRole FromProto(proto::WorkerRole r) {
  switch (r) {
    case proto::WORKER_ROLE_PREFILL:
      return WorkerRole::kPrefill;
    case proto::WORKER_ROLE_DECODE:
      return WorkerRole::kDecode;
    default:
      return WorkerRole::kColocated;
  }
}

template <typename Message>
void SendTo(const std::shared_ptr<FramedConnection>& conn, MessageType type, const Message& m) {
  if (!conn) return;
  std::string payload;
  m.SerializeToString(&payload);
  Status s = conn->Send(type, payload);
  if (!s.ok()) LOG_WARNING << "control send to " << conn->name() << " failed: " << s.ToString();
}

}  // namespace

struct ClusterBackend::State {
  explicit State(ClusterBackendOptions o) : options(std::move(o)), router(options.router) {}

  const ClusterBackendOptions options;
  Router router;
  std::mutex mu;
  bool shut_down = false;                                      // guarded by mu
  std::map<std::string, WorkerEntry> workers;                  // guarded by mu
  std::map<const FramedConnection*, std::string> conn_worker;  // guarded by mu
  std::map<const FramedConnection*, bool> handshaken;          // guarded by mu
  std::map<uint64_t, RequestEntry> requests;                   // guarded by mu
  std::unique_ptr<boost::asio::steady_timer> timer;            // io thread only

  WorkerEntry* FindWorker(const std::string& id) {
    auto it = workers.find(id);
    return it == workers.end() ? nullptr : &it->second;
  }

  void Fail(uint64_t id, const Status& error, PendingEvents& out) {
    auto it = requests.find(id);
    if (it == requests.end()) return;
    TokenEvent e;
    e.finished = true;
    e.finish_reason =
        error.code() == StatusCode::kCancelled ? FinishReason::kCancelled : FinishReason::kError;
    e.error = error;
    e.prompt_tokens = it->second.prompt_tokens;
    out.emplace_back(it->second.sink, e);
    requests.erase(it);
  }

  void SendCancel(const std::string& worker_id, uint64_t request_id, const std::string& why) {
    WorkerEntry* w = FindWorker(worker_id);
    if (!w) return;
    proto::Cancel c;
    c.set_request_id(request_id);
    c.set_reason(why);
    SendTo(w->conn, MessageType::kCancel, c);
  }

  void DropWorker(const std::string& worker_id, const Status& reason, PendingEvents& out) {
    // A copy: callers pass references into `workers` / `conn_worker`, which
    // are erased below.
    const std::string id = worker_id;
    auto it = workers.find(id);
    if (it == workers.end()) return;
    LOG_WARNING << "worker " << id << " lost: " << reason.ToString();
    std::shared_ptr<FramedConnection> conn = it->second.conn;
    conn_worker.erase(conn.get());
    workers.erase(it);
    router.prefix_index().RemoveWorker(id);
    std::vector<uint64_t> affected;
    for (auto& [rid, r] : requests) {
      if (r.prefill_id == id || r.decode_id == id) affected.push_back(rid);
    }
    for (uint64_t rid : affected) {
      RequestEntry& r = requests[rid];
      if (r.phase == Phase::kDecoding && r.prefill_id == id && r.decode_id != id) {
        // Handed over: the prefill side reported its first token only once the
        // KV streams were delivered to the transport, so the request no longer
        // depends on it (a decode-side KV failure still ends it with an error).
        continue;
      }
      const std::string other = r.prefill_id == id ? r.decode_id : r.prefill_id;
      if (other != id) SendCancel(other, rid, "peer worker " + id + " lost");
      // Nothing has reached the client yet: run it again on the workers left
      // (once; a second loss fails it).
      if (r.phase != Phase::kDecoding && r.reroutes < 1) {
        ++r.reroutes;
        Status s = Start(rid, r);
        if (s.ok()) {
          LOG_INFO << "request " << rid << " re-run on " << r.prefill_id << " / " << r.decode_id
                   << " after losing " << id;
          continue;
        }
        Fail(rid, s.WithContext("worker " + id + " was lost and no other can take the request"),
             out);
        continue;
      }
      Fail(rid, Unavailable("worker " + id + " was lost: " + reason.message()), out);
    }
    if (conn) conn->Close(reason);
  }

  // Routes r to a prefill worker (and a decode group) and starts it: a block
  // reservation on the decode side, or straight to prefill when colocated.
  Status Start(uint64_t id, RequestEntry& r) {
    std::vector<WorkerInfo> infos;
    for (auto& [wid, w] : workers) infos.push_back(w.info);
    RouteRequest route;
    route.prefix_blocks = r.request.prefix_blocks;
    route.prompt_tokens = static_cast<int64_t>(r.request.prompt.size());
    route.max_new_tokens = r.request.sampling.max_new_tokens;
    ASSIGN_OR_RETURN(std::string prefill_id, router.PickPrefill(route, infos));
    WorkerEntry* p = FindWorker(prefill_id);
    std::string decode_id = prefill_id;
    if (p->info.role != WorkerRole::kColocated) {
      ASSIGN_OR_RETURN(decode_id, router.PickDecode(route, infos));
    }
    r.prefill_id = prefill_id;
    r.decode_id = decode_id;
    r.decode_blocks.clear();
    r.prompt_tokens = static_cast<int>(r.request.prompt.size());
    // Queue accounting until the next heartbeat refreshes it.
    p->info.queued_tokens += r.prompt_tokens;
    if (decode_id == prefill_id) {
      SendPrefillTask(id, r);
    } else {
      r.phase = Phase::kReserving;
      WorkerEntry* d = FindWorker(decode_id);
      d->info.free_kv_blocks -=
          (r.prompt_tokens + r.request.sampling.max_new_tokens + d->info.block_tokens - 1) /
          std::max<int64_t>(1, d->info.block_tokens);
      SendReserveBlocks(id, r);
    }
    return Status::Ok();
  }

  void SendPrefillTask(uint64_t rid, RequestEntry& r) {
    WorkerEntry* p = FindWorker(r.prefill_id);
    proto::PrefillTask task;
    task.set_request_id(rid);
    for (int32_t t : r.request.prompt) task.add_prompt_token_ids(t);
    ToProto(r.request.sampling, task.mutable_sampling());
    task.set_tenant_salt(r.request.tenant_salt);
    if (r.decode_id != r.prefill_id) {
      WorkerEntry* d = FindWorker(r.decode_id);
      auto* target = task.mutable_decode();
      target->set_worker_id(r.decode_id);
      if (d != nullptr && d->tp_ranks.size() > 1) {
        for (uint32_t rank : d->tp_ranks) target->add_ranks(rank);
        for (const auto& a : d->tp_kv_addresses) target->add_kv_addresses(a);
        target->set_tp_size(static_cast<uint32_t>(d->tp_ranks.size()));
      } else {
        target->add_ranks(d ? d->rank : 0);
      }
      for (int32_t b : r.decode_blocks) target->add_block_ids(b);
      target->set_kv_address(d ? d->kv_address : "");
    }
    r.phase = Phase::kPrefilling;
    SendTo(p ? p->conn : nullptr, MessageType::kPrefillTask, task);
  }

  void SendReserveBlocks(uint64_t rid, RequestEntry& r) {
    WorkerEntry* d = FindWorker(r.decode_id);
    WorkerEntry* p = FindWorker(r.prefill_id);
    proto::ReserveBlocks m;
    m.set_request_id(rid);
    for (int32_t t : r.request.prompt) m.add_prompt_token_ids(t);
    ToProto(r.request.sampling, m.mutable_sampling());
    m.set_prefill_rank(p ? p->rank : 0);
    SendTo(d ? d->conn : nullptr, MessageType::kReserveBlocks, m);
  }

  void SendStartDecode(uint64_t rid, RequestEntry& r, int32_t first_token) {
    WorkerEntry* d = FindWorker(r.decode_id);
    proto::StartDecode m;
    m.set_request_id(rid);
    m.set_first_token(first_token);
    SendTo(d ? d->conn : nullptr, MessageType::kStartDecode, m);
  }

  void OnFrame(const std::shared_ptr<FramedConnection>& conn, const protocols::Frame& frame,
               PendingEvents& out);
  void OnHello(const std::shared_ptr<FramedConnection>& conn, const protocols::Frame& frame);
  void OnRegister(const std::shared_ptr<FramedConnection>& conn, const protocols::Frame& frame,
                  PendingEvents& out);
  void CheckHeartbeats(PendingEvents& out);
};

void ClusterBackend::State::OnHello(const std::shared_ptr<FramedConnection>& conn,
                                    const protocols::Frame& frame) {
  proto::Hello hello;
  proto::HelloReply reply;
  Status s = protocols::DecodeMessage(frame, MessageType::kHello, &hello);
  if (s.ok()) {
    auto peer = protocols::FromProto(hello.config());
    if (!peer.ok()) {
      s = peer.status();
    } else {
      protocols::PeerConfig local = options.config;
      local.tp_size = peer->tp_size;  // TP layouts may differ between coordinator and workers
      local.tp_rank = peer->tp_rank;
      s = protocols::CheckPeerCompatible(local, *peer);
    }
  }
  reply.set_accepted(s.ok());
  reply.set_reason(s.ok() ? "" : s.message());
  protocols::ToProto(options.config, reply.mutable_config());
  SendTo(conn, MessageType::kHelloReply, reply);
  if (s.ok()) {
    handshaken[conn.get()] = true;
  } else {
    LOG_WARNING << "refusing peer " << hello.peer_name() << ": " << s.ToString();
    conn->CloseAfterFlush(s);
  }
}

void ClusterBackend::State::OnRegister(const std::shared_ptr<FramedConnection>& conn,
                                       const protocols::Frame& frame, PendingEvents& out) {
  proto::RegisterWorker reg;
  proto::RegisterReply reply;
  Status s = protocols::DecodeMessage(frame, MessageType::kRegisterWorker, &reg);
  if (s.ok() && reg.worker_id().empty()) s = InvalidArgument("RegisterWorker.worker_id is empty");
  if (s.ok() && workers.count(reg.worker_id())) {
    // The same worker came back (it reconnects after losing its link, e.g.
    // after a stall) before its old connection was noticed dead: the new
    // registration replaces the old one, whose requests are re-run or failed.
    DropWorker(reg.worker_id(), Unavailable("replaced by a new registration of the same worker"),
               out);
  }
  if (s.ok() && reg.tp_size() > 1 &&
      (reg.tp_ranks_size() != static_cast<int>(reg.tp_size()) ||
       reg.tp_kv_addresses_size() != static_cast<int>(reg.tp_size()))) {
    s = InvalidArgument("RegisterWorker: TP size " + std::to_string(reg.tp_size()) + " with " +
                        std::to_string(reg.tp_ranks_size()) + " ranks and " +
                        std::to_string(reg.tp_kv_addresses_size()) + " KV addresses");
  }
  reply.set_accepted(s.ok());
  reply.set_reason(s.ok() ? "" : s.message());
  reply.set_heartbeat_interval_ms(static_cast<uint32_t>(options.heartbeat_interval.count()));
  SendTo(conn, MessageType::kRegisterReply, reply);
  if (!s.ok()) {
    conn->CloseAfterFlush(s);
    return;
  }
  WorkerEntry w;
  w.info.id = reg.worker_id();
  w.info.role = FromProto(reg.role());
  w.info.total_kv_blocks = static_cast<int64_t>(reg.capacity_blocks());
  w.info.free_kv_blocks = static_cast<int64_t>(reg.capacity_blocks());
  w.info.block_tokens = options.config.block_tokens;
  w.conn = conn;
  w.rank = reg.rank();
  w.kv_address = reg.kv_address();
  if (reg.tp_size() > 1) {
    w.tp_ranks.assign(reg.tp_ranks().begin(), reg.tp_ranks().end());
    w.tp_kv_addresses.assign(reg.tp_kv_addresses().begin(), reg.tp_kv_addresses().end());
  }
  w.last_seen = Clock::now();
  LOG_INFO << "registered worker " << w.info.id << " rank " << w.rank << " kv " << w.kv_address;
  conn_worker[conn.get()] = w.info.id;
  workers[w.info.id] = std::move(w);
}

void ClusterBackend::State::OnFrame(const std::shared_ptr<FramedConnection>& conn,
                                    const protocols::Frame& frame, PendingEvents& out) {
  const auto type = static_cast<MessageType>(frame.type);
  if (!handshaken.count(conn.get())) {
    if (type != MessageType::kHello) {
      conn->Close(InvalidArgument("first control frame must be Hello, got type " +
                                  std::to_string(frame.type)));
      return;
    }
    OnHello(conn, frame);
    return;
  }
  auto wit = conn_worker.find(conn.get());
  if (wit == conn_worker.end()) {
    if (type == MessageType::kRegisterWorker) {
      OnRegister(conn, frame, out);
    } else {
      conn->Close(
          InvalidArgument("expected RegisterWorker, got type " + std::to_string(frame.type)));
    }
    return;
  }
  const std::string worker_id = wit->second;
  WorkerEntry* w = FindWorker(worker_id);
  if (!w) return;
  w->last_seen = Clock::now();
  Status s;
  switch (type) {
    case MessageType::kHeartbeat: {
      proto::Heartbeat hb;
      s = protocols::DecodeMessage(frame, type, &hb);
      if (!s.ok()) break;
      w->info.free_kv_blocks = static_cast<int64_t>(hb.free_blocks());
      w->info.total_kv_blocks = static_cast<int64_t>(hb.capacity_blocks());
      w->info.running = hb.running_requests();
      w->info.queued_tokens = hb.queued_tokens();
      w->info.prefix_hit_tokens = static_cast<int64_t>(hb.prefix_hit_tokens());
      w->info.transfer_bytes = static_cast<int64_t>(hb.transfer_bytes());
      w->info.transfer_seconds = hb.transfer_seconds();
      break;
    }
    case MessageType::kPrefixCacheEvent: {
      proto::PrefixCacheEvent ev;
      s = protocols::DecodeMessage(frame, type, &ev);
      if (!s.ok()) break;
      auto to_hash = [](const std::string& b, PrefixBlockHash* h) {
        if (b.size() != h->size()) return false;
        std::copy(b.begin(), b.end(), h->begin());
        return true;
      };
      PrefixBlockHash h;
      for (const auto& b : ev.stored_block_hashes()) {
        if (to_hash(b, &h)) router.prefix_index().OnStored(worker_id, h);
      }
      for (const auto& b : ev.evicted_block_hashes()) {
        if (to_hash(b, &h)) router.prefix_index().OnEvicted(worker_id, h);
      }
      break;
    }
    case MessageType::kReserveBlocksReply: {
      proto::ReserveBlocksReply rep;
      s = protocols::DecodeMessage(frame, type, &rep);
      if (!s.ok()) break;
      auto it = requests.find(rep.request_id());
      if (it == requests.end() || it->second.phase != Phase::kReserving ||
          it->second.decode_id != worker_id) {  // (re-run elsewhere meanwhile)
        // Cancelled meanwhile: make sure the decode side lets go.
        if (rep.ok()) SendCancel(worker_id, rep.request_id(), "request no longer live");
        break;
      }
      if (!rep.ok()) {
        Fail(rep.request_id(),
             ResourceExhausted("decode worker " + worker_id +
                               " could not reserve KV blocks: " + rep.reason()),
             out);
        break;
      }
      it->second.decode_blocks.assign(rep.block_ids().begin(), rep.block_ids().end());
      SendPrefillTask(rep.request_id(), it->second);
      break;
    }
    case MessageType::kPrefillDone: {
      proto::PrefillDone done;
      s = protocols::DecodeMessage(frame, type, &done);
      if (!s.ok()) break;
      auto it = requests.find(done.request_id());
      if (it == requests.end() || it->second.prefill_id != worker_id) break;
      RequestEntry& r = it->second;
      r.prompt_tokens = static_cast<int>(done.prompt_tokens());
      r.cached_tokens = static_cast<int>(done.cached_prompt_tokens());
      TokenEvent e;
      e.token = done.first_token();
      e.prompt_tokens = r.prompt_tokens;
      e.cached_tokens = r.cached_tokens;
      if (done.finished()) {
        e.finished = true;
        e.finish_reason = FromProto(done.reason());
        if (e.finish_reason == FinishReason::kStop) e.token = -1;  // EOS is not text
        out.emplace_back(r.sink, e);
        if (r.decode_id != r.prefill_id)
          SendCancel(r.decode_id, done.request_id(), "finished at prefill");
        requests.erase(it);
        break;
      }
      out.emplace_back(r.sink, e);
      r.phase = Phase::kDecoding;
      if (r.decode_id != r.prefill_id)
        SendStartDecode(done.request_id(), r, done.first_token());
      break;
    }
    case MessageType::kTokenChunk: {
      proto::TokenChunk chunk;
      s = protocols::DecodeMessage(frame, type, &chunk);
      if (!s.ok()) break;
      for (const auto& entry : chunk.entries()) {
        auto it = requests.find(entry.request_id());
        if (it == requests.end()) continue;
        for (int32_t t : entry.token_ids()) {
          TokenEvent e;
          e.token = t;
          e.prompt_tokens = it->second.prompt_tokens;
          e.cached_tokens = it->second.cached_tokens;
          out.emplace_back(it->second.sink, e);
        }
      }
      break;
    }
    case MessageType::kFinish: {
      proto::Finish fin;
      s = protocols::DecodeMessage(frame, type, &fin);
      if (!s.ok()) break;
      auto it = requests.find(fin.request_id());
      if (it == requests.end()) break;
      RequestEntry& r = it->second;
      // A worker the request was moved away from may still report on it.
      if (worker_id != r.prefill_id && worker_id != r.decode_id) break;
      TokenEvent e;
      e.finished = true;
      e.finish_reason = FromProto(fin.reason());
      e.prompt_tokens = r.prompt_tokens;
      e.cached_tokens = r.cached_tokens;
      if (e.finish_reason == FinishReason::kError) {
        e.error = Status(static_cast<StatusCode>(
                             fin.status_code() ? fin.status_code()
                                               : static_cast<uint32_t>(StatusCode::kInternal)),
                         worker_id + ": " + fin.message());
        const std::string other = worker_id == r.prefill_id ? r.decode_id : r.prefill_id;
        if (other != worker_id) SendCancel(other, fin.request_id(), "peer failed");
      }
      out.emplace_back(r.sink, e);
      requests.erase(it);
      break;
    }
    default:
      s = InvalidArgument("unexpected control frame type " + std::to_string(frame.type));
  }
  if (!s.ok()) {
    LOG_WARNING << "bad control frame from " << worker_id << ": " << s.ToString();
  }
}

void ClusterBackend::State::CheckHeartbeats(PendingEvents& out) {
  const auto limit = options.heartbeat_interval * options.missed_heartbeats;
  std::vector<std::string> late;
  for (auto& [id, w] : workers) {
    if (Clock::now() - w.last_seen > limit) late.push_back(id);
  }
  for (const auto& id : late) {
    DropWorker(id,
               DeadlineExceeded("no heartbeat for " + std::to_string(options.missed_heartbeats) +
                                " intervals"),
               out);
  }
}

ClusterBackend::ClusterBackend(ClusterBackendOptions options) : options_(std::move(options)) {}

Result<std::unique_ptr<ClusterBackend>> ClusterBackend::Create(ClusterBackendOptions options) {
  RETURN_IF_ERROR(protocols::ValidatePeerConfig(options.config).WithContext("cluster config"));
  if (options.heartbeat_interval.count() <= 0 || options.missed_heartbeats < 1) {
    return InvalidArgument("heartbeat_interval and missed_heartbeats must be positive");
  }
  std::unique_ptr<ClusterBackend> b(new ClusterBackend(options));
  b->state_ = std::make_shared<State>(options);
  b->io_ = std::make_unique<protocols::IoThread>("coord-control");
  std::weak_ptr<State> weak = b->state_;
  protocols::ConnectionOptions conn_options;
  conn_options.name = "worker";
  auto on_accept = [weak](std::shared_ptr<FramedConnection> conn) {
    std::weak_ptr<FramedConnection> weak_conn = conn;
    conn->Start(
        [weak, weak_conn](protocols::Frame frame) {
          auto state = weak.lock();
          auto c = weak_conn.lock();
          if (!state || !c) return;
          PendingEvents out;
          {
            std::lock_guard<std::mutex> lock(state->mu);
            state->OnFrame(c, frame, out);
          }
          Deliver(out);
        },
        [weak, weak_conn](const Status& reason) {
          auto state = weak.lock();
          if (!state) return;
          PendingEvents out;
          {
            std::lock_guard<std::mutex> lock(state->mu);
            auto c = weak_conn.lock();
            const FramedConnection* key = c.get();
            state->handshaken.erase(key);
            auto it = state->conn_worker.find(key);
            if (it != state->conn_worker.end()) {
              state->DropWorker(it->second, reason.ok() ? Unavailable("connection closed") : reason,
                                out);
            }
          }
          Deliver(out);
        });
  };
  ASSIGN_OR_RETURN(b->server_,
                   protocols::FramedServer::Listen(*b->io_, options.host, options.control_port,
                                                   conn_options, on_accept));
  b->port_ = b->server_->port();
  // Heartbeat watchdog on the io thread.
  b->state_->timer = std::make_unique<boost::asio::steady_timer>(b->io_->context());
  auto tick = std::make_shared<std::function<void()>>();
  *tick = [weak, tick_weak = std::weak_ptr<std::function<void()>>(tick)]() {
    auto state = weak.lock();
    if (!state) return;
    PendingEvents out;
    {
      std::lock_guard<std::mutex> lock(state->mu);
      if (state->shut_down) return;
      state->CheckHeartbeats(out);
    }
    Deliver(out);
    state->timer->expires_after(state->options.heartbeat_interval);
    auto next = tick_weak.lock();
    if (!next) return;
    state->timer->async_wait([next](const boost::system::error_code& ec) {
      if (!ec) (*next)();
    });
  };
  b->tick_ = tick;
  boost::asio::post(b->io_->context(), [tick] { (*tick)(); });
  LOG_INFO << "control plane listening on " << options.host << ":" << b->port_;
  return b;
}

ClusterBackend::~ClusterBackend() { Shutdown(); }

void ClusterBackend::Shutdown() {
  if (!state_) return;
  PendingEvents out;
  std::vector<std::shared_ptr<FramedConnection>> conns;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->shut_down) return;
    state_->shut_down = true;
    std::vector<uint64_t> ids;
    for (auto& [id, r] : state_->requests) ids.push_back(id);
    for (uint64_t id : ids) state_->Fail(id, Unavailable("coordinator shutting down"), out);
    for (auto& [id, w] : state_->workers) conns.push_back(w.conn);
    state_->workers.clear();
    state_->conn_worker.clear();
  }
  Deliver(out);
  for (auto& c : conns) {
    if (c) c->Close(Cancelled("coordinator shutting down"));
  }
  if (server_) server_->Stop();
  boost::asio::post(io_->context(), [state = state_] {
    if (state->timer) state->timer->cancel();
  });
  io_->Stop();
  state_->timer.reset();
  tick_.reset();
}

Status ClusterBackend::Submit(GenerationRequest request, TokenSink sink) {
  PendingEvents out;
  Status result;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->shut_down) return Unavailable("coordinator is shutting down");
    if (state_->requests.count(request.id)) {
      return AlreadyExists("request id " + std::to_string(request.id) + " is live");
    }
    const uint64_t id = request.id;
    RequestEntry& r = state_->requests[id];
    r.request = std::move(request);
    r.sink = std::move(sink);
    Status s = state_->Start(id, r);
    if (!s.ok()) {
      state_->requests.erase(id);
      return s;
    }
  }
  Deliver(out);
  return result;
}

void ClusterBackend::Cancel(uint64_t id) {
  PendingEvents out;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    auto it = state_->requests.find(id);
    if (it == state_->requests.end()) return;
    const std::string p = it->second.prefill_id;
    const std::string d = it->second.decode_id;
    state_->SendCancel(p, id, "cancelled by client");
    if (d != p) state_->SendCancel(d, id, "cancelled by client");
    state_->Fail(id, Cancelled("cancelled"), out);
  }
  Deliver(out);
}

Status ClusterBackend::Health() {
  std::lock_guard<std::mutex> lock(state_->mu);
  bool prefill = false, decode = false;
  for (auto& [id, w] : state_->workers) {
    if (!w.info.healthy) continue;
    if (w.info.role != WorkerRole::kDecode) prefill = true;
    if (w.info.role != WorkerRole::kPrefill) decode = true;
  }
  if (prefill && decode) return Status::Ok();
  return Unavailable(std::string("cluster not ready: ") + (prefill ? "" : "no prefill worker ") +
                     (decode ? "" : "no decode worker"));
}

std::vector<WorkerInfo> ClusterBackend::Workers() {
  std::lock_guard<std::mutex> lock(state_->mu);
  std::vector<WorkerInfo> infos;
  for (auto& [id, w] : state_->workers) infos.push_back(w.info);
  return infos;
}

}  // namespace kvrelay::coordinator
