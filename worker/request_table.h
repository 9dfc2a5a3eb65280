// RequestTable: the one record a worker process keeps of each request it
// holds, in named states. The roles (prefill, decode, colocated) and the
// EventReporter read and move the same record; the heartbeat's queue and
// running figures (the coordinator's kvrelay_worker_queued_tokens and
// kvrelay_worker_running) are counted from it.
//
//   prefill (a task with a decode target):
//     kQueued -> kComputing -> kStreaming -> kDelivered -> (gone after kv_timeout)
//   colocated (a task run to completion here):
//     kQueued -> kComputing -> kRunning -> (gone)
//   decode:
//     kReserved -> kReceiving -> kRunning -> (gone)
// Any state may end early (an error, a cancel, a lost peer). A record the
// coordinator cancelled while the engine still held the request stays as
// kFinished until the engine's kCancelled event for it has been swallowed:
// the coordinator may start the same id again at once (a re-run after a lost
// worker), and that stale event must not end the new attempt.
//
// Every transition is logged at debug level with the request id. One table
// per worker process, owned by the shell (worker.h), used on its run thread.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <string_view>
#include <vector>

#include "common/clock.h"
#include "engine/runtime/engine.h"

namespace kvrelay::worker {

enum class RequestState : uint8_t {
  kQueued,     // prefill/colocated: submitted to the engine, in no step yet
  kComputing,  // prefill/colocated: its prompt is being computed
  kStreaming,  // prefill: first token sampled; its KV still on its way to decode
  kDelivered,  // prefill: every KV byte handed to the transport (kept for kv_timeout)
  kReserved,   // decode: blocks asked for; its receives not posted yet
  kReceiving,  // decode: its KV streams and hand-over frame are being received
  kRunning,    // decode/colocated: in the running batch, its tokens streamed
  kFinished,   // ended; kept only while stale cancel events of its id pend
};
std::string_view RequestStateName(RequestState s);

// A role's own part of a request: the prefill role's KV streams, the decode
// role's receives. The table owns it; the role releases it (RequestTable::
// SetRelease) before it is destroyed, on every path.
struct RequestWork {
  virtual ~RequestWork() = default;
};

struct Request {
  engine::RequestId id = 0;
  RequestState state = RequestState::kQueued;
  TimePoint since;    // entered `state`
  TimePoint created;  // this attempt was added
  int64_t prompt_tokens = 0;
  // Tokens reported to the coordinator. The decode side counts the prefill
  // side's first token once its KV is being received.
  int64_t generated = 0;
  // The data-plane peers its KV moves between: the decode group's ranks in
  // TP order (prefill side), the prefill rank (decode side).
  std::vector<int> peers;
  std::unique_ptr<RequestWork> work;  // null when the role has none (any more)

  // The role's work, as the type the role stored (one role per process).
  template <class T>
  T* work_as() const {
    return static_cast<T*>(work.get());
  }

 private:
  friend class RequestTable;
  int stale_cancels = 0;  // kCancelled events of this id not to report
};

class RequestTable {
 public:
  // Called with a record whose work is about to be dropped (finish, cancel,
  // re-run of the id, Clear): the role cancels what its work has in flight
  // and may move the work out of the record (a quarantine) instead.
  using ReleaseFn = std::function<void(Request&)>;

  RequestTable() = default;
  RequestTable(const RequestTable&) = delete;
  RequestTable& operator=(const RequestTable&) = delete;
  ~RequestTable();

  void SetRelease(ReleaseFn release) { release_ = std::move(release); }

  // A new attempt of `id`. A record of an earlier attempt is released and
  // replaced; its pending stale cancels carry over.
  Request& Add(engine::RequestId id, RequestState state, int64_t prompt_tokens);
  // The live record of `id`; null when there is none or it has finished.
  Request* Find(engine::RequestId id);
  const Request* Find(engine::RequestId id) const;
  // Moves `r` to `to` (logged at debug level). No-op when already there.
  void Move(Request& r, RequestState to);
  // Releases `r`'s work (the role's Release), keeping the record.
  void DropWork(Request& r);
  // The request ended: its work is released and its record removed.
  void Finish(engine::RequestId id);
  // The coordinator cancelled `id` and forgot it. `engine_had_it`: the
  // engine will still emit a kCancelled event for it, which TakeStaleCancel
  // then swallows.
  void Cancelled(engine::RequestId id, bool engine_had_it);
  // True (and consumed) when a kCancelled event of `id` belongs to an
  // attempt the coordinator already cancelled.
  bool TakeStaleCancel(engine::RequestId id);
  // Releases and forgets every record (the coordinator that knew them is gone).
  void Clear();

  // Ids of the live records in `state`, in id order (a snapshot: safe to
  // move or finish them while walking it).
  std::vector<engine::RequestId> IdsIn(RequestState state) const;
  // Live records in any of `states`, and the sum of their prompt tokens.
  int64_t Count(std::initializer_list<RequestState> states) const;
  int64_t PromptTokens(std::initializer_list<RequestState> states) const;
  size_t size() const { return records_.size(); }  // records, finished ones included

 private:
  void ReleaseWork(Request& r);

  std::map<engine::RequestId, Request> records_;
  ReleaseFn release_;
};

}  // namespace kvrelay::worker
