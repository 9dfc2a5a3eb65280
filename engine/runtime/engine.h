// The request-level engine: continuous batching over one model and one paged
// KV pool. This is the API the prefill and decode workers and the coordinator
// build on; keep it stable (extend additively).
//
// Threading: an Engine is thread-compatible. One owner thread calls Submit,
// Cancel, Step, ExportBlocks, ReleaseRequest and AdmitPrefilled; Step uses the
// engine's own ThreadPool internally and returns when the step is complete.
//
// Scheduling (inside Step):
//  * FCFS admission while fewer than max_running sequences run and the pool
//    has the blocks for the next chunk; prefix-cache reuse at admission
//    (pool->MatchPrefix on the chain hashes of the prompt's full blocks).
//  * Continuous batching with chunked prefill: one step holds one decode token
//    per running sequence plus prefill chunks, at most max_step_tokens tokens.
//  * Full blocks are committed to the prefix cache as they fill; a shared
//    block is copied (copy-on-write) before it is written.
//  * When blocks run out, the youngest running sequence is preempted: its
//    blocks are released and it is requeued to be recomputed (its generated
//    tokens are kept and re-prefilled, so the output is unchanged).
//  * Every path (finish, cancel, error, preemption, ReleaseRequest) returns
//    every block reference the request held.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/kv_cache/kv_cache.h"
#include "engine/runtime/sampler.h"

namespace kvrelay::engine {

class Model;
struct TensorParallelHooks;

struct EngineOptions {
  std::string model_path;  // GGUF file; ignored when a Model is passed to Create
  KvDtype kv_dtype = KvDtype::kF32;
  // Total KV budget of the pool; 0 = room for max_running full contexts, capped at 1 GiB.
  int64_t kv_capacity_bytes = 0;
  int block_tokens = 16;
  int threads = 0;            // 0 = ThreadPool::DefaultThreads()
  int max_step_tokens = 512;  // tokens computed per Step (chunked prefill budget)
  int max_running = 64;       // sequences in the running batch
  // Longest prompt + generation accepted (0 = the model's context length).
  int64_t max_context = 0;
  // Where the forward pass runs: "cpu" (default) or "cuda" / "cuda:N"
  // (engine/runtime/compute_backend.h). Create fails with Unavailable when
  // no CUDA device is found, Unimplemented in a build without CUDA.
  std::string device = "cpu";

  Status Validate() const;
};

enum class RequestMode : uint8_t {
  kFull = 0,         // prefill, then decode until a stop condition
  kPrefillOnly = 1,  // prefill, sample the first token, finish with kPrefilled
                     // (or kStop / kLength when that token already ends it) and
                     // KEEP the prompt's blocks until ReleaseRequest (disaggregation)
};

struct RequestSpec {
  std::string id;               // unique among live requests
  std::vector<int32_t> prompt;  // token ids, non-empty
  SamplingParams sampling;
  std::string tenant_salt;  // isolates prefix-cache hits per tenant
  RequestMode mode = RequestMode::kFull;
};

enum class FinishReason : uint8_t {
  kNone = 0,       // not finished
  kStop = 1,       // end-of-generation token or stop string
  kLength = 2,     // max_tokens or context length reached
  kCancelled = 3,  // Cancel(id)
  kError = 4,      // see TokenEvent::error
  kPrefilled = 5,  // kPrefillOnly request done; blocks kept for ExportBlocks
};
std::string_view FinishReasonName(FinishReason r);  // "stop", "length", ...

// One event per request per Step that produced something for it.
struct TokenEvent {
  std::string id;
  int32_t token = -1;  // -1 when no token comes with the event (cancel, error)
  std::string text;    // detokenized text released by this token (stop-string safe)
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;
  Status error;  // set when finish_reason == kError
  int64_t prompt_tokens = 0;
  int64_t cached_prompt_tokens = 0;  // prompt tokens reused from the prefix cache
};

// Describes one sequence's part of the step being computed, for the layer hook.
struct StepSequence {
  const std::string* id;            // valid during the hook call
  int64_t begin;                    // first position written in this step
  int64_t end;                      // one past the last position written
  std::span<const BlockId> blocks;  // the sequence's block table
};
// Called during Step right after layer `layer`'s K/V of every sequence in the
// step is written to the pool (layer-wise KV streaming). Runs on the Step thread.
using LayerHook = std::function<void(int layer, std::span<const StepSequence> seqs)>;

class Engine {
 public:
  // Loads options.model_path and creates the pool.
  static Result<std::unique_ptr<Engine>> Create(const EngineOptions& options);
  // Shares an already loaded model (several engines, or tests).
  static Result<std::unique_ptr<Engine>> Create(const EngineOptions& options,
                                                std::shared_ptr<const Model> model);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a request. InvalidArgument for a bad spec (empty prompt, token out
  // of vocab, duplicate id, bad sampling params); ResourceExhausted if it can
  // never fit (prompt + max_tokens over the context or over the whole pool).
  Status Submit(RequestSpec spec);
  // Cancels a queued or running request: its blocks are released now and the
  // next Step emits its finished event (kCancelled). NotFound if unknown.
  Status Cancel(const std::string& id);
  // Runs one scheduling step and returns the events it produced.
  Result<std::vector<TokenEvent>> Step();
  // True while any request is queued or running.
  bool HasWork() const;

  // --- disaggregation ---
  // The block table of a finished kPrefillOnly request (covering its prompt),
  // valid until ReleaseRequest. NotFound if there is no such kept request.
  Result<std::vector<BlockId>> ExportBlocks(const std::string& id) const;
  // Drops a kept request's block references. NotFound if unknown.
  Status ReleaseRequest(const std::string& id);
  // Decode side: the prompt's KV is already in `blocks` of this pool
  // (ceil(prompt/B) blocks; the engine takes over ONE reference of each), and
  // `first_token` was sampled by the prefill side. Decoding continues from
  // there; the first event carries the second generated token. On error the
  // references are released.
  Status AdmitPrefilled(RequestSpec spec, int32_t first_token, std::vector<BlockId> blocks);

  void SetLayerHook(LayerHook hook);
  // Makes this engine rank 0 of a tensor-parallel group (tensor_parallel.h):
  // its model must be a shard, every step's plan is published before the
  // forward and partial projections are all-reduced. Call before the first
  // Submit. FailedPrecondition for a KV dtype TP cannot mirror.
  Status SetTensorParallel(const TensorParallelHooks& hooks);

  KvBlockPool* pool();
  const Model& model() const;
  const EngineOptions& options() const;
  // Counters since creation.
  struct Stats {
    int64_t steps = 0;
    int64_t prompt_tokens_computed = 0;
    int64_t prompt_tokens_cached = 0;
    int64_t generated_tokens = 0;
    int64_t preemptions = 0;
  };
  Stats stats() const;
  int64_t running() const;  // sequences in the running batch
  int64_t queued() const;

 private:
  class Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvrelay::engine
