#include "common/process_stats.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <ctime>
#include <vector>

namespace kvrelay {
namespace {

TEST(ProcessStatsTest, MeasuresThisProcess) {
  const ProcessStats before = ReadProcessStats();
  // Burn ~50 ms of CPU (a clock check, not a sleep: the CPU time must grow).
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(50);
  volatile uint64_t x = 1;
  while (std::chrono::steady_clock::now() < until) x = x * 6364136223846793005ULL + 1;
  // Touch 64 MiB so the resident set must hold it.
  std::vector<char> big(64 << 20, 1);
  const int fd = open("/dev/null", O_RDONLY);
  ASSERT_GE(fd, 0);
  const ProcessStats after = ReadProcessStats();
  close(fd);
  EXPECT_GT(after.cpu_seconds, before.cpu_seconds + 0.02);
  EXPECT_GE(after.resident_bytes, int64_t{64} << 20);
  EXPECT_GE(after.virtual_bytes, after.resident_bytes);
  EXPECT_EQ(after.open_fds, before.open_fds + 1);
  // Started in the last hour, not in the future.
  const double now = static_cast<double>(std::time(nullptr));
  EXPECT_LE(after.start_time_seconds, now + 1);
  EXPECT_GT(after.start_time_seconds, now - 3600);
  EXPECT_EQ(big[12345], 1);
}

}  // namespace
}  // namespace kvrelay
