// One step of the engine, as data: what the scheduler decided and what the
// runner (ForwardPass, a TP follower, the layer-wise KV streamer) executes.
//
// The scheduler (Engine::Step) builds a StepPlan; ForwardPass::Run executes
// its sequences; rank 0 of a tensor-parallel group publishes the same plan to
// its followers (decode_worker/, converted to protobuf only at that edge),
// and a KvConnector's save side sees the plan after each layer. There is one
// sequence-in-a-step type in the engine: SeqStep.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "engine/kv_cache/kv_cache.h"

namespace kvrelay::engine {

// Requests are named by number everywhere (coordinator, protocol, engine).
using RequestId = uint64_t;

// Which logit rows of a sequence the forward pass computes.
enum class LogitRows : uint8_t {
  kNone = 0,  // none (a prefill chunk that is not the prompt's last; TP followers)
  kLast = 1,  // the last new token's (sampling)
  kAll = 2,   // every new token's (perplexity, scoring)
};

// One sequence's part of a step: `tokens` are computed at positions
// cache_len, cache_len + 1, ...; their K/V are written to blocks[pos / B],
// slot pos % B, and attention reads every position <= the query's.
//
// With several KV cache groups (engine/kv_cache/kv_groups.h) `blocks` is
// group 0's table and group_blocks[g - 1] group g's, all indexed by pos / B
// and naming blocks of the same pool. A sliding-window group's entries wholly
// before the window of the first new token
// (KvCacheGroups::DroppableBlocks(g, cache_len, B)) may be kNoBlock. With one
// group `group_blocks` is empty.
struct SeqStep {
  RequestId request = 0;        // the engine request (0 for bare forward calls)
  std::vector<BlockId> blocks;  // covers at least cache_len + tokens.size() positions
  int64_t cache_len = 0;        // positions already in the KV cache
  std::vector<int32_t> tokens;  // new tokens (>= 1)
  LogitRows logits = LogitRows::kLast;
  std::vector<std::vector<BlockId>> group_blocks = {};  // groups 1.. only

  int64_t end() const { return cache_len + static_cast<int64_t>(tokens.size()); }
};

// A bare sequence step (benchmarks, tools, tests that drive ForwardPass).
inline SeqStep MakeSeqStep(std::span<const BlockId> blocks, int64_t cache_len,
                           std::span<const int32_t> tokens, LogitRows logits = LogitRows::kLast) {
  return SeqStep{
      0, {blocks.begin(), blocks.end()}, cache_len, {tokens.begin(), tokens.end()}, logits, {}};
}

// A copy-on-write of a shared block, done before the forward.
struct BlockCopy {
  BlockId src = 0;
  BlockId dst = 0;
};

// What one step does, in order: block copies, then one forward over `seqs`.
struct StepPlan {
  std::vector<BlockCopy> copies;
  std::vector<SeqStep> seqs;
};

// What a runner needs to size a step, once the step is known to be valid.
struct StepShape {
  int64_t tokens = 0;   // new tokens over all sequences
  int64_t max_len = 0;  // longest cache_len + tokens
};
// The runners' (ForwardPass, the CUDA backend) shared validation of a step
// against a pool of `total_blocks` blocks of `block_tokens` and a vocabulary:
// InvalidArgument naming the sequence and what is wrong (no tokens, a block
// table too short or naming a block outside the pool, a token out of vocab).
Result<StepShape> CheckStep(std::span<const SeqStep> seqs, int block_tokens, int64_t total_blocks,
                            int vocab);

}  // namespace kvrelay::engine
