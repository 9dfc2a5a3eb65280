// A compute backend's kernel table: the operations one forward step is made
// of, over activation buffers the backend owns (host vectors on the CPU,
// device memory on CUDA).
//
// The model's structure (which operation follows which, per architecture:
// Llama, Qwen2, Gemma 3 with its windows, norms and soft-capping) is written
// once, in ForwardPass::Run (forward.cc), as calls into this table. A backend
// says only how each operation runs and which ones it fuses: the CUDA table
// quantizes a product's input in the kernel that writes it and adds the
// output projection into the residual in the product itself; the CPU table
// keeps llama.cpp's arithmetic (bit-identical, docs/ENGINE_NUMERICS.md).
//
// Both tables are told the KV cache groups at construction, so RopeWriteKv
// and Attend find a layer's block table (the sequence's table of the layer's
// group) and its layer slot inside the blocks themselves.
//
// Not thread-safe: one owner thread, like ForwardPass.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "common/status.h"
#include "engine/runtime/model.h"
#include "engine/runtime/sampler.h"
#include "engine/runtime/step_plan.h"
#include "engine/runtime/tp_collective.h"

namespace kvrelay::engine {

struct ForwardOutput;

// The activation buffers of a step, T tokens (R logit rows).
enum class Act : uint8_t {
  kX,     // the residual stream [T][d_model]
  kXn,    // a product's normed input [T][d_model] (FinalNorm: [R][d_model])
  kAttn,  // attention output [T][q_dim]
  kProj,  // a product's output before the residual add [T][d_model]
  kFfn,   // the gated activation [T][ffn_dim]
  kFull,  // kExact tensor parallelism: a gathered full-width input
};

// The per-layer products whose output the forward pass places.
enum class LayerMatrix : uint8_t { kOut, kDown };

// The per-layer RMSNorm weights.
enum class LayerNorm : uint8_t { kAttn, kFfn, kPostAttn, kPostFfn };

class StepKernels {
 public:
  virtual ~StepKernels() = default;

  // Runs one validated step: lays out its inputs (tokens, positions, the
  // block tables of every group, the logit rows of `seqs`), then `body`
  // issues the operations below in model order. A backend may run body
  // directly or replay a capture of an earlier body of the same step shape
  // without calling it (CUDA graphs), so body must issue the same
  // operations for the same shape. On return the logit rows are in `out`
  // (out->row_begin is filled by the caller) and layer_hook (may be empty)
  // has been called once per layer, in layer order, each call after that
  // layer's K/V of every sequence is readable in the host pool. With
  // `picks` (one per logit row; only when PicksTokens()) the table picks
  // the rows' tokens itself into out->picked and may leave out->logits empty.
  virtual Status RunStep(std::span<const SeqStep> seqs, const StepShape& shape,
                         std::span<const int64_t> logit_rows, std::span<const BackendPick> picks,
                         ForwardOutput* out, const std::function<void(int layer)>& layer_hook,
                         const std::function<Status()>& body) = 0;
  // Whether RunStep takes picks (the CUDA table: sampling on the device).
  virtual bool PicksTokens() const { return false; }

  // kX := embedding rows of the step's tokens, times `scale` when it is not 1.
  virtual Status Embed(float scale) = 0;
  // out := RMSNorm(in) * the layer's weights, per token (in == out allowed).
  virtual Status RmsNorm(int layer, LayerNorm which, Act in, Act out) = 0;
  // The step's Q, K and V := kXn times the layer's Q, K, V matrices, plus
  // their biases where the model has them.
  virtual Status ProjectQkv(int layer) = 0;
  // Gemma 3: every Q and K head := RMSNorm(head) * the layer's q / k norm.
  virtual Status QkNorm(int layer) = 0;
  // RoPE of Q and K at the tokens' positions with `rope_base`, then
  // Q *= q_scale when q_scale != 0, then K and V stored at the tokens'
  // positions of the layer (its group's block table, its slot).
  virtual Status RopeWriteKv(int layer, float rope_base, float q_scale) = 0;
  // kAttn := causal attention of Q over the layer's KV (positions
  // max(0, pos - window + 1) .. pos; window 0 = all), softmax scale `scale`.
  virtual Status Attend(int layer, int window, float scale) = 0;
  // This step's attention of `layer` has read its K/V: the layer hook may
  // run for it (now, or once the step's K/V reached the host pool).
  virtual Status LayerDone(int layer) = 0;
  // out (+)= in times the layer's matrix (accumulate adds into out).
  virtual Status Project(int layer, LayerMatrix which, Act in, Act out, bool accumulate) = 0;
  // The step's gate and up := kXn times the layer's gate and up matrices.
  virtual Status ProjectGateUp(int layer) = 0;
  // kFfn := act(gate) * up (SiLU or Gemma's tanh-approximate GELU).
  virtual Status GatedActivation(ModelConfig::FfnAct act) = 0;
  // dst += src, element-wise over [T][d_model].
  virtual Status Add(Act dst, Act src) = 0;
  // Tensor parallelism over the collective of SetCollective.
  virtual Status AllReduce(Act a) = 0;
  // kFull := every rank's [T x width_r] block of `local` as full rows.
  virtual Status GatherColumns(Act local, const std::vector<UnitRange>& widths) = 0;
  // kXn rows [0, R) := RMSNorm(kX row logit_rows[r]) * the output norm.
  virtual Status FinalNorm() = 0;
  // The logits := kXn rows times the LM head; then, when softcap > 0,
  // tanh(v / softcap) * softcap per logit.
  virtual Status Logits(float softcap) = 0;

  virtual void SetCollective(TpCollective* collective) = 0;
  // The bytes of `block` in the host pool changed behind the table's back
  // (a device copy must re-read them); the CPU table ignores it.
  virtual void InvalidateBlock(BlockId block) = 0;
};

}  // namespace kvrelay::engine
