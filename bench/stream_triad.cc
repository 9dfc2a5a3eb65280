// A STREAM-like triad, a[i] = b[i] + s * c[i], over arrays far larger than the
// last-level cache, on T threads (one contiguous slice each). Reports the best
// and median of N runs in GB/s, counting 3 arrays x 8 bytes... as STREAM does
// (2 reads + 1 write, no write-allocate traffic), and a read-only sum, which is
// the pattern of decode (weights are only read).
//
//   stream_triad [--threads T] [--mib M] [--reps N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/thread_pool.h"

namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int threads = kvrelay::ThreadPool::DefaultThreads();
  int64_t mib = 256;
  int reps = 10;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const long v = std::strtol(argv[i + 1], nullptr, 10);
    if (flag == "--threads") {
      threads = static_cast<int>(v);
    } else if (flag == "--mib") {
      mib = v;
    } else if (flag == "--reps") {
      reps = static_cast<int>(v);
    } else {
      std::fprintf(stderr, "usage: stream_triad [--threads T] [--mib M] [--reps N]\n");
      return 2;
    }
  }
  if (threads < 1 || mib < 8 || reps < 1) {
    std::fprintf(stderr, "stream_triad: need threads >= 1, mib >= 8, reps >= 1\n");
    return 2;
  }
  const int64_t n = mib * 1024 * 1024 / sizeof(double);
  std::vector<double> a(n), b(n), c(n);
  kvrelay::ThreadPool pool(threads, "triad");
  // First touch on the worker that will use each slice.
  pool.ParallelFor(n, [&](int64_t i0, int64_t i1, int) {
    for (int64_t i = i0; i < i1; ++i) {
      a[i] = 0;
      b[i] = 1.0 + static_cast<double>(i & 7);
      c[i] = 2.0;
    }
  });
  std::vector<double> triad, read;
  std::vector<double> partial(threads, 0.0);
  for (int r = 0; r < reps; ++r) {
    const double s = 3.0 + r;
    auto t0 = std::chrono::steady_clock::now();
    pool.ParallelFor(n, [&](int64_t i0, int64_t i1, int) {
      double* __restrict pa = a.data();
      const double* __restrict pb = b.data();
      const double* __restrict pc = c.data();
      for (int64_t i = i0; i < i1; ++i) pa[i] = pb[i] + s * pc[i];
    });
    auto t1 = std::chrono::steady_clock::now();
    triad.push_back(3.0 * n * sizeof(double) / std::chrono::duration<double>(t1 - t0).count() /
                    1e9);
    t0 = std::chrono::steady_clock::now();
    pool.ParallelFor(n, [&](int64_t i0, int64_t i1, int k) {
      const double* __restrict pa = a.data();
      double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
      int64_t i = i0;
      for (; i + 4 <= i1; i += 4) {
        s0 += pa[i];
        s1 += pa[i + 1];
        s2 += pa[i + 2];
        s3 += pa[i + 3];
      }
      for (; i < i1; ++i) s0 += pa[i];
      partial[k] += s0 + s1 + s2 + s3;
    });
    t1 = std::chrono::steady_clock::now();
    read.push_back(1.0 * n * sizeof(double) / std::chrono::duration<double>(t1 - t0).count() / 1e9);
  }
  double check = 0;
  for (double p : partial) check += p;
  std::printf("stream_triad threads=%d array=%lld MiB reps=%d\n", threads,
              static_cast<long long>(mib), reps);
  std::printf("triad GB/s: best %.2f median %.2f\n", *std::max_element(triad.begin(), triad.end()),
              Median(triad));
  std::printf("read  GB/s: best %.2f median %.2f   (checksum %.3g)\n",
              *std::max_element(read.begin(), read.end()), Median(read), check);
  return 0;
}
