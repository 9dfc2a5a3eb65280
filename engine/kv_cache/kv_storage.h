// KvStorage: the bytes half of the paged KV cache — one slab array per block
// in the KvLayout's encoding (kv_codec.h), with KIVI's f32 staging of
// partially written layers. It knows nothing of references, hashes or
// eviction: the BlockManager (block_manager.h) decides which blocks are live,
// and KvBlockPool (kv_cache.h) tells the storage when a block is forgotten
// (freed or reallocated) and when it is about to be committed.
//
// HostKvStorage (CreateHost) keeps every block in host memory; a device
// storage keeps them in the accelerator's memory behind the same calls.
// Thread-compatible, as KvBlockPool: the const reads may be fanned out while
// the owner makes no other call.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "engine/kv_cache/kv_cache.h"

namespace kvrelay::engine {

class KvStorage {
 public:
  virtual ~KvStorage() = default;

  // `blocks` blocks of `layout`; KIVI dtypes get `staging_slots` f32 staging
  // slots of one layer of one block each (ignored for other dtypes).
  static std::unique_ptr<KvStorage> CreateHost(const KvLayout& layout, int64_t blocks,
                                               int64_t staging_slots);

  virtual const KvLayout& layout() const = 0;
  // KIVI: free staging slots (0 for other dtypes).
  virtual int64_t staging_slots_free() const = 0;

  // The block's contents are no longer wanted (it was freed or reallocated):
  // KIVI returns its staging slots and forgets what was written.
  virtual void Forget(BlockId id) = 0;
  // Every layer of the block holds its final bytes (KIVI quantizes staged
  // layers): called before the block is committed to the prefix cache.
  virtual void Seal(BlockId id) = 0;

  // The calls of KvBlockPool's "data" section, same contracts.
  virtual void WriteToken(BlockId id, int layer, int offset, const float* k, const float* v) = 0;
  virtual void ReadHead(BlockId id, int layer, int head, int n, float* k, float* v) const = 0;
  virtual const float* HeadSlabF32(BlockId id, int layer, bool value, int head) const = 0;
  virtual std::span<uint8_t> LayerData(BlockId id, int layer) = 0;
  virtual std::span<const uint8_t> LayerData(BlockId id, int layer) const = 0;
  virtual const uint8_t* LayerAddress(BlockId id, int layer) const = 0;
  virtual void CopyBlock(BlockId src, BlockId dst) = 0;
};

}  // namespace kvrelay::engine
