// In-place kernels for the weight formats of llama.cpp's K-quant files
// (Q4_K, Q6_K, and Q5_0, which Q4_K_M files use for most projections).
// Internal to engine/kernels; matmul.cc owns threading and tiling.
//
// Q5_0 multiplies against the Q8_0 activations of quant_blocks.h (blocks of
// 32, the GemmQFn of kernel_table.h). Q4_K and Q6_K multiply against Q8_K
// activations, as ggml's CPU backend does (quantize_row_q8_K): per block of
// 256, with max the element of largest magnitude (its sign kept),
//   iscale = -127 / max, q_j = min(127, nearest(iscale * x_j)), d = 1 / iscale
// (a float, not rounded to fp16), and bsums = the sum of every 16 q_j.
// So |x_j - d q_j| <= |d| / 2 = amax / 254 per element.
//
// Every dot is made of exact integer sums times float scales, accumulated in
// the order of llama.cpp's CPU backend (AVX2 build) for a prompt pass, and in
// the same order on every path: the scalar and vector kernels return
// bit-identical results (tests/unit/kernels/kquant_test.cc).
//   Q4_K (ggml_gemm_q4_K_8x8_q8_K, the interleaved repack llama.cpp uses on
//   AVX2): per pair p of 32-element sub-blocks (64 elements), in order,
//     acc  = fma(float(sc_2p dot_2p + sc_2p+1 dot_2p+1), fp16 d * dx, acc)
//     accm = fma(float(m_2p bsum_2p + m_2p+1 bsum_2p+1), fp16 dmin * dx, accm)
//   and y = acc - accm at the end.
//   Q6_K (its tiled K-quant matmul): per block,
//     acc = fma(fp16 d * float(sum_s sc_s sum_j (q6_j - 32) x8_j), dx, acc).
//   Q5_0 block: 8 lanes acc_m = fma(fp16 d * dx, float(lane m), acc_m), lane m
//   holding elements 4m..4m+3, reduced as ggml's hsum (dx = the Q8_0 scale).
// llama.cpp itself sums a batch's last len % 4 rows (Q4_K) and batches of
// fewer than 8 rows (Q6_K) in other orders; kvrelay uses the orders above for
// every row, so its results never depend on batching (docs/ENGINE_NUMERICS.md).
#pragma once

#include <cstdint>

#include "engine/kernels/kernel_table.h"

namespace kvrelay::engine::kernels {

inline constexpr int kBlockK = 256;

// Q8_K activations, structure of arrays: token t, block b (nb per token):
//   q[(t * nb + b) * 256 + j], d[t * nb + b], bsums[(t * nb + b) * 16 + s].
struct Q8KActs {
  int8_t* q = nullptr;
  float* d = nullptr;
  int16_t* bsums = nullptr;
  int64_t nb = 0;
};

using QuantizeQ8KFn = void (*)(const float* x, int64_t cols, int64_t t0, int64_t t1,
                               const Q8KActs& a);
// As GemmQFn, against Q8_K activations.
using GemmQ8KFn = void (*)(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1,
                           const Q8KActs& a, int64_t t0, int64_t t1, float* y, int64_t ldy);

struct KQuantKernels {
  const char* name;
  QuantizeQ8KFn quantize_q8k;
  GemmQ8KFn gemm_q4_k;
  GemmQ8KFn gemm_q6_k;
  GemmQFn gemm_q5_0;  // Q8_0 activations (QuantizedActs)
};

const KQuantKernels& ScalarKQuantKernels();
// Only when the CPU has AVX2 + FMA + F16C.
const KQuantKernels& Avx2KQuantKernels();
// Only when it also has AVX512F/BW/VL and VNNI (vpdpbusd; the same bits).
//
// Batches (4+ tokens) run on register tiles, each output's operations and
// their order unchanged, so a batched product equals the token-by-token one
// bit for bit: Q4_K / Q6_K with one row per 32-bit lane (16 rows per zmm on
// AVX-512, 8 per ymm on AVX2; the weights of a block unpacked and transposed
// once for up to 64 tokens, each token's 4-byte activation groups broadcast,
// so the exact sub-block sums of 16 / 8 rows come out side by side and the
// fma steps above run on them at once), Q5_0 in 4 rows x 8 tokens
// (AVX-512, the Q4_0 pair tiles of kernels_avx512.cc) or 2 rows x 4 tokens
// (AVX2).
const KQuantKernels& Avx512KQuantKernels();

// Q5_0 x Q8_0 on the AVX-512 pair layout (kernels_avx512.cc TilePairs: 4 rows
// x 8 tokens per register tile, the per-output order of the row-by-row
// kernels). Handles a call only when `a` carries the pair layout (qp), t0 is
// even and there are 4+ tokens; returns false, having written nothing,
// otherwise. Only reached from the AVX-512 table.
bool GemmQ5_0Pairs(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1,
                   const QuantizedActs& a, int64_t t0, int64_t t1, float* y, int64_t ldy);

// The 8 (scale, min) 6-bit pairs of a Q4_K block from its 12 packed bytes.
inline void UnpackQ4KScales(const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      sc[j] = q[j] & 63;
      mn[j] = q[j + 4] & 63;
    } else {
      sc[j] = static_cast<uint8_t>((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4));
      mn[j] = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
  }
}

}  // namespace kvrelay::engine::kernels
