#include "common/thread_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace kvrelay {
namespace {

TEST(ThreadPoolTest, CoversRangeExactlyOnce) {
  ThreadPool pool(4);
  for (int64_t n : {1, 3, 4, 7, 1000, 1001}) {
    std::vector<std::atomic<int>> hits(n);
    pool.ParallelFor(n, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) hits[i]++;
    });
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n=" << n << " i=" << i;
  }
}

TEST(ThreadPoolTest, ManyRoundsReuseThreads) {
  ThreadPool pool(3);
  std::atomic<int64_t> sum{0};
  for (int round = 0; round < 2000; ++round) {
    pool.ParallelFor(30, [&](int64_t b, int64_t e, int) { sum += e - b; });
  }
  EXPECT_EQ(sum.load(), 2000 * 30);
}

// Chunk boundaries are a function of (n, grain, threads) alone: the same set
// of ranges every round, whichever thread ran each.
TEST(ThreadPoolTest, ChunkBoundariesAreFixed) {
  ThreadPool pool(3);
  for (int64_t n : {5, 64, 1000}) {
    const int64_t len = pool.ChunkLength(n, 2);
    std::vector<std::pair<int64_t, int64_t>> want;
    for (int64_t b = 0; b < n; b += len) want.emplace_back(b, std::min(n, b + len));
    EXPECT_LE(static_cast<int64_t>(want.size()), 3 * ThreadPool::kChunksPerThread);
    for (int round = 0; round < 50; ++round) {
      std::mutex mu;
      std::vector<std::pair<int64_t, int64_t>> got;
      pool.ParallelFor(
          n,
          [&](int64_t b, int64_t e, int) {
            std::lock_guard<std::mutex> lock(mu);
            got.emplace_back(b, e);
          },
          2);
      std::sort(got.begin(), got.end());
      ASSERT_EQ(got, want) << "n=" << n << " round " << round;
    }
  }
}

// A worker that stalls inside its chunk (as a descheduled thread does on a
// shared machine) holds up only that chunk: the caller claims and runs every
// chunk the stalled worker did not take. With a static split the caller would
// run only its own share and this test would hit the deadline.
TEST(ThreadPoolTest, CallerTakesOverAStalledWorkersShare) {
  ThreadPool pool(2, "stall", /*spin_us=*/0);
  const int64_t n = 64;
  const int64_t chunks = (n + pool.ChunkLength(n) - 1) / pool.ChunkLength(n);
  ASSERT_GE(chunks, 4);
  for (int round = 0; round < 20; ++round) {
    std::atomic<int64_t> caller_chunks{0};
    std::atomic<int64_t> worker_chunks{0};
    std::atomic<bool> timed_out{false};
    pool.ParallelFor(n, [&](int64_t, int64_t, int index) {
      if (index == 0) {
        caller_chunks.fetch_add(1);
        return;
      }
      worker_chunks.fetch_add(1);
      // Stall until the caller has run everything else (deadline 10 s).
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (caller_chunks.load() < chunks - 1) {
        if (std::chrono::steady_clock::now() > deadline) {
          timed_out = true;
          return;
        }
        std::this_thread::yield();
      }
    });
    ASSERT_FALSE(timed_out.load()) << "round " << round;
    EXPECT_LE(worker_chunks.load(), 1);
    EXPECT_EQ(caller_chunks.load() + worker_chunks.load(), chunks);
  }
}

}  // namespace
}  // namespace kvrelay
