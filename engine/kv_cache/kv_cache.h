// Paged KV cache: a fixed budget of KV memory split into blocks of B tokens,
// shared by many sequences through block tables, with a prefix cache.
//
// THIS HEADER IS A CONTRACT shared by engine/forward (reads/writes KV),
// kv_transfer (moves encoded layer slabs), kv_store (spills/restores full
// blocks) and the workers. Extend it; do not change the meaning of what is here
// without updating every user.
//
// Memory layout of one block: for each layer, K for every kv head then V for
// every kv head; each (layer, K|V, head) is one "slab" of SlabBytes() bytes
// holding block_tokens x head_dim values in the pool's KvDtype (plus scales
// for int8 / KIVI). Head-major slabs make head sharding a contiguous slice.
// The byte format of a slab per dtype, and its error bound, is specified in
// engine/kv_cache/kv_codec.h.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvrelay::engine {

enum class KvDtype : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2, kInt8 = 3, kKivi4 = 4, kKivi2 = 5 };

// The KV dtype of every component that does not say otherwise (coordinator,
// workers, launchers, manifests): peers must agree at the handshake.
inline constexpr KvDtype kDefaultKvDtype = KvDtype::kF32;
std::string_view KvDtypeName(KvDtype d);  // "f32", "f16", "bf16", "int8", "kivi4", "kivi2"
Result<KvDtype> ParseKvDtype(std::string_view name);

struct KvLayout {
  int layers = 0;
  int kv_heads = 0;
  int head_dim = 0;
  int block_tokens = 16;
  KvDtype dtype = KvDtype::kF32;

  // Bytes of one (layer, K|V, head) slab of a block, scales included.
  int64_t SlabBytes() const;
  // Bytes of one layer of one block: 2 * kv_heads * SlabBytes().
  int64_t LayerBytes() const { return 2 * static_cast<int64_t>(kv_heads) * SlabBytes(); }
  int64_t BlockBytes() const { return static_cast<int64_t>(layers) * LayerBytes(); }
  // 2 x layers x kv_heads x head_dim x bytes-per-element (scales amortised).
  double BytesPerToken() const { return static_cast<double>(BlockBytes()) / block_tokens; }
  bool operator==(const KvLayout&) const = default;
};

using BlockId = int32_t;
constexpr BlockId kNoBlock = -1;
using BlockHash = std::array<uint8_t, 32>;  // SHA-256 chain hash

// Identifies the model weights a KV block was computed with (SHA-256 of the
// architecture metadata and tensor table); part of every block hash.
using ModelFingerprint = std::array<uint8_t, 32>;

// Chain hash of a full block: SHA-256(parent || tokens || model || tenant salt).
// The first block's parent is all zeros. Exact bytes hashed: parent (32) ||
// uint32 LE token count || each token as int32 LE || model (32) || salt bytes
// (the count keeps blocks of different sizes from aliasing).
BlockHash HashBlock(const BlockHash& parent, std::span<const int32_t> tokens,
                    const ModelFingerprint& model, std::string_view tenant_salt);

// Hashes of every full block of `tokens` (tokens.size() / block_tokens of them).
std::vector<BlockHash> HashPrefixBlocks(std::span<const int32_t> tokens, int block_tokens,
                                        const ModelFingerprint& model,
                                        std::string_view tenant_salt);

// What the engine knows of a request's prefix when it asks a connector for
// missing blocks. The chain hashes are computed once, by the engine, and
// handed down: hashes[i] covers tokens[i * block_tokens, (i + 1) * block_tokens);
// blocks [0, first) are already in the pool.
struct PrefixLookup {
  std::span<const int32_t> tokens;
  std::span<const BlockHash> hashes;
  int64_t first = 0;
  int block_tokens = 0;
  std::span<const BlockHash> missing() const { return hashes.subspan(static_cast<size_t>(first)); }
};

struct KvEvent {
  enum class Kind { kStored, kEvicted } kind;
  BlockHash hash;
};

// The pool. Thread-compatible: one owner thread (the worker's scheduler) calls
// it; event and spill callbacks run on that thread. The const methods other
// than LayerData (ReadHead, HeadSlabF32, refcount, IsCached, counts) only read,
// so the owner may fan them out to worker threads while it makes no other call
// (the forward pass reads heads in parallel this way).
class KvBlockPool {
 public:
  struct Options {
    KvLayout layout;
    int64_t capacity_bytes = 256 << 20;  // total KV budget; blocks = capacity / BlockBytes
    // KIVI dtypes only: f32 staging for partially written blocks, carved out of
    // capacity_bytes (-1: capacity_bytes / 8). One staging slot holds one layer
    // of one block (2 * kv_heads * block_tokens * head_dim floats). When no slot
    // is free, writes re-quantize the layer in place (correct, less accurate).
    int64_t staging_bytes = -1;
  };
  static Result<std::unique_ptr<KvBlockPool>> Create(const Options& options);
  virtual ~KvBlockPool() = default;

  virtual const KvLayout& layout() const = 0;
  virtual int64_t total_blocks() const = 0;
  // Blocks with refcount 0 that are not in the prefix cache.
  virtual int64_t free_blocks() const = 0;
  // free_blocks() + unreferenced cached blocks (reclaimable by LRU eviction).
  virtual int64_t available_blocks() const = 0;

  // Takes a free block (evicting the least recently used unreferenced cached
  // block when none is free), refcount 1. ResourceExhausted when none can be had.
  virtual Result<BlockId> Allocate() = 0;
  virtual void Ref(BlockId id) = 0;
  // Drops one reference; at 0 a cached block stays in the prefix cache (LRU),
  // an uncached one returns to the free list.
  virtual void Release(BlockId id) = 0;
  virtual int refcount(BlockId id) const = 0;
  // KIVI pools: free f32 staging slots (0 for other dtypes). A slot is held by
  // a partially written layer until it is filled, flushed (LayerData/Commit)
  // or its block is freed.
  virtual int64_t staging_slots_free() const = 0;

  // --- data ---
  // Encodes one token's K and V (each kv_heads * head_dim floats) into slot
  // `offset` of the block for `layer`.
  virtual void WriteToken(BlockId id, int layer, int offset, const float* k, const float* v) = 0;
  // Decodes tokens [0, n) of one head of one layer into k and v ([n][head_dim] floats).
  virtual void ReadHead(BlockId id, int layer, int head, int n, float* k, float* v) const = 0;
  // kF32 pools only (nullptr otherwise): the slab of (layer, K if !value else V,
  // head) in place, block_tokens x head_dim floats, valid until the block is
  // freed. Lets attention read K/V without the copy ReadHead makes.
  virtual const float* HeadSlabF32(BlockId id, int layer, bool value, int head) const = 0;
  // Raw encoded bytes of one layer of a block (LayerBytes()), for transfer and
  // spill: K slabs of all heads, then V slabs of all heads.
  // KIVI pools: a layer is kept in f32 staging (exact values for ReadHead)
  // until its last slot (block_tokens - 1) is written, then quantized. Calling
  // LayerData on a staged layer first quantizes the rows written so far, so the
  // bytes are always a faithful encoding of what was written (a partial tail
  // block can be transferred like a full one); later writes into that layer
  // re-quantize it (slightly lossier than staging). Writing into the mutable
  // span of a freshly allocated block (import) makes those bytes the layer's
  // contents for all block_tokens rows.
  virtual std::span<uint8_t> LayerData(BlockId id, int layer) = 0;
  virtual std::span<const uint8_t> LayerData(BlockId id, int layer) const = 0;
  // Where LayerData(id, layer)'s bytes live, without flushing a KIVI layer's
  // staging or changing its state: for a sender that takes the addresses of
  // a whole segment up front and seals each layer (LayerData) only when it
  // sends it, after the steps that still write or read it staged.
  virtual const uint8_t* LayerAddress(BlockId id, int layer) const = 0;
  // Copies every layer of src into dst (copy-on-write).
  virtual void CopyBlock(BlockId src, BlockId dst) = 0;

  // --- prefix cache ---
  // Registers a full, complete block under `hash` (emits kStored). If another
  // block already holds this hash the call is a no-op.
  virtual void Commit(BlockId id, const BlockHash& hash) = 0;
  // Longest run of leading hashes present in the cache; each returned block is
  // Ref'ed for the caller and marked recently used.
  virtual std::vector<BlockId> MatchPrefix(std::span<const BlockHash> hashes) = 0;
  virtual bool IsCached(const BlockHash& hash) const = 0;
  // Called with (hash, block) just before an unreferenced cached block is
  // evicted, so a lower tier can copy it; then kEvicted is emitted.
  virtual void SetSpillHook(std::function<void(const BlockHash&, BlockId)> hook) = 0;
  virtual void SetEventListener(std::function<void(const KvEvent&)> listener) = 0;
  // Called with the block before every write to its bytes that does not go
  // through WriteToken: the mutable LayerData (an import, a KIVI flush) and
  // CopyBlock's destination. A device backend that mirrors the pool re-reads
  // such a block before it next uses it (ComputeBackend::InvalidateBlock).
  virtual void SetHostWriteHook(std::function<void(BlockId)> hook) = 0;
};

}  // namespace kvrelay::engine
