// CUDA runtime plumbing shared by engine/cuda and the CUDA transports:
// error conversion at the adapter edge (cudaError_t -> Status) and RAII
// owners of device, pinned-host memory, streams and events. Internal.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "common/status.h"

namespace kvrelay::engine::cuda {

// Status for a CUDA error: no device / driver problems are Unavailable (the
// machine cannot run this), out-of-memory ResourceExhausted, others Internal.
inline Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  std::string m =
      std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
  switch (e) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
    case cudaErrorDevicesUnavailable:
    case cudaErrorSystemDriverMismatch:
      return Unavailable(std::move(m));
    case cudaErrorMemoryAllocation:
      return ResourceExhausted(std::move(m));
    default:
      return Internal(std::move(m));
  }
}

#define KVR_CUDA_RETURN(expr)                                           \
  do {                                                                  \
    const cudaError_t kvr_cuda_err_ = (expr);                           \
    if (kvr_cuda_err_ != cudaSuccess)                                   \
      return ::kvrelay::engine::cuda::CudaStatus(kvr_cuda_err_, #expr); \
  } while (0)

// Device memory that grows on demand (contents are not kept on growth).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() { Free(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}

  Status Reserve(size_t bytes) {
    if (bytes <= bytes_) return Status::Ok();
    Free();
    void* p = nullptr;
    KVR_CUDA_RETURN(cudaMalloc(&p, bytes));
    ptr_ = p;
    bytes_ = bytes;
    return Status::Ok();
  }
  void Free() {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Page-locked host memory (for asynchronous copies), grows on demand.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer() { Free(); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  Status Reserve(size_t bytes) {
    if (bytes <= bytes_) return Status::Ok();
    Free();
    void* p = nullptr;
    KVR_CUDA_RETURN(cudaMallocHost(&p, bytes));
    ptr_ = p;
    bytes_ = bytes;
    return Status::Ok();
  }
  void Free() {
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

class Stream {
 public:
  Stream() = default;
  ~Stream() {
    if (s_ != nullptr) cudaStreamDestroy(s_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  Status Create() {
    KVR_CUDA_RETURN(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking));
    return Status::Ok();
  }
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

class Event {
 public:
  Event() = default;
  ~Event() {
    if (e_ != nullptr) cudaEventDestroy(e_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  Event(Event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  Status Create(unsigned flags = cudaEventDisableTiming) {
    KVR_CUDA_RETURN(cudaEventCreateWithFlags(&e_, flags));
    return Status::Ok();
  }
  cudaEvent_t get() const { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

}  // namespace kvrelay::engine::cuda
