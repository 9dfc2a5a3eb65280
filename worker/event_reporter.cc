#include "worker/event_reporter.h"

#include <string>

#include "common/logging.h"
#include "protocols/sampling_codec.h"

namespace kvrelay::worker {

using protocols::MessageType;

EventReporter::EventReporter(ControlLink* control, const engine::Tokenizer* tokenizer,
                             RequestTable* requests)
    : control_(control), tokenizer_(tokenizer), requests_(requests) {}

void EventReporter::ReportFirst(Request& r, const engine::TokenEvent& ev) {
  proto::PrefillDone done;
  done.set_request_id(ev.id);
  done.set_kv_transfer_id(ev.kv_transfer_id);
  done.set_first_token(ev.token);
  done.set_prompt_tokens(static_cast<uint32_t>(ev.prompt_tokens));
  done.set_cached_prompt_tokens(static_cast<uint32_t>(ev.cached_prompt_tokens));
  if (ev.has_logprobs && ev.token >= 0)
    protocols::ToProto(ev.logprobs, done.mutable_first_logprob());
  if (ev.finish_reason == engine::FinishReason::kError ||
      ev.finish_reason == engine::FinishReason::kCancelled || ev.token < 0) {
    control_->SendFinish(ev.id, ToProto(ev.finish_reason), ev.error, ev.prompt_tokens, 0,
                         ev.kv_transfer_id);
    requests_->Finish(ev.id);  // drops a half-sent stream, if any
    return;
  }
  if (ev.finish_reason == engine::FinishReason::kPrefilled && r.state != RequestState::kStreaming) {
    // Computed for a hand-over whose delivery is gone (the record's work was
    // released: its decode peer was lost meanwhile). A fault of the KV path,
    // reported with its status so that the coordinator moves the request on.
    control_->SendFinish(ev.id, proto::Finish::REASON_ERROR,
                         Unavailable("the KV hand-over of request " + std::to_string(ev.id) +
                                     " has no delivery (its decode peer was lost)"),
                         ev.prompt_tokens, 0, ev.kv_transfer_id);
    requests_->Finish(ev.id);
    return;
  }
  if (r.state == RequestState::kStreaming) {
    // Disaggregated: the first token reaches the client now (TTFT) and the
    // decode side with the KV (the hand-over frame); only a failed delivery
    // is reported later, by the role.
    done.set_finished(false);
    control_->Send(MessageType::kPrefillDone, done);
    return;
  }
  // A prefill-only request that ended at its first token (end of generation,
  // max_tokens 1) hands nothing over: the coordinator cancels the decode side.
  done.set_finished(ev.finished);
  if (ev.finished) done.set_reason(ToProto(ev.finish_reason));
  control_->Send(MessageType::kPrefillDone, done);
  if (ev.finished) {
    requests_->Finish(ev.id);
  } else {
    r.generated = 1;
    requests_->Move(r, RequestState::kRunning);
  }
}

void EventReporter::Report(const std::vector<engine::TokenEvent>& events) {
  auto flush = [&] {
    if (chunk_.entries_size() == 0) return;
    control_->Send(MessageType::kTokenChunk, chunk_);
    chunk_.Clear();
  };
  for (const auto& ev : events) {
    if (ev.finish_reason == engine::FinishReason::kCancelled && requests_->TakeStaleCancel(ev.id)) {
      continue;
    }
    Request* r = requests_->Find(ev.id);
    if (r == nullptr) {
      // Every request the engine holds was added before it was submitted:
      // this one's record ended (its peers were lost, the link dropped).
      LOG_DEBUG << "request " << ev.id << ": event after its record ended, not reported";
      continue;
    }
    if (r->state == RequestState::kQueued || r->state == RequestState::kComputing ||
        r->state == RequestState::kStreaming) {
      ReportFirst(*r, ev);
      continue;
    }
    // An end-of-generation token ends the request; it is not text to stream.
    const bool eog = ev.finish_reason == engine::FinishReason::kStop && ev.token >= 0 &&
                     tokenizer_ != nullptr && tokenizer_->IsEndOfGeneration(ev.token);
    if (ev.token >= 0 && !eog) {
      auto* entry = chunk_.add_entries();
      entry->set_request_id(ev.id);
      entry->add_token_ids(ev.token);
      if (ev.has_logprobs) protocols::ToProto(ev.logprobs, entry->add_logprobs());
      ++r->generated;
    }
    if (ev.finished) {
      flush();  // the tokens before the Finish
      control_->SendFinish(ev.id, ToProto(ev.finish_reason), ev.error, ev.prompt_tokens,
                           r->generated, ev.kv_transfer_id);
      requests_->Finish(ev.id);
    }
  }
  flush();
}

}  // namespace kvrelay::worker
