// A fixed-size pool of named worker threads for data-parallel loops.
//
// Threads are created once (never per step). Between loops a worker spins for
// a short, bounded time (spin_us) watching for the next loop — a decode step
// runs hundreds of short loops back to back, and a condition-variable wake-up
// per loop would cost more than the loop — and then sleeps on a condition
// variable, so an idle pool costs no CPU. ParallelFor is the only entry point:
// the calling thread takes part in the work, and returns when all of it is done.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace kvrelay {

class ThreadPool {
 public:
  // num_threads counts the caller: 1 means "run everything inline".
  // spin_us < 0 takes KVRELAY_POOL_SPIN_US from the environment (default 200);
  // 0 never spins (every hand-off sleeps and wakes).
  explicit ThreadPool(int num_threads, std::string name = "pool", int spin_us = -1);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // Calls fn(begin, end, thread_index) on disjoint chunks covering [0, n).
  // Chunks are contiguous, one per thread (static split), at least `grain` long.
  // Not reentrant: fn must not call ParallelFor on the same pool, and one
  // thread at a time may call it.
  void ParallelFor(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn,
                   int64_t grain = 1);

  // Number of cores the process may use (sched affinity), at least 1.
  static int DefaultThreads();

 private:
  void WorkerLoop(int index);

  const int num_threads_;
  const std::chrono::nanoseconds spin_;
  std::vector<std::thread> workers_;

  // The current loop. Written by the caller before generation_ is bumped
  // (release) and read by workers after they see the bump (acquire).
  const std::function<void(int64_t, int64_t, int)>* fn_ = nullptr;
  int64_t n_ = 0;
  int64_t chunk_ = 0;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};  // workers still running the current loop
  std::atomic<bool> stop_{false};

  std::mutex mutex_;
  std::condition_variable work_cv_;  // workers sleep here between loops
  std::condition_variable done_cv_;  // the caller sleeps here for pending_ == 0
  int sleeping_workers_ = 0;         // guarded by mutex_
  bool caller_sleeping_ = false;     // guarded by mutex_
};

}  // namespace kvrelay
