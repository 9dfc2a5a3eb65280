// The CPU kernel table (step_kernels.h): engine/kernels/ on host buffers and
// the host KvBlockPool, on the engine's thread pool. Its arithmetic is
// llama.cpp's (docs/ENGINE_NUMERICS.md): the forward pass over this table is
// bit-identical to llama.cpp's CPU backend.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "common/thread_pool.h"
#include "engine/kv_cache/kv_cache.h"
#include "engine/kv_cache/kv_groups.h"
#include "engine/runtime/model.h"
#include "engine/runtime/step_kernels.h"

namespace kvrelay::engine {

class CpuKernels final : public StepKernels {
 public:
  // `model`, `pool` and `threads` must outlive the table; threads may be null.
  CpuKernels(const Model& model, KvBlockPool* pool, KvCacheGroups groups, ThreadPool* threads);

  Status RunStep(std::span<const SeqStep> seqs, const StepShape& shape,
                 std::span<const int64_t> logit_rows, std::span<const BackendPick> picks,
                 ForwardOutput* out, const std::function<void(int layer)>& layer_hook,
                 const std::function<Status()>& body) override;
  Status Embed(float scale) override;
  Status RmsNorm(int layer, LayerNorm which, Act in, Act out) override;
  Status ProjectQkv(int layer) override;
  Status QkNorm(int layer) override;
  Status RopeWriteKv(int layer, float rope_base, float q_scale) override;
  Status Attend(int layer, int window, float scale) override;
  Status LayerDone(int layer) override;
  Status Project(int layer, LayerMatrix which, Act in, Act out, bool accumulate) override;
  Status ProjectGateUp(int layer) override;
  Status GatedActivation(ModelConfig::FfnAct act) override;
  Status Add(Act dst, Act src) override;
  Status AllReduce(Act a) override;
  Status GatherColumns(Act local, const std::vector<UnitRange>& widths) override;
  Status FinalNorm() override;
  Status Logits(float softcap) override;
  void SetCollective(TpCollective* collective) override { collective_ = collective; }
  void InvalidateBlock(BlockId) override {}

  // Attention of the rows that are not split over the context: in tiles
  // (default; the query heads of one KV head and up to kTileRows / group new
  // tokens walk each chunk of K and V once, ops.h AttendTileGgml) or row by
  // row (AttendRowGgml, each row reading the whole K and V). Same bits either
  // way; the switch exists so tests and benchmarks can compare the two.
  void set_tiled_attention(bool on) { tiled_attention_ = on; }

 private:
  std::vector<float>& Buf(Act a);
  // q's block table of the group that holds model layer `layer`.
  const std::vector<BlockId>& TableOf(const SeqStep& q, int layer) const {
    const int g = groups_.group_of[layer];
    return g == 0 ? q.blocks : q.group_blocks[static_cast<size_t>(g - 1)];
  }

  const Model& model_;
  KvBlockPool* pool_;
  KvCacheGroups groups_;
  ThreadPool* threads_;
  TpCollective* collective_ = nullptr;
  bool tiled_attention_ = true;

  // The step RunStep is running.
  std::span<const SeqStep> seqs_;
  std::span<const int64_t> rows_;
  ForwardOutput* out_ = nullptr;
  const std::function<void(int)>* hook_ = nullptr;
  int64_t T_ = 0;

  // Scratch, sized per step.
  std::vector<float> x_, xn_, q_, k_, v_, attn_, proj_, gate_, up_, full_, gathered_, acc_;
  std::vector<float> kv_scratch_;          // decoded K then V per (seq, kv head), non-f32 pools
  std::vector<const float*> kptr_, vptr_;  // per (seq, kv head, block): K / V rows
  std::vector<int64_t> tok_seq_;           // per token: sequence index
  std::vector<int64_t> tok_pos_;           // per token: position
};

// y = x / rms(x) * w over n floats (llama.cpp's arithmetic).
void RmsNorm(const float* x, const float* w, int n, float eps, float* y);

}  // namespace kvrelay::engine
