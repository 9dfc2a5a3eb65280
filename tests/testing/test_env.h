// Helpers for integration tests that drive the build's scripts and binaries:
// where the source and build trees are (set by CTest), and running a shell
// command for its exit status and stdout.
#pragma once

#include <fcntl.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

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

// A venv at `dir` with the official `openai` client, made once for the whole
// test run: tests that run in parallel take an exclusive lock on
// `dir`.lock, and the venv counts as ready only after pip finished (a marker
// file), so no test sees a venv whose packages are still being installed.
// Returns 0 when ready; otherwise the failing command's exit status, with its
// output in *log.
inline int EnsureOpenAiVenv(const std::string& dir, std::string* log) {
  const int lock = ::open((dir + ".lock").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600);
  if (lock < 0) {
    *log = "cannot open " + dir + ".lock";
    return -1;
  }
  ::flock(lock, LOCK_EX);  // released by close(), also if the test dies
  int rc = 0;
  const std::string ready = dir + "/.kvrelay-openai-ready";
  if (::access(ready.c_str(), F_OK) != 0) {
    rc = RunCommand("rm -rf '" + dir + "' && python3 -m venv '" + dir + "' 2>&1 && '" + dir +
                        "/bin/pip' install -q openai 2>&1 && touch '" + ready + "'",
                    log);
  }
  ::close(lock);
  return rc;
}

}  // namespace kvrelay::testing
