// CUDA kernels of the forward pass. The arithmetic per element / per block is
// in kernel_math.h (tested on the CPU); this file is thread mapping and
// reductions. Launch configuration notes say why a shape was chosen.
#include <cuda_fp16.h>

#include <cstdlib>
#include <cstring>

#include "engine/cuda/kernel_math.h"
#include "engine/cuda/kernels.cuh"

namespace kvrelay::engine::cuda {
namespace {

constexpr int kWarp = 32;

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}
__device__ __forceinline__ int WarpSumInt(int v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = math::Fmax(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The 32 elements of one activation block, one per lane, to q8 (as
// math::QuantizeBlockQ8): amax and the code sum reduced with shuffles.
__device__ __forceinline__ void WarpQuantizeQ8(float v, int64_t item, int lane, DevQ8 out) {
  const float amax = WarpMax(math::Fabs(v));
  const float inv = math::Q8Inverse(amax);
  const int8_t q = math::Q8Code(v, inv);
  out.q[item * 32 + lane] = q;
  const int sum = WarpSumInt(q);
  if (lane == 0) {
    out.d[item] = math::Q8Scale(amax);
    out.s[item] = math::Q8Sum(amax, sum);
  }
}

// One warp per (token, 32-block).
__global__ void QuantizeQ8Kernel(const float* __restrict__ x, int64_t T, int64_t cols, DevQ8 out) {
  const int64_t nb = cols / 32;
  const int64_t item = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (item >= T * nb) return;
  WarpQuantizeQ8(x[item * 32 + lane], item, lane, out);  // [t][cols] == [t][nb][32]
}

// The quantized decode GEMV (mmvq) for Q4_0 / Q4_1 / Q8_0 against q8
// activations, kCols tokens per CTA. 128 threads, two per 32-element weight
// block (math::WeightPart), stride 64 blocks along the row; kMmvqRows rows per
// CTA. Each thread loads and unpacks its part of a weight block once (32-bit
// loads) and dots it with dp4a against every token's activation ints, so a
// batch of up to kMmvqMaxCols tokens costs one pass over the weights. Partial sums: warp shuffle
// tree, then the four warps in order through shared memory.
constexpr int kMmvqThreads = 128;
constexpr int kMmvqRows = 2;
constexpr int kMmvqMaxCols = 16;  // tokens per weight pass (more: chunks)
template <uint32_t kType, int kCols>
__global__ void __launch_bounds__(kMmvqThreads)
    MmvqKernel(DevMatrix w, DevQ8 xq, int64_t T, const float* __restrict__ bias, bool accumulate,
               float* __restrict__ y) {
  constexpr int kBytes = kType == math::kTypeQ4_0   ? math::kQ4_0Bytes
                         : kType == math::kTypeQ4_1 ? math::kQ4_1Bytes
                                                    : math::kQ8_0Bytes;
  constexpr int kBlocksPerPass = kMmvqThreads / math::kMmvqParts;
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  const int part = tid % math::kMmvqParts;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kMmvqRows;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kCols;
  const int nt = static_cast<int>(T - t0 < kCols ? T - t0 : kCols);
  const int64_t nb = w.cols / 32;
  int act[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) act[i] = math::MmvqActInt(kType, part, i);
  float acc[kMmvqRows][kCols];
#pragma unroll
  for (int r = 0; r < kMmvqRows; ++r) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[r][c] = 0.0f;
  }
  for (int64_t b = tid / math::kMmvqParts; b < nb; b += kBlocksPerPass) {
    math::WeightPart wp[kMmvqRows];
#pragma unroll
    for (int r = 0; r < kMmvqRows; ++r) {
      const int64_t row = r0 + r < w.rows ? r0 + r : w.rows - 1;  // tail rows: in bounds, unused
      wp[r] = math::LoadWeightPart(kType, w.data + row * w.row_bytes + b * kBytes, part);
    }
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      if (c >= nt) break;
      const int64_t a = (t0 + c) * nb + b;
      const uint32_t* xi = reinterpret_cast<const uint32_t*>(xq.q + a * 32);
      uint32_t xa[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) xa[i] = xi[act[i]];
      const float dx = xq.d[a], sx = xq.s[a];
#pragma unroll
      for (int r = 0; r < kMmvqRows; ++r) acc[r][c] += math::PartTerm(wp[r], xa, dx, sx, part);
    }
  }
  __shared__ float red[kMmvqThreads / kWarp][kMmvqRows * kCols];
#pragma unroll
  for (int r = 0; r < kMmvqRows; ++r) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const float v = WarpSum(acc[r][c]);
      if (lane == 0) red[warp][r * kCols + c] = v;
    }
  }
  __syncthreads();
  if (tid >= kMmvqRows * kCols) return;
  const int r = tid / kCols, c = tid % kCols;
  const int64_t row = r0 + r;
  if (row >= w.rows || c >= nt) return;
  float v = red[0][tid];
#pragma unroll
  for (int k = 1; k < kMmvqThreads / kWarp; ++k) v += red[k][tid];
  const float out = v + (bias != nullptr ? bias[row] : 0.0f);
  float* dst = y + (t0 + c) * w.rows + row;
  *dst = accumulate ? *dst + out : out;
}

// Decode GEMV for float-activation types (F16, F32, Q4_K, Q6_K), and for
// Q4_0/Q4_1/Q8_0 only under KVRELAY_CUDA_GEMV=legacy (MmvqKernel otherwise):
// one warp per output row, up to kTok tokens per CTA so each weight byte is
// read once per kTok tokens (its unpacking is redone per token). Lanes stride over the row's
// 32-blocks (quantized types) or elements (float types), so a warp reads a
// contiguous span of the row per iteration (coalesced).
constexpr int kTok = 8;
constexpr int kRowsPerCta = 4;

template <uint32_t kType>
__global__ void GemvKernel(DevMatrix w, const float* __restrict__ x, DevQ8 xq, int64_t T,
                           const float* __restrict__ bias, bool accumulate, float* __restrict__ y) {
  const int lane = threadIdx.x % kWarp;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + threadIdx.x / kWarp;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kTok;
  if (r >= w.rows) return;
  const int nt = static_cast<int>(T - t0 < kTok ? T - t0 : kTok);
  const uint8_t* row = w.data + r * w.row_bytes;
  float acc[kTok];
#pragma unroll
  for (int t = 0; t < kTok; ++t) acc[t] = 0.0f;
  if constexpr (kType == math::kTypeQ4_0 || kType == math::kTypeQ4_1 || kType == math::kTypeQ8_0) {
    const int64_t nb = w.cols / 32;
    constexpr int kBytes = kType == math::kTypeQ4_0   ? math::kQ4_0Bytes
                           : kType == math::kTypeQ4_1 ? math::kQ4_1Bytes
                                                      : math::kQ8_0Bytes;
    for (int64_t b = lane; b < nb; b += kWarp) {
      const uint8_t* blk = row + b * kBytes;
#pragma unroll
      for (int t = 0; t < kTok; ++t) {
        if (t >= nt) break;
        const int64_t a = (t0 + t) * nb + b;
        const int8_t* q = xq.q + a * 32;
        if constexpr (kType == math::kTypeQ4_0) {
          acc[t] += math::BlockTermQ4_0(blk, q, xq.d[a], xq.s[a]);
        } else if constexpr (kType == math::kTypeQ4_1) {
          acc[t] += math::BlockTermQ4_1(blk, q, xq.d[a], xq.s[a]);
        } else {
          acc[t] += math::BlockTermQ8_0(blk, q, xq.d[a]);
        }
      }
    }
  } else {
    for (int64_t c = lane; c < w.cols; c += kWarp) {
      const float wv = math::DequantElem(kType, row, c);
#pragma unroll
      for (int t = 0; t < kTok; ++t) {
        if (t >= nt) break;
        acc[t] = math::Fma(wv, x[(t0 + t) * w.cols + c], acc[t]);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kTok; ++t) {
    if (t >= nt) break;
    const float v = WarpSum(acc[t]);
    if (lane == 0) {
      float out = v + (bias != nullptr ? bias[r] : 0.0f);
      float* dst = y + (t0 + t) * w.rows + r;
      *dst = accumulate ? *dst + out : out;
    }
  }
}

__global__ void DequantF16Kernel(DevMatrix w, __half* __restrict__ out) {
  const int64_t n = w.rows * w.cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / w.cols, c = i % w.cols;
    out[i] = __float2half_rn(math::DequantElem(w.type, w.data + r * w.row_bytes, c));
  }
}

__global__ void FloatToHalfKernel(const float* __restrict__ x, int64_t n,
                                  __half* __restrict__ out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = __float2half_rn(x[i]);
  }
}

__global__ void AddBiasKernel(float* __restrict__ y, const float* __restrict__ b, int64_t n,
                              int64_t rows) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] += b[i % rows];
  }
}

// One thread per output element, grid-stride.
__global__ void EmbedKernel(DevMatrix w, const int32_t* __restrict__ tokens, int64_t T,
                            float* __restrict__ out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < T * w.cols;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / w.cols, c = i % w.cols;
    out[i] = math::DequantElem(w.type, w.data + static_cast<int64_t>(tokens[t]) * w.row_bytes, c);
  }
}

// One CTA per row (up to 1024 threads, about 4 elements each): squares summed
// in double (the CPU sums them in order; the double sum of float squares
// rounds to the same float mean except in rare ties), reduced with warp
// shuffles, then the CPU's scale and multiply. With q.q set, each warp also
// quantizes its 32-element blocks of the result to q8 (the fused
// RMSNorm + quantize: the same codes as QuantizeQ8Kernel on y).
constexpr int kNormMaxThreads = 1024;
__device__ __forceinline__ double WarpSumDouble(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}
__global__ void __launch_bounds__(kNormMaxThreads)
    RmsNormKernel(const float* __restrict__ x, const int32_t* __restrict__ rows, int d,
                  const float* __restrict__ w, float eps, float* __restrict__ y, DevQ8 q) {
  __shared__ double part[kNormMaxThreads / kWarp];
  const int64_t r = blockIdx.x;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int warps = blockDim.x / kWarp;
  const float* xr = x + (rows != nullptr ? static_cast<int64_t>(rows[r]) : r) * d;
  double ss = 0;
  // d % 32 == 0 and rows start 128-byte aligned: float4 loads.
  const float4* x4 = reinterpret_cast<const float4*>(xr);
  for (int i = threadIdx.x; i < d / 4; i += blockDim.x) {
    const float4 v = x4[i];
    ss += static_cast<double>(v.x * v.x) + static_cast<double>(v.y * v.y) +
          static_cast<double>(v.z * v.z) + static_cast<double>(v.w * v.w);
  }
  ss = WarpSumDouble(ss);
  if (lane == 0) part[warp] = ss;
  __syncthreads();
  double total = 0;
  for (int k = 0; k < warps; ++k) total += part[k];
  const float scale = math::RmsScale(total, d, eps);
  const int nb = d / 32;
  for (int b = warp; b < nb; b += warps) {
    const int i = b * 32 + lane;
    const float v = math::RmsApply(xr[i], scale, w[i]);
    y[r * d + i] = v;
    if (q.q != nullptr) WarpQuantizeQ8(v, r * nb + b, lane, q);
  }
}

// out[t][i] = silu(gate[t][i]) * up[t][i] for i < n, gate and up rows ld
// floats apart (ld = 2 n and up = gate + n for the concatenated gate|up
// product). One warp per (token, 32-block); with q.q set the block is also
// quantized to q8 for the down projection (the fused SwiGLU + quantize).
// n % 32 == 0, so every element lies in a whole group of 8 (SiluMulElem).
__global__ void SwiGluKernel(const float* __restrict__ gate, const float* __restrict__ up,
                             int64_t ld, int64_t T, int64_t n, float* __restrict__ out, DevQ8 q) {
  const int64_t nb = n / 32;
  const int64_t item = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (item >= T * nb) return;
  const int64_t t = item / nb, i = (item % nb) * 32 + lane;
  const float v = math::SiluMulElem(gate[t * ld + i], up[t * ld + i], true);
  out[t * n + i] = v;
  if (q.q != nullptr) WarpQuantizeQ8(v, item, lane, q);
}

// GeLU's twin of SwiGluKernel: ggml's fp16 GELU table (math::GeluMulElem).
__global__ void GeGluKernel(const float* __restrict__ gate, const float* __restrict__ up,
                            int64_t ld, int64_t T, int64_t n, const uint16_t* __restrict__ table,
                            float* __restrict__ out, DevQ8 q) {
  const int64_t nb = n / 32;
  const int64_t item = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (item >= T * nb) return;
  const int64_t t = item / nb, i = (item % nb) * 32 + lane;
  const float v = math::GeluMulElem(gate[t * ld + i], up[t * ld + i], table);
  out[t * n + i] = v;
  if (q.q != nullptr) WarpQuantizeQ8(v, item, lane, q);
}

// One warp per (token, head); lane l holds head elements l, l + 32, ... (hd
// / 32 <= 8 of them) in registers, so the norm is in place. Squares summed in
// double as RmsNormKernel.
__global__ void HeadRmsNormKernel(float* __restrict__ x, int64_t ld, int64_t T, int n_heads, int hd,
                                  const float* __restrict__ w, float eps) {
  const int64_t item = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (item >= T * n_heads) return;
  float* head = x + (item / n_heads) * ld + (item % n_heads) * hd;
  const int per_lane = hd / kWarp;
  float v[8];
  double ss = 0;
  for (int e = 0; e < per_lane; ++e) {
    v[e] = head[lane + kWarp * e];
    ss += static_cast<double>(v[e] * v[e]);
  }
  ss = WarpSumDouble(ss);
  const float scale = math::RmsScale(ss, hd, eps);
  for (int e = 0; e < per_lane; ++e) {
    head[lane + kWarp * e] = math::RmsApply(v[e], scale, w[lane + kWarp * e]);
  }
}

__global__ void ScaleKernel(float* __restrict__ x, int64_t ld, int64_t rows, int64_t cols,
                            float s) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * cols;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[(i / cols) * ld + i % cols] *= s;
  }
}

__global__ void SoftcapKernel(float* __restrict__ x, int64_t n, float inv_cap, float cap) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] = math::SoftcapElem(x[i], inv_cap, cap);
  }
}

__device__ __forceinline__ uint8_t* SlabAt(const DevKvView& kv, int64_t seq, int64_t p, int layer,
                                           int slab, int* offset) {
  const int64_t blk = kv.tables[kv.table_off[seq] + p / kv.block_tokens];
  *offset = static_cast<int>(p % kv.block_tokens);
  return kv.pool + blk * kv.block_bytes + layer * kv.layer_bytes + slab * kv.slab_bytes;
}

// RoPE and the KV write in one kernel (rotate, then store): one thread per
// (token, unit), with n_q * half query units (a pair rotated in place) then
// n_kv * (hd - half) key units (math::RopeKvUnit: a rotated pair, or one
// unrotated tail element). A key thread writes its elements back (the host
// mirror copies rotated keys) and stores them and the matching value
// elements to (seq[t], pos[t]) of `layer`. The arithmetic is
// math::RopeTheta / RopePair and an fp16 (or f32) store.
__global__ void RopeWriteKvKernel(DevKvView kv, int layer, float* __restrict__ q,
                                  float* __restrict__ k, const float* __restrict__ v, int64_t ldq,
                                  int64_t ldkv, const int32_t* __restrict__ seq,
                                  const int64_t* __restrict__ pos, int64_t T, int n_q, int rope_dim,
                                  bool neox, float theta_scale) {
  const int hd = kv.head_dim, half = rope_dim / 2;
  const int k_units = hd - half;
  const int64_t per_token =
      static_cast<int64_t>(n_q) * half + static_cast<int64_t>(kv.kv_heads) * k_units;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < T * per_token;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = g / per_token;
    int64_t u = g % per_token;
    if (u < static_cast<int64_t>(n_q) * half) {
      const int head = static_cast<int>(u / half), i = static_cast<int>(u % half);
      float* base = q + t * ldq + head * hd;
      const float theta = math::RopeTheta(pos[t], theta_scale, i);
      math::RopePair(base + (neox ? i : 2 * i), base + (neox ? i + half : 2 * i + 1), cosf(theta),
                     sinf(theta));
      continue;
    }
    u -= static_cast<int64_t>(n_q) * half;
    const int h = static_cast<int>(u / k_units), unit = static_cast<int>(u % k_units);
    float* kb = k + t * ldkv + h * hd;
    const float* vb = v + t * ldkv + h * hd;
    int e0, e1;
    math::RopeKvUnit(unit, rope_dim, neox, &e0, &e1);
    if (e1 >= 0) {
      const float theta = math::RopeTheta(pos[t], theta_scale, unit);
      math::RopePair(kb + e0, kb + e1, cosf(theta), sinf(theta));
    }
    int off;
    uint8_t* ks = SlabAt(kv, seq[t], pos[t], layer, h, &off);
    uint8_t* vs = ks + static_cast<int64_t>(kv.kv_heads) * kv.slab_bytes;
    const int64_t row = static_cast<int64_t>(off) * hd;
    for (int e : {e0, e1}) {
      if (e < 0) continue;
      if (kv.f16) {
        reinterpret_cast<__half*>(ks)[row + e] = __float2half_rn(kb[e]);
        reinterpret_cast<__half*>(vs)[row + e] = __float2half_rn(vb[e]);
      } else {
        reinterpret_cast<float*>(ks)[row + e] = kb[e];
        reinterpret_cast<float*>(vs)[row + e] = vb[e];
      }
    }
  }
}

__device__ __forceinline__ float LoadKv(const uint8_t* slab, bool f16, int64_t idx) {
  return f16 ? __half2float(reinterpret_cast<const __half*>(slab)[idx])
             : reinterpret_cast<const float*>(slab)[idx];
}

// grid (n_heads, T, n_splits), 4 warps; each warp walks positions of the
// split with stride 4 keeping an online-softmax state, lane l owning head
// elements l, l + 32, ... (kE of them). Warps merge in shared memory and
// write one unnormalised partial per (token, head, split).
constexpr int kAttnWarps = 4;
template <int kE>
__global__ void AttentionKernel(DevKvView kv, int layer, const float* __restrict__ q, int64_t ldq,
                                const int32_t* __restrict__ seq, const int64_t* __restrict__ pos,
                                int n_heads, int window, float scale, int split_tokens,
                                float* __restrict__ partials) {
  const int head = blockIdx.x;
  const int64_t t = blockIdx.y;
  const int split = blockIdx.z, n_splits = gridDim.z;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int hd = kv.head_dim;
  const int group = n_heads / kv.kv_heads;
  const int kvh = head / group;
  const int64_t p = pos[t];
  const int64_t j_lo = window > 0 ? (p - window + 1 > 0 ? p - window + 1 : 0) : 0;
  int64_t j0 = static_cast<int64_t>(split) * split_tokens;
  int64_t j1 = j0 + split_tokens;
  if (j0 < j_lo) j0 = j_lo;
  if (j1 > p + 1) j1 = p + 1;
  float qv[kE], acc[kE];
  const float* qrow = q + t * ldq + head * hd;
#pragma unroll
  for (int e = 0; e < kE; ++e) {
    qv[e] = qrow[lane + kWarp * e];
    acc[e] = 0.0f;
  }
  math::SoftmaxState st{0.0f, 0.0f};
  for (int64_t j = j0 + warp; j < j1; j += kAttnWarps) {
    int off;
    const uint8_t* ks = SlabAt(kv, seq[t], j, layer, kvh, &off);
    const uint8_t* vs = ks + static_cast<int64_t>(kv.kv_heads) * kv.slab_bytes;
    const int64_t base = static_cast<int64_t>(off) * hd;
    float dot = 0.0f;
#pragma unroll
    for (int e = 0; e < kE; ++e)
      dot = math::Fma(qv[e], LoadKv(ks, kv.f16, base + lane + kWarp * e), dot);
    const float s = WarpSum(dot) * scale;
    float sa, pw;
    st = math::PushSoftmax(st, s, &sa, &pw);
#pragma unroll
    for (int e = 0; e < kE; ++e)
      acc[e] = acc[e] * sa + pw * LoadKv(vs, kv.f16, base + lane + kWarp * e);
  }
  __shared__ float sm[kAttnWarps], sl[kAttnWarps];
  __shared__ float sacc[kAttnWarps][kE * kWarp];
  if (lane == 0) {
    sm[warp] = st.m;
    sl[warp] = st.l;
  }
#pragma unroll
  for (int e = 0; e < kE; ++e) sacc[warp][lane + kWarp * e] = acc[e];
  __syncthreads();
  if (warp != 0) return;
  math::SoftmaxState m{sm[0], sl[0]};
#pragma unroll
  for (int e = 0; e < kE; ++e) acc[e] = sacc[0][lane + kWarp * e];
  for (int w = 1; w < kAttnWarps; ++w) {
    float sa, sb;
    m = math::MergeSoftmax(m, {sm[w], sl[w]}, &sa, &sb);
#pragma unroll
    for (int e = 0; e < kE; ++e) acc[e] = acc[e] * sa + sacc[w][lane + kWarp * e] * sb;
  }
  float* out = partials + ((t * n_heads + head) * n_splits + split) * (hd + 2);
  if (lane == 0) {
    out[0] = m.m;
    out[1] = m.l;
  }
#pragma unroll
  for (int e = 0; e < kE; ++e) out[2 + lane + kWarp * e] = acc[e];
}

// grid (n_heads, T), hd threads: merges the splits of one (token, head) by
// log-sum-exp. With q.q set each warp also quantizes its 32 outputs to q8
// (the output projection's input; hd % 32 == 0, so a warp is one block).
__global__ void AttentionMergeKernel(const float* __restrict__ partials, int n_heads, int hd,
                                     int n_splits, float* __restrict__ out, DevQ8 q) {
  const int head = blockIdx.x;
  const int64_t t = blockIdx.y;
  const int e = threadIdx.x;
  const float* p = partials + (t * n_heads + head) * n_splits * (hd + 2);
  math::SoftmaxState m{p[0], p[1]};
  float acc = p[2 + e];
  for (int s = 1; s < n_splits; ++s) {
    const float* ps = p + s * (hd + 2);
    float sa, sb;
    m = math::MergeSoftmax(m, {ps[0], ps[1]}, &sa, &sb);
    acc = acc * sa + ps[2 + e] * sb;
  }
  const float v = m.l > 0.0f ? acc / m.l : 0.0f;
  const int64_t i = (t * n_heads + head) * hd + e;
  out[i] = v;
  if (q.q != nullptr) WarpQuantizeQ8(v, i / 32, e % kWarp, q);
}

__global__ void GatherRowsKernel(const float* __restrict__ x, const int32_t* __restrict__ rows,
                                 int64_t R, int d, float* __restrict__ out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < R * d;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = x[static_cast<int64_t>(rows[i / d]) * d + i % d];
  }
}

int GridFor(int64_t n, int threads) {
  const int64_t blocks = CeilDiv(n, threads);
  return static_cast<int>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

}  // namespace

void LaunchQuantizeQ8(const float* x, int64_t T, int64_t cols, DevQ8 out, cudaStream_t stream) {
  const int64_t warps = T * (cols / 32);
  if (warps == 0) return;
  QuantizeQ8Kernel<<<static_cast<unsigned>(CeilDiv(warps * kWarp, 256)), 256, 0, stream>>>(
      x, T, cols, out);
}

namespace {

// KVRELAY_CUDA_GEMV=legacy routes the quantized types to the pre-mmvq
// GemvKernel (one warp per row, a whole block per lane), kept for a GPU A/B.
bool LegacyGemv() {
  static const bool legacy = [] {
    const char* e = std::getenv("KVRELAY_CUDA_GEMV");
    return e != nullptr && std::strcmp(e, "legacy") == 0;
  }();
  return legacy;
}

template <uint32_t kType>
void LaunchMmvq(const DevMatrix& w, const DevQ8& xq, int64_t T, const float* bias, bool accumulate,
                float* y, cudaStream_t stream) {
  const int cols = T > 8 ? kMmvqMaxCols : T > 4 ? 8 : T > 2 ? 4 : static_cast<int>(T);
  const dim3 grid(static_cast<unsigned>(CeilDiv(w.rows, kMmvqRows)),
                  static_cast<unsigned>(CeilDiv(T, cols)));
  switch (cols) {
    case 1:
      MmvqKernel<kType, 1><<<grid, kMmvqThreads, 0, stream>>>(w, xq, T, bias, accumulate, y);
      break;
    case 2:
      MmvqKernel<kType, 2><<<grid, kMmvqThreads, 0, stream>>>(w, xq, T, bias, accumulate, y);
      break;
    case 4:
      MmvqKernel<kType, 4><<<grid, kMmvqThreads, 0, stream>>>(w, xq, T, bias, accumulate, y);
      break;
    case 8:
      MmvqKernel<kType, 8><<<grid, kMmvqThreads, 0, stream>>>(w, xq, T, bias, accumulate, y);
      break;
    default:
      MmvqKernel<kType, kMmvqMaxCols>
          <<<grid, kMmvqThreads, 0, stream>>>(w, xq, T, bias, accumulate, y);
      break;
  }
}

}  // namespace

void LaunchGemv(const DevMatrix& w, const float* x, const DevQ8& xq, int64_t T, const float* bias,
                bool accumulate, float* y, cudaStream_t stream) {
  if (T == 0 || w.rows == 0) return;
  if (!LegacyGemv()) {
    switch (w.type) {
      case math::kTypeQ4_0:
        return LaunchMmvq<math::kTypeQ4_0>(w, xq, T, bias, accumulate, y, stream);
      case math::kTypeQ4_1:
        return LaunchMmvq<math::kTypeQ4_1>(w, xq, T, bias, accumulate, y, stream);
      case math::kTypeQ8_0:
        return LaunchMmvq<math::kTypeQ8_0>(w, xq, T, bias, accumulate, y, stream);
      default:
        break;  // float activations: GemvKernel below
    }
  }
  const dim3 grid(static_cast<unsigned>(CeilDiv(w.rows, kRowsPerCta)),
                  static_cast<unsigned>(CeilDiv(T, kTok)));
  const int threads = kRowsPerCta * kWarp;
  switch (w.type) {
    case math::kTypeQ4_0:
      GemvKernel<math::kTypeQ4_0><<<grid, threads, 0, stream>>>(w, x, xq, T, bias, accumulate, y);
      break;
    case math::kTypeQ4_1:
      GemvKernel<math::kTypeQ4_1><<<grid, threads, 0, stream>>>(w, x, xq, T, bias, accumulate, y);
      break;
    case math::kTypeQ8_0:
      GemvKernel<math::kTypeQ8_0><<<grid, threads, 0, stream>>>(w, x, xq, T, bias, accumulate, y);
      break;
    case math::kTypeF16:
      GemvKernel<math::kTypeF16><<<grid, threads, 0, stream>>>(w, x, xq, T, bias, accumulate, y);
      break;
    case math::kTypeF32:
      GemvKernel<math::kTypeF32><<<grid, threads, 0, stream>>>(w, x, xq, T, bias, accumulate, y);
      break;
    case math::kTypeQ4_K:
      GemvKernel<math::kTypeQ4_K><<<grid, threads, 0, stream>>>(w, x, xq, T, bias, accumulate, y);
      break;
    case math::kTypeQ6_K:
      GemvKernel<math::kTypeQ6_K><<<grid, threads, 0, stream>>>(w, x, xq, T, bias, accumulate, y);
      break;
    default:
      break;  // refused at load (DeviceSupportsType)
  }
}

void LaunchDequantF16(const DevMatrix& w, __half* out, cudaStream_t stream) {
  DequantF16Kernel<<<GridFor(w.rows * w.cols, 256), 256, 0, stream>>>(w, out);
}

void LaunchFloatToHalf(const float* x, int64_t n, __half* out, cudaStream_t stream) {
  if (n == 0) return;
  FloatToHalfKernel<<<GridFor(n, 256), 256, 0, stream>>>(x, n, out);
}

void LaunchAddBias(float* y, const float* bias, int64_t T, int64_t rows, cudaStream_t stream) {
  if (T * rows == 0) return;
  AddBiasKernel<<<GridFor(T * rows, 256), 256, 0, stream>>>(y, bias, T * rows, rows);
}

void LaunchEmbed(const DevMatrix& w, const int32_t* tokens, int64_t T, float* out,
                 cudaStream_t stream) {
  if (T == 0) return;
  EmbedKernel<<<GridFor(T * w.cols, 256), 256, 0, stream>>>(w, tokens, T, out);
}

void LaunchRmsNorm(const float* x, const int32_t* rows, int64_t R, int d, const float* w, float eps,
                   float* y, const DevQ8* q, cudaStream_t stream) {
  if (R == 0) return;
  // About 4 elements a thread, whole warps, at most 1024 threads.
  int threads = static_cast<int>(CeilDiv(d / 4, kWarp) * kWarp);
  threads = threads < kWarp ? kWarp : threads > kNormMaxThreads ? kNormMaxThreads : threads;
  RmsNormKernel<<<static_cast<unsigned>(R), threads, 0, stream>>>(x, rows, d, w, eps, y,
                                                                  q != nullptr ? *q : DevQ8{});
}

void LaunchSwiGlu(const float* gate, const float* up, int64_t ld, int64_t T, int64_t n, float* out,
                  const DevQ8* q, cudaStream_t stream) {
  const int64_t warps = T * (n / 32);
  if (warps == 0) return;
  SwiGluKernel<<<static_cast<unsigned>(CeilDiv(warps * kWarp, 256)), 256, 0, stream>>>(
      gate, up, ld, T, n, out, q != nullptr ? *q : DevQ8{});
}

void LaunchGeGlu(const float* gate, const float* up, int64_t ld, int64_t T, int64_t n,
                 const uint16_t* table, float* out, const DevQ8* q, cudaStream_t stream) {
  const int64_t warps = T * (n / 32);
  if (warps == 0) return;
  GeGluKernel<<<static_cast<unsigned>(CeilDiv(warps * kWarp, 256)), 256, 0, stream>>>(
      gate, up, ld, T, n, table, out, q != nullptr ? *q : DevQ8{});
}

void LaunchHeadRmsNorm(float* x, int64_t ld, int64_t T, int n_heads, int hd, const float* w,
                       float eps, cudaStream_t stream) {
  const int64_t warps = T * n_heads;
  if (warps == 0) return;
  HeadRmsNormKernel<<<static_cast<unsigned>(CeilDiv(warps * kWarp, 256)), 256, 0, stream>>>(
      x, ld, T, n_heads, hd, w, eps);
}

void LaunchScale(float* x, int64_t ld, int64_t rows, int64_t cols, float s, cudaStream_t stream) {
  if (rows * cols == 0) return;
  ScaleKernel<<<GridFor(rows * cols, 256), 256, 0, stream>>>(x, ld, rows, cols, s);
}

void LaunchSoftcap(float* x, int64_t n, float cap, cudaStream_t stream) {
  if (n == 0) return;
  SoftcapKernel<<<GridFor(n, 256), 256, 0, stream>>>(x, n, 1.0f / cap, cap);
}

void LaunchRopeWriteKv(const DevKvView& kv, int layer, float* q, float* k, const float* v,
                       int64_t ldq, int64_t ldkv, const int32_t* seq, const int64_t* pos, int64_t T,
                       int n_q, int rope_dim, bool neox, float theta_scale, cudaStream_t stream) {
  const int half = rope_dim / 2;
  const int64_t n = T * (static_cast<int64_t>(n_q) * half +
                         static_cast<int64_t>(kv.kv_heads) * (kv.head_dim - half));
  if (n == 0) return;
  RopeWriteKvKernel<<<GridFor(n, 256), 256, 0, stream>>>(kv, layer, q, k, v, ldq, ldkv, seq, pos, T,
                                                         n_q, rope_dim, neox, theta_scale);
}

int AttentionSplits(int64_t max_len, int split_tokens) {
  return static_cast<int>(CeilDiv(max_len, split_tokens));
}

int AttentionSplitTokens(int64_t T, int n_heads, int max_split_tokens) {
  // About two CTAs per SM of a 132-SM part before splitting the context.
  constexpr int64_t kTargetCtas = 264, kMinSplit = 64;
  int64_t split = max_split_tokens;
  for (int64_t ctas = T * n_heads; ctas < kTargetCtas && split / 2 >= kMinSplit; ctas *= 2)
    split /= 2;
  return static_cast<int>(split);
}

void LaunchAttention(const DevKvView& kv, int layer, const float* q, int64_t ldq,
                     const int32_t* seq, const int64_t* pos, int64_t T, int n_heads, int window,
                     float scale, int64_t max_len, int split_tokens, float* partials, float* out,
                     const DevQ8* out_q8, cudaStream_t stream) {
  if (T == 0) return;
  const int splits = AttentionSplits(max_len, split_tokens);
  const dim3 grid(static_cast<unsigned>(n_heads), static_cast<unsigned>(T),
                  static_cast<unsigned>(splits));
  const int threads = kAttnWarps * kWarp;
  switch (kv.head_dim / kWarp) {
    case 1:
      AttentionKernel<1><<<grid, threads, 0, stream>>>(kv, layer, q, ldq, seq, pos, n_heads, window,
                                                       scale, split_tokens, partials);
      break;
    case 2:
      AttentionKernel<2><<<grid, threads, 0, stream>>>(kv, layer, q, ldq, seq, pos, n_heads, window,
                                                       scale, split_tokens, partials);
      break;
    case 3:
      AttentionKernel<3><<<grid, threads, 0, stream>>>(kv, layer, q, ldq, seq, pos, n_heads, window,
                                                       scale, split_tokens, partials);
      break;
    case 4:
      AttentionKernel<4><<<grid, threads, 0, stream>>>(kv, layer, q, ldq, seq, pos, n_heads, window,
                                                       scale, split_tokens, partials);
      break;
    case 8:
      AttentionKernel<8><<<grid, threads, 0, stream>>>(kv, layer, q, ldq, seq, pos, n_heads, window,
                                                       scale, split_tokens, partials);
      break;
    default:
      return;  // refused at backend creation (SupportedHeadDim)
  }
  AttentionMergeKernel<<<dim3(static_cast<unsigned>(n_heads), static_cast<unsigned>(T)),
                         kv.head_dim, 0, stream>>>(partials, n_heads, kv.head_dim, splits, out,
                                                   out_q8 != nullptr ? *out_q8 : DevQ8{});
}

void LaunchGatherRows(const float* x, const int32_t* rows, int64_t R, int d, float* out,
                      cudaStream_t stream) {
  if (R == 0) return;
  GatherRowsKernel<<<GridFor(R * d, 256), 256, 0, stream>>>(x, rows, R, d, out);
}

}  // namespace kvrelay::engine::cuda
