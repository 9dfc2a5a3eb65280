#include <gtest/gtest.h>

#include <regex>

#include "common/log_format.h"

namespace kvrelay {
namespace {

TEST(LoggingTest, RecordHasIsoUtcTimeLevelPidTagAndLocation) {
  // 2026-12-01T10:05:03.123Z
  const auto when = std::chrono::system_clock::time_point(std::chrono::milliseconds(1796119503123));
  const std::string line =
      FormatLogLine(LogLevel::kWarning, when, 4242, "decode-0", "/src/worker/worker.cc", 17, "hi");
  EXPECT_EQ(line, "2026-12-01T10:05:03.123Z W 4242 decode-0 worker.cc:17] hi");
}

TEST(LoggingTest, MillisecondsArePaddedAndNewlinesEscaped) {
  const auto when = std::chrono::system_clock::time_point(std::chrono::milliseconds(7));
  const std::string line =
      FormatLogLine(LogLevel::kInfo, when, 1, "launch", "a.cc", 1, "two\nlines\r\n");
  EXPECT_EQ(line, "1970-01-01T00:00:00.007Z I 1 launch a.cc:1] two\\nlines\\n");
  EXPECT_EQ(line.find('\n'), std::string::npos);
}

TEST(LoggingTest, LiveLineMatchesTheFormat) {
  ::testing::internal::CaptureStderr();
  SetLogTag("unit");
  LOG_ERROR << "boom " << 3;
  const std::string err = ::testing::internal::GetCapturedStderr();
  const std::regex re(
      R"(^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z E \d+ unit logging_test\.cc:\d+\] boom 3\n$)");
  EXPECT_TRUE(std::regex_match(err, re)) << err;
}

}  // namespace
}  // namespace kvrelay
