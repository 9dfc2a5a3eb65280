// The request-level engine: continuous batching over one model and one paged
// KV pool. This is the API the prefill and decode workers and the coordinator
// build on; keep it stable (extend additively).
//
// Threading: an Engine is thread-compatible. One owner thread calls Submit,
// Cancel and Step; Step uses the engine's own ThreadPool internally and returns
// when the step is complete. The KvConnector is called on that thread.
//
// Scheduling (inside Step):
//  * FCFS admission while fewer than max_running sequences run and the pool
//    has the blocks for the next chunk; prefix-cache reuse at admission
//    (pool->MatchPrefix on the chain hashes of the prompt's full blocks, then
//    the connector's lower tiers for the blocks the pool does not hold).
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
#include "engine/kv_cache/kv_groups.h"
#include "engine/runtime/kv_connector.h"
#include "engine/runtime/sampler.h"
#include "engine/runtime/step_plan.h"

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
  // A model that mixes full-attention and sliding-window layers (gemma3) gets
  // full-attention and sliding-window KV cache groups on the CPU backend, so
  // a sequence holds only the blocks inside its window on the sliding layers
  // (engine/kv_cache/kv_groups.h). False: one group of every layer whatever
  // the model (attention still applies each layer's window) — the reference
  // the split is tested against; every path is the same N-group code.
  bool split_kv_groups = true;

  Status Validate() const;
};

enum class RequestMode : uint8_t {
  kFull = 0,          // prefill, then decode until a stop condition
  kPrefillOnly = 1,   // prefill, sample the first token, finish with kPrefilled
                      // (or kStop / kLength when that token already ends it);
                      // the connector may keep the prompt's blocks
                      // (KvConnector::RequestFinished) — the prefill role
  kRemotePrompt = 2,  // the prompt's KV (and its first token) come from the
                      // connector (KvConnector::StartRemoteLoad); decoding
                      // starts when the load is done — the decode role
};

struct RequestSpec {
  RequestId id = 0;             // unique among live requests
  std::vector<int32_t> prompt;  // token ids, non-empty
  SamplingParams sampling;
  std::string tenant_salt;  // isolates prefix-cache hits per tenant
  RequestMode mode = RequestMode::kFull;
  // TokenEvent::text is filled (the engine detokenizes) only when set or when
  // sampling.stop is not empty. Serving leaves it off: the coordinator
  // detokenizes and matches stop strings itself.
  bool want_text = true;
  // kRemotePrompt: the data-plane peer that sends this request's KV, for the
  // connector (as vLLM's kv_transfer_params: opaque to the engine). -1: none.
  int kv_peer = -1;
  uint64_t kv_transfer_id = 0;  // the id its KV streams use (0: id)
};

enum class FinishReason : uint8_t {
  kNone = 0,       // not finished
  kStop = 1,       // end-of-generation token or stop string
  kLength = 2,     // max_tokens or context length reached
  kCancelled = 3,  // Cancel(id)
  kError = 4,      // see TokenEvent::error
  kPrefilled = 5,  // kPrefillOnly request done; its blocks went to the connector
};
std::string_view FinishReasonName(FinishReason r);  // "stop", "length", ...

// One event per request per Step that produced something for it.
struct TokenEvent {
  RequestId id = 0;
  int32_t token = -1;  // -1 when no token comes with the event (cancel, error)
  std::string text;    // detokenized text released by this token (stop-string safe)
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;
  Status error;  // set when finish_reason == kError
  int64_t prompt_tokens = 0;
  int64_t cached_prompt_tokens = 0;  // prompt tokens reused from the prefix cache or a tier
  // With a sampled `token` when sampling.logprobs >= 0.
  bool has_logprobs = false;
  TokenLogprobs logprobs;
  // The request's RequestSpec::kv_transfer_id (0 when it has none): workers
  // tag their reports with it, so a report of an earlier attempt of a re-run
  // request (same id) is told apart from the current one's.
  uint64_t kv_transfer_id = 0;
};

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
  // Cancels a queued, loading or running request: its blocks are released now
  // and the next Step emits its finished event (kCancelled). NotFound if unknown.
  Status Cancel(RequestId id);
  // Cancels every live request (a worker that lost its coordinator); the
  // prefix cache stays. Returns how many were cancelled.
  int64_t CancelAll();
  // Runs one scheduling step and returns the events it produced.
  Result<std::vector<TokenEvent>> Step();
  // True while any request is queued or running or an event is pending (a
  // Step computes). Loading requests are not work: see loading().
  bool HasWork() const;

  // --- disaggregation and tiers ---
  // Installs the KV connector (kv_connector.h; not owned, must outlive the
  // engine, may be null). Call before the first Submit. The connector
  // addresses the engine's KV cache groups (kv_groups()), one or several.
  void SetKvConnector(KvConnector* connector);
  // kRemotePrompt requests whose KV is still being loaded.
  int64_t loading() const;

  // Makes this engine rank 0 of a tensor-parallel group (tensor_parallel.h):
  // its model must be a shard, every step's plan is published before the
  // forward and partial projections are all-reduced. Call before the first
  // Submit. FailedPrecondition for a KV dtype TP cannot mirror. With several
  // KV cache groups the plan carries every group's table (SeqStep::
  // group_blocks): the followers' pools must be built with the same groups.
  Status SetTensorParallel(const TensorParallelHooks& hooks);

  KvBlockPool* pool();
  // The KV cache groups the pool's blocks serve: one group of every layer,
  // or, for a model that mixes full-attention and sliding-window layers on
  // the CPU backend, full-attention and sliding-window groups
  // (KvCacheGroups::FromLayerWindows); the pool's blocks hold
  // layers_per_block() layers.
  const KvCacheGroups& kv_groups() const;
  // Pool blocks request `id` holds now, per KV cache group (holes of a
  // sliding-window table not counted). NotFound unless it is queued, loading
  // or running.
  Result<std::vector<int64_t>> HeldBlocks(RequestId id) const;
  const Model& model() const;
  const EngineOptions& options() const;
  // Counters since creation.
  struct Stats {
    int64_t steps = 0;
    int64_t prompt_tokens_computed = 0;
    int64_t prompt_tokens_cached = 0;
    int64_t generated_tokens = 0;
    int64_t preemptions = 0;
    // Per KV cache group: the most pool blocks one sequence held between two
    // steps (after its out-of-window blocks were dropped). A sliding-window
    // group's stays <= ceil(window / block_tokens) + 1; a full-attention
    // group's is the longest sequence's block count.
    std::vector<int64_t> peak_group_blocks;
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
