#include "engine/runtime/compute_backend.h"

#include <charconv>

#if KVRELAY_WITH_CUDA
#include "engine/cuda/cuda_kernels.h"
#endif

namespace kvrelay::engine {
namespace {

// Every backend: the one ForwardPass over the device's kernel table.
class KernelBackend final : public ComputeBackend {
 public:
  KernelBackend(DeviceSpec device, const Model& model, KvBlockPool* pool, KvCacheGroups groups,
                std::unique_ptr<StepKernels> kernels)
      : device_(device), forward_(model, pool, std::move(groups), std::move(kernels)) {}
  DeviceSpec device() const override { return device_; }
  Status Run(std::span<const SeqStep> seqs, ForwardOutput* out,
             const std::function<void(int layer)>& layer_hook,
             std::span<const BackendPick> picks) override {
    return forward_.Run(seqs, out, layer_hook, picks);
  }
  bool PicksTokens() const override { return forward_.kernels().PicksTokens(); }
  void SetCollective(TpCollective* collective) override { forward_.SetCollective(collective); }
  void InvalidateBlock(BlockId block) override { forward_.kernels().InvalidateBlock(block); }

 private:
  DeviceSpec device_;
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
  return CreateComputeBackend(options, model, pool, KvCacheGroups::One(model.config().n_layers),
                              threads);
}

Result<std::unique_ptr<ComputeBackend>> CreateComputeBackend(const ComputeBackendOptions& options,
                                                             const Model& model, KvBlockPool* pool,
                                                             const KvCacheGroups& groups,
                                                             ThreadPool* threads) {
  if (pool == nullptr) return InvalidArgument("CreateComputeBackend: null pool");
  if (options.device.kind == DeviceKind::kCpu) {
    return std::unique_ptr<ComputeBackend>(
        new KernelBackend(options.device, model, pool, groups,
                          std::make_unique<CpuKernels>(model, pool, groups, threads)));
  }
#if KVRELAY_WITH_CUDA
  ASSIGN_OR_RETURN(std::unique_ptr<StepKernels> kernels,
                   cuda::CreateCudaKernels(options, model, pool, groups));
  return std::unique_ptr<ComputeBackend>(
      new KernelBackend(options.device, model, pool, groups, std::move(kernels)));
#else
  return Unimplemented("device " + DeviceName(options.device) +
                       ": this build has no CUDA backend (configure with the CUDA toolkit "
                       "installed, KVRELAY_WITH_CUDA=ON)");
#endif
}

}  // namespace kvrelay::engine
