// The device sampling kernel (cuda_sampler.h).
#include <cuda_runtime.h>

#include "engine/cuda/kernel_math.h"
#include "engine/cuda/kernels.cuh"

namespace kvrelay::engine::cuda {
namespace {

constexpr int kThreads = 1024;

struct Best {
  float v;
  int32_t id;
};
// Candidate order with removed entries (NaN) last.
__device__ __forceinline__ bool Better(Best a, Best b) {
  if (b.id < 0 || isnan(b.v)) return a.id >= 0 && !isnan(a.v);
  if (a.id < 0 || isnan(a.v)) return false;
  return math::CandidateBefore(a.v, a.id, b.v, b.id);
}

__device__ Best BlockBest(Best mine, Best* shared) {
  for (int o = 16; o > 0; o >>= 1) {
    Best other{__shfl_xor_sync(0xFFFFFFFFu, mine.v, o), __shfl_xor_sync(0xFFFFFFFFu, mine.id, o)};
    if (Better(other, mine)) mine = other;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) shared[warp] = mine;
  __syncthreads();
  if (warp == 0) {
    mine = lane < static_cast<int>(blockDim.x / 32) ? shared[lane] : Best{0.0f, -1};
    for (int o = 16; o > 0; o >>= 1) {
      Best other{__shfl_xor_sync(0xFFFFFFFFu, mine.v, o), __shfl_xor_sync(0xFFFFFFFFu, mine.id, o)};
      if (Better(other, mine)) mine = other;
    }
    if (lane == 0) shared[0] = mine;
  }
  __syncthreads();
  return shared[0];
}

// One CTA per row. Greedy: one argmax. Sampling: top_k rounds of argmax over
// a copy of the row (a chosen entry becomes NaN), then thread 0 picks.
__global__ void SampleKernel(const float* __restrict__ logits, int vocab,
                             const DeviceSampleParams* __restrict__ params,
                             float* __restrict__ work, float* __restrict__ cand_v,
                             int32_t* __restrict__ cand_id, double* __restrict__ probs,
                             int32_t* __restrict__ out) {
  __shared__ Best shared[32];
  const int64_t r = blockIdx.x;
  const float* row = logits + r * vocab;
  const DeviceSampleParams p = params[r];
  const bool greedy = p.temperature <= 0.0f;
  const int k = greedy ? 1 : p.top_k;
  float* w = work + r * vocab;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) w[i] = row[i];
  __syncthreads();
  for (int round = 0; round < k; ++round) {
    Best mine{0.0f, -1};
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
      const Best c{w[i], i};
      if (Better(c, mine)) mine = c;
    }
    const Best b = BlockBest(mine, shared);
    if (threadIdx.x == 0) {
      cand_v[r * kMaxDeviceTopK + round] = b.v;
      cand_id[r * kMaxDeviceTopK + round] = b.id;
      if (b.id >= 0) w[b.id] = NAN;
    }
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  if (greedy) {
    out[r] = cand_id[r * kMaxDeviceTopK];
    return;
  }
  out[r] = math::PickSorted(cand_v + r * kMaxDeviceTopK, cand_id + r * kMaxDeviceTopK, k,
                            p.temperature, p.min_p, p.top_p, p.uniform, probs + r * kMaxDeviceTopK);
}

}  // namespace

void LaunchSample(const float* logits, int64_t rows, int vocab, const DeviceSampleParams* params,
                  float* work, float* cand_v, int32_t* cand_id, double* probs, int32_t* out,
                  cudaStream_t stream) {
  SampleKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(logits, vocab, params, work,
                                                                     cand_v, cand_id, probs, out);
}

}  // namespace kvrelay::engine::cuda
