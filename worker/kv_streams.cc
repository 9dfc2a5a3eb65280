#include "worker/kv_streams.h"

namespace kvrelay::worker {

kv_transfer::StreamSpec MakeStreamSpec(const engine::KvLayout& layout,
                                       const engine::ModelFingerprint& model, engine::RequestId id,
                                       int64_t segment, int64_t blocks,
                                       kv_transfer::HeadRange heads) {
  kv_transfer::StreamSpec spec;
  spec.request_id = id;
  spec.stream_id = static_cast<uint32_t>(segment);
  spec.layers = layout.layers;
  const BlockRange r = StreamSegment(blocks, segment);
  for (int64_t i = r.first; i < r.first + r.count; ++i) {
    spec.blocks.push_back(static_cast<engine::BlockId>(i));  // its position in the prompt
  }
  spec.global_heads = heads;
  spec.block_tokens = layout.block_tokens;
  spec.head_dim = layout.head_dim;
  spec.dtype = layout.dtype;
  spec.model_fingerprint = model;
  return spec;
}

kv_transfer::StreamBuffers MakeStreamBuffers(StreamSide side, engine::KvBlockPool* pool,
                                             const engine::KvCacheGroups& groups,
                                             std::span<const std::vector<engine::BlockId>> tables,
                                             BlockRange range, kv_transfer::HeadRange local,
                                             uint8_t* hole_layer) {
  const engine::KvLayout& layout = pool->layout();
  kv_transfer::StreamBuffers buffers;
  buffers.layout.kv_heads = layout.kv_heads;
  buffers.layout.slab_bytes = layout.SlabBytes();
  buffers.local_heads = local;
  // The stream only writes through a receiver's addresses; a sender's are
  // read (the bytes a KIVI sender seals later stay at the same address).
  auto address = [&](engine::BlockId b, int slot) {
    return side == StreamSide::kReceive ? pool->LayerData(b, slot).data()
                                        : const_cast<uint8_t*>(pool->LayerAddress(b, slot));
  };
  for (int64_t i = range.first; i < range.first + range.count; ++i) {
    buffers.block_layer0.push_back(address(tables[0][static_cast<size_t>(i)], 0));
  }
  for (int l = 0; l < groups.n_layers(); ++l) {
    const std::vector<engine::BlockId>& table = tables[static_cast<size_t>(groups.group_of[l])];
    for (int64_t i = range.first; i < range.first + range.count; ++i) {
      const engine::BlockId b = table[static_cast<size_t>(i)];
      buffers.layer_data.push_back(b == engine::kNoBlock && hole_layer != nullptr
                                       ? hole_layer
                                       : address(b, groups.slot_of[l]));
    }
  }
  return buffers;
}

Result<std::vector<std::unique_ptr<kv_transfer::LayerStreamReceiver>>> StartSegmentReceivers(
    kv_transfer::Transport* transport, int peer, engine::KvBlockPool* pool,
    const engine::KvCacheGroups& groups, const engine::ModelFingerprint& model,
    engine::RequestId id, std::span<const std::vector<engine::BlockId>> tables,
    kv_transfer::HeadRange own) {
  std::vector<std::unique_ptr<kv_transfer::LayerStreamReceiver>> receivers;
  engine::KvLayout layout = pool->layout();
  layout.layers = groups.n_layers();  // the stream carries every model layer
  const int64_t n = static_cast<int64_t>(tables[0].size());
  for (int64_t g = 0; g < StreamSegments(n); ++g) {
    const BlockRange r = StreamSegment(n, g);
    receivers.push_back(std::make_unique<kv_transfer::LayerStreamReceiver>(
        transport, peer, MakeStreamSpec(layout, model, id, g, n, own),
        MakeStreamBuffers(StreamSide::kReceive, pool, groups, tables, r, {0, own.size()})));
    RETURN_IF_ERROR(receivers.back()->Start());
  }
  return receivers;
}

void AbandonAllPeers(kv_transfer::Transport& t, const Status& why) {
  for (int peer = 0; peer < t.world_size(); ++peer) {
    if (peer != t.rank()) t.AbandonPeer(peer, why);
  }
}

}  // namespace kvrelay::worker
