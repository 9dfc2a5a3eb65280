#include "common/thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVRELAY_CPU_RELAX() _mm_pause()
#else
#define KVRELAY_CPU_RELAX() ((void)0)
#endif

namespace kvrelay {
namespace {

int SpinMicros(int requested) {
  if (requested >= 0) return requested;
  const char* env = std::getenv("KVRELAY_POOL_SPIN_US");
  if (env == nullptr) return 200;
  return std::max(0, std::atoi(env));
}

// Busy-waits with pause for this long before yielding the core between checks.
constexpr std::chrono::nanoseconds kPauseOnly = std::chrono::microseconds(20);

// Spins until pred() or `budget` passes; true when pred() held. After the
// first kPauseOnly the spin yields between checks: on a core shared with
// another runnable thread (a descheduled worker of this pool, or another
// process) that thread then runs instead of the spin.
template <typename Pred>
bool SpinUntil(std::chrono::nanoseconds budget, Pred pred) {
  if (budget.count() <= 0) return pred();
  const auto start = std::chrono::steady_clock::now();
  const auto until = start + budget;
  const auto pause_until = start + std::min(budget, kPauseOnly);
  bool yielding = false;
  for (int i = 0;; ++i) {
    if (pred()) return true;
    if (yielding) {
      sched_yield();
    } else {
      KVRELAY_CPU_RELAX();
    }
    if (yielding || (i & 63) == 63) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= until) return pred();
      yielding = now >= pause_until;
    }
  }
}

constexpr uint64_t Pack(uint32_t gen, uint32_t next, uint32_t count) {
  return (static_cast<uint64_t>(gen) << 32) | (static_cast<uint64_t>(next) << 16) | count;
}
constexpr uint32_t GenOf(uint64_t s) { return static_cast<uint32_t>(s >> 32); }
constexpr uint32_t NextOf(uint64_t s) { return static_cast<uint32_t>(s >> 16) & 0xFFFF; }
constexpr uint32_t CountOf(uint64_t s) { return static_cast<uint32_t>(s) & 0xFFFF; }

}  // namespace

ThreadPool::ThreadPool(int num_threads, std::string name, int spin_us)
    : num_threads_(std::clamp(num_threads, 1, 1024)),
      spin_(std::chrono::microseconds(SpinMicros(spin_us))) {
  for (int i = 1; i < num_threads_; ++i) {
    workers_.emplace_back([this, i] { WorkerLoop(i); });
    std::string thread_name = (name + "-" + std::to_string(i)).substr(0, 15);
    pthread_setname_np(workers_.back().native_handle(), thread_name.c_str());
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_.store(true, std::memory_order_release);
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

int ThreadPool::DefaultThreads() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

int64_t ThreadPool::ChunkLength(int64_t n, int64_t grain) const {
  if (n <= 0) return 0;
  grain = std::max<int64_t>(1, grain);
  const int64_t max_chunks = (n + grain - 1) / grain;
  const int64_t threads = std::min<int64_t>(num_threads_, max_chunks);
  if (threads <= 1) return n;
  const int64_t chunks = std::min<int64_t>(max_chunks, threads * kChunksPerThread);
  return std::max(grain, (n + chunks - 1) / chunks);
}

int ThreadPool::RunChunks(uint32_t gen, int index) {
  int ran = 0;
  uint64_t s = state_.load(std::memory_order_acquire);
  for (;;) {
    if (GenOf(s) != gen || NextOf(s) >= CountOf(s)) return ran;
    const uint64_t claimed = Pack(gen, NextOf(s) + 1, CountOf(s));
    if (!state_.compare_exchange_weak(s, claimed, std::memory_order_acq_rel,
                                      std::memory_order_acquire)) {
      continue;  // s now holds the current word
    }
    const int64_t begin = static_cast<int64_t>(NextOf(s)) * chunk_;
    const int64_t end = std::min(n_, begin + chunk_);
    const uint32_t count = CountOf(s);
    (*fn_)(begin, end, index);
    ++ran;
    if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<int>(count) &&
        index != 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (caller_sleeping_) done_cv_.notify_one();
    }
    s = claimed;
  }
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn,
                             int64_t grain) {
  if (n <= 0) return;
  const int64_t len = ChunkLength(n, grain);
  if (len >= n) {
    fn(0, n, 0);
    return;
  }
  const int64_t chunks = (n + len - 1) / len;  // <= num_threads_ * kChunksPerThread
  fn_ = &fn;
  n_ = n;
  chunk_ = len;
  done_.store(0, std::memory_order_relaxed);
  const uint32_t gen = static_cast<uint32_t>(generation_.load(std::memory_order_relaxed) + 1);
  state_.store(Pack(gen, 0, static_cast<uint32_t>(std::min<int64_t>(chunks, 0xFFFF))),
               std::memory_order_release);
  generation_.fetch_add(1, std::memory_order_release);
  {
    // Workers check generation_ under the mutex before sleeping, so a
    // notify made after the bump cannot be lost.
    std::lock_guard<std::mutex> lock(mutex_);
    if (sleeping_workers_ > 0) work_cv_.notify_all();
  }
  RunChunks(gen, 0);
  // Every chunk is claimed; wait for the ones other threads still run.
  auto done = [&] { return done_.load(std::memory_order_acquire) == static_cast<int>(chunks); };
  if (!SpinUntil(spin_, done)) {
    std::unique_lock<std::mutex> lock(mutex_);
    caller_sleeping_ = true;
    done_cv_.wait(lock, done);
    caller_sleeping_ = false;
  }
  fn_ = nullptr;
}

void ThreadPool::WorkerLoop(int index) {
  uint64_t seen = 0;
  for (;;) {
    auto has_work = [&] {
      return stop_.load(std::memory_order_acquire) ||
             generation_.load(std::memory_order_acquire) != seen;
    };
    if (!SpinUntil(spin_, has_work)) {
      std::unique_lock<std::mutex> lock(mutex_);
      ++sleeping_workers_;
      work_cv_.wait(lock, has_work);
      --sleeping_workers_;
    }
    if (stop_.load(std::memory_order_acquire)) return;
    seen = generation_.load(std::memory_order_acquire);
    RunChunks(static_cast<uint32_t>(seen), index);
  }
}

}  // namespace kvrelay
