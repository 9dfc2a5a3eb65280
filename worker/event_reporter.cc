#include "worker/event_reporter.h"

#include <algorithm>

#include "protocols/sampling_codec.h"

namespace kvrelay::worker {

using protocols::MessageType;

EventReporter::EventReporter(ControlLink* control, const engine::Tokenizer* tokenizer,
                             HandOver hand_over, int64_t* queued_tokens)
    : control_(control),
      tokenizer_(tokenizer),
      hand_over_(std::move(hand_over)),
      queued_tokens_(queued_tokens) {}

std::vector<engine::RequestId> EventReporter::live() const {
  std::vector<engine::RequestId> ids;
  for (const auto& [id, n] : generated_) ids.push_back(id);
  return ids;
}

void EventReporter::Reset() {
  generated_.clear();
  handing_over_.clear();
  silenced_.clear();
  chunk_.Clear();
}

void EventReporter::CancelledByCoordinator(engine::RequestId id) {
  generated_.erase(id);
  handing_over_.erase(id);
  ++silenced_[id];
}

void EventReporter::ReportFirst(const engine::TokenEvent& ev) {
  *queued_tokens_ = std::max<int64_t>(0, *queued_tokens_ - ev.prompt_tokens);
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
    (void)hand_over_(ev.id, /*deliver=*/false, -1);  // drops a half-sent stream, if any
    control_->SendFinish(ev.id, ToProto(ev.finish_reason), ev.error, ev.prompt_tokens, 0,
                         ev.kv_transfer_id);
    return;
  }
  // A prefill-only request that ended at its first token (end of generation,
  // max_tokens 1) hands nothing over: the coordinator cancels the decode side.
  const bool ended = ev.finished && ev.finish_reason != engine::FinishReason::kPrefilled;
  if (hand_over_(ev.id, /*deliver=*/!ended, ev.token) && !ended) {
    // Disaggregated: the first token reaches the client now (TTFT) and the
    // decode side with the KV (the hand-over frame); only a failed delivery
    // is reported later (HandOverDone).
    done.set_finished(false);
    control_->Send(MessageType::kPrefillDone, done);
    handing_over_[ev.id] = ev.prompt_tokens;
    return;
  }
  done.set_finished(ev.finished);
  if (ev.finished) done.set_reason(ToProto(ev.finish_reason));
  control_->Send(MessageType::kPrefillDone, done);
  if (!ev.finished) generated_[ev.id] = 1;
}

void EventReporter::HandOverDone(engine::RequestId id, const Status& status,
                                 uint64_t kv_transfer_id) {
  auto it = handing_over_.find(id);
  if (it == handing_over_.end()) return;  // cancelled meanwhile
  if (!status.ok()) {
    control_->SendFinish(id, proto::Finish::REASON_ERROR,
                         status.WithContext("KV transfer to decode"), it->second, 0,
                         kv_transfer_id);
  }
  handing_over_.erase(it);
}

void EventReporter::Report(const std::vector<engine::TokenEvent>& events) {
  auto flush = [&] {
    if (chunk_.entries_size() == 0) return;
    control_->Send(MessageType::kTokenChunk, chunk_);
    chunk_.Clear();
  };
  for (const auto& ev : events) {
    if (ev.finish_reason == engine::FinishReason::kCancelled) {
      auto s = silenced_.find(ev.id);
      if (s != silenced_.end()) {
        if (--s->second == 0) silenced_.erase(s);
        continue;
      }
    }
    auto gen = generated_.find(ev.id);
    if (gen == generated_.end()) {
      ReportFirst(ev);
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
      ++gen->second;
    }
    if (ev.finished) {
      flush();  // the tokens before the Finish
      control_->SendFinish(ev.id, ToProto(ev.finish_reason), ev.error, ev.prompt_tokens,
                           gen->second, ev.kv_transfer_id);
      generated_.erase(gen);
    }
  }
  flush();
}

}  // namespace kvrelay::worker
