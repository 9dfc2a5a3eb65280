// Internal to the cluster backend (cluster_backend.cc: request lifecycle and
// frames; cluster_registration.cc: a worker's handshake, authentication and
// registration). Not part of the coordinator's API.
#pragma once

#include <algorithm>
#include <boost/asio/steady_timer.hpp>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/logging.h"
#include "coordinator/cluster/cluster_backend.h"
#include "protocols/control.pb.h"
#include "protocols/messages.h"
#include "protocols/sampling_codec.h"

namespace kvrelay::coordinator {
namespace cluster_internal {

using protocols::FramedConnection;
using protocols::MessageType;

// A request's life on the coordinator:
//   kWaiting: no healthy worker could take it yet (ClusterBackendOptions::worker_wait);
//   kPrefilling: its prefill task (and decode reservation) went out;
//   kHandingOver: the first token reached the client (PrefillDone) and the
//     KV is on its way to the decode group, which has not reported yet: a
//     lost prefill worker still matters (the request migrates);
//   kDecoding: the decode side streams (or a colocated worker does both).
enum class Phase { kWaiting, kPrefilling, kHandingOver, kDecoding };
inline constexpr size_t kPhases = 4;
inline const char* PhaseName(Phase p) {
  switch (p) {
    case Phase::kWaiting:
      return "waiting";
    case Phase::kPrefilling:
      return "prefilling";
    case Phase::kHandingOver:
      return "handing over";
    case Phase::kDecoding:
      return "decoding";
  }
  return "?";
}
// The phase label of kvrelay_cluster_requests.
inline const char* PhaseMetricName(Phase p) {
  return p == Phase::kHandingOver ? "handing_over" : PhaseName(p);
}

// A worker's error report that names a fault of the worker or of its KV path
// rather than of the request (which would fail the same anywhere): a peer
// or TP rank gone, a stalled path, corrupt or lost KV, memory abandoned to
// a dead peer. Such a request moves on to other workers (Migrate).
inline bool IsWorkerFault(StatusCode code) {
  return code == StatusCode::kUnavailable || code == StatusCode::kDeadlineExceeded ||
         code == StatusCode::kDataLoss || code == StatusCode::kAborted;
}

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
  bool leaving = false;        // it said it stops on purpose (WorkerLeaving)
  std::string leaving_reason;  // what it said (e.g. its TP group broke)
};

struct RequestEntry {
  GenerationRequest request;
  TokenSink sink;
  std::string prefill_id;
  std::string decode_id;  // == prefill_id for a colocated worker
  Phase phase = Phase::kPrefilling;
  int prompt_tokens = 0;
  int cached_tokens = 0;
  int reroutes = 0;  // times re-run elsewhere after losing a worker before any token
  // Migration: every token sent to the client so far, in order (the prompt's
  // continuation a new prefill starts from), and how often it moved.
  std::vector<int32_t> generated;
  int migrations = 0;
  // kWaiting: when it gives up, and the error it then ends with.
  TimePoint wait_until{};
  Status wait_error;
  bool migrating = false;  // waits to continue after a loss (counted when it starts)
  // The workers of the attempt that failed, which its next Start prefers
  // not to use again (empty: none to avoid).
  std::string avoid_prefill, avoid_decode;
  // Prompt tokens added to its prefill worker's queued_tokens when routed,
  // taken off again at PrefillDone (heartbeats refresh the figure meanwhile).
  int64_t queued_charge = 0;
  // Disaggregated: the decode side's reports that arrived before the
  // PrefillDone (they travel on another connection and may overtake it);
  // replayed right after it.
  std::vector<proto::TokenChunk::Entry> early_tokens;
  std::optional<proto::Finish> early_finish;
  // kHandingOver: since when, and whether the decode side was told its KV
  // is overdue (HandOverDue, sent when it has not reported for a tick).
  TimePoint handing_over_since{};
  bool hand_over_due_sent = false;
  // Attempts started so far (Start); the KV streams of attempt k carry
  // KvTransferId(id, k), so a re-run never meets an earlier attempt's bytes.
  uint32_t attempts = 0;
};

// The KV stream id of attempt `attempt` of request `id`.
inline uint64_t KvTransferId(uint64_t id, uint32_t attempt) {
  return id ^ (static_cast<uint64_t>(attempt) << 48);
}

// Where one control connection stands before it may act as a worker: the
// cluster-key challenge-response, then the configuration Hello.
struct PeerAuth {
  explicit PeerAuth(const protocols::ClusterKey& key) : auth(key, protocols::kAuthChannelControl) {}
  protocols::AuthResponder auth;
  bool configured = false;  // the configuration Hello was accepted
  bool refused = false;     // refused and closing: later frames are ignored
};

// Sink calls collected under the lock and made after it is released, so a
// sink may call Cancel without deadlocking.
using PendingEvents = std::vector<std::pair<TokenSink, TokenEvent>>;

inline void Deliver(PendingEvents& events) {
  for (auto& [sink, event] : events) sink(event);
  events.clear();
}

inline FinishReason FromProto(proto::Finish::Reason r) {
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

inline WorkerRole FromProto(proto::WorkerRole r) {
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

}  // namespace cluster_internal

using namespace cluster_internal;  // the State below is written in these terms

struct ClusterBackend::State {
  explicit State(ClusterBackendOptions o) : options(std::move(o)), router(options.router) {}

  const ClusterBackendOptions options;
  Router router;
  std::mutex mu;
  bool shut_down = false;                                      // guarded by mu
  std::map<std::string, WorkerEntry> workers;                  // guarded by mu
  std::map<const FramedConnection*, std::string> conn_worker;  // guarded by mu
  std::map<const FramedConnection*, PeerAuth> peers;           // guarded by mu
  ControlSecurityCounters counters;                            // guarded by mu
  std::map<uint64_t, RequestEntry> requests;                   // guarded by mu
  std::unique_ptr<boost::asio::steady_timer> timer;            // io thread only
  TimePoint last_tick{};                                       // guarded by mu: watchdog's last run
  TimePoint last_beat{};                                       // guarded by mu: our last heartbeat
  uint64_t requests_migrated = 0;                              // guarded by mu
  // Control messages of registered workers by (sent, type): the request
  // path's message count per request (kvrelay_control_messages_total).
  std::map<std::pair<bool, uint16_t>, uint64_t> control_messages;  // guarded by mu

  // Every message to a worker goes through here (counted).
  template <typename Message>
  void SendTo(const std::shared_ptr<FramedConnection>& conn, MessageType type, const Message& m) {
    if (!conn) return;
    if (conn_worker.count(conn.get()) != 0) ++control_messages[{true, static_cast<uint16_t>(type)}];
    cluster_internal::SendTo(conn, type, m);
  }

  // How long a routed prompt counts as cached on its prefill worker before
  // the worker's cache events (sent with its heartbeats) confirm or evict it.
  std::chrono::milliseconds OptimisticPrefixTtl() const {
    return std::max(options.heartbeat_interval * 4, std::chrono::milliseconds(1000));
  }

  // How often the watchdog runs: a tenth of the worker timeout (so a silent
  // worker is dropped within 1.1 x it), at most one heartbeat interval and a
  // tenth of the worker wait (a waiting request ends within 1.1 x it).
  std::chrono::milliseconds tick_period() const {
    const auto t = std::chrono::duration_cast<std::chrono::milliseconds>(options.worker_timeout());
    auto period =
        std::min(std::max(t / 10, std::chrono::milliseconds(5)), options.heartbeat_interval);
    const auto wait = options.worker_wait_bound();
    if (wait.count() > 0)
      period = std::min(period, std::max(wait / 10, std::chrono::milliseconds(5)));
    return period;
  }

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

  // Tells every prefill worker that a dropped decode group's ranks are dead,
  // before the Cancels of its requests: KV sends to them are abandoned at once
  // (an MPI send to a dead rank never completes on its own).
  void AnnouncePeerLost(const WorkerEntry& dead, const Status& reason) {
    proto::PeerLost m;
    m.set_worker_id(dead.info.id);
    m.set_reason(reason.ToString());
    std::vector<uint32_t> ranks = dead.tp_ranks;
    if (ranks.empty()) ranks.push_back(dead.rank);
    for (uint32_t r : ranks) {
      // A rank another live worker also claims (a misconfigured or rogue
      // registration) is not declared dead: that would cut the live one off.
      const bool claimed = std::any_of(workers.begin(), workers.end(), [&](const auto& kv) {
        const WorkerEntry& w = kv.second;
        if (&w == &dead) return false;
        return w.rank == r ||
               std::find(w.tp_ranks.begin(), w.tp_ranks.end(), r) != w.tp_ranks.end();
      });
      if (!claimed) m.add_ranks(r);
    }
    if (m.ranks_size() == 0) return;
    for (auto& [wid, w] : workers) {
      if (w.info.role == WorkerRole::kPrefill) SendTo(w.conn, MessageType::kPeerLost, m);
    }
  }

  void DropWorker(const std::string& worker_id, const Status& reason, PendingEvents& out) {
    // A copy: callers pass references into `workers` / `conn_worker`, which
    // are erased below.
    const std::string id = worker_id;
    auto it = workers.find(id);
    if (it == workers.end()) return;
    if (it->second.leaving) {
      LOG_INFO << "worker " << id << " left ("
               << (it->second.leaving_reason.empty() ? "it is stopping" : it->second.leaving_reason)
               << ")";
    } else {
      LOG_WARNING << "worker " << id << " lost: " << reason.ToString();
    }
    std::shared_ptr<FramedConnection> conn = it->second.conn;
    // A decode worker that left on purpose with no request on it has no KV
    // send in flight to abandon: no announcement (and no warning on the
    // prefill side).
    bool busy = false;
    for (const auto& [rid, r] : requests) busy = busy || r.decode_id == id;
    if (it->second.info.role == WorkerRole::kDecode && (!it->second.leaving || busy)) {
      AnnouncePeerLost(it->second, reason);
    }
    conn_worker.erase(conn.get());
    workers.erase(it);
    router.RemoveWorker(id);
    std::vector<uint64_t> affected;
    for (auto& [rid, r] : requests) {
      if (r.prefill_id == id || r.decode_id == id) affected.push_back(rid);
    }
    for (uint64_t rid : affected) {
      RequestEntry& r = requests[rid];
      if (r.phase == Phase::kDecoding && r.prefill_id == id && r.decode_id != id) {
        // Handed over: the decode side has every layer and the first token
        // (it already streams), so the request no longer depends on it. In
        // kHandingOver it still does: it migrates (below).
        continue;
      }
      const std::string other = r.prefill_id == id ? r.decode_id : r.prefill_id;
      if (other != id) SendCancel(other, rid, "peer worker " + id + " lost");
      // Nothing has reached the client yet: run it again on the workers left
      // (once; a second loss may migrate it, below).
      if (r.generated.empty() && r.phase != Phase::kDecoding && r.reroutes < 1) {
        ++r.reroutes;
        Status s = Start(rid, r);
        if (s.ok()) {
          LOG_INFO << "request " << rid << " re-run on " << r.prefill_id << " / " << r.decode_id
                   << " after losing " << id;
          continue;
        }
        if (Wait(rid, r, s)) {
          LOG_INFO << "request " << rid << " waits for a worker after losing " << id;
          continue;
        }
        Fail(rid, s.WithContext("worker " + id + " was lost and no other can take the request"),
             out);
        continue;
      }
      if (Migrate(rid, r, id, out)) continue;
      Fail(rid, Unavailable("worker " + id + " was lost: " + reason.message()), out);
    }
    if (conn) conn->Close(reason);
  }

  // Why r may not continue on other workers, or "" when it may
  // (ClusterBackendOptions::migration_limit).
  std::string MigrationBlocker(const RequestEntry& r) const {
    const SamplingParams& p = r.request.sampling;
    if (r.migrations >= options.migration_limit) {
      return "it moved " + std::to_string(r.migrations) + " times (--migration-limit " +
             std::to_string(options.migration_limit) + ")";
    }
    if (!p.json_schema.empty()) {
      return "its output follows a JSON schema, whose state is not rebuilt from tokens";
    }
    if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
      return "presence/frequency penalties count generated tokens only: a re-prefill would drop "
             "them";
    }
    return "";
  }

  // r lost worker `lost` after its tokens started to stream (or a second time
  // before): starts it again on the workers registered now as a new prefill
  // of its prompt plus the tokens already sent, for the tokens still allowed;
  // its sink sees the stream go on. True when r was moved or ended here;
  // false when it may not move (the caller fails it as before).
  bool Migrate(uint64_t rid, RequestEntry& r, const std::string& lost, PendingEvents& out) {
    const std::string blocker = MigrationBlocker(r);
    if (!blocker.empty()) {
      if (options.migration_limit > 0) {
        LOG_INFO << "request " << rid << " not migrated after losing " << lost << ": " << blocker;
      }
      return false;
    }
    if (static_cast<int64_t>(r.generated.size()) >= r.request.sampling.max_tokens) {
      // Its last token was sent; only the Finish was lost.
      TokenEvent e;
      e.finished = true;
      e.finish_reason = FinishReason::kLength;
      e.prompt_tokens = r.prompt_tokens;
      e.cached_tokens = r.cached_tokens;
      out.emplace_back(r.sink, e);
      requests.erase(rid);
      return true;
    }
    ++r.migrations;  // before Start: its sampling depends on it (RunSampling)
    const size_t carried = r.generated.size();
    r.avoid_prefill = r.prefill_id;
    r.avoid_decode = r.decode_id;
    Status s = Start(rid, r);
    if (s.ok()) {
      ++requests_migrated;
      LOG_INFO << "request " << rid << " migrated from " << lost << " to " << r.prefill_id
               << (r.decode_id == r.prefill_id ? "" : " / " + r.decode_id) << " carrying "
               << carried << " tokens (move " << r.migrations << " of " << options.migration_limit
               << ")";
      return true;
    }
    // No worker of a role it needs is registered now (its only decode group
    // is restarting): it waits for one like a request not yet started, the
    // client's stream held open, and fails when none comes in time.
    if (Wait(rid, r, s)) {
      r.migrating = true;
      LOG_INFO << "request " << rid << " waits for a worker to continue after losing " << lost
               << " (carrying " << carried << " tokens)";
      return true;
    }
    Fail(rid,
         Unavailable("worker " + lost +
                     " was lost and no other can take the request: " + s.message()),
         out);
    return true;
  }

  // What a (re-)prefill of r computes: its prompt, then the tokens it already
  // sent (none unless it migrated).
  static std::vector<int32_t> PrefillPrompt(const RequestEntry& r) {
    std::vector<int32_t> tokens;
    tokens.reserve(r.request.prompt.size() + r.generated.size());
    tokens.insert(tokens.end(), r.request.prompt.begin(), r.request.prompt.end());
    tokens.insert(tokens.end(), r.generated.begin(), r.generated.end());
    return tokens;
  }

  // r's sampling for its current run: max_tokens less the tokens already
  // sent, and after a move a derived seed (MigratedSeed).
  static SamplingParams RunSampling(const RequestEntry& r) {
    SamplingParams p = r.request.sampling;
    if (r.migrations > 0) {
      p.max_tokens -= static_cast<int>(r.generated.size());
      p.seed = MigratedSeed(p.seed, r.generated.size(), r.migrations);
    }
    return p;
  }

  // Moves r to `to`, logged at debug level with its id and workers.
  static void SetPhase(uint64_t rid, RequestEntry& r, Phase to) {
    LOG_DEBUG << "request " << rid << ": " << PhaseName(r.phase) << " -> " << PhaseName(to)
              << (to == Phase::kWaiting
                      ? std::string()
                      : " on " + r.prefill_id +
                            (r.decode_id == r.prefill_id ? "" : " / " + r.decode_id));
    r.phase = to;
  }

  // Parks r, which Start refused with `why`, until a worker registers: true
  // when it waits (no healthy worker of a role it needs, and waiting is on).
  bool Wait(uint64_t rid, RequestEntry& r, const Status& why) {
    const auto bound = options.worker_wait_bound();
    if (why.code() != StatusCode::kUnavailable || bound.count() <= 0) return false;
    SetPhase(rid, r, Phase::kWaiting);
    r.prefill_id.clear();  // it is nobody's: no worker may report on it
    r.decode_id.clear();
    r.wait_until = Clock::now() + bound;
    r.wait_error = why;
    return true;
  }

  // A worker registered: starts the waiting requests that can start now, in
  // arrival order; those still without a worker of a role they need wait on.
  void AdmitWaiting(PendingEvents& out) {
    std::vector<uint64_t> waiting;
    for (auto& [id, r] : requests) {
      if (r.phase == Phase::kWaiting) waiting.push_back(id);
    }
    for (uint64_t id : waiting) {
      RequestEntry& r = requests[id];
      Status s = Start(id, r);
      if (s.ok() && r.migrating) {
        r.migrating = false;
        ++requests_migrated;
        LOG_INFO << "request " << id << " continues on " << r.prefill_id
                 << (r.decode_id == r.prefill_id ? "" : " / " + r.decode_id) << " carrying "
                 << r.generated.size() << " tokens (move " << r.migrations << " of "
                 << options.migration_limit << ")";
      }
      // Start changes nothing when it refuses: one still without a worker
      // of a role it needs waits on.
      if (s.ok() || s.code() == StatusCode::kUnavailable) continue;
      Fail(id, s, out);
    }
  }

  // Ends the waiting requests whose bound has passed, with the error they
  // would have got without waiting.
  void ExpireWaiting(TimePoint now, PendingEvents& out) {
    std::vector<uint64_t> expired;
    for (auto& [id, r] : requests) {
      if (r.phase == Phase::kWaiting && now >= r.wait_until) expired.push_back(id);
    }
    const auto waited =
        std::chrono::duration_cast<std::chrono::milliseconds>(options.worker_wait_bound());
    for (uint64_t id : expired) {
      const Status why = requests[id].wait_error;
      Fail(id,
           Status(why.code(), why.message() + " (waited " + std::to_string(waited.count()) +
                                  " ms for one to register)"),
           out);
    }
  }

  // Routes r to a prefill worker (and a decode group) and starts it: a block
  // reservation on the decode side, or straight to prefill when colocated.
  Status Start(uint64_t id, RequestEntry& r) {
    std::vector<WorkerInfo> infos;
    for (auto& [wid, w] : workers) infos.push_back(w.info);
    RouteRequest route;
    // A migrated request's prompt blocks lead its longer prefill: still the
    // prefix to route by.
    route.prefix_blocks = r.request.prefix_blocks;
    const int64_t prefill_tokens =
        static_cast<int64_t>(r.request.prompt.size() + r.generated.size());
    const int64_t new_tokens =
        r.request.sampling.max_tokens - static_cast<int64_t>(r.generated.size());
    route.prompt_tokens = prefill_tokens;
    route.max_new_tokens = new_tokens;
    // A request moving on after a fault prefers other workers than the
    // attempt that failed (a path stuck between those two, a worker gone
    // bad), and takes the same ones when no other can serve it.
    auto pick = [&](const std::string& avoid, auto&& choose) -> Result<std::string> {
      if (!avoid.empty()) {
        std::vector<WorkerInfo> others;
        for (const WorkerInfo& w : infos) {
          if (w.id != avoid) others.push_back(w);
        }
        auto other = choose(others);
        if (other.ok()) return other;
      }
      return choose(infos);
    };
    ASSIGN_OR_RETURN(std::string prefill_id,
                     pick(r.avoid_prefill, [&](const std::vector<WorkerInfo>& from) {
                       return router.PickPrefill(route, from);
                     }));
    WorkerEntry* p = FindWorker(prefill_id);
    std::string decode_id = prefill_id;
    if (p->info.role != WorkerRole::kColocated) {
      ASSIGN_OR_RETURN(decode_id, pick(r.avoid_decode, [&](const std::vector<WorkerInfo>& from) {
                         return router.PickDecode(route, from);
                       }));
    }
    r.avoid_prefill.clear();
    r.avoid_decode.clear();
    r.prefill_id = prefill_id;
    r.decode_id = decode_id;
    r.early_tokens.clear();
    r.early_finish.reset();
    r.hand_over_due_sent = false;
    ++r.attempts;
    r.prompt_tokens = static_cast<int>(r.request.prompt.size());  // the client's, for usage
    // Queue accounting until the next heartbeat refreshes it (PrefillDone
    // takes it off again).
    r.queued_charge = prefill_tokens;
    p->info.queued_tokens += r.queued_charge;
    // The prompt's blocks will be cached there: an immediate repeat finds
    // them before the worker's heartbeat reports them (#42).
    router.NoteRouted(prefill_id, r.request.prefix_blocks, Clock::now() + OptimisticPrefixTtl());
    // One hop: the decode reservation and the prefill task leave together.
    // The prefill starts at once and streams the KV by block position; the
    // decode side maps positions to the blocks it reserves, and starts on
    // the hand-over frame that ends the streams (no block ids come back,
    // nothing else goes to the decode side).
    if (decode_id != prefill_id) {
      WorkerEntry* d = FindWorker(decode_id);
      d->info.free_kv_blocks -= (prefill_tokens + new_tokens + d->info.block_tokens - 1) /
                                std::max<int64_t>(1, d->info.block_tokens);
      SendReserveBlocks(id, r);
    }
    SendPrefillTask(id, r);
    return Status::Ok();
  }

  void SendPrefillTask(uint64_t rid, RequestEntry& r) {
    WorkerEntry* p = FindWorker(r.prefill_id);
    proto::PrefillTask task;
    task.set_request_id(rid);
    for (int32_t t : PrefillPrompt(r)) task.add_prompt_token_ids(t);
    protocols::ToProto(RunSampling(r), task.mutable_sampling());
    task.set_tenant_salt(r.request.tenant_salt);
    task.set_kv_transfer_id(KvTransferId(rid, r.attempts));
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
      target->set_kv_address(d ? d->kv_address : "");
    }
    SetPhase(rid, r, Phase::kPrefilling);
    SendTo(p ? p->conn : nullptr, MessageType::kPrefillTask, task);
  }

  void SendReserveBlocks(uint64_t rid, RequestEntry& r) {
    WorkerEntry* d = FindWorker(r.decode_id);
    WorkerEntry* p = FindWorker(r.prefill_id);
    proto::ReserveBlocks m;
    m.set_request_id(rid);
    for (int32_t t : PrefillPrompt(r)) m.add_prompt_token_ids(t);
    protocols::ToProto(RunSampling(r), m.mutable_sampling());
    m.set_prefill_rank(p ? p->rank : 0);
    m.set_kv_transfer_id(KvTransferId(rid, r.attempts));
    SendTo(d ? d->conn : nullptr, MessageType::kReserveBlocks, m);
  }

  void OnFrame(const std::shared_ptr<FramedConnection>& conn, const protocols::Frame& frame,
               PendingEvents& out);
  // A request's tokens from its decode side (its first report ends the hand-over).
  void OnTokens(const proto::TokenChunk::Entry& entry, RequestEntry& r, PendingEvents& out);
  // A request's end as `worker_id` reports it.
  void OnFinish(const std::string& worker_id, const proto::Finish& fin, PendingEvents& out);
  // Tells the decode side of each hand-over silent for a tick that its KV
  // is due (HandOverDue): from then on it times a stalled path out.
  void NudgeHandOvers(TimePoint now);
  // Security: the frames of a connection before it is a configured peer.
  void OnHandshakeFrame(const std::shared_ptr<FramedConnection>& conn,
                        const protocols::Frame& frame);
  // Security: true (and counted, logged) when `worker_id` reports on a live
  // request assigned to another worker; the frame is then dropped.
  bool IsForeign(const std::string& worker_id, uint64_t request_id, const char* what);
  void OnHello(const std::shared_ptr<FramedConnection>& conn, const protocols::Frame& frame);
  void OnRegister(const std::shared_ptr<FramedConnection>& conn, const protocols::Frame& frame,
                  PendingEvents& out);
  void CheckHeartbeats(PendingEvents& out);
};

}  // namespace kvrelay::coordinator
