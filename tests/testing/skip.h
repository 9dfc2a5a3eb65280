// Skips that are honest and skips that hide a broken setup.
//
// GTEST_SKIP is for a prerequisite this machine may lack and still be a
// supported machine: no CUDA device, a CPU without AVX-512. A prerequisite the
// project's own scripts provide (the models fetched by scripts/fetch-model.sh,
// mpirun and promtool from scripts/install-deps.sh, a venv from PyPI) uses
// KVRELAY_SKIP_OR_FAIL: a skip on a developer's machine, a failure where
// requirements are enforced (KVRELAY_TEST_REQUIRE=1, which scripts/test.sh
// sets under CI=true), so CI cannot go green by skipping what it must run.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

namespace kvrelay::testing {

// The exit code of a test binary in which every test that ran was skipped;
// kvrelay_add_test sets it as the ctest SKIP_RETURN_CODE.
inline constexpr int kSkipExitCode = 77;

inline bool RequirementsEnforced() {
  const char* v = std::getenv("KVRELAY_TEST_REQUIRE");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

}  // namespace kvrelay::testing

// Usage, where GTEST_SKIP would go: KVRELAY_SKIP_OR_FAIL() << "model absent: " << path;
// (a skip, or a fatal failure when enforced; either returns from the function).
#define KVRELAY_SKIP_OR_FAIL()                                                              \
  return GTEST_MESSAGE_AT_(                                                                 \
      __FILE__, __LINE__,                                                                   \
      ::kvrelay::testing::RequirementsEnforced()                                            \
          ? "Missing requirement (KVRELAY_TEST_REQUIRE=1 makes this a failure): "           \
          : "Skipped: ",                                                                    \
      ::kvrelay::testing::RequirementsEnforced() ? ::testing::TestPartResult::kFatalFailure \
                                                 : ::testing::TestPartResult::kSkip)
