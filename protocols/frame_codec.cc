#include "protocols/frame_codec.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace kvrelay::protocols {
namespace {

void PutU16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}
void PutU32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint16_t GetU16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
uint32_t GetU32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

}  // namespace

void EncodeFrameHeader(uint16_t type, uint32_t length, uint8_t* out) {
  PutU32(out, kFrameMagic);
  PutU16(out + 4, kFrameVersion);
  PutU16(out + 6, type);
  PutU32(out + 8, length);
}

Result<std::string> EncodeFrame(uint16_t type, std::string_view payload, uint32_t max_payload) {
  if (payload.size() > max_payload) {
    return InvalidArgument("frame payload of " + std::to_string(payload.size()) +
                           " bytes exceeds the maximum of " + std::to_string(max_payload));
  }
  std::string out(kFrameHeaderBytes + payload.size(), '\0');
  EncodeFrameHeader(type, static_cast<uint32_t>(payload.size()),
                    reinterpret_cast<uint8_t*>(out.data()));
  if (!payload.empty()) std::memcpy(out.data() + kFrameHeaderBytes, payload.data(), payload.size());
  return out;
}

Result<FrameHeader> ParseFrameHeader(std::span<const uint8_t, kFrameHeaderBytes> bytes,
                                     uint32_t max_payload) {
  uint32_t magic = GetU32(bytes.data());
  if (magic != kFrameMagic) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "bad frame magic 0x%08x (expected 0x%08x)", magic, kFrameMagic);
    return InvalidArgument(buf);
  }
  FrameHeader h;
  h.version = GetU16(bytes.data() + 4);
  h.type = GetU16(bytes.data() + 6);
  h.length = GetU32(bytes.data() + 8);
  if (h.version != kFrameVersion) {
    return InvalidArgument("unsupported frame version " + std::to_string(h.version) +
                           " (this build speaks " + std::to_string(kFrameVersion) + ")");
  }
  if (h.length > max_payload) {
    return ResourceExhausted("frame of type " + std::to_string(h.type) + " declares " +
                             std::to_string(h.length) + " payload bytes, over the maximum of " +
                             std::to_string(max_payload));
  }
  return h;
}

Status FrameDecoder::Feed(const void* data, size_t size) {
  if (!status_.ok()) return status_;
  const uint8_t* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    if (!have_header_) {
      size_t take = std::min(size, kFrameHeaderBytes - header_fill_);
      std::memcpy(header_.data() + header_fill_, p, take);
      header_fill_ += take;
      p += take;
      size -= take;
      if (header_fill_ < kFrameHeaderBytes) break;
      auto header = ParseFrameHeader(header_, options_.max_payload_bytes);
      if (!header.ok()) {
        status_ = header.status();
        return status_;
      }
      have_header_ = true;
      want_ = header->length;
      partial_.type = header->type;
      partial_.payload.clear();
      // No reserve(want_): a header only announces bytes, and an announced
      // 16 MiB must not cost 16 MiB before they arrive. append() grows
      // geometrically as they do.
    }
    size_t take = std::min<size_t>(size, want_ - partial_.payload.size());
    partial_.payload.append(reinterpret_cast<const char*>(p), take);
    p += take;
    size -= take;
    if (partial_.payload.size() == want_) {
      ready_bytes_ += partial_.payload.size();
      ready_.push_back(std::move(partial_));
      partial_ = Frame{};
      have_header_ = false;
      header_fill_ = 0;
      want_ = 0;
    }
  }
  return status_;
}

void FrameDecoder::Release() {
  partial_ = Frame{};
  std::deque<Frame>().swap(ready_);
  ready_bytes_ = 0;
  header_fill_ = 0;
  have_header_ = false;
  want_ = 0;
}

std::optional<Frame> FrameDecoder::Next() {
  if (ready_.empty()) return std::nullopt;
  Frame f = std::move(ready_.front());
  ready_.pop_front();
  ready_bytes_ -= f.payload.size();
  return f;
}

Status FrameDecoder::Finish() const {
  if (!status_.ok()) return status_;
  if (header_fill_ > 0) {
    if (!have_header_) {
      return DataLoss("stream ended inside a frame header (" + std::to_string(header_fill_) +
                      " of " + std::to_string(kFrameHeaderBytes) + " bytes)");
    }
    return DataLoss("stream ended inside a frame of type " + std::to_string(partial_.type) + ": " +
                    std::to_string(partial_.payload.size()) + " of " + std::to_string(want_) +
                    " payload bytes");
  }
  return Status::Ok();
}

std::string_view MessageTypeName(uint16_t type) {
  switch (static_cast<MessageType>(type)) {
    case MessageType::kHello:
      return "Hello";
    case MessageType::kHelloReply:
      return "HelloReply";
    case MessageType::kRegisterWorker:
      return "RegisterWorker";
    case MessageType::kRegisterReply:
      return "RegisterReply";
    case MessageType::kHeartbeat:
      return "Heartbeat";
    case MessageType::kPrefillTask:
      return "PrefillTask";
    case MessageType::kReserveBlocks:
      return "ReserveBlocks";
    case MessageType::kReserveBlocksReply:
      return "ReserveBlocksReply";
    case MessageType::kTokenChunk:
      return "TokenChunk";
    case MessageType::kCancel:
      return "Cancel";
    case MessageType::kFinish:
      return "Finish";
    case MessageType::kPrefixCacheEvent:
      return "PrefixCacheEvent";
    case MessageType::kPrefillDone:
      return "PrefillDone";
    case MessageType::kAuthHello:
      return "AuthHello";
    case MessageType::kAuthChallenge:
      return "AuthChallenge";
    case MessageType::kAuthProof:
      return "AuthProof";
    case MessageType::kPeerLost:
      return "PeerLost";
    case MessageType::kWorkerLeaving:
      return "WorkerLeaving";
    case MessageType::kHandOverDue:
      return "HandOverDue";
    case MessageType::kKvData:
      return "KvData";
    case MessageType::kKvAbort:
      return "KvAbort";
  }
  return "other";
}

}  // namespace kvrelay::protocols
