// A group of child processes started and stopped together (the local
// launcher's topology). Children are forked and exec'd; they inherit stderr,
// and their stdout is the launcher's stderr too (the launcher's stdout is for
// its user). The group owns them: Stop() (and the destructor) sends
// SIGTERM, waits up to a deadline, then SIGKILLs what is left and reaps every
// child, so no process outlives its launcher. Each child also gets SIGTERM
// from the kernel when the launcher dies without stopping it (kill -9, a
// crash): PR_SET_PDEATHSIG. That signal follows the *thread* that called
// Spawn, so spawn from a thread that lives as long as the group (the main
// thread, as kvrelay launch does).
#pragma once

#include <sys/types.h>

#include <mutex>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/status.h"

namespace kvrelay::deploy {

struct ChildSpec {
  std::string name;               // for log lines, e.g. "prefill-0"
  std::vector<std::string> argv;  // argv[0] is the executable path
  std::vector<std::string> env;   // extra KEY=VALUE entries added to the parent's environment
};

class ProcessGroup {
 public:
  ProcessGroup() = default;
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  Status Spawn(const ChildSpec& spec);

  struct Exit {
    std::string name;         // the ChildSpec's name
    std::string description;  // "exited with status 1", "killed by signal Killed"
  };
  // Waits until any child exits or `deadline`; reaps it and returns which one,
  // or DeadlineExceeded when all are still running at the deadline.
  Result<Exit> WaitAnyExit(Deadline deadline);
  // As WaitAnyExit, as one string: "prefill-0 exited with status 1".
  Result<std::string> WaitAny(Deadline deadline);

  // Starts the reaped child `name` again from the spec it was spawned with
  // (same argv and environment; a new pid). FailedPrecondition while it runs,
  // NotFound for a name never spawned. PR_SET_PDEATHSIG follows the calling
  // thread, as for Spawn.
  Status Respawn(const std::string& name);
  // SIGTERM to the child `name`, SIGKILL once `grace` passes; reaps it. A
  // child already reaped (or unknown) is left alone.
  void StopChild(const std::string& name, std::chrono::milliseconds grace);

  // SIGTERM to all, wait until `grace` passes, then SIGKILL; reaps all. Idempotent.
  void Stop(std::chrono::milliseconds grace = std::chrono::milliseconds(5000));
  // How the children that Stop and StopChild ended exited, oldest first (the
  // last 256), each also logged as "stopped NAME: DESCRIPTION". A clean
  // shutdown is "exited with status 0" for every one; a sanitizer's report at
  // exit, or a SIGKILL after the grace, shows here.
  std::vector<Exit> stopped() const;

  size_t size() const { return children_.size(); }

  // The pid of the child spawned as `name` (fault-injection tests, CPU
  // accounting); -1 if there is none. The pid stays valid (a zombie at worst)
  // until the child is reaped by WaitAny or Stop.
  pid_t Pid(const std::string& name) const;
  // Pids of every child not yet reaped.
  std::vector<pid_t> LivePids() const;

 private:
  struct Child {
    ChildSpec spec;  // kept for Respawn
    pid_t pid;
    bool reaped;
  };
  Result<pid_t> ForkExec(const ChildSpec& spec);
  void RecordStopLocked(const std::string& name, int status);  // mu_ held

  static constexpr size_t kMaxStopped = 256;

  // Every member may be called from any thread (a supervisor thread restarts
  // children while a test reads their pids); `mu_` is never held across a wait
  // for a child except in Stop.
  mutable std::mutex mu_;
  std::vector<Child> children_;  // guarded by mu_
  std::vector<Exit> stopped_;    // guarded by mu_
};

// Directory of the running executable (for finding sibling binaries).
std::string ExecutableDir();

}  // namespace kvrelay::deploy
