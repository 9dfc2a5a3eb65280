#include "engine/cuda/cuda_sampler.h"

#include <string>

#include "engine/cuda/cuda_util.h"
#include "engine/cuda/kernels.cuh"

namespace kvrelay::engine::cuda {

CudaSampler::~CudaSampler() {
  if (scratch_ != nullptr) cudaFree(scratch_);
}

Status CudaSampler::Sample(const float* d_logits, int64_t rows, int vocab,
                           std::span<const DeviceSampleParams> params, int32_t* tokens,
                           void* stream) {
  if (static_cast<int64_t>(params.size()) != rows) {
    return InvalidArgument("CudaSampler: " + std::to_string(params.size()) + " params for " +
                           std::to_string(rows) + " rows");
  }
  if (rows == 0) return Status::Ok();
  if (vocab < 1) return InvalidArgument("CudaSampler: vocab must be >= 1");
  for (const DeviceSampleParams& p : params) {
    if (p.temperature > 0.0f && (p.top_k < 1 || p.top_k > kMaxDeviceTopK || p.top_k > vocab)) {
      return Unimplemented("device sampling needs top_k in [1, " + std::to_string(kMaxDeviceTopK) +
                           "] (got " + std::to_string(p.top_k) + "); sample on the host");
    }
    if (!(p.uniform >= 0.0 && p.uniform < 1.0))
      return InvalidArgument("CudaSampler: uniform not in [0, 1)");
  }
  auto align = [](size_t n) { return (n + 255) & ~size_t{255}; };
  const size_t params_b = align(rows * sizeof(DeviceSampleParams));
  const size_t work_b = align(static_cast<size_t>(rows) * vocab * sizeof(float));
  const size_t cv_b = align(static_cast<size_t>(rows) * kMaxDeviceTopK * sizeof(float));
  const size_t ci_b = align(static_cast<size_t>(rows) * kMaxDeviceTopK * sizeof(int32_t));
  const size_t pr_b = align(static_cast<size_t>(rows) * kMaxDeviceTopK * sizeof(double));
  const size_t out_b = align(rows * sizeof(int32_t));
  const size_t total = params_b + work_b + cv_b + ci_b + pr_b + out_b;
  if (total > scratch_bytes_) {
    if (scratch_ != nullptr) cudaFree(scratch_);
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    KVR_CUDA_RETURN(cudaMalloc(&scratch_, total));
    scratch_bytes_ = total;
  }
  uint8_t* base = static_cast<uint8_t*>(scratch_);
  auto* d_params = reinterpret_cast<DeviceSampleParams*>(base);
  auto* d_work = reinterpret_cast<float*>(base + params_b);
  auto* d_cv = reinterpret_cast<float*>(base + params_b + work_b);
  auto* d_ci = reinterpret_cast<int32_t*>(base + params_b + work_b + cv_b);
  auto* d_pr = reinterpret_cast<double*>(base + params_b + work_b + cv_b + ci_b);
  auto* d_out = reinterpret_cast<int32_t*>(base + params_b + work_b + cv_b + ci_b + pr_b);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  KVR_CUDA_RETURN(cudaMemcpyAsync(d_params, params.data(), rows * sizeof(DeviceSampleParams),
                                  cudaMemcpyHostToDevice, s));
  LaunchSample(d_logits, rows, vocab, d_params, d_work, d_cv, d_ci, d_pr, d_out, s);
  KVR_CUDA_RETURN(cudaGetLastError());
  KVR_CUDA_RETURN(
      cudaMemcpyAsync(tokens, d_out, rows * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
  KVR_CUDA_RETURN(cudaStreamSynchronize(s));
  return Status::Ok();
}

}  // namespace kvrelay::engine::cuda
