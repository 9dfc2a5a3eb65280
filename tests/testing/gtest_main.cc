// The main() of every kvrelay GoogleTest binary (kvrelay_add_test links it in
// place of gtest_main), so that a skip reads as a skip:
// - every skipped test case prints one line
//     KVRELAY-SKIPPED <Suite.Name>: <reason>
//   which scripts/test.sh collects from ctest's log and lists at the end;
// - a binary in which nothing passed, nothing failed and something skipped
//   exits with kSkipExitCode, which ctest reports as "Skipped" (the test's
//   SKIP_RETURN_CODE), not "Passed";
// - ::testing::TempDir() is a directory of this process's own (TEST_TMPDIR,
//   made with mkdtemp and removed at the end), so two checkouts' test runs on
//   one machine never write the same file under /tmp.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "tests/testing/skip.h"

namespace {

std::string SkipReason(const ::testing::TestResult& result) {
  for (int i = 0; i < result.total_part_count(); ++i) {
    const ::testing::TestPartResult& part = result.GetTestPartResult(i);
    if (part.skipped()) {
      std::string m = part.message();
      for (char& c : m) {
        if (c == '\n') c = ' ';
      }
      return m.empty() ? "(no reason given)" : m;
    }
  }
  return "(no reason given)";
}

}  // namespace

int main(int argc, char** argv) {
  std::string scratch;
  const char* given = std::getenv("TEST_TMPDIR");
  if (given == nullptr || given[0] == '\0') {
    char tmpl[] = "/tmp/kvrelay-test-XXXXXX";
    if (::mkdtemp(tmpl) != nullptr) {
      scratch = tmpl;
      ::setenv("TEST_TMPDIR", tmpl, 1);
    }
  }
  ::testing::InitGoogleTest(&argc, argv);
  int rc = RUN_ALL_TESTS();
  const ::testing::UnitTest& unit = *::testing::UnitTest::GetInstance();
  for (int s = 0; s < unit.total_test_suite_count(); ++s) {
    const ::testing::TestSuite& suite = *unit.GetTestSuite(s);
    for (int t = 0; t < suite.total_test_count(); ++t) {
      const ::testing::TestInfo& info = *suite.GetTestInfo(t);
      if (!info.should_run() || !info.result()->Skipped()) continue;
      std::printf("KVRELAY-SKIPPED %s.%s: %s\n", suite.name(), info.name(),
                  SkipReason(*info.result()).c_str());
    }
  }
  std::fflush(stdout);
  if (!scratch.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(scratch, ec);
  }
  if (rc == 0 && unit.successful_test_count() == 0 && unit.skipped_test_count() > 0) {
    rc = kvrelay::testing::kSkipExitCode;
  }
  return rc;
}
