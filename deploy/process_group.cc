#include "deploy/process_group.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

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
  std::vector<char*> argv;
  for (const auto& a : spec.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<std::string> env_storage;
  for (char** e = environ; *e != nullptr; ++e) env_storage.emplace_back(*e);
  for (const auto& e : spec.env) env_storage.push_back(e);
  std::vector<char*> envp;
  for (auto& e : env_storage) envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_t pid = 0;
  int rc = posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), envp.data());
  if (rc != 0) {
    return Unavailable("cannot start " + spec.name + " (" + spec.argv[0] +
                       "): " + std::strerror(rc));
  }
  children_.push_back({spec.name, pid, false});
  LOG_INFO << "started " << spec.name << " (pid " << pid << ")";
  return Status::Ok();
}

pid_t ProcessGroup::Pid(const std::string& name) const {
  for (const Child& c : children_) {
    if (c.name == name) return c.pid;
  }
  return -1;
}

std::vector<pid_t> ProcessGroup::LivePids() const {
  std::vector<pid_t> pids;
  for (const Child& c : children_) {
    if (!c.reaped) pids.push_back(c.pid);
  }
  return pids;
}

Result<std::string> ProcessGroup::WaitAny(Deadline deadline) {
  // waitpid has no timeout; poll with a short, growing interval up to the deadline.
  auto interval = std::chrono::milliseconds(5);
  for (;;) {
    for (auto& c : children_) {
      if (c.reaped) continue;
      int status = 0;
      pid_t r = waitpid(c.pid, &status, WNOHANG);
      if (r == c.pid) {
        c.reaped = true;
        return c.name + " " + DescribeExit(status);
      }
    }
    if (deadline.Expired()) return DeadlineExceeded("all children still running");
    std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(interval, deadline.Remaining()));
    interval = std::min(interval * 2, std::chrono::milliseconds(200));
  }
}

void ProcessGroup::Stop(std::chrono::milliseconds grace) {
  Deadline deadline = Deadline::After(grace);
  // Newest first (workers before the coordinator they report to), each given
  // a moment to exit, so a worker sees its own SIGTERM rather than its
  // coordinator vanishing.
  for (auto it = children_.rbegin(); it != children_.rend(); ++it) {
    if (it->reaped) continue;
    kill(it->pid, SIGTERM);
    const Deadline one = Deadline::After(
        std::min<std::chrono::nanoseconds>(std::chrono::seconds(2), deadline.Remaining()));
    while (!one.Expired()) {
      int status = 0;
      if (waitpid(it->pid, &status, WNOHANG) == it->pid) {
        it->reaped = true;
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
      } else {
        all_done = false;
      }
    }
    if (all_done) break;
    if (deadline.Expired()) {
      for (auto& c : children_) {
        if (c.reaped) continue;
        LOG_WARNING << c.name << " did not stop within " << grace.count() << " ms; killing";
        kill(c.pid, SIGKILL);
        int status = 0;
        waitpid(c.pid, &status, 0);
        c.reaped = true;
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  children_.clear();
}

}  // namespace kvrelay::deploy
