// Block codec: the self-describing, checksummed byte format of one full KV
// block in a lower tier (host RAM, RocksDB, files).
//
// Format (little-endian; all multi-byte fields unaligned):
//   fixed header, kFixedHeaderBytes = 136:
//     u32 magic 'KVRB' | u16 format version | u8 KvDtype | u8 flags (0)
//     u32 layers | u32 kv_heads | u32 head_dim | u32 block_tokens
//     u8[32] model fingerprint | u8[32] SHA-256(tenant salt) | u8[32] block chain hash
//     u64 payload length | u64 checksum
//   i32[block_tokens] the block's token ids
//   [format version 2 only] group extension, kGroupExtBytes = 24:
//     u32 group index | u32 groups in the pool | u32 group's window (0 = full)
//     | u32 0 | u64 Xxh3_64 of the group's model layer ids (i32 each)
//   i32[block_tokens] the block's token ids
//   payload: for each layer, KvBlockPool::LayerData(block, layer) (LayerBytes each)
// checksum = Xxh3_64(extension || tokens || payload, seed = Xxh3_64(fixed header
// bytes before the checksum field)), so it covers the whole header and the payload.
//
// Version 1 is a block of a one-group pool: every model layer (bytes
// unchanged since the format was introduced). Version 2 is one KV cache
// group's block of a grouped pool (engine/kv_cache/kv_groups.h): `layers` is
// the group's layer count and the extension says which group of which
// grouping it is, so a block of another group, of a one-group pool of the same
// model, or of another grouping is a kLayout miss, never KV loaded into the
// wrong layers.
//
// The payload is stored raw: KV values are high-entropy floats, and the tiers
// choose their own compression (RocksDbTier stores blobs uncompressed, see
// rocksdb_tier.h for why).
//
// In the disk tier every block is sealed (AES-256-GCM, block_seal.h) when the
// worker has a cluster key: the bytes above are the plaintext of that envelope.
//
// Decoding always takes the caller's expectations (model, layout, tenant,
// chain hash, tokens): a block is served only when every field matches and the
// checksum verifies. Anything else is a MISS with a reason, never an error the
// caller must handle and never KV that could be wrong.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/hash.h"
#include "common/status.h"
#include "engine/kv_cache/kv_cache.h"
#include "engine/kv_cache/kv_groups.h"

namespace kvrelay::kv_store {

using engine::BlockHash;
using engine::KvLayout;
using engine::ModelFingerprint;

inline constexpr uint32_t kBlockMagic = 0x4252564B;      // "KVRB" in little-endian byte order
inline constexpr uint16_t kBlockFormatVersion = 1;       // a one-group pool's block
inline constexpr uint16_t kGroupBlockFormatVersion = 2;  // one KV cache group's block
inline constexpr size_t kFixedHeaderBytes = 136;
inline constexpr size_t kGroupExtBytes = 24;

// Which KV cache group of which grouping a block belongs to (format version 2).
// count == 0: a one-group pool's block (version 1, every layer).
struct BlockGroup {
  uint32_t index = 0;
  uint32_t count = 0;
  uint32_t window = 0;         // the group's sliding window, 0 = full attention
  uint64_t layers_digest = 0;  // Xxh3_64 of the group's model layer ids
  bool grouped() const { return count > 0; }
  bool operator==(const BlockGroup&) const = default;
};
// Group g of `groups`; a one-group BlockGroup{} when groups.size() == 1.
BlockGroup MakeBlockGroup(const engine::KvCacheGroups& groups, int g);

// SHA-256 of a tenant salt, as stored in block headers (the salt itself is
// never written to disk).
Sha256Digest TenantSaltHash(std::string_view tenant_salt);

// What a block is (when encoding) or must be (when decoding).
struct BlockMeta {
  ModelFingerprint model{};
  KvLayout layout;
  Sha256Digest tenant_salt_hash{};
  BlockHash hash{};
  std::vector<int32_t> tokens;  // exactly layout.block_tokens ids
  BlockGroup group;             // grouped(): layout.layers is the group's layer count
};

// Why a stored block was not served. kNone = verified and served.
enum class MissReason : uint8_t {
  kNone = 0,
  kNotFound,      // no tier held the hash
  kStorageError,  // the tier failed to read it (I/O error, storage-level corruption)
  kTruncated,     // shorter than its header says / sizes inconsistent
  kBadMagic,
  kBadVersion,
  kChecksum,  // bytes damaged
  kModel,     // computed with other weights
  kLayout,    // other layers / heads / head_dim / dtype / block size
  kTenant,    // another tenant's block (salt hash differs)
  kHash,      // header's chain hash is not the key looked up
  kTokens,    // token ids differ (hash collision or a wrong key)
  kExpired,   // older than the tier's TTL
  kAuth,      // a sealed block failed authentication (block_seal.h): another
              // cluster key or tenant, moved to another key, or tampered
  kUnsealed,  // a plaintext block where a sealed one is required (written
              // before sealing, or by a process without a cluster key)
  kCount,     // number of reasons (array size)
};
std::string_view MissReasonName(MissReason r);

// Encodes one block whose per-layer bytes are `layers` (layers.size() ==
// meta.layout.layers, each LayerBytes() long). InvalidArgument on a shape mismatch.
Result<std::string> EncodeBlock(const BlockMeta& meta,
                                std::span<const std::span<const uint8_t>> layers);
// Same, reading the layers of `block` from `pool` (whose layout must equal meta.layout).
Result<std::string> EncodeBlock(const BlockMeta& meta, const engine::KvBlockPool& pool,
                                engine::BlockId block);

struct DecodedBlock {
  MissReason reason = MissReason::kNone;
  // The verified payload (all layers back to back), pointing into the encoded
  // buffer: valid while that buffer lives and is not modified. Empty on a miss.
  std::span<const uint8_t> payload;
  bool ok() const { return reason == MissReason::kNone; }
  // Bytes of layer `layer` (payload must be non-empty).
  std::span<const uint8_t> Layer(const KvLayout& layout, int layer) const {
    return payload.subspan(static_cast<size_t>(layer * layout.LayerBytes()),
                           static_cast<size_t>(layout.LayerBytes()));
  }
};

// Where the payload of an encoded block of `layout` starts, and its total size
// (`grouped`: a format version 2 block, with the group extension).
inline size_t EncodedPayloadOffset(const KvLayout& layout, bool grouped = false) {
  return kFixedHeaderBytes + (grouped ? kGroupExtBytes : 0) +
         static_cast<size_t>(layout.block_tokens) * sizeof(int32_t);
}
inline size_t EncodedBlockBytes(const KvLayout& layout, bool grouped = false) {
  return EncodedPayloadOffset(layout, grouped) + static_cast<size_t>(layout.BlockBytes());
}

// The tenant salt hash in an encoded block's header, unverified (the caller
// decodes later); false when `encoded` is too short or not a block.
bool PeekTenantSaltHash(std::string_view encoded, Sha256Digest* out);

// Verifies `encoded` against `expected` and returns its payload or the reason
// it must not be used. Never reads outside `encoded`; never throws.
DecodedBlock DecodeBlock(std::string_view encoded, const BlockMeta& expected);

// DecodeBlock for an encoded block held in pieces: `head` is its bytes before
// the payload (EncodedPayloadOffset of them: header, group extension, token
// ids) and `payload` the payload's parts in order (e.g. the pool's layers of
// a block a restore decrypted in place). The same checks and reasons.
MissReason VerifyBlock(std::string_view head, std::span<const std::span<const uint8_t>> payload,
                       const BlockMeta& expected);

}  // namespace kvrelay::kv_store
