// Launchers of the CUDA kernels of the forward pass (kernels.cu). Internal to
// engine/cuda; only .cu files include this. Every launcher enqueues on
// `stream` and returns at once; pointers are device memory unless named h_.
// The arithmetic of each element lives in kernel_math.h.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "engine/cuda/sample_params.h"

namespace kvrelay::engine::cuda {

// A weight matrix as it sits in device memory: the GGUF bytes unchanged.
struct DevMatrix {
  uint32_t type = 0;  // ggml type code
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_bytes = 0;
  const uint8_t* data = nullptr;
  const __half* f16 = nullptr;  // optional fp16 copy [rows][cols] for the tensor-core path
};

// Activations quantized per 32-block, as engine/kernels/quant_blocks.h
// QuantizedActs (q: [T][nb][32] int8, d and s: [T][nb] floats).
struct DevQ8 {
  int8_t* q = nullptr;
  float* d = nullptr;
  float* s = nullptr;
};

// x [T][cols] -> q8 (cols % 32 == 0).
void LaunchQuantizeQ8(const float* x, int64_t T, int64_t cols, DevQ8 out, cudaStream_t stream);

// y[t][r] (+)= W[r] . x[t] for T tokens, the decode GEMV. Q4_0/Q4_1/Q8_0
// multiply in place against the q8 activations xq (x unused): the mmvq
// kernel, dp4a, each weight block read once per 16 tokens. Other types use
// float x (xq unused). bias (rows floats) may be null; accumulate adds into
// y (the residual). ldy = rows. KVRELAY_CUDA_GEMV=legacy selects the
// previous quantized kernel (for A/B runs on a GPU).
void LaunchGemv(const DevMatrix& w, const float* x, const DevQ8& xq, int64_t T, const float* bias,
                bool accumulate, float* y, cudaStream_t stream);

// W -> fp16 [rows][cols] (the prefill path's tile for cuBLAS).
void LaunchDequantF16(const DevMatrix& w, __half* out, cudaStream_t stream);
void LaunchFloatToHalf(const float* x, int64_t n, __half* out, cudaStream_t stream);
// y [T][rows] += bias per row.
void LaunchAddBias(float* y, const float* bias, int64_t T, int64_t rows, cudaStream_t stream);

// Embedding rows: out[t] = dequant(W row tokens[t]).
void LaunchEmbed(const DevMatrix& w, const int32_t* tokens, int64_t T, float* out,
                 cudaStream_t stream);
// y[r] = RMSNorm(x[rows[r]]) * w over d floats (d % 32 == 0); rows may be
// null (identity). With q non-null, y is also quantized to q8 in the same
// kernel (the fused RMSNorm + quantize; q as LaunchQuantizeQ8's output).
void LaunchRmsNorm(const float* x, const int32_t* rows, int64_t R, int d, const float* w, float eps,
                   float* y, const DevQ8* q, cudaStream_t stream);
// out[t][i] = silu(gate[t * ld + i]) * up[t * ld + i], i < n (n % 32 == 0);
// with q non-null, out is also quantized to q8 (the down projection's input).
void LaunchSwiGlu(const float* gate, const float* up, int64_t ld, int64_t T, int64_t n, float* out,
                  const DevQ8* q, cudaStream_t stream);

// out[t][i] = gelu(gate[t * ld + i]) * up[t * ld + i] with ggml's fp16 table
// (`table`: 65536 entries in device memory, gelu.h GeluTableGgml); q as
// LaunchSwiGlu's.
void LaunchGeGlu(const float* gate, const float* up, int64_t ld, int64_t T, int64_t n,
                 const uint16_t* table, float* out, const DevQ8* q, cudaStream_t stream);
// Every head of T rows in place: x[t * ld + h * hd ..] := RMSNorm(head) * w
// (hd floats of weights, hd % 32 == 0, hd <= 256): Gemma 3's Q and K norms.
void LaunchHeadRmsNorm(float* x, int64_t ld, int64_t T, int n_heads, int hd, const float* w,
                       float eps, cudaStream_t stream);
// x[r * ld + i] *= s for r < rows, i < cols.
void LaunchScale(float* x, int64_t ld, int64_t rows, int64_t cols, float s, cudaStream_t stream);
// Every logit v := tanh(v / cap) * cap (n floats).
void LaunchSoftcap(float* x, int64_t n, float cap, cudaStream_t stream);

// Where a step's KV lives: pool + the flattened block tables.
struct DevKvView {
  uint8_t* pool = nullptr;
  int64_t block_bytes = 0;
  int64_t layer_bytes = 0;
  int64_t slab_bytes = 0;
  int block_tokens = 0;
  int kv_heads = 0;
  int head_dim = 0;
  bool f16 = false;                    // slab elements: fp16 (else f32)
  const int32_t* tables = nullptr;     // all sequences' block ids
  const int64_t* table_off = nullptr;  // per sequence: first entry in tables
};
// RoPE and the KV write in one kernel: q [T][n_q * hd] and k [T][n_kv * hd]
// rotated in place at positions pos[t] (token t's rows at q + t * ldq,
// k + t * ldkv, v + t * ldkv; a stacked Q|K|V product has ldq = ldkv =
// q_dim + 2 kv_dim), then k and v stored to (seq[t], pos[t]) of `layer`.
void LaunchRopeWriteKv(const DevKvView& kv, int layer, float* q, float* k, const float* v,
                       int64_t ldq, int64_t ldkv, const int32_t* seq, const int64_t* pos, int64_t T,
                       int n_q, int rope_dim, bool neox, float theta_scale, cudaStream_t stream);
// Causal paged attention, one output row per token: token t of sequence
// seq[t] at position pos[t] attends to [max(0, pos - window + 1), pos].
// Positions are split into chunks of `split_tokens` (flash-decoding); the
// partial (m, l, acc) go to `partials` (T * n_heads * n_splits * (hd + 2)
// floats) and a second kernel merges them by log-sum-exp; with out_q8
// non-null it also quantizes out to q8 for the output projection. max_len
// bounds pos + 1. Token t's query row is at q + t * ldq.
void LaunchAttention(const DevKvView& kv, int layer, const float* q, int64_t ldq,
                     const int32_t* seq, const int64_t* pos, int64_t T, int n_heads, int window,
                     float scale, int64_t max_len, int split_tokens, float* partials, float* out,
                     const DevQ8* out_q8, cudaStream_t stream);
int AttentionSplits(int64_t max_len, int split_tokens);
// The split size for T tokens of n_heads heads: max_split_tokens halved
// (not below 64) until T * n_heads * 2^k CTAs would fill the GPU, so a short
// batch still spreads a long context over every SM (FlashDecoding). Depends
// on T, not on the context length, so a decode graph stays valid.
int AttentionSplitTokens(int64_t T, int n_heads, int max_split_tokens);

// Row gather: out[r] = x[rows[r]] (d floats).
void LaunchGatherRows(const float* x, const int32_t* rows, int64_t R, int d, float* out,
                      cudaStream_t stream);

// One CTA per row (sample_kernel.cu); scratch as CudaSampler lays it out.
void LaunchSample(const float* logits, int64_t rows, int vocab, const DeviceSampleParams* params,
                  float* work, float* cand_v, int32_t* cand_id, double* probs, int32_t* out,
                  cudaStream_t stream);

}  // namespace kvrelay::engine::cuda
