#include "kv_store/block_codec.h"

#include <bit>
#include <cstring>

namespace kvrelay::kv_store {
namespace {

static_assert(std::endian::native == std::endian::little,
              "block codec writes host-order integers and assumes little-endian hosts");

// Offsets inside the fixed header.
constexpr size_t kOffMagic = 0;
constexpr size_t kOffVersion = 4;
constexpr size_t kOffDtype = 6;
constexpr size_t kOffFlags = 7;
constexpr size_t kOffLayers = 8;
constexpr size_t kOffKvHeads = 12;
constexpr size_t kOffHeadDim = 16;
constexpr size_t kOffBlockTokens = 20;
constexpr size_t kOffModel = 24;
constexpr size_t kOffSalt = 56;
constexpr size_t kOffHash = 88;
constexpr size_t kOffPayloadLen = 120;
constexpr size_t kOffChecksum = 128;
static_assert(kOffChecksum + 8 == kFixedHeaderBytes);

// Tokens per block accepted when decoding: bounds the work done on a header
// that lies about its size.
constexpr uint32_t kMaxBlockTokens = 1u << 16;

template <typename T>
void Store(char* base, size_t off, T v) {
  std::memcpy(base + off, &v, sizeof(T));
}
template <typename T>
T Load(const char* base, size_t off) {
  T v;
  std::memcpy(&v, base + off, sizeof(T));
  return v;
}

// Offsets inside the group extension (format version 2), from its start.
constexpr size_t kOffGroupIndex = 0;
constexpr size_t kOffGroupCount = 4;
constexpr size_t kOffGroupWindow = 8;
constexpr size_t kOffGroupZero = 12;
constexpr size_t kOffGroupLayers = 16;
static_assert(kOffGroupLayers + 8 == kGroupExtBytes);

uint64_t Checksum(const char* data, size_t size) {
  const uint64_t header_sum = Xxh3_64(data, kOffChecksum);
  return Xxh3_64(data + kFixedHeaderBytes, size - kFixedHeaderBytes, header_sum);
}

}  // namespace

BlockGroup MakeBlockGroup(const engine::KvCacheGroups& groups, int g) {
  if (groups.size() <= 1 || g < 0 || g >= groups.size()) return BlockGroup{};
  const std::vector<int>& layers = groups.layers[static_cast<size_t>(g)];
  std::vector<int32_t> ids(layers.begin(), layers.end());
  BlockGroup out;
  out.index = static_cast<uint32_t>(g);
  out.count = static_cast<uint32_t>(groups.size());
  out.window = static_cast<uint32_t>(groups.window[static_cast<size_t>(g)]);
  out.layers_digest = Xxh3_64(ids.data(), ids.size() * sizeof(int32_t));
  return out;
}

Sha256Digest TenantSaltHash(std::string_view tenant_salt) {
  return Sha256::Of(tenant_salt.data(), tenant_salt.size());
}

std::string_view MissReasonName(MissReason r) {
  switch (r) {
    case MissReason::kNone:
      return "none";
    case MissReason::kNotFound:
      return "not_found";
    case MissReason::kStorageError:
      return "storage_error";
    case MissReason::kTruncated:
      return "truncated";
    case MissReason::kBadMagic:
      return "bad_magic";
    case MissReason::kBadVersion:
      return "bad_version";
    case MissReason::kChecksum:
      return "checksum";
    case MissReason::kModel:
      return "model";
    case MissReason::kLayout:
      return "layout";
    case MissReason::kTenant:
      return "tenant";
    case MissReason::kHash:
      return "hash";
    case MissReason::kTokens:
      return "tokens";
    case MissReason::kExpired:
      return "expired";
    case MissReason::kAuth:
      return "auth";
    case MissReason::kUnsealed:
      return "unsealed";
    case MissReason::kCount:
      break;
  }
  return "unknown";
}

Result<std::string> EncodeBlock(const BlockMeta& meta,
                                std::span<const std::span<const uint8_t>> layers) {
  const KvLayout& l = meta.layout;
  if (l.layers <= 0 || l.kv_heads <= 0 || l.head_dim <= 0 || l.block_tokens <= 0) {
    return InvalidArgument("EncodeBlock: layout has a non-positive dimension");
  }
  if (static_cast<int>(meta.tokens.size()) != l.block_tokens) {
    return InvalidArgument("EncodeBlock: " + std::to_string(meta.tokens.size()) +
                           " token ids for a block of " + std::to_string(l.block_tokens));
  }
  if (static_cast<int>(layers.size()) != l.layers) {
    return InvalidArgument("EncodeBlock: " + std::to_string(layers.size()) + " layer buffers for " +
                           std::to_string(l.layers) + " layers");
  }
  const size_t layer_bytes = static_cast<size_t>(l.LayerBytes());
  for (size_t i = 0; i < layers.size(); ++i) {
    if (layers[i].size() != layer_bytes) {
      return InvalidArgument("EncodeBlock: layer " + std::to_string(i) + " has " +
                             std::to_string(layers[i].size()) + " bytes, expected " +
                             std::to_string(layer_bytes));
    }
  }
  const bool grouped = meta.group.grouped();
  const size_t ext = grouped ? kGroupExtBytes : 0;
  const size_t token_bytes = meta.tokens.size() * sizeof(int32_t);
  const size_t payload_bytes = layer_bytes * layers.size();
  std::string out(kFixedHeaderBytes + ext + token_bytes + payload_bytes, '\0');
  char* p = out.data();
  Store<uint32_t>(p, kOffMagic, kBlockMagic);
  Store<uint16_t>(p, kOffVersion, grouped ? kGroupBlockFormatVersion : kBlockFormatVersion);
  Store<uint8_t>(p, kOffDtype, static_cast<uint8_t>(l.dtype));
  Store<uint8_t>(p, kOffFlags, 0);
  Store<uint32_t>(p, kOffLayers, static_cast<uint32_t>(l.layers));
  Store<uint32_t>(p, kOffKvHeads, static_cast<uint32_t>(l.kv_heads));
  Store<uint32_t>(p, kOffHeadDim, static_cast<uint32_t>(l.head_dim));
  Store<uint32_t>(p, kOffBlockTokens, static_cast<uint32_t>(l.block_tokens));
  std::memcpy(p + kOffModel, meta.model.data(), 32);
  std::memcpy(p + kOffSalt, meta.tenant_salt_hash.data(), 32);
  std::memcpy(p + kOffHash, meta.hash.data(), 32);
  Store<uint64_t>(p, kOffPayloadLen, payload_bytes);
  if (grouped) {
    char* e = p + kFixedHeaderBytes;
    Store<uint32_t>(e, kOffGroupIndex, meta.group.index);
    Store<uint32_t>(e, kOffGroupCount, meta.group.count);
    Store<uint32_t>(e, kOffGroupWindow, meta.group.window);
    Store<uint32_t>(e, kOffGroupZero, 0);
    Store<uint64_t>(e, kOffGroupLayers, meta.group.layers_digest);
  }
  std::memcpy(p + kFixedHeaderBytes + ext, meta.tokens.data(), token_bytes);
  char* payload = p + kFixedHeaderBytes + ext + token_bytes;
  for (size_t i = 0; i < layers.size(); ++i) {
    std::memcpy(payload + i * layer_bytes, layers[i].data(), layer_bytes);
  }
  Store<uint64_t>(p, kOffChecksum, Checksum(p, out.size()));
  return out;
}

Result<std::string> EncodeBlock(const BlockMeta& meta, const engine::KvBlockPool& pool,
                                engine::BlockId block) {
  if (!(pool.layout() == meta.layout)) {
    return InvalidArgument("EncodeBlock: pool layout differs from the block meta layout");
  }
  std::vector<std::span<const uint8_t>> layers;
  layers.reserve(static_cast<size_t>(meta.layout.layers));
  for (int i = 0; i < meta.layout.layers; ++i) layers.push_back(pool.LayerData(block, i));
  return EncodeBlock(meta, layers);
}

bool PeekTenantSaltHash(std::string_view encoded, Sha256Digest* out) {
  if (encoded.size() < kFixedHeaderBytes) return false;
  if (Load<uint32_t>(encoded.data(), kOffMagic) != kBlockMagic) return false;
  std::memcpy(out->data(), encoded.data() + kOffSalt, out->size());
  return true;
}

MissReason VerifyBlock(std::string_view head, std::span<const std::span<const uint8_t>> payload,
                       const BlockMeta& expected) {
  const char* p = head.data();
  if (head.size() < kFixedHeaderBytes) return MissReason::kTruncated;
  if (Load<uint32_t>(p, kOffMagic) != kBlockMagic) return MissReason::kBadMagic;
  const uint16_t version = Load<uint16_t>(p, kOffVersion);
  if (version != kBlockFormatVersion && version != kGroupBlockFormatVersion) {
    return MissReason::kBadVersion;
  }
  const size_t ext = version == kGroupBlockFormatVersion ? kGroupExtBytes : 0;
  const uint32_t block_tokens = Load<uint32_t>(p, kOffBlockTokens);
  const uint64_t payload_len = Load<uint64_t>(p, kOffPayloadLen);
  if (block_tokens > kMaxBlockTokens) return MissReason::kTruncated;
  const uint64_t token_bytes = uint64_t{block_tokens} * sizeof(int32_t);
  uint64_t payload_bytes = 0;
  for (std::span<const uint8_t> part : payload) payload_bytes += part.size();
  if (head.size() != kFixedHeaderBytes + ext + token_bytes || payload_len != payload_bytes) {
    return MissReason::kTruncated;
  }
  Xxh3Stream sum(Xxh3_64(p, kOffChecksum));
  sum.Update(p + kFixedHeaderBytes, head.size() - kFixedHeaderBytes);
  for (std::span<const uint8_t> part : payload) sum.Update(part.data(), part.size());
  if (Load<uint64_t>(p, kOffChecksum) != sum.Digest()) return MissReason::kChecksum;
  // The bytes are what the writer wrote; now check they are what we want.
  if (std::memcmp(p + kOffModel, expected.model.data(), 32) != 0) return MissReason::kModel;
  const KvLayout& l = expected.layout;
  if (Load<uint8_t>(p, kOffDtype) != static_cast<uint8_t>(l.dtype) ||
      Load<uint8_t>(p, kOffFlags) != 0 ||
      Load<uint32_t>(p, kOffLayers) != static_cast<uint32_t>(l.layers) ||
      Load<uint32_t>(p, kOffKvHeads) != static_cast<uint32_t>(l.kv_heads) ||
      Load<uint32_t>(p, kOffHeadDim) != static_cast<uint32_t>(l.head_dim) ||
      block_tokens != static_cast<uint32_t>(l.block_tokens) ||
      payload_len != static_cast<uint64_t>(l.BlockBytes())) {
    return MissReason::kLayout;
  }
  // A one-group block where a group's is wanted (or the reverse), or another
  // group / grouping: its layers are not the ones the caller would fill.
  if ((ext != 0) != expected.group.grouped()) return MissReason::kLayout;
  if (ext != 0) {
    const char* e = p + kFixedHeaderBytes;
    BlockGroup got;
    got.index = Load<uint32_t>(e, kOffGroupIndex);
    got.count = Load<uint32_t>(e, kOffGroupCount);
    got.window = Load<uint32_t>(e, kOffGroupWindow);
    got.layers_digest = Load<uint64_t>(e, kOffGroupLayers);
    if (!(got == expected.group) || Load<uint32_t>(e, kOffGroupZero) != 0) {
      return MissReason::kLayout;
    }
  }
  if (std::memcmp(p + kOffSalt, expected.tenant_salt_hash.data(), 32) != 0) {
    return MissReason::kTenant;
  }
  if (std::memcmp(p + kOffHash, expected.hash.data(), 32) != 0) return MissReason::kHash;
  if (expected.tokens.size() != block_tokens ||
      std::memcmp(p + kFixedHeaderBytes + ext, expected.tokens.data(), token_bytes) != 0) {
    return MissReason::kTokens;
  }
  return MissReason::kNone;
}

DecodedBlock DecodeBlock(std::string_view encoded, const BlockMeta& expected) {
  DecodedBlock out;
  // Where the payload starts, from the header (VerifyBlock checks the rest).
  const char* p = encoded.data();
  size_t head = kFixedHeaderBytes;
  if (encoded.size() >= kFixedHeaderBytes && Load<uint32_t>(p, kOffMagic) == kBlockMagic) {
    if (Load<uint16_t>(p, kOffVersion) == kGroupBlockFormatVersion) head += kGroupExtBytes;
    head += uint64_t{std::min(Load<uint32_t>(p, kOffBlockTokens), kMaxBlockTokens + 1)} *
            sizeof(int32_t);
  }
  if (head > encoded.size()) head = encoded.size();  // VerifyBlock says kTruncated
  const auto payload = std::span<const uint8_t>(
      reinterpret_cast<const uint8_t*>(encoded.data() + head), encoded.size() - head);
  out.reason = VerifyBlock(encoded.substr(0, head), std::span(&payload, 1), expected);
  if (out.ok()) out.payload = payload;
  return out;
}

}  // namespace kvrelay::kv_store
