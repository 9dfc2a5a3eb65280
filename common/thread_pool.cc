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

// Spins until pred() or `budget` passes; true when pred() held.
template <typename Pred>
bool SpinUntil(std::chrono::nanoseconds budget, Pred pred) {
  if (budget.count() <= 0) return pred();
  const auto until = std::chrono::steady_clock::now() + budget;
  for (int i = 0;; ++i) {
    if (pred()) return true;
    KVRELAY_CPU_RELAX();
    if ((i & 63) == 63 && std::chrono::steady_clock::now() >= until) return pred();
  }
}

}  // namespace

ThreadPool::ThreadPool(int num_threads, std::string name, int spin_us)
    : num_threads_(std::max(1, num_threads)),
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

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t, int64_t, int)>& fn,
                             int64_t grain) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t max_chunks = (n + grain - 1) / grain;
  const int threads = static_cast<int>(std::min<int64_t>(num_threads_, max_chunks));
  if (threads <= 1) {
    fn(0, n, 0);
    return;
  }
  fn_ = &fn;
  n_ = n;
  chunk_ = (n + threads - 1) / threads;
  pending_.store(num_threads_ - 1, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  {
    // Workers check generation_ under the mutex before sleeping, so a
    // notify made after the bump cannot be lost.
    std::lock_guard<std::mutex> lock(mutex_);
    if (sleeping_workers_ > 0) work_cv_.notify_all();
  }
  fn(0, std::min(n, chunk_), 0);
  auto done = [this] { return pending_.load(std::memory_order_acquire) == 0; };
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
    const int64_t begin = std::min(n_, chunk_ * index);
    const int64_t end = std::min(n_, begin + chunk_);
    if (begin < end) (*fn_)(begin, end, index);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (caller_sleeping_) done_cv_.notify_one();
    }
  }
}

}  // namespace kvrelay
