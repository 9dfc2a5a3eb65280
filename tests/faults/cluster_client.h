// The client half of the fault tests' harness: requests to a cluster's
// OpenAI API (one at a time or open-loop at a fixed rate), /health and
// /metrics readers, and the single-process engine's greedy text to compare
// answers with. It does not start a cluster: fault_harness.h runs one through
// `kvrelay launch`, sanitized_cluster_test through deploy::LocalLauncher.
//
// Every wait has a deadline; conditions are polled until they hold or the
// deadline passes (no sleeps that win races).
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "tests/testing/worker_metrics.h"

namespace kvrelay::faults {

using Clock = std::chrono::steady_clock;

// GET /metrics: the values of `name` by the `worker` label.
using testing::WorkerGauge;
// /health is 200 and lists every id in `ids`.
bool HealthyWith(uint16_t port, const std::vector<std::string>& ids);
// Polls `cond` every 20 ms until it holds or `timeout` passes.
bool WaitFor(const std::function<bool()>& cond, std::chrono::milliseconds timeout);

// One /v1/completions request's outcome.
struct Outcome {
  int prompt = -1;      // index into the client's prompts
  int http_status = 0;  // 0: no HTTP response (transport error)
  std::string text;
  std::string error;
  Clock::time_point sent, ended;
  double seconds() const { return std::chrono::duration<double>(ended - sent).count(); }
};

// Non-streaming greedy completion of `prompt` (token ids), `max_tokens` tokens
// with ignore_eos, bounded by `timeout_ms`.
Outcome Complete(uint16_t port, const std::vector<int32_t>& prompt, int max_tokens, int timeout_ms);

// An open-loop client: from Start() it sends one request every 1/rate seconds
// (cycling through `prompts`), each on its own thread, whatever the answers;
// Stop() stops sending and joins every request (each bounded by its timeout).
class LoadClient {
 public:
  LoadClient(uint16_t port, std::vector<std::vector<int32_t>> prompts, int max_tokens,
             int timeout_ms)
      : port_(port),
        prompts_(std::move(prompts)),
        max_tokens_(max_tokens),
        timeout_ms_(timeout_ms) {}
  ~LoadClient() { Stop(); }
  void Start(double rate_per_s);
  // Returns every outcome, in sending order.
  std::vector<Outcome> Stop();
  // Requests sent and not yet answered: a fault is injected only while this is
  // at least 1, so every case hits a request in flight.
  int InFlight() const { return in_flight_.load(); }

 private:
  const uint16_t port_;
  const std::vector<std::vector<int32_t>> prompts_;
  const int max_tokens_;
  const int timeout_ms_;
  std::atomic<bool> stop_{false};
  std::atomic<int> in_flight_{0};
  std::thread sender_;
  std::mutex mu_;
  std::vector<std::thread> requests_;           // guarded by mu_
  std::vector<std::unique_ptr<Outcome>> outs_;  // guarded by mu_ (the pointers)
};

// The model's greedy tokens, computed by the single-process engine; null when
// the model file is absent.
class GreedyReference {
 public:
  static GreedyReference* Get();
  std::vector<int32_t> Encode(const std::string& text) const;
  // The text the cluster must answer for `prompt` with `max_tokens` tokens.
  std::string Text(const std::vector<int32_t>& prompt, int max_tokens);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

std::string ModelPath();

}  // namespace kvrelay::faults
