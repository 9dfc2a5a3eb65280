// Bounded admission: at most `max_running` requests are in the backend at a
// time and at most `max_queue` more wait for a slot, first come first served.
// Anything beyond is refused (the HTTP layer answers 429 with Retry-After),
// so memory and backend load stay bounded under any offered load.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>

#include "common/status.h"

namespace kvrelay::coordinator {

class AdmissionQueue {
 public:
  struct Options {
    int max_running = 64;  // >= 1
    int max_queue = 256;   // >= 0
  };
  explicit AdmissionQueue(Options options);

  // Runs `start` now (inline, on the caller's thread) when a slot is free,
  // otherwise queues it to run on the thread of a later Release(). Returns
  // ResourceExhausted when the queue is full (start is then never called).
  // The started request owns one slot until Release().
  Status Enqueue(uint64_t id, std::function<void()> start);

  // A queued request that no longer wants to start (client went away).
  // True if it was still queued (its start will never run).
  bool Remove(uint64_t id);

  // Frees the slot of a started request and starts the next queued one.
  void Release();

  int running() const;
  int queued() const;
  const Options& options() const { return options_; }

 private:
  struct Waiter {
    uint64_t id;
    std::function<void()> start;
  };
  const Options options_;
  mutable std::mutex mutex_;
  int running_ = 0;           // guarded by mutex_
  std::deque<Waiter> queue_;  // guarded by mutex_
};

}  // namespace kvrelay::coordinator
