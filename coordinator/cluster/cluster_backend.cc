#include "coordinator/cluster/cluster_backend.h"

#include <algorithm>
#include <array>
#include <boost/asio/steady_timer.hpp>
#include <cstdint>

#include "common/logging.h"
#include "coordinator/cluster/cluster_backend_state.h"
#include "protocols/control.pb.h"
#include "protocols/messages.h"

namespace kvrelay::coordinator {

Status CheckTokenIds(const GenerationRequest& request, int64_t vocab_size) {
  if (vocab_size <= 0) return Status::Ok();
  auto outside = [&](const char* what, int64_t t) {
    return InvalidArgument(std::string(what) + " token id " + std::to_string(t) +
                           " is outside the model's vocabulary [0, " + std::to_string(vocab_size) +
                           ")");
  };
  for (int32_t t : request.prompt) {
    if (t < 0 || t >= vocab_size) return outside("prompt", t);
  }
  for (const auto& [t, bias] : request.sampling.logit_bias) {
    if (t < 0 || t >= vocab_size) return outside("logit_bias", t);
  }
  return Status::Ok();
}

uint64_t MigratedSeed(uint64_t seed, size_t carried, int migration) {
  // SplitMix64's finalizer over the three, one after the other.
  auto mix = [](uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  };
  uint64_t h = mix(seed + 0x9e3779b97f4a7c15ULL);
  h = mix(h ^ static_cast<uint64_t>(carried));
  return mix(h ^ static_cast<uint64_t>(migration));
}

void ClusterBackend::State::OnFrame(const std::shared_ptr<FramedConnection>& conn,
                                    const protocols::Frame& frame, PendingEvents& out) {
  const auto type = static_cast<MessageType>(frame.type);
  if (auto p = peers.find(conn.get()); p == peers.end() || !p->second.configured) {
    OnHandshakeFrame(conn, frame);
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
  ++control_messages[{false, frame.type}];
  Status s;
  switch (type) {
    case MessageType::kWorkerLeaving: {
      // Its close that follows is a departure, not a loss; nothing new is
      // routed to it meanwhile.
      proto::WorkerLeaving m;
      if (protocols::DecodeMessage(frame, type, &m).ok()) w->leaving_reason = m.reason();
      LOG_INFO << "worker " << worker_id << " is stopping"
               << (w->leaving_reason.empty() ? "" : ": " + w->leaving_reason);
      w->leaving = true;
      w->info.healthy = false;
      break;
    }
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
      w->info.quarantined_kv_blocks = static_cast<int64_t>(hb.quarantined_kv_blocks());
      auto count = [](uint64_t v) {
        return static_cast<int64_t>(std::min<uint64_t>(v, INT64_MAX));
      };
      w->info.kv_integrity_failures = count(hb.kv_integrity_failures());
      w->info.prompt_tokens_computed = count(hb.prompt_tokens_computed());
      w->info.generated_tokens = count(hb.generated_tokens());
      w->info.preemptions = count(hb.preemptions());
      w->info.process_cpu_seconds = hb.process_cpu_seconds();
      w->info.process_resident_bytes = count(hb.process_resident_bytes());
      w->info.transfer_seconds = hb.transfer_seconds();
      w->info.kv_group_window.assign(hb.kv_group_window().begin(), hb.kv_group_window().end());
      w->info.kv_group_peak_blocks.assign(hb.kv_group_peak_blocks().begin(),
                                          hb.kv_group_peak_blocks().end());
      auto take = [](const proto::PortSecurityCounters& c, protocols::PortSecurityCounters* out) {
        *out = {c.auth_failures(), c.refused_connections(), c.oversized_frames(),
                c.foreign_frames()};
      };
      take(hb.kv_port(), &w->info.kv_port);
      take(hb.tp_port(), &w->info.tp_port);
      w->info.data_plane_error = hb.data_plane_error().substr(0, 512);
      if (hb.has_prefix_store()) {
        const proto::PrefixStoreCounters& c = hb.prefix_store();
        auto i = [](uint64_t v) { return static_cast<int64_t>(std::min<uint64_t>(v, INT64_MAX)); };
        w->info.prefix_store =
            WorkerInfo::PrefixStore{i(c.restored_blocks_ram()),  i(c.restored_blocks_disk()),
                                    i(c.restored_bytes()),       i(c.restores()),
                                    i(c.restore_misses()),       i(c.spills()),
                                    i(c.write_through_blocks()), i(c.write_through_dropped()),
                                    i(c.write_backlog()),        i(c.disk_written_blocks()),
                                    i(c.disk_written_bytes()),   i(c.disk_write_failures()),
                                    i(c.disk_entries()),         i(c.disk_used_bytes())};
      } else {
        w->info.prefix_store.reset();
      }
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
        if (to_hash(b, &h)) router.OnEvicted(worker_id, h);
      }
      break;
    }
    case MessageType::kReserveBlocksReply: {
      // Sent only when the decode side refuses the reservation.
      proto::ReserveBlocksReply rep;
      s = protocols::DecodeMessage(frame, type, &rep);
      if (!s.ok()) break;
      if (IsForeign(worker_id, rep.request_id(), "ReserveBlocksReply")) break;
      auto it = requests.find(rep.request_id());
      if (rep.ok()) break;  // (an acceptance says nothing the hand-over will not)
      if (it == requests.end() || it->second.decode_id != worker_id ||
          it->second.phase != Phase::kPrefilling) {
        break;  // ended or re-run elsewhere meanwhile
      }
      SendCancel(it->second.prefill_id, rep.request_id(), "decode side refused the request");
      // Refused for a fault of the worker or its KV path (its data
      // connection from the prefill peer just dropped): moved on like a
      // failed hand-over. Out of blocks or a bad request: failed.
      if (IsWorkerFault(static_cast<StatusCode>(rep.status_code()))) {
        LOG_INFO << "request " << rep.request_id() << ": reservation refused on " << worker_id
                 << ": " << rep.reason();
        if (Migrate(rep.request_id(), it->second, worker_id, out)) break;
      }
      Fail(rep.request_id(),
           ResourceExhausted("decode worker " + worker_id +
                             " could not reserve KV blocks: " + rep.reason()),
           out);
      break;
    }
    case MessageType::kPrefillDone: {
      proto::PrefillDone done;
      s = protocols::DecodeMessage(frame, type, &done);
      if (!s.ok()) break;
      if (IsForeign(worker_id, done.request_id(), "PrefillDone")) break;
      auto it = requests.find(done.request_id());
      if (it == requests.end() || it->second.prefill_id != worker_id) break;
      RequestEntry& r = it->second;
      // An attempt the request moved away from, on the same worker.
      if (r.phase != Phase::kPrefilling ||
          (done.kv_transfer_id() != 0 &&
           done.kv_transfer_id() != KvTransferId(done.request_id(), r.attempts))) {
        break;
      }
      // A migrated request's re-prefill counts the tokens it carries as
      // prompt: the client's usage keeps its own prompt and first cache hit.
      if (r.migrations == 0) {
        r.prompt_tokens = static_cast<int>(done.prompt_tokens());
        r.cached_tokens = static_cast<int>(done.cached_prompt_tokens());
      }
      // Its prompt no longer waits there: without this a repeat sent before
      // the next heartbeat saw the worker loaded by the very request whose
      // prefix it holds, and went elsewhere (#42).
      w->info.queued_tokens = std::max<int64_t>(0, w->info.queued_tokens - r.queued_charge);
      r.queued_charge = 0;
      TokenEvent e;
      e.token = done.first_token();
      e.prompt_tokens = r.prompt_tokens;
      e.cached_tokens = r.cached_tokens;
      if (done.has_first_logprob()) {
        e.has_logprobs = true;
        e.logprobs = protocols::FromProto(done.first_logprob());
      }
      if (done.finished()) {
        e.finished = true;
        e.finish_reason = FromProto(done.reason());
        if (e.finish_reason == FinishReason::kStop) e.token = -1;  // EOS is not text
        if (e.finish_reason == FinishReason::kError) {
          // Errors come as a Finish with their status; never end one as "OK".
          e.error = Internal(worker_id + " ended request " + std::to_string(done.request_id()) +
                             " at its first token with no reason it may give");
        }
        out.emplace_back(r.sink, e);
        if (r.decode_id != r.prefill_id)
          SendCancel(r.decode_id, done.request_id(), "finished at prefill");
        requests.erase(it);
        break;
      }
      out.emplace_back(r.sink, e);
      r.generated.push_back(e.token);
      // Disaggregated: the first token travels to the decode side with the
      // KV (the hand-over frame); the request waits for the decode side's
      // first report.
      SetPhase(done.request_id(), r,
               r.decode_id != r.prefill_id ? Phase::kHandingOver : Phase::kDecoding);
      r.handing_over_since = Clock::now();
      // The decode side's reports that overtook this frame, in their order.
      std::vector<proto::TokenChunk::Entry> early = std::move(r.early_tokens);
      std::optional<proto::Finish> early_finish = std::move(r.early_finish);
      r.early_tokens.clear();
      r.early_finish.reset();
      const std::string decode_id = r.decode_id;
      for (const auto& entry : early) OnTokens(entry, r, out);
      if (early_finish) OnFinish(decode_id, *early_finish, out);
      break;
    }
    case MessageType::kTokenChunk: {
      proto::TokenChunk chunk;
      s = protocols::DecodeMessage(frame, type, &chunk);
      if (!s.ok()) break;
      for (const auto& entry : chunk.entries()) {
        auto it = requests.find(entry.request_id());
        if (it == requests.end()) continue;
        RequestEntry& r = it->second;
        // Tokens come from the request's decode side (== prefill when colocated).
        if (r.decode_id != worker_id) {
          if (!IsForeign(worker_id, entry.request_id(), "TokenChunk")) {
            ++counters.foreign_frames;  // its prefill worker: not the one that streams tokens
          }
          continue;
        }
        if (r.phase == Phase::kPrefilling && r.decode_id != r.prefill_id) {
          // Overtook the PrefillDone on the prefill's connection: replayed
          // after it. Bounded by what the request may generate.
          if (static_cast<int64_t>(r.early_tokens.size()) < r.request.sampling.max_tokens) {
            r.early_tokens.push_back(entry);
          }
          continue;
        }
        OnTokens(entry, r, out);
      }
      break;
    }
    case MessageType::kFinish: {
      proto::Finish fin;
      s = protocols::DecodeMessage(frame, type, &fin);
      if (!s.ok()) break;
      if (IsForeign(worker_id, fin.request_id(), "Finish")) break;
      OnFinish(worker_id, fin, out);
      break;
    }
    default:
      s = InvalidArgument("unexpected control frame type " + std::to_string(frame.type));
  }
  if (!s.ok()) {
    LOG_WARNING << "bad control frame from " << worker_id << ": " << s.ToString();
  }
}

void ClusterBackend::State::OnFinish(const std::string& worker_id, const proto::Finish& fin,
                                     PendingEvents& out) {
  auto it = requests.find(fin.request_id());
  if (it == requests.end()) return;
  RequestEntry& r = it->second;
  // A worker the request was moved away from may still report on it, and
  // so may an earlier attempt on the same worker (a re-run keeps the id).
  if (worker_id != r.prefill_id && worker_id != r.decode_id) return;
  if (fin.kv_transfer_id() != 0 &&
      fin.kv_transfer_id() != KvTransferId(fin.request_id(), r.attempts)) {
    return;
  }
  if (r.phase == Phase::kDecoding && worker_id == r.prefill_id && r.decode_id != r.prefill_id) {
    return;  // the hand-over is complete: the decode side has everything
  }
  if (r.phase == Phase::kPrefilling && worker_id == r.decode_id && r.decode_id != r.prefill_id &&
      (fin.reason() == proto::Finish::REASON_STOP ||
       fin.reason() == proto::Finish::REASON_LENGTH)) {
    r.early_finish = fin;  // overtook the PrefillDone: replayed after it
    return;
  }
  TokenEvent e;
  e.finished = true;
  e.finish_reason = FromProto(fin.reason());
  e.prompt_tokens = r.prompt_tokens;
  e.cached_tokens = r.cached_tokens;
  if (e.finish_reason == FinishReason::kError) {
    e.error = Status(
        static_cast<StatusCode>(fin.status_code() ? fin.status_code()
                                                  : static_cast<uint32_t>(StatusCode::kInternal)),
        worker_id + ": " + fin.message());
    const std::string other = worker_id == r.prefill_id ? r.decode_id : r.prefill_id;
    // The reason names the failure (code first): a prefill worker that
    // already delivered this request's KV learns from a decode-side
    // DEADLINE_EXCEEDED that its data connection is dead.
    if (other != worker_id) {
      SendCancel(other, fin.request_id(), "peer failed: " + e.error.ToString().substr(0, 200));
    }
    // A fault of the worker or of its KV path, not of the request: a
    // hand-over that failed (KV lost, cut or corrupt), a TP group that lost
    // a rank, a stalled peer. The request moves on from prompt + tokens
    // sent, as after a lost worker; with nothing sent yet it is run again.
    if (IsWorkerFault(e.error.code()) && r.phase != Phase::kWaiting) {
      LOG_INFO << "request " << fin.request_id() << ": " << PhaseName(r.phase) << " failed on "
               << worker_id << ": " << e.error.ToString();
      if (Migrate(fin.request_id(), r, worker_id, out)) return;
    }
  }
  out.emplace_back(r.sink, e);
  requests.erase(it);
}

void ClusterBackend::State::OnTokens(const proto::TokenChunk::Entry& entry, RequestEntry& r,
                                     PendingEvents& out) {
  if (r.phase == Phase::kHandingOver) {
    // The decode side has the KV and the first token.
    SetPhase(entry.request_id(), r, Phase::kDecoding);
  }
  for (int k = 0; k < entry.token_ids_size(); ++k) {
    TokenEvent e;
    e.token = entry.token_ids(k);
    if (k < entry.logprobs_size()) {
      e.has_logprobs = true;
      e.logprobs = protocols::FromProto(entry.logprobs(k));
    }
    e.prompt_tokens = r.prompt_tokens;
    e.cached_tokens = r.cached_tokens;
    out.emplace_back(r.sink, e);
    if (e.token >= 0) r.generated.push_back(e.token);
  }
}

void ClusterBackend::State::NudgeHandOvers(TimePoint now) {
  // Off the fast path: a decode side reports within a step of its KV
  // arriving. One that has not after a tick may be behind a path that
  // stopped without a reset, which it cannot tell from a prefill still
  // computing; told that the prefill is done, it fails the load after
  // --kv-progress-timeout-ms of silence instead of at --kv-timeout-ms.
  for (auto& [rid, r] : requests) {
    if (r.phase != Phase::kHandingOver || r.hand_over_due_sent) continue;
    if (now - r.handing_over_since < tick_period()) continue;
    r.hand_over_due_sent = true;
    proto::HandOverDue m;
    m.set_request_id(rid);
    WorkerEntry* d = FindWorker(r.decode_id);
    SendTo(d ? d->conn : nullptr, MessageType::kHandOverDue, m);
  }
}

void ClusterBackend::State::CheckHeartbeats(PendingEvents& out) {
  const auto now = Clock::now();
  const auto limit = options.worker_timeout();
  // The watchdog runs every tick_period(); a tick much later than that means
  // this process did not run meanwhile (SIGSTOP, a starved host) and the
  // workers' frames of that time are still unread in the sockets: the gap is
  // not held against them (their silence before it still counts).
  if (last_tick != TimePoint{} && now - last_tick > 2 * tick_period()) {
    const auto stalled = now - last_tick - tick_period();
    for (auto& [id, w] : workers) w.last_seen += stalled;
    // Nor against a request waiting for a worker: the workers' registrations
    // of that time are still unread too.
    for (auto& [id, r] : requests) {
      if (r.phase == Phase::kWaiting) r.wait_until += stalled;
    }
    if (now - last_tick > limit / 2) {  // worth saying; shorter gaps are a loaded host's jitter
      LOG_WARNING << "the control loop did not run for "
                  << std::chrono::duration_cast<std::chrono::milliseconds>(now - last_tick).count()
                  << " ms: worker silence during it is not counted";
    }
  }
  last_tick = now;
  ExpireWaiting(now, out);
  NudgeHandOvers(now);
  std::vector<std::string> late;
  for (auto& [id, w] : workers) {
    if (now - w.last_seen > limit) late.push_back(id);
  }
  for (const auto& id : late) {
    DropWorker(
        id,
        DeadlineExceeded(
            "no heartbeat for " +
            std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(limit).count()) +
            " ms"),
        out);
  }
  // The coordinator's own heartbeat, every interval: a worker that hears
  // nothing for its coordinator_timeout takes this process for stopped or
  // cut off, drops its link and re-registers (with backoff) until it answers.
  if (now - last_beat >= options.heartbeat_interval) {
    last_beat = now;
    const proto::Heartbeat beat;  // empty: the coordinator is alive
    for (auto& [id, w] : workers) SendTo(w.conn, MessageType::kHeartbeat, beat);
  }
}

ClusterBackend::ClusterBackend(ClusterBackendOptions options) : options_(std::move(options)) {}

Result<std::unique_ptr<ClusterBackend>> ClusterBackend::Create(ClusterBackendOptions options) {
  RETURN_IF_ERROR(protocols::ValidatePeerConfig(options.config).WithContext("cluster config"));
  if (options.heartbeat_interval.count() <= 0 || options.missed_heartbeats < 1) {
    return InvalidArgument("heartbeat_interval and missed_heartbeats must be positive");
  }
  if (options.heartbeat_timeout.count() < 0 ||
      (options.heartbeat_timeout.count() > 0 &&
       options.heartbeat_timeout < options.heartbeat_interval)) {
    return InvalidArgument(
        "heartbeat_timeout (--heartbeat-timeout-ms) must be 0 (= missed_heartbeats intervals) or "
        "at least one heartbeat interval: a shorter one drops every live worker between two of "
        "its heartbeats");
  }
  if (options.migration_limit < 0) {
    return InvalidArgument("migration_limit (--migration-limit) must be >= 0 (0 = no migration)");
  }
  if (options.cluster_key.empty()) {
    return InvalidArgument(
        "cluster_key is required: every worker proves the cluster secret before it may join "
        "(--cluster-key-file)");
  }
  std::unique_ptr<ClusterBackend> b(new ClusterBackend(options));
  b->state_ = std::make_shared<State>(options);
  b->io_ = std::make_unique<protocols::IoThread>("coord-control");
  std::weak_ptr<State> weak = b->state_;
  protocols::ConnectionOptions conn_options;
  conn_options.name = "worker";
  conn_options.require_authentication = true;
  conn_options.auth_timeout = options.auth_timeout;
  conn_options.frame_timeout = options.frame_timeout;
  conn_options.tls = options.tls;
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
            // The frame decoder refuses a header that announces more than the
            // connection's limit (1 KiB before authentication) with
            // ResourceExhausted, and the connection closes with it.
            if (reason.code() == StatusCode::kResourceExhausted &&
                reason.message().find("bad frame") != std::string::npos) {
              ++state->counters.oversized_frames;
            }
            if (protocols::IsTlsHandshakeFailure(reason)) {
              ++state->counters.tls_handshake_failures;
            }
            auto c = weak_conn.lock();
            const FramedConnection* key = c.get();
            state->peers.erase(key);
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
                                                   conn_options, on_accept, options.limits));
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
    state->timer->expires_after(state->tick_period());
    auto next = tick_weak.lock();
    if (!next) return;
    state->timer->async_wait([next](const boost::system::error_code& ec) {
      if (!ec) (*next)();
    });
  };
  b->tick_ = tick;
  boost::asio::post(b->io_->context(), [tick] { (*tick)(); });
  LOG_INFO << "control plane listening on " << options.host << ":" << b->port_
           << (options.tls ? " (mutual TLS 1.3)" : "");
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
    state_->peers.clear();
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
    RETURN_IF_ERROR(CheckTokenIds(request, options_.vocab_size));
    const uint64_t id = request.id;
    RequestEntry& r = state_->requests[id];
    r.request = std::move(request);
    r.sink = std::move(sink);
    LOG_DEBUG << "request " << id << ": admitted";
    Status s = state_->Start(id, r);
    if (!s.ok() && !state_->Wait(id, r, s)) {
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
  bool prefill = false, decode = false, reaching = false;
  std::string unreachable;  // the first prefill worker's data-plane error
  for (auto& [id, w] : state_->workers) {
    if (!w.info.healthy) continue;
    if (w.info.role != WorkerRole::kDecode) {
      prefill = true;
      if (w.info.data_plane_error.empty()) {
        reaching = true;
      } else if (unreachable.empty()) {
        unreachable = id + ": " + w.info.data_plane_error;
      }
    }
    if (w.info.role != WorkerRole::kPrefill) decode = true;
  }
  if (prefill && decode && !reaching) {
    // Registered, but no prefill worker can hand its KV to a decode worker:
    // nothing can be served (a cut data plane, a decode KV port held shut).
    return Unavailable("cluster not ready: no prefill worker reaches a decode worker (" +
                       unreachable + ")");
  }
  if (prefill && decode) return Status::Ok();
  return Unavailable(std::string("cluster not ready: ") + (prefill ? "" : "no prefill worker ") +
                     (decode ? "" : "no decode worker"));
}

ControlSecurityCounters ClusterBackend::security_counters() const {
  ControlSecurityCounters c;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    c = state_->counters;
  }
  if (server_) c.refused_connections = server_->refused_connections();
  return c;
}

uint64_t ClusterBackend::requests_migrated() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->requests_migrated;
}

std::vector<BackendMetric> ClusterBackend::Counters() {
  const ControlSecurityCounters c = security_counters();
  std::vector<BackendMetric> messages;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    for (const auto& [key, n] : state_->control_messages) {
      messages.push_back(
          {"kvrelay_control_messages_total",
           "Control-plane messages between the coordinator and its registered workers.",
           static_cast<double>(n),
           {{"direction", key.first ? "sent" : "received"},
            {"type", std::string(protocols::MessageTypeName(key.second))}}});
    }
  }
  std::vector<BackendMetric> all = {
      {"kvrelay_requests_migrated_total",
       "Requests started again on other workers (prompt + the tokens already streamed) "
       "after losing a worker mid-answer (--migration-limit).",
       static_cast<double>(requests_migrated()),
       {}},
      {"kvrelay_control_auth_failures_total",
       "Control-plane connections that failed the cluster-key challenge-response.",
       static_cast<double>(c.auth_failures),
       {}},
      {"kvrelay_control_refused_connections_total",
       "Control-plane connections refused at accept (connection limits).",
       static_cast<double>(c.refused_connections),
       {}},
      {"kvrelay_control_oversized_frames_total",
       "Control-plane connections closed at a frame header over their size limit.",
       static_cast<double>(c.oversized_frames),
       {}},
      {"kvrelay_control_foreign_frames_total",
       "Worker frames about a request the sender does not own, dropped.",
       static_cast<double>(c.foreign_frames),
       {}},
      {"kvrelay_control_tls_handshake_failures_total",
       "Control-plane connections that failed the TLS handshake (TLS on).",
       static_cast<double>(c.tls_handshake_failures),
       {}}};
  all.insert(all.end(), messages.begin(), messages.end());
  return all;
}

std::vector<BackendMetric> ClusterBackend::Gauges() {
  std::array<int64_t, kPhases> n{};
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    for (const auto& [id, r] : state_->requests) ++n[static_cast<size_t>(r.phase)];
  }
  std::vector<BackendMetric> gauges;
  for (size_t p = 0; p < kPhases; ++p) {
    gauges.push_back({"kvrelay_cluster_requests",
                      "Requests the cluster holds, by phase: waiting for a worker, prefilling, "
                      "handing over (first token sent, KV on its way), decoding.",
                      static_cast<double>(n[p]),
                      {{"phase", PhaseMetricName(static_cast<Phase>(p))}}});
  }
  return gauges;
}

std::vector<WorkerInfo> ClusterBackend::Workers() {
  std::lock_guard<std::mutex> lock(state_->mu);
  std::vector<WorkerInfo> infos;
  for (auto& [id, w] : state_->workers) infos.push_back(w.info);
  return infos;
}

}  // namespace kvrelay::coordinator
