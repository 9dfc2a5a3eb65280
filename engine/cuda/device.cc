#include "engine/cuda/device.h"

#include <cstdio>

#include "engine/cuda/cuda_util.h"

namespace kvrelay::engine::cuda {

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

Status UseDevice(int index, std::string* description) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    cudaGetLastError();
    return Unavailable(std::string("no CUDA device was found") +
                       (e != cudaSuccess ? std::string(" (") + cudaGetErrorString(e) + ")" : ""));
  }
  if (index < 0 || index >= n) {
    return Unavailable("CUDA device " + std::to_string(index) +
                       " does not exist (this machine has " + std::to_string(n) + ")");
  }
  KVR_CUDA_RETURN(cudaSetDevice(index));
  if (description != nullptr) {
    cudaDeviceProp p{};
    KVR_CUDA_RETURN(cudaGetDeviceProperties(&p, index));
    char buf[320];
    std::snprintf(buf, sizeof(buf), "%s (sm_%d%d, %.0f GiB)", p.name, p.major, p.minor,
                  static_cast<double>(p.totalGlobalMem) / (1ull << 30));
    *description = buf;
  }
  return Status::Ok();
}

Status DeviceMemory(size_t* free_bytes, size_t* total_bytes) {
  KVR_CUDA_RETURN(cudaMemGetInfo(free_bytes, total_bytes));
  return Status::Ok();
}

}  // namespace kvrelay::engine::cuda
