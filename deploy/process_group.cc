#include "deploy/process_group.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "common/logging.h"

extern char** environ;

namespace kvrelay::deploy {
namespace {

std::string DescribeExit(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("killed by signal ") + strsignal(WTERMSIG(status));
  return "stopped";
}

}  // namespace

std::string ExecutableDir() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  std::string path(buf, static_cast<size_t>(n));
  auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

ProcessGroup::~ProcessGroup() { Stop(); }

Status ProcessGroup::Spawn(const ChildSpec& spec) {
  if (spec.argv.empty()) return InvalidArgument("child '" + spec.name + "' has an empty argv");
  ASSIGN_OR_RETURN(pid_t pid, ForkExec(spec));
  std::lock_guard lock(mu_);
  children_.push_back({spec, pid, false});
  return Status::Ok();
}

Status ProcessGroup::Respawn(const std::string& name) {
  ChildSpec spec;
  {
    std::lock_guard lock(mu_);
    auto it = std::find_if(children_.begin(), children_.end(),
                           [&](const Child& c) { return c.spec.name == name; });
    if (it == children_.end()) return NotFound("no child named '" + name + "'");
    if (!it->reaped) return FailedPrecondition(name + " is still running");
    spec = it->spec;
  }
  ASSIGN_OR_RETURN(pid_t pid, ForkExec(spec));
  std::lock_guard lock(mu_);
  for (Child& c : children_) {
    if (c.spec.name == name) {
      c.pid = pid;
      c.reaped = false;
    }
  }
  return Status::Ok();
}

Result<pid_t> ProcessGroup::ForkExec(const ChildSpec& spec) {
  std::vector<char*> argv;
  for (const auto& a : spec.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<std::string> env_storage;
  for (char** e = environ; *e != nullptr; ++e) env_storage.emplace_back(*e);
  for (const auto& e : spec.env) env_storage.push_back(e);
  std::vector<char*> envp;
  for (auto& e : env_storage) envp.push_back(e.data());
  envp.push_back(nullptr);
  // fork + execve rather than posix_spawn: the child must ask for
  // PR_SET_PDEATHSIG before it execs, so that a launcher killed with SIGKILL
  // takes its cluster with it. Between fork and exec the child calls only
  // async-signal-safe functions. A close-on-exec pipe carries exec's errno
  // back, so a bad path is reported here as posix_spawn did.
  int err_pipe[2];
  if (pipe2(err_pipe, O_CLOEXEC) != 0) {
    return Unavailable("cannot start " + spec.name + ": pipe: " + std::strerror(errno));
  }
  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    const int e = errno;
    close(err_pipe[0]);
    close(err_pipe[1]);
    return Unavailable("cannot start " + spec.name + ": fork: " + std::strerror(e));
  }
  if (pid == 0) {
    close(err_pipe[0]);
    int e = 0;
    if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0) e = errno;
    // The parent may have died before prctl took effect: then no signal
    // comes, so check by hand (we were reparented).
    if (e == 0 && getppid() != parent) _exit(127);
    // A child's stdout joins the launcher's stderr: children are daemons whose
    // output is logs, and the launcher's stdout carries only what it prints
    // for the user (kvrelay launch --demo: the answer alone).
    if (e == 0 && dup2(STDERR_FILENO, STDOUT_FILENO) < 0) e = errno;
    if (e == 0) {
      execve(argv[0], argv.data(), envp.data());
      e = errno;
    }
    ssize_t ignored = write(err_pipe[1], &e, sizeof e);
    (void)ignored;
    _exit(127);
  }
  close(err_pipe[1]);
  int child_errno = 0;
  ssize_t n;
  do {
    n = read(err_pipe[0], &child_errno, sizeof child_errno);
  } while (n < 0 && errno == EINTR);
  close(err_pipe[0]);
  if (n > 0) {  // exec failed (EOF = exec succeeded and closed the pipe)
    int status = 0;
    waitpid(pid, &status, 0);
    return Unavailable("cannot start " + spec.name + " (" + spec.argv[0] +
                       "): " + std::strerror(child_errno));
  }
  LOG_INFO << "started " << spec.name << " (pid " << pid << ")";
  return pid;
}

pid_t ProcessGroup::Pid(const std::string& name) const {
  std::lock_guard lock(mu_);
  for (const Child& c : children_) {
    if (c.spec.name == name) return c.pid;
  }
  return -1;
}

std::vector<pid_t> ProcessGroup::LivePids() const {
  std::lock_guard lock(mu_);
  std::vector<pid_t> pids;
  for (const Child& c : children_) {
    if (!c.reaped) pids.push_back(c.pid);
  }
  return pids;
}

Result<std::string> ProcessGroup::WaitAny(Deadline deadline) {
  ASSIGN_OR_RETURN(Exit e, WaitAnyExit(deadline));
  return e.name + " " + e.description;
}

Result<ProcessGroup::Exit> ProcessGroup::WaitAnyExit(Deadline deadline) {
  // waitpid has no timeout; poll with a short, growing interval up to the deadline.
  auto interval = std::chrono::milliseconds(5);
  for (;;) {
    {
      std::lock_guard lock(mu_);
      for (auto& c : children_) {
        if (c.reaped) continue;
        int status = 0;
        pid_t r = waitpid(c.pid, &status, WNOHANG);
        if (r == c.pid) {
          c.reaped = true;
          return Exit{c.spec.name, DescribeExit(status)};
        }
      }
    }
    if (deadline.Expired()) return DeadlineExceeded("all children still running");
    std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(interval, deadline.Remaining()));
    interval = std::min(interval * 2, std::chrono::milliseconds(200));
  }
}

void ProcessGroup::StopChild(const std::string& name, std::chrono::milliseconds grace) {
  std::lock_guard lock(mu_);
  for (Child& c : children_) {
    if (c.spec.name != name || c.reaped) continue;
    kill(c.pid, SIGTERM);
    kill(c.pid, SIGCONT);  // a stopped child (SIGSTOP) acts on SIGTERM only once resumed
    const Deadline deadline = Deadline::After(grace);
    int status = 0;
    while (waitpid(c.pid, &status, WNOHANG) != c.pid) {
      if (deadline.Expired()) {
        LOG_WARNING << name << " did not stop within " << grace.count() << " ms; killing";
        kill(c.pid, SIGKILL);
        waitpid(c.pid, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    c.reaped = true;
    RecordStopLocked(c.spec.name, status);
  }
}

void ProcessGroup::RecordStopLocked(const std::string& name, int status) {
  Exit e{name, DescribeExit(status)};
  LOG_INFO << "stopped " << e.name << ": " << e.description;
  if (stopped_.size() >= kMaxStopped) stopped_.erase(stopped_.begin());
  stopped_.push_back(std::move(e));
}

std::vector<ProcessGroup::Exit> ProcessGroup::stopped() const {
  std::lock_guard lock(mu_);
  return stopped_;
}

void ProcessGroup::Stop(std::chrono::milliseconds grace) {
  std::lock_guard lock(mu_);
  Deadline deadline = Deadline::After(grace);
  // Newest first (workers before the coordinator they report to), each given
  // a moment to exit, so a worker sees its own SIGTERM rather than its
  // coordinator vanishing.
  for (auto it = children_.rbegin(); it != children_.rend(); ++it) {
    if (it->reaped) continue;
    kill(it->pid, SIGTERM);
    kill(it->pid, SIGCONT);  // a stopped child acts on SIGTERM only once resumed
    const Deadline one = Deadline::After(
        std::min<std::chrono::nanoseconds>(std::chrono::seconds(2), deadline.Remaining()));
    while (!one.Expired()) {
      int status = 0;
      if (waitpid(it->pid, &status, WNOHANG) == it->pid) {
        it->reaped = true;
        RecordStopLocked(it->spec.name, status);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  bool all_done = false;
  while (!all_done) {
    all_done = true;
    for (auto& c : children_) {
      if (c.reaped) continue;
      int status = 0;
      if (waitpid(c.pid, &status, WNOHANG) == c.pid) {
        c.reaped = true;
        RecordStopLocked(c.spec.name, status);
      } else {
        all_done = false;
      }
    }
    if (all_done) break;
    if (deadline.Expired()) {
      for (auto& c : children_) {
        if (c.reaped) continue;
        LOG_WARNING << c.spec.name << " did not stop within " << grace.count() << " ms; killing";
        kill(c.pid, SIGKILL);
        int status = 0;
        waitpid(c.pid, &status, 0);
        c.reaped = true;
        RecordStopLocked(c.spec.name, status);
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  children_.clear();
}

}  // namespace kvrelay::deploy
