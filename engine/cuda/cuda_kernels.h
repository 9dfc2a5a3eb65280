// The CUDA kernel table (engine/runtime/step_kernels.h): the operations of
// one forward step on one GPU. The model's structure is ForwardPass's
// (forward.cc), the same for the CPU and CUDA; this table holds the weights
// in device memory, the kernels and their launch plan.
//
// Weights are copied to device memory in their GGUF formats (Q4_0, Q4_1,
// Q8_0, Q4_K, Q6_K, F16, F32), never expanded. Steps of fewer than
// gemm_min_tokens tokens (decode) use GEMV kernels written for memory
// bandwidth: Q4_0/Q4_1/Q8_0 run the mmvq kernel, which reads each weight
// block once per 16 tokens and multiplies it in place (dp4a) against
// activations quantized to int8 per 32-block with the CPU engine's rounding,
// so it computes the CPU's integer block dots exactly and differs only in
// float summation order (docs/gpu-numerics.md). Q/K/V and gate/up are stacked
// at upload, one product each. Larger steps (prefill chunks, big batches)
// dequantize each matrix to an fp16 tile and run cuBLAS (tensor cores, fp32
// accumulation). Attention is paged over each KV group's block table with an
// online softmax split over chunks of positions (flash-decoding) and merged
// by log-sum-exp. RMSNorm, the gated activations and the attention merge
// also write the next product's q8 input; RoPE and the KV write are one
// kernel; the output and down projections add into the residual stream in
// the GEMV itself; all use the CPU's arithmetic (kernel_math.h). Gemma 3's
// pieces (QK norms, per-layer RoPE bases and windows, post-norms, GeGLU with
// ggml's fp16 GELU table, embedding scale, logit soft-capping) are kernels of
// the table too. KV pool dtypes: f32 and f16 (the same slab bytes as the CPU
// pool, so blocks move between the two with plain copies).
//
// The device pool has the host pool's block layout. Blocks whose host bytes
// changed behind the table (InvalidateBlock) are re-uploaded per layer slot
// on a copy stream before the first step that reads them; the K/V a step
// computes is copied back into the host pool after the step (one copy per
// step; mirror_kv_to_host), where the layer hook, exports, spills and
// transfers read it.
//
// Tensor parallelism: a sharded model works with any TpCollective. With an
// NcclCommunicator the all-reduce (and the all-gather, when every rank's
// piece has the same width) run on device buffers; any other collective gets
// the activations staged through host memory.
#pragma once

#include <memory>

#include "common/status.h"
#include "engine/kv_cache/kv_groups.h"
#include "engine/runtime/compute_backend.h"
#include "engine/runtime/step_kernels.h"

namespace kvrelay::engine::cuda {

// The table for options.device. `model` and `pool` must outlive it.
// Unavailable naming the problem when the device cannot be used,
// Unimplemented for a weight type, KV dtype or head size the kernels do not
// cover; the model's weights are copied to the device here.
Result<std::unique_ptr<StepKernels>> CreateCudaKernels(const ComputeBackendOptions& options,
                                                       const Model& model, KvBlockPool* pool,
                                                       const KvCacheGroups& groups);

}  // namespace kvrelay::engine::cuda
