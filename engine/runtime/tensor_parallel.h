// Tensor parallelism inside one decode group of T ranks.
//
// Every rank loads a TensorParallelShard of the model (model.h): its KV heads,
// the query heads of their groups and a slice of the FFN columns, and keeps a
// KV pool with the SAME number of blocks holding only its heads (TpMode says
// how the output projections are split). Rank 0 runs a
// normal Engine (scheduling, block allocation, prefix cache, sampling); before
// each forward it publishes a StepPlan. The other ranks run a TpFollower that
// repeats the plan on its pool: the same block copies, the same sequences and
// positions into the same block ids. The forward pass of every rank calls the
// group's collective twice per layer (kExact: all-gather of the head outputs
// and of the FFN activations; kReduce: all-reduce after attn_output and after
// ffn_down), so the residual stream is identical on every rank; only rank 0
// computes the LM head.
//
// Block ids mean the same thing on every rank because only rank 0 allocates:
// a follower's pool is plain storage indexed by block id. Anything that
// writes a block outside a plan (KV arriving from a prefill worker) must be
// done by every rank for its own heads before rank 0 uses the block. Dtypes
// whose blocks carry state beyond their bytes (KIVI staging) are refused.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "common/status.h"
#include "engine/kv_cache/kv_cache.h"
#include "engine/kv_cache/kv_groups.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/step_plan.h"
#include "engine/runtime/tp_collective.h"

namespace kvrelay::engine {

class Model;

// Rank 0: installed with Engine::SetTensorParallel.
struct TensorParallelHooks {
  TpCollective* collective = nullptr;  // must outlive the engine
  // Called with each step's plan before its forward runs; an error fails the
  // step's sequences (like a forward error).
  std::function<Status(const StepPlan&)> publish;
};

// Ranks 1..T-1.
class TpFollower {
 public:
  // `model` is this rank's shard; the pool gets `total_blocks` blocks (rank
  // 0's count). options.kv_dtype, block_tokens, threads and device are used:
  // the rank computes on options.device (cuda:N: its own GPU; the CUDA
  // backend's errors as Engine::Create's).
  static Result<std::unique_ptr<TpFollower>> Create(const EngineOptions& options,
                                                    std::shared_ptr<const Model> model,
                                                    int64_t total_blocks, TpCollective* collective);
  // The same with rank 0's KV cache groups (engine/kv_cache/kv_groups.h):
  // the pool's blocks hold groups.layers_per_block() layers and the plans
  // carry every group's table. `groups` must be rank 0's.
  static Result<std::unique_ptr<TpFollower>> Create(const EngineOptions& options,
                                                    std::shared_ptr<const Model> model,
                                                    KvCacheGroups groups, int64_t total_blocks,
                                                    TpCollective* collective);
  ~TpFollower();

  // Repeats one step of rank 0. InvalidArgument for a plan that names blocks
  // or tokens outside this rank's pool / vocabulary (nothing is written then).
  Status Execute(const StepPlan& plan);

  KvBlockPool* pool();
  const Model& model() const;
  const KvCacheGroups& kv_groups() const;

 private:
  class Impl;
  explicit TpFollower(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A TP group whose ranks are threads of one process (tests, and the
// single-process simulation): AllReduceSum waits for every rank, sums the
// buffers in rank order and hands each rank the same result. A rank that does
// not arrive within `timeout` makes the others fail with DeadlineExceeded.
class InProcessTpGroup {
 public:
  InProcessTpGroup(int size, std::chrono::milliseconds timeout);
  ~InProcessTpGroup();
  TpCollective* rank(int r);

 private:
  class Rank;
  struct Shared;
  std::unique_ptr<Shared> shared_;
  std::vector<std::unique_ptr<Rank>> ranks_;
};

// KV dtypes a TP group can use (OK) or why not.
Status CheckTensorParallelDtype(KvDtype dtype);

}  // namespace kvrelay::engine
