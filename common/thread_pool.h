// A fixed-size pool of named worker threads for data-parallel loops.
//
// Threads are created once (never per step) and sleep on a condition variable
// when idle, so an idle pool costs no CPU. ParallelFor is the only entry point:
// the calling thread takes part in the work, and returns when all of it is done.
#pragma once

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
  explicit ThreadPool(int num_threads, std::string name = "pool");
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // Calls fn(begin, end, thread_index) on disjoint chunks covering [0, n).
  // Chunks are contiguous, one per thread (static split), at least `grain` long.
  // Not reentrant: fn must not call ParallelFor on the same pool.
  void ParallelFor(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn,
                   int64_t grain = 1);

  // Number of cores the process may use (sched affinity), at least 1.
  static int DefaultThreads();

 private:
  void WorkerLoop(int index);

  const int num_threads_;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  // All guarded by mutex_.
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  const std::function<void(int64_t, int64_t, int)>* fn_ = nullptr;
  int64_t n_ = 0;
  int64_t chunk_ = 0;
};

}  // namespace kvrelay
