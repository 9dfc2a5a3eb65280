// Typed encode/decode of control messages into frames. The frame type says
// which protobuf message the payload holds; a mismatch or an unparseable
// payload is InvalidArgument naming the type.
#pragma once

#include <string>

#include "common/status.h"
#include "protocols/frame_codec.h"

namespace kvrelay::protocols {

template <typename Message>
Result<std::string> EncodeMessage(MessageType type, const Message& message,
                                  uint32_t max_payload = kDefaultMaxFramePayload) {
  std::string payload;
  if (!message.SerializeToString(&payload)) {
    return Internal("failed to serialize " + message.GetTypeName());
  }
  return EncodeFrame(static_cast<uint16_t>(type), payload, max_payload);
}

template <typename Message>
Status DecodeMessage(const Frame& frame, MessageType expected, Message* out) {
  if (frame.type != static_cast<uint16_t>(expected)) {
    return InvalidArgument("expected frame type " + std::to_string(static_cast<int>(expected)) +
                           " (" + out->GetTypeName() + "), got type " + std::to_string(frame.type));
  }
  if (!out->ParseFromString(frame.payload)) {
    return InvalidArgument("unparseable " + out->GetTypeName() + " payload of " +
                           std::to_string(frame.payload.size()) + " bytes");
  }
  return Status::Ok();
}

}  // namespace kvrelay::protocols
