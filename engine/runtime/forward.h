// One batched forward step of the transformer over many sequences that share
// a paged KV pool.
//
// Each sequence brings its block table, the number of tokens already in its KV
// (cache_len) and new tokens: a prefill chunk or one decode token. Positions of
// the new tokens are cache_len + i. Their K/V are written into the pool
// (blocks[pos / B], slot pos % B) and attention reads every position < =
// the query's through the block table (causal, GQA, sliding window when set).
//
// Not thread-safe: one ForwardPass per engine; it reuses scratch buffers
// between steps and runs its parallel loops on the given ThreadPool.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "common/status.h"
#include "common/thread_pool.h"
#include "engine/kv_cache/kv_cache.h"
#include "engine/kv_cache/kv_groups.h"
#include "engine/runtime/model.h"
#include "engine/runtime/step_plan.h"
#include "engine/runtime/tp_collective.h"

namespace kvrelay::engine {

struct ForwardOutput {
  // Logit rows (vocab floats each) for every requested position, sequences in
  // order; row_begin[s] is the first row of sequence s (row_begin.size() = n + 1).
  std::vector<float> logits;
  std::vector<int64_t> row_begin;
  const float* Row(int64_t r, int vocab) const { return logits.data() + r * vocab; }
};

class ForwardPass {
 public:
  // `model`, `pool` and `threads` must outlive the ForwardPass; threads may be null.
  ForwardPass(const Model& model, KvBlockPool* pool, ThreadPool* threads);
  // KV cache groups (kv_groups.h): the pool's blocks hold
  // groups.layers_per_block() layers; model layer l lives in layer
  // groups.slot_of[l] of the blocks of group groups.group_of[l]'s table
  // (SeqStep::blocks for group 0, SeqStep::group_blocks[g - 1] otherwise).
  // The constructor above is KvCacheGroups::One.
  ForwardPass(const Model& model, KvBlockPool* pool, KvCacheGroups groups, ThreadPool* threads);

  // Runs the step. `layer_hook` (may be empty) is called after layer l's K/V
  // of all sequences are written and this step's attention of layer l has
  // read them (it may seal the layer: KvBlockPool::LayerData). InvalidArgument for a bad sequence
  // (token out of vocab, block table too short, pool layout mismatch).
  Status Run(std::span<const SeqStep> seqs, ForwardOutput* out,
             const std::function<void(int layer)>& layer_hook = {});

  // Tensor parallelism: the model is a shard (model.h) and `collective` (which
  // must outlive this pass) joins its ranks, twice per layer. An error from
  // the collective aborts the step.
  void SetCollective(TpCollective* collective) { collective_ = collective; }

  // Attention of the rows that are not split over the context: in tiles
  // (default; the query heads of one KV head and up to kTileRows / group new
  // tokens walk each chunk of K and V once, ops.h AttendTileGgml) or row by
  // row (AttendRowGgml, each row reading the whole K and V). Same bits either
  // way; the switch exists so tests and benchmarks can compare the two.
  void set_tiled_attention(bool on) { tiled_attention_ = on; }

 private:
  void Attention(int layer, std::span<const SeqStep> seqs);
  // proj_ rows [0, T) := RmsNorm(proj_ row) * weight (gemma3's post-norms).
  void PostNorm(const std::vector<float>& weight, int64_t T);

  // q's block table of the group that holds model layer `layer`.
  const std::vector<BlockId>& TableOf(const SeqStep& q, int layer) const {
    const int g = groups_.group_of[layer];
    return g == 0 ? q.blocks : q.group_blocks[static_cast<size_t>(g - 1)];
  }
  Status CheckGroups(std::span<const SeqStep> seqs) const;

  const Model& model_;
  KvBlockPool* pool_;
  KvCacheGroups groups_;
  ThreadPool* threads_;
  // Concatenates every rank's [T x width_r] block of `local` into full
  // [T x sum width] rows of `out` (kExact mode).
  Status GatherColumns(const float* local, const std::vector<UnitRange>& widths, int64_t T,
                       std::vector<float>* out);

  TpCollective* collective_ = nullptr;
  bool tiled_attention_ = true;
  std::vector<UnitRange> q_cols_, ffn_cols_;  // per rank, kExact mode
  std::vector<float> gathered_, attn_full_, ffn_full_;
  // Scratch, sized per step.
  std::vector<float> x_, xn_, q_, k_, v_, attn_, proj_, gate_, up_;
  std::vector<float> kv_scratch_;          // decoded K then V per (seq, kv head), non-f32 pools
  std::vector<const float*> kptr_, vptr_;  // per (seq, kv head, block): K / V rows
  std::vector<int64_t> tok_seq_;           // per token: sequence index
  std::vector<int64_t> tok_pos_;           // per token: position
};

// y = x / rms(x) * w over n floats.
void RmsNorm(const float* x, const float* w, int n, float eps, float* y);

}  // namespace kvrelay::engine
