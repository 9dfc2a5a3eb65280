// Helpers for integration tests that drive the build's scripts and binaries:
// where the source and build trees are (set by CTest), and running a shell
// command for its exit status and stdout.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace kvrelay::testing {

inline std::string SourceDir() {
  const char* d = std::getenv("KVRELAY_SOURCE_DIR");
  return d ? d : ".";
}
inline std::string BinaryDir() {
  const char* d = std::getenv("KVRELAY_BINARY_DIR");
  return d ? d : ".";
}

// Runs `cmd` with /bin/sh; appends its stdout to *output, returns its exit
// status (-1 when it could not be run or did not exit normally).
inline int RunCommand(const std::string& cmd, std::string* output) {
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return -1;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) output->append(buf, n);
  const int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace kvrelay::testing
