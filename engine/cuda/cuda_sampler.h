// Token sampling on the device over logits the CUDA backend left in device
// memory, with the CPU Sampler's seeded semantics (engine/runtime/sampler.h):
// greedy = first index of the maximum; otherwise the top_k candidates in the
// CPU's order (logit descending, ties by smaller id), softmax at temperature
// in double, min-p, top-p, and the pick by the uniform the request's own
// std::mt19937_64 drew on the host (math::PickSorted, the CPU's arithmetic).
// Penalties are not applied here (the host Sampler path handles requests
// that use them), and top_k must be in [1, kMaxDeviceTopK] when sampling.
#pragma once

#include <cstdint>
#include <span>

#include "common/status.h"
#include "engine/cuda/sample_params.h"

namespace kvrelay::engine::cuda {

class CudaSampler {
 public:
  CudaSampler() = default;
  ~CudaSampler();
  CudaSampler(const CudaSampler&) = delete;
  CudaSampler& operator=(const CudaSampler&) = delete;

  // One token per row of d_logits ([rows][vocab] floats on the device) into
  // tokens (host). `stream` is a cudaStream_t (null: the default stream);
  // returns after the tokens are on the host. Unimplemented for params the
  // device does not cover (top_k = 0 or above kMaxDeviceTopK with
  // temperature > 0): the caller samples those rows on the host.
  Status Sample(const float* d_logits, int64_t rows, int vocab,
                std::span<const DeviceSampleParams> params, int32_t* tokens, void* stream);

 private:
  void* scratch_ = nullptr;  // device: params, row copies, probabilities, tokens
  size_t scratch_bytes_ = 0;
};

}  // namespace kvrelay::engine::cuda
