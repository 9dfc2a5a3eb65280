#include "kv_transfer/hand_over_frame.h"

#include "kv_transfer/layer_stream.h"
#include "protocols/kv_manifest.pb.h"

namespace kvrelay::kv_transfer {

std::unique_ptr<HandOverFrame> HandOverFrame::ToSend(Transport* transport, int peer,
                                                     uint64_t request_id, int32_t first_token,
                                                     int64_t prompt_tokens) {
  std::unique_ptr<HandOverFrame> f(
      new HandOverFrame(transport, peer, request_id, prompt_tokens, /*send=*/true));
  proto::KvHandOver m;
  m.set_request_id(request_id);
  m.set_first_token(first_token);
  m.set_prompt_tokens(static_cast<uint64_t>(prompt_tokens));
  auto slot = EncodeSlot(m.SerializeAsString(), kHandOverSlotBytes);
  if (slot.ok()) {
    f->slot_ = std::move(*slot);
  } else {
    f->status_ = slot.status();
  }
  f->first_token_ = first_token;
  return f;
}

Result<std::unique_ptr<HandOverFrame>> HandOverFrame::Receive(Transport* transport, int peer,
                                                              uint64_t request_id,
                                                              int64_t prompt_tokens) {
  std::unique_ptr<HandOverFrame> f(
      new HandOverFrame(transport, peer, request_id, prompt_tokens, /*send=*/false));
  f->slot_.assign(kHandOverSlotBytes, '\0');
  ASSIGN_OR_RETURN(f->handle_,
                   transport->PostRecv(SlotDesc(peer, request_id, kHandOverTag, &f->slot_)));
  f->posted_ = true;
  return f;
}

HandOverFrame::~HandOverFrame() {
  if (posted_ && !done_) (void)transport_->Cancel(handle_);
}

Result<bool> HandOverFrame::Poll() {
  if (!status_.ok()) return status_;
  if (done_) return true;
  if (!posted_) {
    auto h = transport_->PostSend(SlotDesc(peer_, request_id_, kHandOverTag, &slot_));
    if (!h.ok()) {
      if (h.status().code() == StatusCode::kResourceExhausted) return false;  // room later
      status_ = h.status().WithContext("sending the hand-over frame");
      return status_;
    }
    handle_ = *h;
    posted_ = true;
  }
  Result<bool> r = transport_->Poll(handle_);
  if (r.ok() && !*r) return false;
  done_ = true;  // the handle is consumed either way
  if (!r.ok()) {
    if (r.status().code() == StatusCode::kAborted) quarantined_ = true;
    status_ = r.status().WithContext(send_ ? "sending the hand-over frame"
                                           : "receiving the hand-over frame");
    return status_;
  }
  if (!send_) {
    status_ = Verify();
    if (!status_.ok()) return status_;
  }
  return true;
}

Status HandOverFrame::Verify() {
  const std::string where = "hand-over frame of request " + std::to_string(request_id_) + ": ";
  auto body = OpenSlot(slot_);
  if (!body.ok()) return DataLoss(where + body.status().message());
  proto::KvHandOver m;
  if (!m.ParseFromArray(body->data(), static_cast<int>(body->size()))) {
    return DataLoss(where + "unparseable");
  }
  if (m.request_id() != request_id_) {
    return DataLoss(where + "names request " + std::to_string(m.request_id()));
  }
  if (m.prompt_tokens() != static_cast<uint64_t>(prompt_tokens_)) {
    return DataLoss(where + "carries a prompt of " + std::to_string(m.prompt_tokens()) +
                    " tokens, expected " + std::to_string(prompt_tokens_));
  }
  if (m.first_token() < 0) {
    return DataLoss(where + "first token " + std::to_string(m.first_token()));
  }
  first_token_ = m.first_token();
  return Status::Ok();
}

}  // namespace kvrelay::kv_transfer
