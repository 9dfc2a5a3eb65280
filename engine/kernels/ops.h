// Element-wise and attention CPU ops of the transformer, vectorised (AVX2
// chosen at run time like MatMul, scalar otherwise). The runtime decides
// whether to call them; each is single-threaded, reentrant, and allows y == x
// unless noted.
//
// llama.cpp compatibility (docs/ENGINE_NUMERICS.md): these ops reproduce the
// float arithmetic of llama.cpp's CPU backend (ggml, AVX2 build) operation for
// operation: the same exp approximation, the same accumulation orders and the
// same fp16 roundings. On SmolLM2-class models a single-ulp difference in one
// activation can flip the rounding of an int8-quantized activation and move
// the logits by ~0.5, so "close" arithmetic is not enough to compare with
// llama.cpp; identical arithmetic is. The scalar path computes the same values
// (std::fma where ggml fuses) but is only a fallback.
#pragma once

#include <cstdint>
#include <span>

#include "common/thread_pool.h"
#include "engine/gguf/gguf.h"
#include "engine/kernels/matmul.h"

namespace kvrelay::engine {

// y = x * (1 / sqrtf(mean(x^2) + eps)) * w over n floats, as ggml's rms_norm
// followed by the weight multiply: squares rounded to float and summed in
// double in order, mean and scale in float.
void RmsNormFast(const float* x, const float* w, int64_t n, float eps, float* y);

// out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + exp(-g)), with exp as
// ggml_v_expf (max error ~1.5 ulp; see ExpGgml). out may alias gate or up.
void SiluMul(const float* gate, const float* up, int64_t n, float* out,
             KernelPath path = KernelPath::kAuto);

// y[i] = exp(x[i]) with the approximation ggml's CPU backend vectorises
// (ARM optimized-routines expf: 2^n * poly(r), error <= 1.46 ulp + 0.5).
// y may alias x.
void ExpGgml(const float* x, int64_t n, float* y, KernelPath path = KernelPath::kAuto);

// y[i] += x[i] (residual add).
void AddInPlace(float* y, const float* x, int64_t n);

// RoPE angles for one position, as ggml_rope_cache_init with no scaling:
// theta_0 = float(pos), theta_{i+1} = theta_i * powf(base, -2 / rope_dim) in
// float; cos[i] = cosf(theta_i), sin[i] = sinf(theta_i) for i < rope_dim / 2.
void RopeAnglesGgml(int64_t pos, float base, int rope_dim, float* cos, float* sin);

// Rotates pairs (x[a_i], x[b_i]) by the angles, as ggml's rope kernel:
//   x[a] = x0 * cos - x1 * sin,  x[b] = x0 * sin + x1 * cos   (float)
// where pair i is (2i, 2i+1) for the normal layout and (i, i + half) for NeoX.
void RopeRotate(float* x, int half, bool neox, const float* cos, const float* sin,
                KernelPath path = KernelPath::kAuto);

// One causal attention row over a paged f32 K/V cache, as llama.cpp computes
// it without flash attention (KQ product, soft_max_ext, V * softmax):
//   s_j = dot(q, k_j) * scale for j in [j0, j1), the dot as ggml_vec_dot_f32
//   (4 x 8 FMA lanes, fixed reduction); p = softmax(s) with exp as ExpGgml
//   over groups of 8 positions aligned at j = 0 and the sum in double;
//   out = sum_j p_j v_j.
// llama.cpp sums V * p in one of two orders depending on its batch size:
// with 2+ tokens in the batch (llamafile sgemm) position j goes to lane j mod 8
// of one 8-lane FMA accumulator per output; with a single token (sgemm needs
// 2+ columns) ggml_vec_dot_f32 puts it in lane j mod 32 of 4 x 8 accumulators.
// `single_token` selects the second. The engine passes false for every row so
// its results never depend on batching (docs/ENGINE_NUMERICS.md); true exists
// to reproduce llama.cpp's one-token decode steps.
// Position j's K row is k_blocks[j / block_tokens] + (j % block_tokens) * hd,
// likewise V. Scratch: scores holds j1 floats, acc 8 * hd floats (32 * hd
// with single_token); out holds hd floats.
void AttendRowGgml(const float* q, const float* const* k_blocks, const float* const* v_blocks,
                   int block_tokens, int hd, int64_t j0, int64_t j1, float scale, bool single_token,
                   float* scores, float* acc, float* out, KernelPath path = KernelPath::kAuto);

// AttendRowGgml (single_token = false) in three passes, so one long row can
// be spread over threads with AttendRowGgml's bits (every pass computes each
// value with the same operations; only which thread runs which part changes):
//   1. AttendScoresGgml over chunks [c0, c1) of the positions (c0 a multiple
//      of 16, or <= j0): writes scores[j] for j in [max(j0, c0), min(j1, c1))
//      and returns their max (-inf for an empty range); the row's max is the
//      max of the chunks' (max is exact in any order);
//   2. AttendSoftmaxGgml once per row: scores -> probabilities in place
//      (exp groups and the double sum in position order, as AttendRowGgml);
//   3. AttendValuesGgml over slices [e0, e1) of the head (multiples of 32):
//      out[e0, e1), each element accumulated over all positions in order.
// Only where AttendSplitSupported (the AVX-512 path, hd % 32 == 0,
// block_tokens % 16 == 0); elsewhere callers use AttendRowGgml.
bool AttendSplitSupported(int block_tokens, int hd, KernelPath path = KernelPath::kAuto);
float AttendScoresGgml(const float* q, const float* const* k_blocks, int block_tokens, int hd,
                       int64_t j0, int64_t j1, int64_t c0, int64_t c1, float scale, float* scores);
void AttendSoftmaxGgml(float* scores, int64_t j0, int64_t j1, float max_score);
void AttendValuesGgml(const float* p, const float* const* v_blocks, int block_tokens, int hd,
                      int64_t j0, int64_t j1, int e0, int e1, float* out);

// Attention rows that share one K/V head, computed together: the query
// heads of a GQA group and a run of consecutive new tokens of one sequence
// (prefill). Each row's out is AttendRowGgml's (single_token = false) for
// (q, j0, j1), bit for bit, on every kernel path: every row runs the very
// operations of its own row pass in the same order (scores, max, softmax,
// V * p accumulation per lane); only the loop nest changes. The rows walk the
// positions in chunks, and each chunk of K (then V) serves every row of the
// tile while it is in cache, where the row path reads the head's whole K and V
// once per row (at 4k positions, 2 MiB per row, from L3). Rows may have any
// ranges (causal edges, sliding windows, empty: zeros). scratch holds
// AttendTileScratchFloats(rows.size(), max j1, hd) floats.
struct AttendTileRow {
  const float* q;  // hd floats
  float* out;      // hd floats
  int64_t j0, j1;  // positions [j0, j1), as AttendRowGgml
};
int64_t AttendTileScratchFloats(int64_t n_rows, int64_t max_j1, int hd);
void AttendTileGgml(std::span<const AttendTileRow> rows, const float* const* k_blocks,
                    const float* const* v_blocks, int block_tokens, int hd, float scale,
                    float* scratch, KernelPath path = KernelPath::kAuto);

// Several products that read the SAME input x (Q/K/V, or gate/up): x is
// quantized once and all of them run in a single parallel section, which saves
// thread wake-ups in decode. ys[i] is [n_tokens][ws[i]->Rows()]. All ws must
// have the same Cols(). Equivalent to calling MatMul for each.
void MatMulShared(std::span<const GgufTensor* const> ws, const float* x, int64_t n_tokens,
                  std::span<float* const> ys, ThreadPool* pool);

}  // namespace kvrelay::engine
