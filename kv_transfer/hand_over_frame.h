// The hand-over frame: the last transfer of a prompt's KV streams, from the
// prefill worker to its decode group's TP rank 0, carrying the first token
// the prefill sampled. With it the decode side starts on its own once every
// layer has verified: no coordinator round trip between prefill and decode.
//
// One fixed-size slot (layer_stream.h EncodeSlot) of a KvHandOver message,
// tagged kHandOverTag (no layer stream uses it). The receiver checks the
// slot checksum, the request id and the prompt length against its own.
//
// Thread-compatible, one owner. The slot is this object's: it follows
// transport.h's lifetime rule (a kAborted transfer quarantines the object).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"
#include "kv_transfer/transport.h"

namespace kvrelay::kv_transfer {

inline constexpr uint32_t kHandOverTag = 0xFFFFFFFFu;  // StreamTag never makes it
inline constexpr size_t kHandOverSlotBytes = 64;

class HandOverFrame {
 public:
  // A frame to send. Nothing is posted until the first Poll, which posts it
  // (or keeps it for the next Poll while the transport is full).
  static std::unique_ptr<HandOverFrame> ToSend(Transport* transport, int peer, uint64_t request_id,
                                               int32_t first_token, int64_t prompt_tokens);
  // A posted receive of the frame of `request_id`, whose prompt has
  // `prompt_tokens` tokens.
  static Result<std::unique_ptr<HandOverFrame>> Receive(Transport* transport, int peer,
                                                        uint64_t request_id, int64_t prompt_tokens);
  ~HandOverFrame();  // cancels an unfinished transfer
  HandOverFrame(const HandOverFrame&) = delete;
  HandOverFrame& operator=(const HandOverFrame&) = delete;

  // true: sent, or received and verified (first_token() is then valid);
  // false: not yet; an error (DataLoss for a frame that does not check out)
  // is kept and returned again.
  Result<bool> Poll();
  int32_t first_token() const { return first_token_; }
  // The transfer ended kAborted: the transport still owns the slot, so this
  // object must live as long as the transport.
  bool quarantined() const { return quarantined_; }

 private:
  HandOverFrame(Transport* transport, int peer, uint64_t request_id, int64_t prompt_tokens,
                bool send)
      : transport_(transport),
        peer_(peer),
        request_id_(request_id),
        prompt_tokens_(prompt_tokens),
        send_(send) {}
  Status Verify();

  Transport* transport_;
  int peer_;
  uint64_t request_id_;
  int64_t prompt_tokens_;
  bool send_;
  std::string slot_;
  TransferHandle handle_ = 0;
  bool posted_ = false;
  bool done_ = false;
  bool quarantined_ = false;
  Status status_;
  int32_t first_token_ = -1;
};

}  // namespace kvrelay::kv_transfer
