// EventReporter: turns the engine's TokenEvents into control messages — a
// PrefillDone for the first token of a request prefilled here (TTFT ends
// there), TokenChunks for the tokens a decode step produced (batched per loop
// turn), a Finish when a request ends. It reads and ends the requests'
// records in the worker's RequestTable. One per worker, on its run thread.
#pragma once

#include <vector>

#include "engine/runtime/engine.h"
#include "engine/tokenizer/tokenizer.h"
#include "protocols/control.pb.h"
#include "worker/control_link.h"
#include "worker/request_table.h"

namespace kvrelay::worker {

class EventReporter {
 public:
  EventReporter(ControlLink* control, const engine::Tokenizer* tokenizer, RequestTable* requests);

  // Reports one engine step's events. A request's first event is its first
  // token (a record in kQueued/kComputing): a PrefillDone, unless the
  // request failed; a request the role is streaming to a decode group
  // (kStreaming, set by the role when the first token was sampled) goes on
  // there. Later events are tokens. A Finish ends the record.
  void Report(const std::vector<engine::TokenEvent>& events);

 private:
  void ReportFirst(Request& r, const engine::TokenEvent& ev);

  ControlLink* control_;
  const engine::Tokenizer* tokenizer_;  // may be null (no end-of-generation tokens then)
  RequestTable* requests_;
  proto::TokenChunk chunk_;  // tokens batched within one Report
};

}  // namespace kvrelay::worker
