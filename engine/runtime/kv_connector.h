// KvConnector: where the engine meets everything outside its own KV pool —
// disaggregation (a prefill role saving KV for a decode group, a decode role
// loading it) and the prefix tiers below the pool (host RAM, RocksDB).
//
// After vLLM's v1 KV connector, in two halves:
//  * admission side, called by the scheduler when a request enters the batch:
//    the prompt blocks the pool lacks but a lower tier holds are loaded
//    (LoadPrefix); and, for a request whose whole prompt KV is
//    computed elsewhere (RequestMode::kRemotePrompt), starting that load
//    (StartRemoteLoad) and reporting when it finished (PollRemoteLoads).
//    Loaded blocks belong to the request's block table from the moment they
//    are allocated, so nothing can evict them before the request runs.
//  * step side: SaveLayer after each layer's K/V of a step is in the pool
//    (layer-wise streaming of every prefill chunk), and RequestFinished, where
//    the connector may take over a finished request's prompt blocks (a
//    prefill stream that is still being sent).
//
// Threading: every method is called on the engine's owner thread, inside
// Engine::Submit, Engine::Step or Engine::Cancel. A connector must not call
// back into the engine from them.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "engine/kv_cache/block_table.h"
#include "engine/kv_cache/kv_cache.h"
#include "engine/kv_cache/kv_groups.h"
#include "engine/runtime/step_plan.h"

namespace kvrelay::engine {

struct RequestSpec;

struct TokenEvent;

class KvConnector {
 public:
  virtual ~KvConnector() = default;

  // --- admission side: prefix blocks from a lower tier ---
  // Every engine has N >= 1 KV cache groups (kv_groups.h; one group of every
  // layer for most models). `prefix.missing()` are the chain hashes of the
  // request's full blocks that follow the `prefix.first` ones the engine
  // holds from its pool: group 0's blocks [0, first) and each sliding-window
  // group's blocks from the window of min(first * B, n - 1) on. tables[g]
  // (empty, of the engine's pool) is group g's. The connector may grow the
  // hit to k blocks by appending to EVERY table the entries [first, k):
  // kNoBlock for a block of a sliding-window group before the window of the
  // next position the engine computes, min(k * B, n - 1)
  // (KvCacheGroups::DroppableBlocks; n = prefix.tokens size), else a block
  // holding that group's layers of those tokens (one reference each, the
  // table's). The engine commits them under their group keys
  // (GroupBlockHash; group 0's key is the chain hash itself) and they belong
  // to the request's tables from then on. Tables of unequal length, or a hole
  // where a block is needed, are refused (nothing is used); an error or a
  // shorter hit just means the rest is computed.
  virtual void LoadPrefix(const RequestSpec& /*request*/, const PrefixLookup& /*prefix*/,
                          const KvCacheGroups& /*groups*/, std::span<BlockTable> /*tables*/) {}

  // --- admission side: a prompt whose KV is computed elsewhere ---
  // Called by Engine::Submit for a kRemotePrompt request after it allocated
  // tables[g], group g's table of ceil(prompt / B) blocks, held by the
  // request until it ends (each block holds groups.layers_per_block() layers;
  // model layer l is layer groups.slot_of[l] of tables[groups.group_of[l]]).
  // The connector starts receiving the prompt's KV into them. An error fails
  // the Submit (the blocks go back).
  virtual Status StartRemoteLoad(const RequestSpec& /*request*/, const KvCacheGroups& /*groups*/,
                                 std::span<const std::vector<BlockId>> /*tables*/) {
    return FailedPrecondition("this engine's connector cannot load remote KV");
  }
  struct RemoteLoadDone {
    RequestId request = 0;
    Status status;             // not OK: the request fails with it
    int32_t first_token = -1;  // sampled by the prefill side; required when OK
  };
  // Loads finished since the last call (KV complete and verified, first token
  // known). Polled at the start of every Step while any load is pending.
  virtual std::vector<RemoteLoadDone> PollRemoteLoads() { return {}; }
  // The request was cancelled or is being dropped: stop writing its blocks.
  // When this returns, the connector never touches them again.
  virtual void CancelRemoteLoad(RequestId /*request*/) {}

  // --- step side ---
  // Layer `layer`'s K/V of every sequence in `plan` has been written, and
  // this step is done reading it: the connector may seal it (LayerData)
  // without changing what the step computes.
  virtual void SaveLayer(int /*layer*/, const StepPlan& /*plan*/) {}
  // A kPrefillOnly request finished (event `ev`, its first token sampled or
  // an error). `prompt_blocks` holds exactly the prompt's blocks; return true
  // after moving them out to keep them (e.g. until a KV stream is sent).
  virtual bool RequestFinished(const TokenEvent& /*ev*/, BlockTable& /*prompt_blocks*/) {
    return false;
  }
};

}  // namespace kvrelay::engine
