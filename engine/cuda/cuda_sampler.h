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
#include "engine/runtime/sampler.h"

namespace kvrelay::engine::cuda {

// The device parameters of a request's SamplingParams (the one sampling
// type, engine/runtime/sampler.h) with `uniform`, its RNG's next draw.
// Unimplemented when the request needs what only the host Sampler does
// (logit_bias, penalties, a response grammar, logprobs): sample it there.
inline Result<DeviceSampleParams> ToDeviceSampleParams(const SamplingParams& s, double uniform) {
  if (!s.logit_bias.empty() || s.repetition_penalty != 1.0f || s.presence_penalty != 0.0f ||
      s.frequency_penalty != 0.0f || !s.json_schema.empty() || s.logprobs >= 0) {
    return Unimplemented("device sampling covers temperature, top-k, top-p and min-p only");
  }
  DeviceSampleParams d;
  d.temperature = s.temperature;
  d.top_k = s.top_k;
  d.top_p = s.top_p;
  d.min_p = s.min_p;
  d.uniform = uniform;
  return d;
}

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
