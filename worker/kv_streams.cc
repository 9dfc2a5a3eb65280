#include "worker/kv_streams.h"

namespace kvrelay::worker {

kv_transfer::StreamSpec MakeStreamSpec(const engine::KvLayout& layout,
                                       const engine::ModelFingerprint& model, engine::RequestId id,
                                       std::span<const engine::BlockId> dst,
                                       kv_transfer::HeadRange heads) {
  kv_transfer::StreamSpec spec;
  spec.request_id = id;
  spec.layers = layout.layers;
  spec.dst_blocks.assign(dst.begin(), dst.end());
  spec.global_heads = heads;
  spec.block_tokens = layout.block_tokens;
  spec.head_dim = layout.head_dim;
  spec.dtype = layout.dtype;
  spec.model_fingerprint = model;
  return spec;
}

kv_transfer::StreamBuffers MakeStreamBuffers(engine::KvBlockPool* pool,
                                             std::span<const engine::BlockId> blocks,
                                             kv_transfer::HeadRange local) {
  const engine::KvLayout& layout = pool->layout();
  kv_transfer::StreamBuffers buffers;
  buffers.layout.kv_heads = layout.kv_heads;
  buffers.layout.slab_bytes = layout.SlabBytes();
  buffers.local_heads = local;
  for (engine::BlockId b : blocks) buffers.block_layer0.push_back(pool->LayerData(b, 0).data());
  if (layout.layers > 1 && !blocks.empty()) {
    // Layers of one block are a fixed stride apart in the pool.
    buffers.layer_stride = pool->LayerData(blocks[0], 1).data() - buffers.block_layer0[0];
  }
  return buffers;
}

}  // namespace kvrelay::worker
