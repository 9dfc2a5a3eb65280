// Framing of the kvrelay TCP streams (control plane and TCP KV data plane).
//
// Wire format of one frame, little endian:
//   [magic u32 = kFrameMagic][version u16][type u16][length u32][payload: length bytes]
// The decoder is incremental (bytes may arrive split anywhere) and safe on
// hostile input: a bad magic, an unknown version or a length above the
// configured maximum is an error before any payload is buffered, and a
// frame's buffer grows with the bytes that actually arrived (nothing is
// reserved for what a header merely announces), so memory stays bounded by
// the bytes received, at most max_payload_bytes + one header. After an error
// the decoder stays failed; the owner closes the connection and logs status().
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "common/status.h"

namespace kvrelay::protocols {

inline constexpr uint32_t kFrameMagic = 0x4C52564Bu;  // "KVRL" read as little endian
inline constexpr uint16_t kFrameVersion = 1;
inline constexpr size_t kFrameHeaderBytes = 12;
inline constexpr uint32_t kDefaultMaxFramePayload = 16u << 20;

// Frame types. Control messages carry one protobuf message of the named type
// (protocols/control.proto); kKvData frames carry raw KV bytes (kv_transfer/tcp).
enum class MessageType : uint16_t {
  kHello = 1,
  kHelloReply = 2,
  kRegisterWorker = 3,
  kRegisterReply = 4,
  kHeartbeat = 5,
  kPrefillTask = 6,
  kReserveBlocks = 7,
  // 8 was kStartDecode: the first token now travels with the KV
  // (kv_transfer/hand_over_frame.h). Not to be reused.
  kReserveBlocksReply = 9,
  kTokenChunk = 10,
  kCancel = 11,
  kFinish = 12,
  kPrefixCacheEvent = 13,
  kPrefillDone = 15,
  kAuthHello = 16,      // proto::AuthHello (protocols/cluster_auth.h)
  kAuthChallenge = 17,  // proto::AuthChallenge
  kAuthProof = 18,      // proto::AuthProof
  kPeerLost = 19,       // proto::PeerLost (coordinator -> prefill workers)
  kWorkerLeaving = 20,  // proto::WorkerLeaving: the worker stops on purpose
  kHandOverDue = 21,    // proto::HandOverDue (coordinator -> decode worker)
  kKvData = 100,
  kKvAbort = 101,
};

// "PrefillTask", ... for metrics and logs; "other" for a type not listed above.
std::string_view MessageTypeName(uint16_t type);

struct FrameHeader {
  uint16_t version = kFrameVersion;
  uint16_t type = 0;
  uint32_t length = 0;
};

struct Frame {
  uint16_t type = 0;
  std::string payload;
};

// Writes the 12-byte header for a payload of `length` bytes.
void EncodeFrameHeader(uint16_t type, uint32_t length, uint8_t* out);
// Header + payload in one string. InvalidArgument when the payload exceeds max_payload.
Result<std::string> EncodeFrame(uint16_t type, std::string_view payload,
                                uint32_t max_payload = kDefaultMaxFramePayload);
// Validates magic, version and length (<= max_payload) of a 12-byte header.
Result<FrameHeader> ParseFrameHeader(std::span<const uint8_t, kFrameHeaderBytes> bytes,
                                     uint32_t max_payload);

// Incremental decoder. Thread-compatible (one reader per connection).
class FrameDecoder {
 public:
  struct Options {
    uint32_t max_payload_bytes = kDefaultMaxFramePayload;
  };
  explicit FrameDecoder(Options options) : options_(options) {}
  FrameDecoder() : FrameDecoder(Options{}) {}

  // Appends received bytes and decodes as far as possible. Returns the
  // decoder's status (sticky once failed).
  Status Feed(const void* data, size_t size);
  // Pops the next complete frame, if any.
  std::optional<Frame> Next();
  // Call at end of stream: DataLoss if a partial frame is buffered.
  Status Finish() const;
  const Status& status() const { return status_; }
  // Bytes held in partial frames (bounded by max payload + header).
  size_t buffered_bytes() const { return header_fill_ + partial_.payload.size(); }
  // Memory reserved for the partial frame (never more than twice what arrived).
  size_t partial_capacity() const { return partial_.payload.capacity(); }
  // Changes the limit for headers parsed from now on (a connection raises it
  // once its peer authenticated).
  void set_max_payload_bytes(uint32_t max) { options_.max_payload_bytes = max; }
  uint32_t max_payload_bytes() const { return options_.max_payload_bytes; }
  // Drops every buffered byte and frees the memory (the decoder stays usable
  // only if it had not failed). For a connection being closed.
  void Release();

 private:
  Options options_;
  Status status_;
  std::array<uint8_t, kFrameHeaderBytes> header_{};
  size_t header_fill_ = 0;
  bool have_header_ = false;
  uint32_t want_ = 0;  // payload bytes of the current frame
  Frame partial_;
  std::deque<Frame> ready_;  // complete frames not yet popped
  size_t ready_bytes_ = 0;
};

}  // namespace kvrelay::protocols
