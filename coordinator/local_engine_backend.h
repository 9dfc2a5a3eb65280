// A Backend that runs an engine::Engine in this process (colocated prefill
// and decode): the single-process serving mode, and the reference the
// disaggregated cluster must match.
//
// Threads: one named stepping thread ("engine-step") owns the Engine. Submit
// and Cancel only enqueue work for it and wake it; when there is no work the
// thread sleeps on a condition variable (no spinning). Sinks are called on
// the stepping thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/backend.h"
#include "engine/runtime/engine.h"

namespace kvrelay::coordinator {

class LocalEngineBackend : public Backend {
 public:
  struct Options {
    std::string worker_id = "local-0";
    // Tokens that end generation (EOS/EOT); they finish a request with kStop
    // and are never delivered to the sink as text. Optional.
    std::function<bool(int32_t)> is_end_of_generation;
    // Upper bound of one idle sleep; the thread wakes earlier on new work.
    int idle_wait_ms = 200;
  };

  // Takes ownership of `engine` and starts the stepping thread.
  static Result<std::unique_ptr<LocalEngineBackend>> Create(std::unique_ptr<engine::Engine> engine,
                                                            Options options);
  // Stops the thread; every request still live gets a final kCancelled event.
  ~LocalEngineBackend() override;

  Status Submit(GenerationRequest request, TokenSink sink) override;
  void Cancel(uint64_t id) override;
  Status Health() override;
  std::vector<WorkerInfo> Workers() override;

 private:
  LocalEngineBackend(std::unique_ptr<engine::Engine> engine, Options options);
  void Loop();
  // Stepping thread: hands pending submits and cancels to the engine.
  void DrainInbox(std::vector<std::pair<TokenSink, TokenEvent>>* out, bool* step_needed);
  void UpdateSnapshot();

  struct Pending {
    GenerationRequest request;
    TokenSink sink;
  };

  std::unique_ptr<engine::Engine> engine_;  // used only by the stepping thread
  const Options options_;
  struct Live {
    TokenSink sink;
    bool ignore_eos = false;
  };
  std::map<uint64_t, Live> live_;  // stepping thread only

  std::mutex mutex_;
  std::condition_variable cv_;
  // All guarded by mutex_.
  std::deque<Pending> submits_;
  std::vector<uint64_t> cancels_;
  bool stop_ = false;
  Status failure_;  // set when Step failed; the backend is then unhealthy
  WorkerInfo snapshot_;

  std::thread thread_;
};

}  // namespace kvrelay::coordinator
