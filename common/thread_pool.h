// A fixed-size pool of named worker threads for data-parallel loops.
//
// Threads are created once (never per step). Between loops a worker spins for
// a short, bounded time (spin_us) watching for the next loop — a decode step
// runs hundreds of short loops back to back, and a condition-variable wake-up
// per loop would cost more than the loop — and then sleeps on a condition
// variable, so an idle pool costs no CPU. ParallelFor is the only entry point:
// the calling thread takes part in the work, and returns when all of it is done.
//
// Work is claimed dynamically: a loop is cut into a fixed number of chunks
// (several per thread) and every thread, the caller included, claims the next
// unclaimed chunk from one atomic word until none is left. On a machine shared
// with other processes a descheduled worker then delays a loop by at most the
// one chunk it holds, not by its whole static share: the running threads take
// over the chunks it never claimed. Chunk boundaries depend only on (n, grain,
// num_threads), never on which thread runs a chunk, so a loop whose chunks
// write disjoint outputs gives the same result whoever runs them.
#pragma once

#include <atomic>
#include <chrono>
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

  // Calls fn(begin, end, thread_index) on disjoint contiguous chunks covering
  // [0, n), each at least `grain` long (the last may be shorter only when n
  // is). There are up to kChunksPerThread chunks per thread; which thread runs
  // which chunk is decided at run time, and one thread may run several chunks
  // (one at a time; thread_index is the running thread's, 0 = the caller, so
  // per-thread scratch indexed by it is never shared by two running chunks).
  // Not reentrant: fn must not call ParallelFor on the same pool, and one
  // thread at a time may call it.
  void ParallelFor(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn,
                   int64_t grain = 1);

  // The chunk length ParallelFor uses for (n, grain) on this pool (tests and
  // callers that want to know the fixed boundaries: chunk i is
  // [i * len, min(n, (i + 1) * len))).
  int64_t ChunkLength(int64_t n, int64_t grain = 1) const;

  // Number of cores the process may use (sched affinity), at least 1.
  static int DefaultThreads();

  static constexpr int kChunksPerThread = 4;

 private:
  void WorkerLoop(int index);
  // Claims and runs chunks of loop `gen` until none is left or another loop
  // has started. Returns the number of chunks this thread ran.
  int RunChunks(uint32_t gen, int index);

  const int num_threads_;
  const std::chrono::nanoseconds spin_;
  std::vector<std::thread> workers_;

  // The current loop. fn_, n_ and chunk_ are written by the caller before it
  // publishes the loop in state_ (release) and read by a worker only after it
  // has claimed a chunk of that loop from state_ (acquire): the caller does
  // not start another loop before every chunk is done, so they cannot change
  // under a thread that holds a chunk.
  const std::function<void(int64_t, int64_t, int)>* fn_ = nullptr;
  int64_t n_ = 0;
  int64_t chunk_ = 0;
  // Bits 63..32: loop generation; 31..16: next unclaimed chunk; 15..0: chunk count.
  std::atomic<uint64_t> state_{0};
  std::atomic<uint64_t> generation_{0};  // wake-up word for workers
  std::atomic<int> done_{0};             // chunks of the current loop finished
  std::atomic<bool> stop_{false};

  std::mutex mutex_;
  std::condition_variable work_cv_;  // workers sleep here between loops
  std::condition_variable done_cv_;  // the caller sleeps here for the last chunks
  int sleeping_workers_ = 0;         // guarded by mutex_
  bool caller_sleeping_ = false;     // guarded by mutex_
};

}  // namespace kvrelay
