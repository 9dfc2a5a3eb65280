// Bounded admission: at most `max_running` requests are in the backend at a
// time and at most `max_queue` more wait for a slot, first come first served.
// Anything beyond is refused (the HTTP layer answers 429 with Retry-After),
// so memory and backend load stay bounded under any offered load.
//
// A request is also refused when the wait it would see in the queue is
// predicted to exceed `max_queue_delay_ms` (10 s by default; 0 = no bound): a
// client is told at once to come back later instead of waiting (and holding
// a connection) for a first token that arrives too late to be of use. The
// prediction comes from the measured throughput of the slots: while every
// slot is busy, a slot frees every H / max_running on average, where H is the
// measured time a request holds its slot (an exponentially weighted mean over
// finished requests; before any finished, the mean age of the running ones,
// which they have held at least), so the (q+1)-th waiter starts after about
// (q + 1) * H / max_running. Retry-After is computed from the same estimate:
// the time until the queue ahead has drained to within the bound.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <unordered_map>

#include "common/clock.h"
#include "common/status.h"

namespace kvrelay::coordinator {

// The default bound on the predicted queue wait (--max-queue-delay-ms): a
// request that would wait longer for a slot is refused at once with 429.
inline constexpr int kDefaultMaxQueueDelayMs = 10'000;

class AdmissionQueue {
 public:
  struct Options {
    int max_running = 64;                              // >= 1
    int max_queue = 256;                               // >= 0
    int max_queue_delay_ms = kDefaultMaxQueueDelayMs;  // refuse beyond this predicted wait; 0 = off
    int retry_after_seconds = 1;  // Retry-After at least, until a hold time was measured
    std::function<TimePoint()> now =
        nullptr;  // the clock (tests pass their own); empty = Clock::now
  };
  explicit AdmissionQueue(Options options);

  // Why a request was refused and when to come back.
  struct Refusal {
    enum Reason { kQueueFull, kQueueDelay } reason = kQueueFull;
    int retry_after_seconds = 1;  // >= 1
  };

  // Runs `start` now (inline, on the caller's thread) when a slot is free,
  // otherwise queues it to run on the thread of a later Release(). Returns
  // ResourceExhausted when the queue is full or the predicted queue wait
  // exceeds max_queue_delay_ms (start is then never called), with `*refusal`
  // (if given) filled. The started request owns one slot until Release(id).
  Status Enqueue(uint64_t id, std::function<void()> start, Refusal* refusal = nullptr);

  // A queued request that no longer wants to start (client went away).
  // True if it was still queued (its start will never run).
  bool Remove(uint64_t id);

  // Frees the slot of started request `id` (its hold time feeds the
  // prediction) and starts the next queued one.
  void Release(uint64_t id);

  int running() const;
  int queued() const;
  // The queue wait a request arriving now is predicted to see, in ms (0 while
  // a slot is free or before any request finished).
  double PredictedQueueDelayMs() const;
  // The measured mean time a request holds a slot, in ms (0 = none yet).
  double MeanHoldMs() const;
  const Options& options() const { return options_; }

 private:
  struct Waiter {
    uint64_t id;
    std::function<void()> start;
  };
  TimePoint Now() const { return options_.now ? options_.now() : Clock::now(); }
  double PredictedLocked() const;
  // H: the measured mean hold time, or before any request finished the mean
  // age of the running ones (0 when none runs).
  double HoldEstimateLocked() const;
  int RetryAfterLocked(double excess_ms) const;

  const Options options_;
  mutable std::mutex mutex_;
  int running_ = 0;                                  // guarded by mutex_
  std::deque<Waiter> queue_;                         // guarded by mutex_
  std::unordered_map<uint64_t, TimePoint> started_;  // guarded by mutex_: id -> slot taken
  double hold_ms_ = 0;                               // guarded by mutex_: EWMA
  int64_t holds_ = 0;                                // guarded by mutex_: samples
};

}  // namespace kvrelay::coordinator
