// Bounded admission: at most `max_running` requests are in the backend at a
// time and at most `max_queue` more wait for a slot, first come first served.
// Anything beyond is refused (the HTTP layer answers 429 with Retry-After),
// so memory and backend load stay bounded under any offered load.
//
// A request is also refused when the time to its first token is predicted to
// exceed `max_queue_delay_ms` (2 s by default; 0 = no bound) and something is
// ahead of it: a client is told at once to come back later instead of
// waiting (and holding a connection) for a first token that arrives too late
// to be of use. An idle cluster never refuses, however long the prompt.
//
// Two estimates, the larger wins:
// - The slot queue. While every slot is busy a slot frees every
//   H / max_running on average, where H is the measured time a request holds
//   its slot (an exponentially weighted mean over finished requests; before
//   any finished, the mean age of the running ones, which they have held at
//   least), so the (q+1)-th waiter starts after about (q + 1) * H / max_running.
// - The first tokens. With max_running large, requests wait inside the
//   backend (its prefill queue, KV room) where the slot queue cannot see it.
//   The queue measures the interval G between first tokens while some
//   request was waiting for one (a decayed mean, so it follows load changes
//   within tens of requests and ignores idle gaps) and S, the time to a first
//   token of a request admitted with nothing ahead of it, and predicts
//   A * G + max(G, S) for a request with A ahead of it (admitted without a
//   first token yet, or queued for a slot): the A ahead drain one per G
//   (requests prefilled in one batch share it), then its own prefill takes
//   S. A count, not tokens: prompts of very different lengths make it coarse.
// Retry-After is computed from the same estimate: the time until the work
// ahead has drained to within the bound.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "common/clock.h"
#include "common/status.h"

namespace kvrelay::coordinator {

// The default bound on the predicted time to a first token
// (--max-queue-delay-ms): a request that would wait longer behind others is
// refused at once with 429.
inline constexpr int kDefaultMaxQueueDelayMs = 2'000;

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

  // Started request `id` produced its first token (its wait feeds the
  // prediction); later calls for it are ignored.
  void FirstToken(uint64_t id);

  int running() const;
  int queued() const;
  // The queue wait a request arriving now is predicted to see, in ms (0 while
  // a slot is free or before any request finished).
  double PredictedQueueDelayMs() const;
  // The measured mean time a request holds a slot, in ms (0 = none yet).
  double MeanHoldMs() const;
  // The measured mean interval between first tokens while requests waited
  // for one, in ms (0 = none yet).
  double FirstTokenIntervalMs() const;
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
  // Before `id` joins the requests waiting for a first token: starts the
  // busy period the next interval is measured from, if none runs.
  void MarkWaitingLocked(TimePoint now);

  const Options options_;
  mutable std::mutex mutex_;
  int running_ = 0;                                  // guarded by mutex_
  std::deque<Waiter> queue_;                         // guarded by mutex_
  std::unordered_map<uint64_t, TimePoint> started_;  // guarded by mutex_: id -> slot taken
  double hold_ms_ = 0;                               // guarded by mutex_: EWMA
  int64_t holds_ = 0;                                // guarded by mutex_: samples
  std::unordered_set<uint64_t> before_first_;  // guarded by mutex_: started, no first token yet
  TimePoint first_mark_{};  // guarded by mutex_: the last first token or the busy period's start
  double gap_sum_ = 0;      // guarded by mutex_: decayed sum of first-token intervals (ms)
  double gap_count_ = 0;    // guarded by mutex_: decayed count of them
  std::unordered_set<uint64_t> solo_;  // guarded by mutex_: started with nothing ahead
  double solo_sum_ = 0;    // guarded by mutex_: decayed sum of their times to a first token (ms)
  double solo_count_ = 0;  // guarded by mutex_: decayed count of them
};

}  // namespace kvrelay::coordinator
