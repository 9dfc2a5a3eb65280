// One batched forward step of the transformer over many sequences that share
// a paged KV pool.
//
// Each sequence brings its block table, the number of tokens already in its KV
// (cache_len) and new tokens: a prefill chunk or one decode token. Positions of
// the new tokens are cache_len + i. Their K/V are written into the pool
// (blocks[pos / B], slot pos % B) and attention reads every position < =
// the query's through the block table (causal, GQA, sliding window when set).
//
// The model's structure is written here once, as calls into a backend's
// kernel table (step_kernels.h): the CPU table (cpu_kernels.h) by default,
// the CUDA table (engine/cuda/cuda_kernels.h) on a GPU.
//
// Not thread-safe: one ForwardPass per engine; its table reuses scratch
// buffers between steps.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "common/status.h"
#include "common/thread_pool.h"
#include "engine/kv_cache/kv_cache.h"
#include "engine/kv_cache/kv_groups.h"
#include "engine/runtime/cpu_kernels.h"
#include "engine/runtime/model.h"
#include "engine/runtime/step_kernels.h"
#include "engine/runtime/step_plan.h"
#include "engine/runtime/tp_collective.h"

namespace kvrelay::engine {

struct ForwardOutput {
  // Logit rows (vocab floats each) for every requested position, sequences in
  // order; row_begin[s] is the first row of sequence s (row_begin.size() = n + 1).
  std::vector<float> logits;
  std::vector<int64_t> row_begin;
  // The tokens the backend picked, one per logit row, when Run was given
  // picks (logits may then be empty).
  std::vector<int32_t> picked;
  const float* Row(int64_t r, int vocab) const { return logits.data() + r * vocab; }
};

class ForwardPass {
 public:
  // The CPU kernel table (cpu_kernels.h). `model`, `pool` and `threads` must
  // outlive the ForwardPass; threads may be null.
  ForwardPass(const Model& model, KvBlockPool* pool, ThreadPool* threads);
  // KV cache groups (kv_groups.h): the pool's blocks hold
  // groups.layers_per_block() layers; model layer l lives in layer
  // groups.slot_of[l] of the blocks of group groups.group_of[l]'s table
  // (SeqStep::blocks for group 0, SeqStep::group_blocks[g - 1] otherwise).
  // The constructor above is KvCacheGroups::One.
  ForwardPass(const Model& model, KvBlockPool* pool, KvCacheGroups groups, ThreadPool* threads);
  // Over any backend's kernel table, built for the same model, pool and groups.
  ForwardPass(const Model& model, KvBlockPool* pool, KvCacheGroups groups,
              std::unique_ptr<StepKernels> kernels);

  // Runs the step. `layer_hook` (may be empty) is called after layer l's K/V
  // of all sequences are written and this step's attention of layer l has
  // read them (it may seal the layer: KvBlockPool::LayerData). InvalidArgument for a bad sequence
  // (token out of vocab, block table too short, pool layout mismatch).
  // With `picks` (one per logit row, only when kernels().PicksTokens()) the
  // rows' tokens are picked by the backend into out->picked instead.
  Status Run(std::span<const SeqStep> seqs, ForwardOutput* out,
             const std::function<void(int layer)>& layer_hook = {},
             std::span<const BackendPick> picks = {});

  // Tensor parallelism: the model is a shard (model.h) and `collective` (which
  // must outlive this pass) joins its ranks, twice per layer. An error from
  // the collective aborts the step.
  void SetCollective(TpCollective* collective);

  // CPU table only (CpuKernels::set_tiled_attention); ignored otherwise.
  void set_tiled_attention(bool on);

  StepKernels& kernels() { return *kernels_; }
  const StepKernels& kernels() const { return *kernels_; }

 private:
  // The model's structure over the kernel table: every architecture, once.
  Status Layers();
  Status CheckGroups(std::span<const SeqStep> seqs) const;

  const Model& model_;
  KvBlockPool* pool_;
  KvCacheGroups groups_;
  std::unique_ptr<StepKernels> kernels_;
  CpuKernels* cpu_ = nullptr;  // kernels_ when it is the CPU table
  TpCollective* collective_ = nullptr;
  std::vector<UnitRange> q_cols_, ffn_cols_;  // per rank, kExact mode
};

}  // namespace kvrelay::engine
