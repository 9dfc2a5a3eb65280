#include "engine/runtime/compute_backend.h"

#include <charconv>

#if KVRELAY_WITH_CUDA
#include "engine/cuda/cuda_backend.h"
#endif

namespace kvrelay::engine {
namespace {

// The default backend: ForwardPass on the engine's thread pool.
class CpuBackend final : public ComputeBackend {
 public:
  CpuBackend(const Model& model, KvBlockPool* pool, ThreadPool* threads)
      : forward_(model, pool, threads) {}
  DeviceSpec device() const override { return {}; }
  Status Run(std::span<const SeqStep> seqs, ForwardOutput* out,
             const std::function<void(int layer)>& layer_hook) override {
    return forward_.Run(seqs, out, layer_hook);
  }
  void SetCollective(TpCollective* collective) override { forward_.SetCollective(collective); }
  void InvalidateBlock(BlockId) override {}

 private:
  ForwardPass forward_;
};

}  // namespace

Result<DeviceSpec> ParseDevice(std::string_view text) {
  if (text == "cpu") return DeviceSpec{};
  if (text == "cuda") return DeviceSpec{DeviceKind::kCuda, 0};
  if (text.starts_with("cuda:")) {
    const std::string_view n = text.substr(5);
    int index = -1;
    const auto [end, ec] = std::from_chars(n.data(), n.data() + n.size(), index);
    if (ec == std::errc() && end == n.data() + n.size() && !n.empty() && index >= 0) {
      return DeviceSpec{DeviceKind::kCuda, index};
    }
  }
  return InvalidArgument("device must be cpu, cuda or cuda:N, got '" + std::string(text) + "'");
}

std::string DeviceName(const DeviceSpec& device) {
  return device.kind == DeviceKind::kCpu ? "cpu" : "cuda:" + std::to_string(device.index);
}

bool CudaBackendBuilt() { return KVRELAY_WITH_CUDA != 0; }

Result<std::unique_ptr<ComputeBackend>> CreateComputeBackend(const ComputeBackendOptions& options,
                                                             const Model& model, KvBlockPool* pool,
                                                             ThreadPool* threads) {
  if (pool == nullptr) return InvalidArgument("CreateComputeBackend: null pool");
  if (options.device.kind == DeviceKind::kCpu) {
    return std::unique_ptr<ComputeBackend>(new CpuBackend(model, pool, threads));
  }
#if KVRELAY_WITH_CUDA
  return cuda::CreateCudaBackend(options, model, pool);
#else
  return Unimplemented("device " + DeviceName(options.device) +
                       ": this build has no CUDA backend (configure with the CUDA toolkit "
                       "installed, KVRELAY_WITH_CUDA=ON)");
#endif
}

}  // namespace kvrelay::engine
