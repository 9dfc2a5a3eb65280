// The CUDA compute backend (engine/runtime/compute_backend.h): the forward
// pass of one engine on one GPU.
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
// accumulation). Attention is paged over the block table with an online
// softmax split over chunks of positions (flash-decoding) and merged by
// log-sum-exp. RMSNorm, SwiGLU and the attention merge also write the next
// product's q8 input; RoPE and the KV write are one kernel; all use the CPU's
// arithmetic (kernel_math.h). KV pool dtypes: f32 and
// f16 (the same slab bytes as the CPU pool, so blocks move between the two
// with plain copies).
//
// Tensor parallelism: a sharded model works with any TpCollective. With an
// NcclCommunicator the all-reduce (and the all-gather, when every rank's
// piece has the same width) run on device buffers; any other collective gets
// the activations staged through host memory.
#pragma once

#include <memory>

#include "common/status.h"
#include "engine/runtime/compute_backend.h"

namespace kvrelay::engine::cuda {

Result<std::unique_ptr<ComputeBackend>> CreateCudaBackend(const ComputeBackendOptions& options,
                                                          const Model& model, KvBlockPool* pool);

}  // namespace kvrelay::engine::cuda
