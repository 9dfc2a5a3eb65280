#include "protocols/handshake.h"

#include <algorithm>

#include "common/hash.h"
#include "protocols/common.pb.h"

namespace kvrelay::protocols {
namespace {

// Local name table: engine's KvDtypeName lives in kvrelay_kv_cache, which this
// library does not link.
const char* DtypeName(engine::KvDtype d) {
  switch (d) {
    case engine::KvDtype::kF32:
      return "f32";
    case engine::KvDtype::kF16:
      return "f16";
    case engine::KvDtype::kBF16:
      return "bf16";
    case engine::KvDtype::kInt8:
      return "int8";
    case engine::KvDtype::kKivi4:
      return "kivi4";
    case engine::KvDtype::kKivi2:
      return "kivi2";
  }
  return "unknown";
}

Status Mismatch(const char* field, const std::string& local, const std::string& peer) {
  return FailedPrecondition(std::string("handshake: ") + field + " mismatch: local " + local +
                            ", peer " + peer);
}

}  // namespace

Status ValidatePeerConfig(const PeerConfig& c) {
  auto bad = [](const char* field, int v) {
    return InvalidArgument(std::string("handshake: invalid ") + field + " " + std::to_string(v));
  };
  if (c.layers <= 0) return bad("layers", c.layers);
  if (c.kv_heads <= 0) return bad("kv_heads", c.kv_heads);
  if (c.head_dim <= 0) return bad("head_dim", c.head_dim);
  if (c.block_tokens <= 0) return bad("block_tokens", c.block_tokens);
  // More ranks than KV heads replicate them (kv_transfer::ShardHeads): the
  // size must then be a multiple of the heads.
  if (c.tp_size <= 0 || (c.tp_size > c.kv_heads && c.tp_size % c.kv_heads != 0)) {
    return bad("tp_size", c.tp_size);
  }
  if (c.tp_rank < 0 || c.tp_rank >= c.tp_size) return bad("tp_rank", c.tp_rank);
  if (static_cast<int>(c.kv_dtype) > static_cast<int>(engine::KvDtype::kKivi2)) {
    return bad("kv_dtype", static_cast<int>(c.kv_dtype));
  }
  return Status::Ok();
}

Status CheckPeerCompatible(const PeerConfig& local, const PeerConfig& peer,
                           const CompatibilityOptions& options) {
  if (local.protocol_version != peer.protocol_version) {
    return Mismatch("protocol_version", std::to_string(local.protocol_version),
                    std::to_string(peer.protocol_version));
  }
  RETURN_IF_ERROR(ValidatePeerConfig(local).WithContext("local config"));
  RETURN_IF_ERROR(ValidatePeerConfig(peer).WithContext("peer config"));
  if (local.model_fingerprint != peer.model_fingerprint) {
    return Mismatch("model_fingerprint", ToHex(local.model_fingerprint).substr(0, 16),
                    ToHex(peer.model_fingerprint).substr(0, 16));
  }
  if (local.kv_dtype != peer.kv_dtype) {
    return Mismatch("kv_dtype", DtypeName(local.kv_dtype), DtypeName(peer.kv_dtype));
  }
  auto num = [](int v) { return std::to_string(v); };
  if (local.block_tokens != peer.block_tokens) {
    return Mismatch("block_tokens", num(local.block_tokens), num(peer.block_tokens));
  }
  if (local.layers != peer.layers) return Mismatch("layers", num(local.layers), num(peer.layers));
  if (local.kv_heads != peer.kv_heads) {
    return Mismatch("kv_heads", num(local.kv_heads), num(peer.kv_heads));
  }
  if (local.head_dim != peer.head_dim) {
    return Mismatch("head_dim", num(local.head_dim), num(peer.head_dim));
  }
  if (options.require_same_tp && local.tp_size != peer.tp_size) {
    return Mismatch("tp_size", num(local.tp_size), num(peer.tp_size));
  }
  return Status::Ok();
}

void ToProto(const PeerConfig& c, proto::PeerConfig* out) {
  out->set_model_fingerprint(c.model_fingerprint.data(), c.model_fingerprint.size());
  out->set_kv_dtype(static_cast<proto::KvDtype>(static_cast<int>(c.kv_dtype) + 1));
  out->set_block_tokens(static_cast<uint32_t>(c.block_tokens));
  out->set_layers(static_cast<uint32_t>(c.layers));
  out->set_kv_heads(static_cast<uint32_t>(c.kv_heads));
  out->set_head_dim(static_cast<uint32_t>(c.head_dim));
  out->set_tp_size(static_cast<uint32_t>(c.tp_size));
  out->set_tp_rank(static_cast<uint32_t>(c.tp_rank));
  out->set_protocol_version(c.protocol_version);
}

Result<PeerConfig> FromProto(const proto::PeerConfig& m) {
  PeerConfig c;
  if (m.model_fingerprint().size() != c.model_fingerprint.size()) {
    return InvalidArgument("handshake: model_fingerprint has " +
                           std::to_string(m.model_fingerprint().size()) + " bytes, expected 32");
  }
  std::copy(m.model_fingerprint().begin(), m.model_fingerprint().end(),
            c.model_fingerprint.begin());
  int dtype = static_cast<int>(m.kv_dtype()) - 1;
  if (dtype < 0 || dtype > static_cast<int>(engine::KvDtype::kKivi2)) {
    return InvalidArgument("handshake: kv_dtype " + std::to_string(m.kv_dtype()) +
                           " is unset or unknown");
  }
  c.kv_dtype = static_cast<engine::KvDtype>(dtype);
  constexpr uint32_t kMax = 1u << 20;
  auto field = [&](const char* name, uint32_t v, int* dst) -> Status {
    if (v > kMax) return InvalidArgument(std::string("handshake: ") + name + " out of range");
    *dst = static_cast<int>(v);
    return Status::Ok();
  };
  RETURN_IF_ERROR(field("block_tokens", m.block_tokens(), &c.block_tokens));
  RETURN_IF_ERROR(field("layers", m.layers(), &c.layers));
  RETURN_IF_ERROR(field("kv_heads", m.kv_heads(), &c.kv_heads));
  RETURN_IF_ERROR(field("head_dim", m.head_dim(), &c.head_dim));
  RETURN_IF_ERROR(field("tp_size", m.tp_size(), &c.tp_size));
  RETURN_IF_ERROR(field("tp_rank", m.tp_rank(), &c.tp_rank));
  c.protocol_version = m.protocol_version();
  return c;
}

}  // namespace kvrelay::protocols
