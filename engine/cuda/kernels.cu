// CUDA kernels of the forward pass. The arithmetic per element / per block is
// in kernel_math.h (tested on the CPU); this file is thread mapping and
// reductions. Launch configuration notes say why a shape was chosen.
#include <cuda_fp16.h>

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

// One warp per (token, 32-block).
__global__ void QuantizeQ8Kernel(const float* __restrict__ x, int64_t T, int64_t cols, DevQ8 out) {
  const int64_t nb = cols / 32;
  const int64_t item = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (item >= T * nb) return;
  const float v = x[item * 32 + lane];  // [t][cols] == [t][nb][32]
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

// Decode GEMV: one warp per output row, up to kTok tokens per CTA so each
// weight byte is read once per kTok tokens. Lanes stride over the row's
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

__global__ void EmbedKernel(DevMatrix w, const int32_t* __restrict__ tokens,
                            float* __restrict__ out) {
  const int64_t t = blockIdx.x;
  const uint8_t* row = w.data + static_cast<int64_t>(tokens[t]) * w.row_bytes;
  for (int64_t c = threadIdx.x; c < w.cols; c += blockDim.x) {
    out[t * w.cols + c] = math::DequantElem(w.type, row, c);
  }
}

// One CTA per row: squares summed in double (the CPU sums them in order;
// the double sum of float squares rounds to the same float mean except in
// rare ties), then the CPU's scale and multiply.
constexpr int kNormThreads = 256;
__global__ void RmsNormKernel(const float* __restrict__ x, const int32_t* __restrict__ rows, int d,
                              const float* __restrict__ w, float eps, float* __restrict__ y) {
  __shared__ double part[kNormThreads];
  const int64_t r = blockIdx.x;
  const float* xr = x + (rows != nullptr ? static_cast<int64_t>(rows[r]) : r) * d;
  double ss = 0;
  for (int i = threadIdx.x; i < d; i += blockDim.x) ss += static_cast<double>(xr[i] * xr[i]);
  part[threadIdx.x] = ss;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) part[threadIdx.x] += part[threadIdx.x + s];
    __syncthreads();
  }
  const float scale = math::RmsScale(part[0], d, eps);
  for (int i = threadIdx.x; i < d; i += blockDim.x)
    y[r * d + i] = math::RmsApply(xr[i], scale, w[i]);
}

__global__ void RopeKernel(float* __restrict__ q, float* __restrict__ k,
                           const int64_t* __restrict__ pos, int n_q, int n_kv, int hd, int rope_dim,
                           bool neox, float theta_scale) {
  const int64_t t = blockIdx.x;
  const int half = rope_dim / 2;
  const int pairs = (n_q + n_kv) * half;
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int head = p / half, i = p % half;
    float* base = head < n_q ? q + (t * n_q + head) * hd : k + (t * n_kv + (head - n_q)) * hd;
    const float theta = math::RopeTheta(pos[t], theta_scale, i);
    const int a = neox ? i : 2 * i;
    const int b = neox ? i + half : 2 * i + 1;
    math::RopePair(base + a, base + b, cosf(theta), sinf(theta));
  }
}

__global__ void SiluMulKernel(float* __restrict__ gate, const float* __restrict__ up, int64_t T,
                              int64_t n) {
  const int64_t n8 = n & ~int64_t{7};
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < T * n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    gate[i] = math::SiluMulElem(gate[i], up[i], i % n < n8);
  }
}

__device__ __forceinline__ uint8_t* SlabAt(const DevKvView& kv, int64_t seq, int64_t p, int layer,
                                           int slab, int* offset) {
  const int64_t blk = kv.tables[kv.table_off[seq] + p / kv.block_tokens];
  *offset = static_cast<int>(p % kv.block_tokens);
  return kv.pool + blk * kv.block_bytes + layer * kv.layer_bytes + slab * kv.slab_bytes;
}

__global__ void WriteKvKernel(DevKvView kv, int layer, const float* __restrict__ k,
                              const float* __restrict__ v, const int32_t* __restrict__ seq,
                              const int64_t* __restrict__ pos) {
  const int64_t t = blockIdx.x;
  const int kvd = kv.kv_heads * kv.head_dim;
  for (int e = threadIdx.x; e < kvd; e += blockDim.x) {
    const int h = e / kv.head_dim, d = e % kv.head_dim;
    int off;
    uint8_t* ks = SlabAt(kv, seq[t], pos[t], layer, h, &off);
    uint8_t* vs = ks + static_cast<int64_t>(kv.kv_heads) * kv.slab_bytes;
    const int64_t idx = static_cast<int64_t>(off) * kv.head_dim + d;
    if (kv.f16) {
      reinterpret_cast<__half*>(ks)[idx] = __float2half_rn(k[t * kvd + e]);
      reinterpret_cast<__half*>(vs)[idx] = __float2half_rn(v[t * kvd + e]);
    } else {
      reinterpret_cast<float*>(ks)[idx] = k[t * kvd + e];
      reinterpret_cast<float*>(vs)[idx] = v[t * kvd + e];
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
__global__ void AttentionKernel(DevKvView kv, int layer, const float* __restrict__ q,
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
  const float* qrow = q + (t * n_heads + head) * hd;
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

// grid (n_heads, T), hd threads: merges the splits of one (token, head).
__global__ void AttentionMergeKernel(const float* __restrict__ partials, int n_heads, int hd,
                                     int n_splits, float* __restrict__ out) {
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
  out[(t * n_heads + head) * hd + e] = m.l > 0.0f ? acc / m.l : 0.0f;
}

__global__ void GatherRowsKernel(const float* __restrict__ x, const int32_t* __restrict__ rows,
                                 int d, float* __restrict__ out) {
  const int64_t r = blockIdx.x;
  for (int i = threadIdx.x; i < d; i += blockDim.x)
    out[r * d + i] = x[static_cast<int64_t>(rows[r]) * d + i];
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

void LaunchGemv(const DevMatrix& w, const float* x, const DevQ8& xq, int64_t T, const float* bias,
                bool accumulate, float* y, cudaStream_t stream) {
  if (T == 0 || w.rows == 0) return;
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
  EmbedKernel<<<static_cast<unsigned>(T), 256, 0, stream>>>(w, tokens, out);
}

void LaunchRmsNorm(const float* x, const int32_t* rows, int64_t R, int d, const float* w, float eps,
                   float* y, cudaStream_t stream) {
  if (R == 0) return;
  RmsNormKernel<<<static_cast<unsigned>(R), kNormThreads, 0, stream>>>(x, rows, d, w, eps, y);
}

void LaunchRope(float* q, float* k, const int64_t* pos, int64_t T, int n_q, int n_kv, int hd,
                int rope_dim, bool neox, float theta_scale, cudaStream_t stream) {
  if (T == 0) return;
  RopeKernel<<<static_cast<unsigned>(T), 256, 0, stream>>>(q, k, pos, n_q, n_kv, hd, rope_dim, neox,
                                                           theta_scale);
}

void LaunchSiluMul(float* gate, const float* up, int64_t T, int64_t n, cudaStream_t stream) {
  if (T * n == 0) return;
  SiluMulKernel<<<GridFor(T * n, 256), 256, 0, stream>>>(gate, up, T, n);
}

void LaunchWriteKv(const DevKvView& kv, int layer, const float* k, const float* v,
                   const int32_t* seq, const int64_t* pos, int64_t T, cudaStream_t stream) {
  if (T == 0) return;
  WriteKvKernel<<<static_cast<unsigned>(T), 256, 0, stream>>>(kv, layer, k, v, seq, pos);
}

int AttentionSplits(int64_t max_len, int split_tokens) {
  return static_cast<int>(CeilDiv(max_len, split_tokens));
}

void LaunchAttention(const DevKvView& kv, int layer, const float* q, const int32_t* seq,
                     const int64_t* pos, int64_t T, int n_heads, int window, float scale,
                     int64_t max_len, int split_tokens, float* partials, float* out,
                     cudaStream_t stream) {
  if (T == 0) return;
  const int splits = AttentionSplits(max_len, split_tokens);
  const dim3 grid(static_cast<unsigned>(n_heads), static_cast<unsigned>(T),
                  static_cast<unsigned>(splits));
  const int threads = kAttnWarps * kWarp;
  switch (kv.head_dim / kWarp) {
    case 1:
      AttentionKernel<1><<<grid, threads, 0, stream>>>(kv, layer, q, seq, pos, n_heads, window,
                                                       scale, split_tokens, partials);
      break;
    case 2:
      AttentionKernel<2><<<grid, threads, 0, stream>>>(kv, layer, q, seq, pos, n_heads, window,
                                                       scale, split_tokens, partials);
      break;
    case 3:
      AttentionKernel<3><<<grid, threads, 0, stream>>>(kv, layer, q, seq, pos, n_heads, window,
                                                       scale, split_tokens, partials);
      break;
    case 4:
      AttentionKernel<4><<<grid, threads, 0, stream>>>(kv, layer, q, seq, pos, n_heads, window,
                                                       scale, split_tokens, partials);
      break;
    case 8:
      AttentionKernel<8><<<grid, threads, 0, stream>>>(kv, layer, q, seq, pos, n_heads, window,
                                                       scale, split_tokens, partials);
      break;
    default:
      return;  // refused at backend creation (SupportedHeadDim)
  }
  AttentionMergeKernel<<<dim3(static_cast<unsigned>(n_heads), static_cast<unsigned>(T)),
                         kv.head_dim, 0, stream>>>(partials, n_heads, kv.head_dim, splits, out);
}

void LaunchGatherRows(const float* x, const int32_t* rows, int64_t R, int d, float* out,
                      cudaStream_t stream) {
  if (R == 0) return;
  GatherRowsKernel<<<static_cast<unsigned>(R), 256, 0, stream>>>(x, rows, d, out);
}

}  // namespace kvrelay::engine::cuda
