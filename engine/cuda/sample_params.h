// Per-row parameters of device sampling (cuda_sampler.h); plain data shared
// by the host code and the kernel.
#pragma once

namespace kvrelay::engine::cuda {

inline constexpr int kMaxDeviceTopK = 1024;

struct DeviceSampleParams {
  float temperature = 0.0f;  // <= 0: greedy
  int top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  double uniform = 0.0;  // [0, 1): the request RNG's next draw (unused when greedy)
};

}  // namespace kvrelay::engine::cuda
