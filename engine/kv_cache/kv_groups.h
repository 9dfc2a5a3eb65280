// KV cache groups: layers of one attention type share one block table per
// sequence (vLLM v1's hybrid KV cache manager), all drawn from ONE pool.
//
// A model whose layers all attend alike (every llama / qwen2 file, or a model
// with the same sliding window on every layer) has ONE group holding every
// layer: one block table, byte for byte what the engine always had.
// A model that mixes full-attention and sliding-window layers (gemma3 270M:
// 15 local layers with a 512-token window, 3 global) may be split: as in
// vLLM, every group holds the same number of layers P (the gcd of the two
// layer counts; 3 for gemma3 270M), so a pool block (P layers x B tokens)
// serves any group and the pool stays one shared budget:
//   full-attention groups  a sequence holds a block for every B tokens of
//                          its length;
//   sliding-window groups  a block wholly before the window of the
//                          sequence's next query (every position <
//                          next - window + 1) is never read again: the
//                          sequence drops it (its table entry becomes
//                          kNoBlock) and holds at most ceil(window / B) + 1
//                          blocks per group between steps.
// Every table is indexed by position / B: the blocks of all groups at one
// index hold the same tokens. Prefix-cache keys differ per group
// (GroupBlockHash) so the groups' blocks never alias in the pool's index.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "engine/kv_cache/kv_cache.h"

namespace kvrelay::engine {

struct KvCacheGroups {
  // layers[g]: the model layers of group g, ascending; every group has
  // layers_per_block() of them and block layer i of group g is model layer
  // layers[g][i]. Group 0 is a full-attention group.
  std::vector<std::vector<int>> layers;
  // Per group: 0 = full attention, else the sliding window in tokens.
  std::vector<int> window;
  // Per model layer: its group and its layer index inside that group's blocks.
  std::vector<int> group_of;
  std::vector<int> slot_of;

  int size() const { return static_cast<int>(layers.size()); }
  int n_layers() const { return static_cast<int>(group_of.size()); }
  int layers_per_block() const { return layers.empty() ? 0 : static_cast<int>(layers[0].size()); }
  bool sliding(int group) const { return window[static_cast<size_t>(group)] > 0; }
  int sliding_groups() const;

  // One group of every layer (windows ignored: attention still applies them).
  static KvCacheGroups One(int n_layers);
  // From each layer's window (0 = full attention): full-attention and
  // sliding-window groups when `split` and the layers mix full attention with
  // ONE sliding window; one group otherwise (a single attention type, or
  // several distinct windows).
  static KvCacheGroups FromLayerWindows(std::span<const int> windows, bool split);

  // Leading table entries of `group` that a step whose first new token is at
  // `next_pos` never reads: for a sliding-window group, the blocks wholly
  // before next_pos - window + 1; 0 for a full-attention group.
  int64_t DroppableBlocks(int group, int64_t next_pos, int block_tokens) const;
  // The most blocks one sequence of a sliding-window group holds during a
  // step of up to `step_tokens` new tokens (after dropping, before the step).
  int64_t WindowBlocksBound(int group, int64_t step_tokens, int block_tokens) const;
  std::string DebugString() const;
};

// The prefix-cache key of group g's block whose chain hash is `hash`: the
// hash itself for group 0 (one-group pools are keyed as always), else
// SHA-256(hash || "kv-group" || uint32 LE g).
BlockHash GroupBlockHash(const BlockHash& hash, int group);

}  // namespace kvrelay::engine
