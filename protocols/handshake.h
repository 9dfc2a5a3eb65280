// Configuration handshake: before any KV byte moves, two peers exchange what
// the bytes mean (model fingerprint, KV dtype, block size, head layout, TP) and
// both refuse on any mismatch with a message that names the field. There is
// no fallback: a peer that cannot agree is never talked to.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"
#include "engine/kv_cache/kv_cache.h"

namespace kvrelay::proto {
class PeerConfig;
}

namespace kvrelay::protocols {

inline constexpr uint32_t kProtocolVersion = 1;

struct PeerConfig {
  engine::ModelFingerprint model_fingerprint{};
  engine::KvDtype kv_dtype = engine::KvDtype::kF32;
  int block_tokens = 16;
  int layers = 0;
  int kv_heads = 0;  // of the whole model, not per rank
  int head_dim = 0;
  int tp_size = 1;
  int tp_rank = 0;
  uint32_t protocol_version = kProtocolVersion;
};

struct CompatibilityOptions {
  // Prefill and decode TP may differ (heads are re-sliced in transfer); peers
  // of one TP group must match. When true, tp_size must be equal.
  bool require_same_tp = false;
};

// Ok, or FailedPrecondition naming the first mismatched field and both
// values, e.g. "handshake: kv_dtype mismatch: local f16, peer f32". Also
// rejects a config that is invalid on its own (InvalidArgument naming the field).
Status CheckPeerCompatible(const PeerConfig& local, const PeerConfig& peer,
                           const CompatibilityOptions& options = {});
// A config that is unusable by itself (zero layers, tp_rank >= tp_size, ...).
Status ValidatePeerConfig(const PeerConfig& config);

// Protobuf converters (protobuf stays at the edge).
void ToProto(const PeerConfig& config, proto::PeerConfig* out);
Result<PeerConfig> FromProto(const proto::PeerConfig& message);

}  // namespace kvrelay::protocols
