// EventReporter: turns the engine's TokenEvents into control messages — a
// PrefillDone for the first token of a request prefilled here (TTFT ends
// there), TokenChunks for the tokens a decode step produced (batched per loop
// turn), a Finish when a request ends. One per worker, on its run thread.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <vector>

#include "engine/runtime/engine.h"
#include "engine/tokenizer/tokenizer.h"
#include "protocols/control.pb.h"
#include "worker/control_link.h"

namespace kvrelay::worker {

class EventReporter {
 public:
  // `hand_over(id, deliver, first_token)`: the role starts finishing
  // (deliver) or drops a request's KV hand-over to a decode group when its
  // first token or its failure is reported (false: not a handed-over
  // request). A delivery ends later in HandOverDone.
  using HandOver = std::function<bool(engine::RequestId, bool deliver, int32_t first_token)>;
  EventReporter(ControlLink* control, const engine::Tokenizer* tokenizer, HandOver hand_over,
                int64_t* queued_tokens);

  // The request's first token came from elsewhere (the decode side of a
  // disaggregated request): its events are generated tokens from the start.
  void ExpectDecodeOnly(engine::RequestId id) { generated_[id] = 1; }
  // The coordinator cancelled the request (and has forgotten it): the
  // engine's kCancelled event for it is not reported. The coordinator may
  // start the same id again at once (a re-run after a lost worker), so that
  // stale event must not end the new attempt.
  void CancelledByCoordinator(engine::RequestId id);
  void Report(const std::vector<engine::TokenEvent>& events);
  // The KV hand-over of `id` finished: nothing more to say (ok; its first
  // token went to the coordinator when sampled), or the request ends with
  // the transfer's error.
  void HandOverDone(engine::RequestId id, const Status& status, uint64_t kv_transfer_id);
  // The hand-over of `id` was abandoned because the coordinator already
  // knows (it cancelled the request or dropped its decode group): report nothing.
  void ForgetHandOver(engine::RequestId id) { handing_over_.erase(id); }
  // Forgets every request (the coordinator that knew them is gone).
  void Reset();
  // Requests with tokens still to come (the shell cancels them on shutdown).
  std::vector<engine::RequestId> live() const;

 private:
  void ReportFirst(const engine::TokenEvent& ev);

  ControlLink* control_;
  const engine::Tokenizer* tokenizer_;  // may be null (no end-of-generation tokens then)
  HandOver hand_over_;
  int64_t* queued_tokens_;
  std::map<engine::RequestId, int64_t> generated_;  // tokens emitted per running request
  std::map<engine::RequestId, int> silenced_;       // cancel events not to report, per id
  proto::TokenChunk chunk_;                         // tokens batched within one Report
  // Requests whose KV is still on its way to the decode group: their
  // prompt lengths, for the Finish of a failed delivery.
  std::map<engine::RequestId, int64_t> handing_over_;
};

}  // namespace kvrelay::worker
