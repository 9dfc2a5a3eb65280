#include "tests/faults/fault_harness.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "deploy/local_launcher.h"

namespace kvrelay::faults {
namespace {

namespace fs = std::filesystem;

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

}  // namespace

// ---------------------------------------------------------------- cluster

Result<std::unique_ptr<LaunchedCluster>> LaunchedCluster::Start(const Options& options) {
  std::unique_ptr<LaunchedCluster> c(new LaunchedCluster());
  char tmpl[] = "/tmp/kvrelay-faults-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return Unavailable("mkdtemp failed");
  c->dir_ = tmpl;
  c->log_path_ = c->dir_ + "/launch.log";
  ASSIGN_OR_RETURN(c->http_port_, deploy::PickFreePort());
  ASSIGN_OR_RETURN(uint16_t control, deploy::PickFreePort());
  // The prefix store on (in the test's own directory), as `kvrelay launch` runs it by default.
  std::vector<std::string> args = {KVRELAY_FAULTS_KVRELAY,
                                   "launch",
                                   "--model",
                                   ModelPath(),
                                   "--bin-dir",
                                   KVRELAY_FAULTS_BIN_DIR,
                                   "--port",
                                   std::to_string(c->http_port_),
                                   "--control-port",
                                   std::to_string(control),
                                   "--prefill",
                                   std::to_string(options.prefill),
                                   "--decode",
                                   std::to_string(options.decode),
                                   "--kv-dtype",
                                   "f32",
                                   "--kv-capacity-mb",
                                   "128",
                                   "--threads-per-worker",
                                   "1",
                                   "--kv-store",
                                   c->dir_ + "/kvstore",
                                   "--heartbeat-ms",
                                   std::to_string(options.heartbeat_ms),
                                   "--kv-timeout-ms",
                                   std::to_string(options.kv_timeout_ms),
                                   "--max-restarts",
                                   std::to_string(options.max_restarts),
                                   "--ready-timeout-ms",
                                   "120000"};
  if (options.mpirun) {
    c->mpirun_ = true;
    args = {"/bin/bash", std::string(KVRELAY_FAULTS_SOURCE_DIR) + "/deploy/mpirun/launch.sh",
            "-P",        std::to_string(options.prefill),
            "-D",        std::to_string(options.decode),
            "-X",        "tcp",
            "-R",        std::to_string(options.max_restarts),
            "-b",        KVRELAY_FAULTS_BIN_DIR,
            "-m",        ModelPath(),
            "-p",        std::to_string(c->http_port_),
            "-C",        std::to_string(control),
            "-k",        "f32",
            "-t",        "1",
            "-B",        std::to_string(options.heartbeat_ms),
            "-W",        std::to_string(options.kv_timeout_ms)};
  }
  // Both launchers take the silent-fault deadlines under the binaries' names.
  for (const auto& [flag, ms] :
       {std::pair{"--heartbeat-timeout-ms", options.heartbeat_timeout_ms},
        std::pair{"--tp-step-timeout-ms", options.tp_step_timeout_ms},
        std::pair{"--kv-progress-timeout-ms", options.kv_progress_timeout_ms},
        std::pair{"--coordinator-timeout-ms", options.coordinator_timeout_ms}}) {
    if (ms > 0) args.insert(args.end(), {flag, std::to_string(ms)});
  }
  args.insert(args.end(), options.extra.begin(), options.extra.end());
  const int log_fd = ::open(c->log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (log_fd < 0) return Unavailable("cannot create " + c->log_path_);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) {
    ::close(log_fd);
    return Unavailable("fork failed");
  }
  if (pid == 0) {
    setpgid(0, 0);  // its own group: Stop() can end whatever is left of it
    dup2(log_fd, STDOUT_FILENO);
    dup2(log_fd, STDERR_FILENO);
    execv(argv[0], argv.data());
    _exit(127);
  }
  ::close(log_fd);
  setpgid(pid, pid);
  c->launcher_ = pid;
  // Ready when the launcher prints its banner (it has seen /health list every
  // worker; launch.sh: when /health lists them), or fails if it exits first.
  std::vector<std::string> ids;
  for (int i = 0; i < options.prefill; ++i) ids.push_back("prefill-" + std::to_string(i));
  for (int i = 0; i < options.decode; ++i) ids.push_back("decode-" + std::to_string(i));
  const Deadline deadline = Deadline::After(std::chrono::seconds(150));
  for (;;) {
    if (c->mpirun_
            ? HealthyWith(c->http_port_, ids)
            : ReadFile(c->log_path_).find("kvrelay cluster serving on") != std::string::npos) {
      break;
    }
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      c->launcher_ = -1;
      return Unavailable("kvrelay launch exited before it was ready:\n" + c->LogTail());
    }
    if (deadline.Expired()) return DeadlineExceeded("kvrelay launch not ready within 150 s");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return c;
}

pid_t LaunchedCluster::Pid(const std::string& name) const {
  const std::string log = ReadFile(log_path_);
  if (mpirun_) {
    // Log records: "<time> <level> <pid> <role> <file:line>] <message>"; a
    // worker's role is its id. The newest record of `name` is its newest process.
    std::istringstream in(log);
    std::string line;
    pid_t pid = -1;
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string time, level, role;
      long p = -1;
      if (fields >> time >> level >> p >> role && role == name && time.size() > 20 &&
          time[4] == '-') {
        pid = static_cast<pid_t>(p);
      }
    }
    return pid;
  }
  const std::string needle = "started " + name + " (pid ";
  auto at = log.rfind(needle);
  if (at == std::string::npos) return -1;
  return static_cast<pid_t>(std::atol(log.c_str() + at + needle.size()));
}

int LaunchedCluster::Restarts() const {
  const std::string log = ReadFile(log_path_);
  int n = 0;
  const std::string needle = mpirun_ ? "; restarting in " : "] restarted ";
  for (size_t at = log.find(needle); at != std::string::npos; at = log.find(needle, at + 1)) {
    ++n;
  }
  return n;
}

int LaunchedCluster::CountInLog(const std::string& text) const {
  const std::string log = ReadFile(log_path_);
  int n = 0;
  for (size_t at = log.find(text); at != std::string::npos; at = log.find(text, at + 1)) ++n;
  return n;
}

std::string LaunchedCluster::LogTail(size_t bytes) const {
  const std::string log = ReadFile(log_path_);
  return log.size() <= bytes ? log : log.substr(log.size() - bytes);
}

void LaunchedCluster::Stop() {
  if (launcher_ > 0) {
    kill(launcher_, SIGCONT);  // in case a test left something stopped
    for (pid_t p : {Pid("coordinator"), Pid("prefill-0"), Pid("prefill-1"), Pid("decode-0"),
                    Pid("decode-1"), Pid("decode-0-tp1"), Pid("decode-1-tp1")}) {
      if (p > 0) kill(p, SIGCONT);
    }
    kill(launcher_, SIGTERM);
    bool reaped = WaitFor(
        [&] {
          int status = 0;
          return waitpid(launcher_, &status, WNOHANG) == launcher_;
        },
        std::chrono::seconds(30));
    if (!reaped) {
      kill(-launcher_, SIGKILL);
      waitpid(launcher_, nullptr, 0);
    }
    launcher_ = -1;
  }
  if (!dir_.empty() && std::getenv("KVRELAY_FAULTS_KEEP_LOGS") == nullptr) {
    std::error_code ec;
    fs::remove_all(dir_, ec);
    dir_.clear();
  }
}

}  // namespace kvrelay::faults
