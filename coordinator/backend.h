// The seam between the coordinator's HTTP front end and whatever generates
// tokens: a colocated engine in this process (LocalEngineBackend), or the
// cluster of prefill and decode workers over the control plane.
//
// Backends deal only in token ids; tokenization, chat templates, stop strings
// and detokenization stay in the coordinator.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/metrics.h"
#include "common/status.h"
#include "engine/runtime/sampler.h"
#include "protocols/port_counters.h"

namespace kvrelay::coordinator {

// SHA-256 chain hash of one full prefix block (same bytes as engine::BlockHash).
using PrefixBlockHash = std::array<uint8_t, 32>;

// The one sampling description (engine/runtime/sampler.h). The coordinator
// always sets a seed (a random one when the client gave none).
using SamplingParams = engine::SamplingParams;
using TokenLogprobs = engine::TokenLogprobs;

struct GenerationRequest {
  uint64_t id = 0;  // unique per coordinator process
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  std::string tenant_salt;  // isolates prefix-cache blocks per tenant ("" = shared)
  std::vector<PrefixBlockHash> prefix_blocks;  // chain hashes of the prompt's full blocks
};

enum class FinishReason {
  kNone = 0,   // not finished
  kStop,       // end-of-sequence token (not emitted as text)
  kLength,     // max_new_tokens reached
  kCancelled,  // Backend::Cancel was called
  kError,      // see TokenEvent::error
};

// One step of a request's life, delivered in order.
struct TokenEvent {
  // A generated token id, or -1 when this event carries no token (e.g. a final
  // event for EOS, cancel or error).
  int32_t token = -1;
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;
  Status error;           // set when finish_reason == kError
  int prompt_tokens = 0;  // filled on the first event at least
  int cached_tokens = 0;  // prompt tokens served from the prefix cache (first event)
  // With `token`, when the request asked for logprobs (sampling.logprobs >= 0).
  bool has_logprobs = false;
  TokenLogprobs logprobs;
};

// Called by the backend from one of its own threads. Events of one request are
// delivered sequentially (never concurrently) and in order, ending with exactly
// one event with finished == true (also after Cancel). The sink must be cheap
// and must not call back into the backend synchronously except Cancel.
using TokenSink = std::function<void(const TokenEvent&)>;

enum class WorkerRole { kColocated, kPrefill, kDecode };

// A point-in-time view of one worker, for routing, /health and /metrics.
struct WorkerInfo {
  std::string id;  // unique, e.g. "prefill-0"
  WorkerRole role = WorkerRole::kColocated;
  bool healthy = true;
  // Non-empty while it cannot reach a data-plane peer (Heartbeat.data_plane_error).
  std::string data_plane_error;
  int64_t queued_requests = 0;
  int64_t queued_tokens = 0;  // prompt tokens waiting for prefill
  int64_t running = 0;        // sequences in the running batch
  int64_t max_batch = 0;      // 0 = unknown / unlimited
  int64_t total_kv_blocks = 0;
  int64_t free_kv_blocks = 0;
  int64_t block_tokens = 16;
  int64_t prefix_hit_tokens = 0;      // cumulative prompt tokens served from cache
  int64_t transfer_bytes = 0;         // cumulative KV bytes sent/received
  double transfer_seconds = 0;        // cumulative seconds spent in KV transfer
  int64_t quarantined_kv_blocks = 0;  // never reused: abandoned to a dead peer's MPI request
  int64_t kv_integrity_failures = 0;  // cumulative: KV streams refused by a checksum/manifest check
  int64_t prompt_tokens_computed = 0;  // cumulative (the cached ones: prefix_hit_tokens)
  int64_t generated_tokens = 0;        // cumulative
  int64_t preemptions = 0;             // cumulative
  double process_cpu_seconds = 0;      // the worker process's user + system CPU
  int64_t process_resident_bytes = 0;  // its RSS
  // Per KV cache group: its window (0 = full attention) and the most blocks
  // one sequence held in it between steps (from heartbeats).
  std::vector<int64_t> kv_group_window;
  std::vector<int64_t> kv_group_peak_blocks;
  // What the worker's KV data port and TP link refused (cumulative, from heartbeats).
  protocols::PortSecurityCounters kv_port;
  protocols::PortSecurityCounters tp_port;
  // Its prefix store, when it has one (from heartbeats; cumulative but for
  // write_backlog, disk_entries and disk_used_bytes).
  struct PrefixStore {
    int64_t restored_blocks_ram = 0, restored_blocks_disk = 0, restored_bytes = 0, restores = 0;
    int64_t restore_misses = 0, spills = 0;
    int64_t write_through_blocks = 0, write_through_dropped = 0, write_backlog = 0;
    int64_t disk_written_blocks = 0, disk_written_bytes = 0, disk_write_failures = 0;
    int64_t disk_entries = 0, disk_used_bytes = 0;
  };
  std::optional<PrefixStore> prefix_store;
};

// A figure a backend keeps, exported on /metrics under `name`: a cumulative
// count (Counters: e.g. what its control plane refused; `name` ends in
// _total) or a value now (Gauges: e.g. its requests per phase).
struct BackendMetric {
  std::string name;
  std::string help;
  double value = 0;
  MetricLabels labels;  // beside the server's own (model)
};

class Backend {
 public:
  virtual ~Backend() = default;

  // Starts generating. On OK the sink will receive events until one has
  // finished == true; on error it is never called. ResourceExhausted means "no
  // capacity right now" (the HTTP layer answers 503). Thread-safe.
  virtual Status Submit(GenerationRequest request, TokenSink sink) = 0;

  // Asks the backend to stop request `id`; its sink still gets a final event
  // (finish_reason kCancelled unless it had already finished). Unknown ids are
  // ignored. Thread-safe, non-blocking.
  virtual void Cancel(uint64_t id) = 0;

  // OK when the backend can serve requests (for a cluster: at least one
  // prefill and one decode worker registered); Unavailable otherwise.
  virtual Status Health() = 0;

  // Snapshot of the workers. Thread-safe.
  virtual std::vector<WorkerInfo> Workers() = 0;

  // The backend's cumulative counters, read at every /metrics scrape. Thread-safe.
  virtual std::vector<BackendMetric> Counters() { return {}; }
  // The backend's gauges, read likewise. Thread-safe.
  virtual std::vector<BackendMetric> Gauges() { return {}; }
};

}  // namespace kvrelay::coordinator
