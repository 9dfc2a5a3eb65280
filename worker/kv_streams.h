// One request's prompt KV as a layer stream (kv_transfer/layer_stream.h):
// what the prefill sender and the decode receiver agree on, and where the
// blocks of that stream live in a pool. Shared by the prefill role (save
// side), the decode role and its TP followers (load side).
#pragma once

#include <algorithm>
#include <memory>
#include <span>
#include <vector>

#include "engine/kv_cache/kv_cache.h"
#include "engine/kv_cache/kv_groups.h"
#include "engine/runtime/step_plan.h"
#include "kv_transfer/head_sharding.h"
#include "kv_transfer/layer_stream.h"

namespace kvrelay::worker {

// A prompt's KV travels as one layer stream per SEGMENT of kStreamSegmentBlocks
// consecutive blocks (stream_id = segment index), so the prefill side can send
// a segment's layers as soon as the chunk that completes the segment has
// written them — every prefill chunk is streamed while later chunks compute,
// not only the prompt's last. Both sides derive the same segments from the
// block count alone.
inline constexpr int64_t kStreamSegmentBlocks = 32;
inline int64_t StreamSegments(int64_t blocks) {
  return (blocks + kStreamSegmentBlocks - 1) / kStreamSegmentBlocks;
}
// Blocks [first, first + count) of segment `g`.
struct BlockRange {
  int64_t first = 0;
  int64_t count = 0;
};
inline BlockRange StreamSegment(int64_t blocks, int64_t g) {
  const int64_t first = g * kStreamSegmentBlocks;
  return {first, std::min(kStreamSegmentBlocks, blocks - first)};
}

// Segment `segment`'s stream of request `id`, a prompt of `blocks` blocks,
// carrying the model KV heads `heads`. The stream names each block by its
// position in the prompt: the sender needs nothing from the receiver, which
// maps positions to the blocks it reserved (one hop, no block ids sent back).
kv_transfer::StreamSpec MakeStreamSpec(const engine::KvLayout& layout,
                                       const engine::ModelFingerprint& model, engine::RequestId id,
                                       int64_t segment, int64_t blocks,
                                       kv_transfer::HeadRange heads);

// Which end of a stream the buffers are for.
enum class StreamSide : uint8_t {
  // The sender takes the addresses only (KvBlockPool::LayerAddress) and must
  // seal each (block, layer) with LayerData before it sends that layer: a
  // KIVI layer still staged is quantized then, not before the steps that
  // write and read it staged are done (PrefillRole::SealLayer).
  kSend,
  // The receiver's blocks go through LayerData: a KIVI pool takes the bytes
  // that land as the layer's contents.
  kReceive,
};

// Where blocks [range.first, range.first + range.count) of a prompt live in
// `pool`, whose KV cache groups are `groups` (engine/kv_cache/kv_groups.h;
// one group of every layer for most models): the stream carries every model
// layer of each block, and model layer l of block i is layer
// groups.slot_of[l] of tables[groups.group_of[l]][i]. The streams name blocks
// by position, so the wire format does not depend on the grouping.
// `local` = the stream's heads within the pool's own head set.
// A sender whose sliding-window tables have holes (kNoBlock: a block the
// engine never held, wholly before every later query's window) passes
// `hole_layer`, zeros of one block layer (KvLayout::LayerBytes), read in
// place of each such entry. Without it every entry must name a block.
kv_transfer::StreamBuffers MakeStreamBuffers(StreamSide side, engine::KvBlockPool* pool,
                                             const engine::KvCacheGroups& groups,
                                             std::span<const std::vector<engine::BlockId>> tables,
                                             BlockRange range, kv_transfer::HeadRange local,
                                             uint8_t* hole_layer = nullptr);

// The receivers of every segment of a prompt's KV into `tables` (one per KV
// cache group, of equal length) of `pool` (this process's heads `own`), from
// data-plane peer `peer`, each Started.
Result<std::vector<std::unique_ptr<kv_transfer::LayerStreamReceiver>>> StartSegmentReceivers(
    kv_transfer::Transport* transport, int peer, engine::KvBlockPool* pool,
    const engine::KvCacheGroups& groups, const engine::ModelFingerprint& model,
    engine::RequestId id, std::span<const std::vector<engine::BlockId>> tables,
    kv_transfer::HeadRange own);

// Abandons every data-plane peer but this endpoint on `t` (their
// connections close; a later PeerRejoined or connect brings each back): a
// decode rank whose registration ended (Role::OnRegistrationEnded).
void AbandonAllPeers(kv_transfer::Transport& t, const Status& why);

}  // namespace kvrelay::worker
