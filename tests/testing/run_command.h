// Running a command line as a user would, for the CLI tests: through the
// shell, with stdin from /dev/null, stdout and stderr captured apart, and a
// hard limit (timeout -s KILL) so a hung process cannot hang the test.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

namespace kvrelay::testing {

struct RunResult {
  int exit_code = -1;  // 128 + signal when killed (137: the time limit)
  std::string out;
  std::string err;
};

// stderr goes through a file under this test binary's own TempDir().
inline RunResult RunCmd(const std::string& command, int limit_s = 60) {
  const std::string err_path = ::testing::TempDir() + "/run_command_stderr.txt";
  const std::string full = "timeout -s KILL " + std::to_string(limit_s) + " " + command + " 2>" +
                           err_path + " </dev/null";
  RunResult r;
  FILE* p = ::popen(full.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int status = ::pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::ifstream e(err_path);
  std::stringstream ss;
  ss << e.rdbuf();
  r.err = ss.str();
  return r;
}

}  // namespace kvrelay::testing
