// The compute-backend seam: where the forward pass of one engine runs.
//
// Every backend is the one ForwardPass (forward.h: the model's structure,
// written once) over its device's kernel table (step_kernels.h): the CPU
// table (cpu_kernels.h, the default; bit-identical to llama.cpp) or the CUDA
// table (engine/cuda/cuda_kernels.h), which keeps the weights quantized in
// device memory and a device copy of the pool with the same block layout:
//
//   * host -> device: a block whose host bytes changed behind the backend's
//     back (KV imported by a decode worker, restored from the store, a
//     copy-on-write copy) is re-uploaded per layer slot before the first
//     step that reads it. The engine learns of such writes through the
//     pool's host-write hook (KvBlockPool::SetHostWriteHook), which it
//     routes to InvalidateBlock.
//   * device -> host: the K/V a step computes is copied back into the host
//     pool (one copy per step), so exports, the layer hook, spills and
//     transfers read exactly what they read with the CPU backend.
//
// Not thread-safe, like ForwardPass: one owner thread per backend.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"
#include "common/thread_pool.h"
#include "engine/kv_cache/kv_cache.h"
#include "engine/kv_cache/kv_groups.h"
#include "engine/runtime/forward.h"
#include "engine/runtime/model.h"
#include "engine/runtime/tp_collective.h"

namespace kvrelay::engine {

enum class DeviceKind : uint8_t { kCpu = 0, kCuda = 1 };

struct DeviceSpec {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;  // CUDA device ordinal
  bool operator==(const DeviceSpec&) const = default;
};

// "cpu", "cuda" (= cuda:0) or "cuda:N". InvalidArgument naming the text otherwise.
Result<DeviceSpec> ParseDevice(std::string_view text);
std::string DeviceName(const DeviceSpec& device);  // "cpu", "cuda:0"

// True when this binary was built with the CUDA backend (KVRELAY_WITH_CUDA).
bool CudaBackendBuilt();

class ComputeBackend {
 public:
  virtual ~ComputeBackend() = default;
  virtual DeviceSpec device() const = 0;
  // ForwardPass::Run's contract (forward.h), including the layer hook: it is
  // called in layer order, each call after that layer's K/V of every
  // sequence is in the host pool.
  // With `picks` (only when PicksTokens()) the backend picks the rows'
  // tokens itself (ForwardOutput::picked).
  virtual Status Run(std::span<const SeqStep> seqs, ForwardOutput* out,
                     const std::function<void(int layer)>& layer_hook = {},
                     std::span<const BackendPick> picks = {}) = 0;
  // Whether Run takes picks: sampling on the device (CUDA).
  virtual bool PicksTokens() const = 0;
  // ForwardPass::SetCollective.
  virtual void SetCollective(TpCollective* collective) = 0;
  // The bytes of `block` in the host pool changed (all layers): a device
  // mirror must re-read them (the engine routes the pool's host-write hook,
  // KvBlockPool::SetHostWriteHook, here). The CPU backend ignores it.
  virtual void InvalidateBlock(BlockId block) = 0;
};

struct ComputeBackendOptions {
  DeviceSpec device;
  // CUDA: prefill chunks of at least this many tokens use the fp16 tensor-core
  // path (dequantize + cuBLAS); smaller steps use the quantized GEMV.
  // 32: below it the GEMV reads the quantized weights at most 4 times (once
  // per 8 tokens), about what one pass over the fp16 copies costs.
  int gemm_min_tokens = 32;
  // CUDA: positions per attention split (flash-decoding) for long contexts.
  int attention_split_tokens = 256;
  // CUDA: copy each step's K/V back into the host pool (what the engine
  // needs: exports, spills, the layer hook read host bytes). Off only for a
  // device-only run (benchmarks); Run then refuses a layer hook.
  bool mirror_kv_to_host = true;
  // CUDA: replay decode steps (fewer than gemm_min_tokens tokens, no KV
  // upload, no tensor parallelism) from CUDA graphs captured per step shape,
  // which removes the per-kernel launch cost that dominates small models.
  bool cuda_graphs = true;
  // CUDA: also keep an fp16 copy of every matrix for the tensor-core path
  // when all copies fit in this fraction of the free device memory (0: never;
  // then each large step dequantizes each matrix into a scratch tile). The
  // quantized weights stay and serve every decode step below gemm_min_tokens;
  // the copy saves a full dequantization pass per large batch / prefill step.
  double fp16_weight_cache_fraction = 0.5;
};

// The backend for options.device. `model`, `pool` and `threads` must outlive
// it (threads may be null). CUDA: Unimplemented when built without CUDA,
// Unavailable naming the problem when no CUDA device is found (or the ordinal
// is out of range), Unimplemented for a weight type or KV dtype the kernels
// do not cover; the model's weights are copied to the device here.
Result<std::unique_ptr<ComputeBackend>> CreateComputeBackend(const ComputeBackendOptions& options,
                                                             const Model& model, KvBlockPool* pool,
                                                             ThreadPool* threads);
// The same for a pool whose blocks serve KV cache `groups` (kv_groups.h).
Result<std::unique_ptr<ComputeBackend>> CreateComputeBackend(const ComputeBackendOptions& options,
                                                             const Model& model, KvBlockPool* pool,
                                                             const KvCacheGroups& groups,
                                                             ThreadPool* threads);

}  // namespace kvrelay::engine
