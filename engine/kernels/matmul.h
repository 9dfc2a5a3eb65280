// Matrix products against GGUF weight tensors, the hot path of the engine.
//
// CONTRACT shared by engine/forward and the kernel work: keep the signatures.
//   W is a 2-D GGUF tensor with dims {cols, rows} (ggml order), any type for
//   which CanDequantize() is true. X is [n_tokens][cols] row-major floats,
//   Y is [n_tokens][rows]. Y[t][r] = sum_c W[r][c] * X[t][c].
//
// How MatMul computes (see docs/BENCHMARKS.md "Engine speed"):
//   Q4_0 / Q4_1 / Q8_0 weights are read in place, never expanded to fp32. X is
//   quantized once per call to int8 per block of 32 exactly as llama.cpp's CPU
//   backend does it (Q8_0 / Q8_1: scale fp16(amax/127), block sum in fp16; see
//   quant_blocks.h), and each output is a sum of exact integer block dots times
//   one float scale per block, accumulated in ggml's lane order. So the result
//   differs from the exact product by at most, per block b with d0 = amax_b/127,
//     sum|w| * 0.562 d0  +  |m_b| * 2^-10 * d0 * |sum_j q_j|   (m_b: the Q4 min)
//   plus float rounding. F32/F16 weights use a float dot (no quantization).
//   Q5_0 (against the same Q8_0 activations) and Q4_K / Q6_K (against Q8_K
//   activations, blocks of 256; see MatMulActivationBlock) are read in place
//   too (engine/kernels/kquant.h). Other types (Q5_1, other K-quants, BF16)
//   dequantize a tile of rows to fp32 and reuse it for every token.
//   Rows are split over the pool's threads; tokens are processed in tiles so a
//   weight tile stays in cache while it is reused across the tile's tokens.
#pragma once

#include <cstdint>
#include <string_view>

#include "common/thread_pool.h"
#include "engine/gguf/gguf.h"

namespace kvrelay::engine {

// Fast path: chosen at run time (AVX2 / scalar). `pool` may be null (one thread).
// Thread-safe: concurrent calls are fine if they use different pools (or none).
// x and y must not overlap.
void MatMul(const GgufTensor& w, const float* x, int64_t n_tokens, float* y, ThreadPool* pool);

// Reference: dequantize each row to fp32 and accumulate in double. Slow; the
// yardstick every fast kernel is tested against.
void MatMulReference(const GgufTensor& w, const float* x, int64_t n_tokens, float* y);

// Copies row `row` of an embedding-style tensor (dims {cols, rows}) to dst as floats.
void GetRow(const GgufTensor& w, int64_t row, float* dst);

// ---- Instruction-set paths (additive to the contract above) ----

// kAuto resolves to KVRELAY_KERNELS ("scalar", "avx2" or "avx512") when that
// environment variable is set and the CPU supports it, else to the best path
// the CPU supports (checked with CPUID at run time: AVX2 needs avx2+fma+f16c;
// AVX-512 needs those plus avx512 f/bw/vl/dq/vnni and an OS that saves the
// opmask and zmm state, XCR0 via XGETBV). The AVX-512 path gives the same
// bits as AVX2 (kernels_avx512.cc); only the quantized products differ in how
// they are computed, the element-wise ops are the AVX2 ones.
enum class KernelPath { kAuto = 0, kScalar = 1, kAvx2 = 2, kAvx512 = 3 };

bool KernelPathSupported(KernelPath path);
// The path kAuto stands for in this process (read once).
KernelPath ResolvedKernelPath();
std::string_view KernelPathName(KernelPath path);

// MatMul on an explicit path (tests force each path with it). A path the CPU
// does not support falls back to the best one below it (AVX-512 -> AVX2 -> scalar).
void MatMulWithPath(const GgufTensor& w, const float* x, int64_t n_tokens, float* y,
                    ThreadPool* pool, KernelPath path);

// True when MatMul multiplies this weight type in place with int8 activations
// (the error bound in the header comment applies); false for the float paths.
bool MatMulQuantizesActivations(GgmlType type);
// The activation quantization block of MatMul for this weight type: 32 (Q8_0 /
// Q8_1 style, the bound above), 256 (Q4_K / Q6_K: Q8_K activations with a
// float scale, |x - x^| <= amax_256 / 254 per element; engine/kernels/kquant.h),
// or 0 (float activations).
int MatMulActivationBlock(GgmlType type);

}  // namespace kvrelay::engine
