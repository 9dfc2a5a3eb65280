// One request's prompt KV as a layer stream (kv_transfer/layer_stream.h):
// what the prefill sender and the decode receiver agree on, and where the
// blocks of that stream live in a pool. Shared by the prefill role (save
// side), the decode role and its TP followers (load side).
#pragma once

#include <span>

#include "engine/kv_cache/kv_cache.h"
#include "engine/runtime/step_plan.h"
#include "kv_transfer/head_sharding.h"
#include "kv_transfer/layer_stream.h"

namespace kvrelay::worker {

// The stream of request `id` into the decode side's blocks `dst`, carrying
// the model KV heads `heads`.
kv_transfer::StreamSpec MakeStreamSpec(const engine::KvLayout& layout,
                                       const engine::ModelFingerprint& model, engine::RequestId id,
                                       std::span<const engine::BlockId> dst,
                                       kv_transfer::HeadRange heads);

// Where `blocks` live in `pool`; `local` = the stream's heads within the
// pool's own head set.
kv_transfer::StreamBuffers MakeStreamBuffers(engine::KvBlockPool* pool,
                                             std::span<const engine::BlockId> blocks,
                                             kv_transfer::HeadRange local);

}  // namespace kvrelay::worker
