#include "deploy/local_launcher.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string_view>
#include <thread>
#include <utility>

#include "common/http_client.h"
#include "common/logging.h"
#include "engine/gguf/gguf.h"
#include "protocols/cluster_auth.h"

namespace kvrelay::deploy {

namespace {

// The coordinator flags the launcher sets itself, and what to use instead.
// Passed through a second time they would silently win (the last value of a
// flag counts) and break the cluster, e.g. a second --port or a key file the
// workers do not have.
constexpr std::pair<std::string_view, std::string_view> kLauncherOwnedFlags[] = {
    {"model", "--model"},
    {"host", "--host"},
    {"port", "--port"},
    {"control-port", "--control-port"},
    {"control-host", ""},
    {"cluster-key-file", "--cluster-key-file"},
    {"control-tls-cert", "--control-tls-dir"},
    {"control-tls-key", "--control-tls-dir"},
    {"control-tls-ca", "--control-tls-dir"},
    {"kv-dtype", "--kv-dtype"},
    {"router", "--router"},
    {"heartbeat-ms", "--heartbeat-ms"},
    {"heartbeat-timeout-ms", "--heartbeat-timeout-ms"},
    {"max-running", "--max-running"},
    {"max-queue-delay-ms", "--max-queue-delay-ms"},
};

Status ValidateCoordinatorArgs(const std::vector<std::string>& args) {
  for (const std::string& arg : args) {
    if (!arg.starts_with("--")) continue;  // a value of the flag before it
    const std::string_view name = std::string_view(arg).substr(2, arg.find('=') - 2);
    for (const auto& [owned, instead] : kLauncherOwnedFlags) {
      if (name == owned) {
        return InvalidArgument(
            "--coordinator-arg " + arg + ": the launcher sets --" + std::string(owned) + " itself" +
            (instead.empty() ? std::string(" (the control plane stays on loopback)")
                             : "; use kvrelay launch " + std::string(instead)));
      }
    }
  }
  return Status::Ok();
}

}  // namespace

std::string WorkerDevice(const std::string& device, int tp_rank) {
  return device == "cuda" && tp_rank > 0 ? "cuda:" + std::to_string(tp_rank) : device;
}

Status LaunchOptions::Validate() const {
  if (prefill < 0 || decode < 0 || colocated < 0)
    return InvalidArgument("worker counts must be >= 0");
  if (colocated == 0 && (prefill == 0 || decode == 0)) {
    return InvalidArgument("need at least one prefill and one decode worker, or --colocated N");
  }
  if (tp < 1) return InvalidArgument("--tp must be >= 1");
  for (const auto& [flag, device] : {std::pair{"--prefill-device", &prefill_device},
                                     std::pair{"--decode-device", &decode_device}}) {
    const bool ordinal = device->size() > 5 && device->starts_with("cuda:") &&
                         device->find_first_not_of("0123456789", 5) == std::string::npos;
    if (*device != "cpu" && *device != "cuda" && !ordinal) {
      return InvalidArgument(std::string(flag) + " must be cpu, cuda or cuda:N, got '" + *device +
                             "'");
    }
  }
  if (!control_tls_dir.empty()) {
    for (const char* f :
         {"ca.crt", "coordinator.crt", "coordinator.key", "worker.crt", "worker.key"}) {
      const std::string path = control_tls_dir + "/" + f;
      if (access(path.c_str(), R_OK) != 0) {
        return InvalidArgument("--control-tls-dir: cannot read " + path +
                               " (make the directory with scripts/make-cluster-certs.sh)");
      }
    }
  }
  if (tp_mode != "exact" && tp_mode != "reduce") {
    return InvalidArgument("--tp-mode must be exact or reduce, got '" + tp_mode + "'");
  }
  if (threads_per_worker < 1) return InvalidArgument("--threads-per-worker must be >= 1");
  if (prefill_threads < 0) return InvalidArgument("--prefill-threads must be >= 0");
  if (kv_timeout_ms < 0) return InvalidArgument("--kv-timeout-ms must be >= 0");
  if (heartbeat_ms < 0) return InvalidArgument("--heartbeat-ms must be >= 0");
  if (heartbeat_timeout_ms < 0 || tp_step_timeout_ms < 0 || kv_progress_timeout_ms < 0 ||
      coordinator_timeout_ms < 0) {
    return InvalidArgument(
        "--heartbeat-timeout-ms, --tp-step-timeout-ms, --kv-progress-timeout-ms and "
        "--coordinator-timeout-ms must be >= 0 (0 = the default)");
  }
  RETURN_IF_ERROR(ValidateCoordinatorArgs(coordinator_args));
  if (max_restarts < 0) return InvalidArgument("--max-restarts must be >= 0");
  if (restart_window_s < 1) return InvalidArgument("--restart-window-s must be >= 1");
  if (restart_backoff_ms < 0 || restart_backoff_max_ms < restart_backoff_ms) {
    return InvalidArgument("restart backoff must satisfy 0 <= initial <= max");
  }
  return Status::Ok();
}

Result<uint16_t> PickFreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return Unavailable("socket() failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    close(fd);
    return Unavailable("cannot bind an ephemeral port on 127.0.0.1");
  }
  uint16_t port = ntohs(addr.sin_port);
  close(fd);
  return port;
}

void LocalLauncher::Stop() {
  // A TP group's leader goes first: it leaves the coordinator in order
  // (WorkerLeaving) and its followers then see their leader's link close,
  // instead of the leader reporting its group broken.
  for (const auto& [unit, members] : units_) {
    if (members.size() > 1) group_.StopChild(members.front(), std::chrono::seconds(5));
  }
  group_.Stop(std::chrono::seconds(15));
  if (!key_dir_.empty()) {
    // The processes that read it are gone.
    ::unlink(key_file_.c_str());
    ::rmdir(key_dir_.c_str());
    key_dir_.clear();
  }
}

namespace {

// Fails (naming the port) when host:port cannot be bound now, e.g. another
// server holds it: so a busy port is reported at once, before any process is
// started, not after the workers have loaded the model. SO_REUSEADDR as the
// coordinator binds, so a port in TIME_WAIT is not called busy. A host that is
// not an IPv4 literal is left to the coordinator to check.
Status CheckPortFree(const std::string& host, uint16_t port, const char* what, const char* flag) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) return Status::Ok();
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return Status::Ok();
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  const int err = errno;
  close(fd);
  if (ok) return Status::Ok();
  return Unavailable(std::string("cannot use ") + what + " port " + std::to_string(port) + " on " +
                     host + ": " + std::strerror(err) +
                     (err == EADDRINUSE
                          ? std::string(" (another server holds it; pick another ") + flag + ")"
                          : std::string()));
}

}  // namespace

std::vector<std::string> LocalLauncher::CoordinatorArgv(const std::string& bin, uint16_t http,
                                                        uint16_t control) const {
  std::vector<std::string> argv = {bin + "/kvrelay-coordinator", "--model", options_.model_path,
                                   "--host", options_.host, "--port", std::to_string(http),
                                   "--control-port", std::to_string(control),
                                   // Everything runs on this machine: the control plane
                                   // stays on loopback whatever --host the HTTP API is given.
                                   "--control-host", "127.0.0.1", "--cluster-key-file", key_file_,
                                   "--kv-dtype", options_.kv_dtype, "--router", options_.router};
  if (!options_.control_tls_dir.empty()) {
    const std::string& d = options_.control_tls_dir;
    argv.insert(argv.end(), {"--control-tls-cert", d + "/coordinator.crt", "--control-tls-key",
                             d + "/coordinator.key", "--control-tls-ca", d + "/ca.crt"});
  }
  if (options_.heartbeat_ms > 0) {
    argv.push_back("--heartbeat-ms");
    argv.push_back(std::to_string(options_.heartbeat_ms));
  }
  if (options_.heartbeat_timeout_ms > 0) {
    argv.push_back("--heartbeat-timeout-ms");
    argv.push_back(std::to_string(options_.heartbeat_timeout_ms));
  }
  if (options_.coordinator_max_running > 0) {
    argv.push_back("--max-running");
    argv.push_back(std::to_string(options_.coordinator_max_running));
  }
  if (options_.coordinator_max_queue_delay_ms >= 0) {
    argv.push_back("--max-queue-delay-ms");
    argv.push_back(std::to_string(options_.coordinator_max_queue_delay_ms));
  }
  argv.insert(argv.end(), options_.coordinator_args.begin(), options_.coordinator_args.end());
  return argv;
}

Status LocalLauncher::Start() {
  RETURN_IF_ERROR(options_.Validate());
  key_file_ = options_.cluster_key_file;
  if (key_file_.empty() && !options_.kv_store_dir.empty()) {
    // The prefix store is sealed with keys derived from the cluster key
    // (kv_store/block_seal.h): a key kept beside it (in its 0700 root) lets
    // the next launch reuse the stored prefixes. A fresh key would not.
    std::error_code ec;
    std::filesystem::create_directories(options_.kv_store_dir, ec);
    if (ec) return Unavailable("creating " + options_.kv_store_dir + ": " + ec.message());
    ::chmod(options_.kv_store_dir.c_str(), 0700);
    key_file_ = options_.kv_store_dir + "/cluster.key";
    if (!std::filesystem::exists(key_file_, ec)) {
      RETURN_IF_ERROR(protocols::ClusterKey::GenerateFile(key_file_));
    }
  } else if (key_file_.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/kvrelay-launch-XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr) {
      return Unavailable("cannot create a private directory for the cluster key under " + templ);
    }
    key_dir_ = templ;
    key_file_ = key_dir_ + "/cluster.key";
    RETURN_IF_ERROR(protocols::ClusterKey::GenerateFile(key_file_));
  }
  RETURN_IF_ERROR(protocols::ClusterKey::LoadFile(key_file_).status());
  std::string bin = options_.bin_dir;
  if (bin.empty()) {
    // The daemons sit next to this executable, or in ../bin of a build tree
    // (kvrelay is build/cli/kvrelay, the daemons build/bin/kvrelay-*).
    bin = ExecutableDir();
    if (access((bin + "/kvrelay-coordinator").c_str(), X_OK) != 0 &&
        access((bin + "/../bin/kvrelay-coordinator").c_str(), X_OK) == 0) {
      bin += "/../bin";
    }
  }
  // A model that is not there or not GGUF fails here, before any worker
  // starts (opening reads the header and tensor table, not the weights).
  if (auto gguf = engine::GgufFile::Open(options_.model_path); !gguf.ok()) {
    return gguf.status().WithContext("--model " + options_.model_path);
  }
  http_port_ = options_.port;
  if (http_port_ != 0)
    RETURN_IF_ERROR(CheckPortFree(options_.host, http_port_, "the HTTP", "--port"));
  if (options_.control_port != 0) {
    RETURN_IF_ERROR(
        CheckPortFree(options_.host, options_.control_port, "the control", "--control-port"));
  }
  if (http_port_ == 0) {
    ASSIGN_OR_RETURN(http_port_, PickFreePort());
  }
  uint16_t control = options_.control_port;
  if (control == 0) {
    ASSIGN_OR_RETURN(control, PickFreePort());
  }
  control_port_ = control;
  // Everything runs on this machine: the control plane stays on loopback
  // whatever --host the HTTP API is given.
  const std::string coord_addr = "127.0.0.1:" + std::to_string(control);

  units_.clear();
  unit_of_.clear();
  auto add_to_unit = [&](const std::string& unit, const std::string& name) {
    units_[unit].push_back(name);
    unit_of_[name] = unit;
  };
  RETURN_IF_ERROR(group_.Spawn({"coordinator", CoordinatorArgv(bin, http_port_, control), {}}));
  add_to_unit("coordinator", "coordinator");
  // The ports above were free when picked, not held: a worker's own
  // ephemeral port (its KV listener) could take one before the coordinator
  // binds it. The workers start once the coordinator answers HTTP (it binds
  // its control port first).
  const Deadline deadline = Deadline::After(std::chrono::milliseconds(options_.ready_timeout_ms));
  RETURN_IF_ERROR(WaitForHttp(deadline));
  const int world = options_.prefill + options_.decode * options_.tp + options_.colocated;
  int rank = 0;
  auto spawn_worker = [&](const std::string& binary, const std::string& id,
                          const std::vector<std::string>& extra = {}, const std::string& unit = "",
                          int tp_rank = 0) -> Status {
    const int threads = binary == "kvrelay-prefill" && options_.prefill_threads > 0
                            ? options_.prefill_threads
                            : options_.threads_per_worker;
    std::vector<std::string> argv = {bin + "/" + binary,
                                     "--id",
                                     id,
                                     "--coordinator",
                                     coord_addr,
                                     "--model",
                                     options_.model_path,
                                     "--kv-dtype",
                                     options_.kv_dtype,
                                     "--kv-capacity-mb",
                                     std::to_string(options_.kv_capacity_mb),
                                     "--threads",
                                     std::to_string(threads),
                                     "--rank",
                                     std::to_string(rank),
                                     "--world-size",
                                     std::to_string(world),
                                     "--kv-host",
                                     options_.host,
                                     "--cluster-key-file",
                                     key_file_};
    if (!options_.control_tls_dir.empty()) {
      const std::string& d = options_.control_tls_dir;
      argv.insert(argv.end(), {"--control-tls-cert", d + "/worker.crt", "--control-tls-key",
                               d + "/worker.key", "--control-tls-ca", d + "/ca.crt"});
    }
    if (options_.kv_timeout_ms > 0) {
      argv.push_back("--kv-timeout-ms");
      argv.push_back(std::to_string(options_.kv_timeout_ms));
    }
    for (const auto& [flag, ms] :
         {std::pair{"--tp-step-timeout-ms", options_.tp_step_timeout_ms},
          std::pair{"--kv-progress-timeout-ms", options_.kv_progress_timeout_ms},
          std::pair{"--coordinator-timeout-ms", options_.coordinator_timeout_ms}}) {
      if (ms > 0) argv.insert(argv.end(), {flag, std::to_string(ms)});
    }
    const std::string device = WorkerDevice(
        binary == "kvrelay-prefill" ? options_.prefill_device : options_.decode_device, tp_rank);
    if (device != "cpu") argv.insert(argv.end(), {"--device", device});
    if (!options_.kv_store_dir.empty() && binary != "kvrelay-decode") {
      argv.push_back("--kv-store");
      argv.push_back(options_.kv_store_dir + "/" + id);
    }
    argv.insert(argv.end(), extra.begin(), extra.end());
    ++rank;
    RETURN_IF_ERROR(group_.Spawn({id, std::move(argv), {}}));
    add_to_unit(unit.empty() ? id : unit, id);
    return Status::Ok();
  };
  for (int i = 0; i < options_.prefill; ++i) {
    RETURN_IF_ERROR(spawn_worker("kvrelay-prefill", "prefill-" + std::to_string(i)));
  }
  for (int i = 0; i < options_.decode; ++i) {
    const std::string id = "decode-" + std::to_string(i);
    if (options_.tp == 1) {
      RETURN_IF_ERROR(spawn_worker("kvrelay-decode", id));
      continue;
    }
    // A TP group: rank 0 listens on `leader`, the others join it.
    ASSIGN_OR_RETURN(uint16_t tp_port, PickFreePort());
    const std::string leader = options_.host + ":" + std::to_string(tp_port);
    for (int r = 0; r < options_.tp; ++r) {
      RETURN_IF_ERROR(
          spawn_worker("kvrelay-decode", r == 0 ? id : id + "-tp" + std::to_string(r),
                       {"--tp-size", std::to_string(options_.tp), "--tp-rank", std::to_string(r),
                        "--tp-leader", leader, "--tp-mode", options_.tp_mode},
                       id, r));
    }
  }
  for (int i = 0; i < options_.colocated; ++i) {
    RETURN_IF_ERROR(spawn_worker("kvrelay-worker", "worker-" + std::to_string(i)));
  }

  // Ready when /health answers 200 and lists every worker (a decode group
  // registers once, through its rank 0); a child that exits meanwhile fails
  // the start.
  const size_t expected =
      static_cast<size_t>(options_.prefill + options_.decode + options_.colocated);
  while (!deadline.Expired()) {
    auto exited = group_.WaitAny(Deadline::After(std::chrono::milliseconds(200)));
    if (exited.ok()) return Unavailable("cluster failed to start: " + *exited);
    HttpCallSpec spec;
    spec.host = options_.host;
    spec.port = http_port_;
    spec.target = "/health";
    spec.timeout_ms = 1000;
    auto r = HttpCall(spec);
    const auto body = r.ok() ? nlohmann::json::parse(r->body, nullptr, false) : nlohmann::json();
    const bool all_registered = body.is_object() && body.contains("workers") &&
                                body["workers"].is_array() && body["workers"].size() >= expected;
    if (r.ok() && r->status == 200 && all_registered) {
      LOG_INFO << "cluster ready on http://" << options_.host << ":" << http_port_;
      return Status::Ok();
    }
  }
  return DeadlineExceeded("cluster not healthy within " +
                          std::to_string(options_.ready_timeout_ms) + " ms");
}

Status LocalLauncher::WaitForHttp(const Deadline& deadline) {
  while (!deadline.Expired()) {
    auto exited = group_.WaitAny(Deadline::After(std::chrono::milliseconds(20)));
    if (exited.ok()) return Unavailable("cluster failed to start: " + *exited);
    HttpCallSpec spec;
    spec.host = options_.host;
    spec.port = http_port_;
    spec.target = "/health";
    spec.timeout_ms = 1000;
    if (HttpCall(spec).ok()) return Status::Ok();  // any answer: it listens
  }
  return DeadlineExceeded("the coordinator did not listen on port " + std::to_string(http_port_) +
                          " within " + std::to_string(options_.ready_timeout_ms) + " ms");
}

Status LocalLauncher::Supervise(const std::atomic<bool>& stop) {
  using Clock = std::chrono::steady_clock;
  const auto window = std::chrono::seconds(options_.restart_window_s);
  std::map<std::string, std::deque<Clock::time_point>> history;  // unit -> its restarts
  std::map<std::string, Clock::time_point> pending;              // unit -> when to restart
  while (!stop.load()) {
    auto wait = std::chrono::milliseconds(200);
    const auto now = Clock::now();
    for (const auto& [unit, due] : pending) {
      wait = std::min(wait, std::chrono::duration_cast<std::chrono::milliseconds>(
                                std::max(due - now, Clock::duration::zero())));
    }
    auto exited = group_.WaitAnyExit(Deadline::After(wait));
    // Shutting down: a signal to the whole process group (Ctrl-C, timeout(1))
    // ends the children too, and those exits are not failures to restart.
    if (stop.load()) break;
    if (exited.ok()) {
      const std::string what = exited->name + " " + exited->description;
      if (!options_.restart) return Unavailable(what);
      const std::string unit = unit_of_.count(exited->name) ? unit_of_[exited->name] : "";
      if (unit.empty()) return Unavailable(what + " (not a process this launcher restarts)");
      if (pending.count(unit) != 0) continue;  // a member of a group already being restarted
      // The rest of a TP group cannot go on without this rank: stop it too.
      for (const std::string& member : units_[unit]) {
        if (member != exited->name) group_.StopChild(member, std::chrono::seconds(5));
      }
      auto& restarts = history[unit];
      const auto t = Clock::now();
      while (!restarts.empty() && t - restarts.front() > window) restarts.pop_front();
      if (static_cast<int>(restarts.size()) >= options_.max_restarts) {
        return Unavailable(what + "; restarted " + std::to_string(restarts.size()) +
                           " times within " + std::to_string(options_.restart_window_s) +
                           " s, giving up");
      }
      int64_t backoff = options_.restart_backoff_ms;
      for (size_t i = 0; i < restarts.size() && backoff < options_.restart_backoff_max_ms; ++i) {
        backoff *= 2;
      }
      backoff = std::min<int64_t>(backoff, options_.restart_backoff_max_ms);
      restarts.push_back(t);
      LOG_WARNING << what << "; restarting " << (units_[unit].size() > 1 ? "its group " : "")
                  << unit << " in " << backoff << " ms (restart " << restarts.size()
                  << " of at most " << options_.max_restarts << " within "
                  << options_.restart_window_s << " s)";
      pending[unit] = t + std::chrono::milliseconds(backoff);
      continue;
    }
    for (auto it = pending.begin(); it != pending.end();) {
      if (Clock::now() < it->second) {
        ++it;
        continue;
      }
      for (const std::string& member : units_[it->first]) {
        Status s = group_.Respawn(member);
        if (!s.ok()) return s.WithContext("restarting " + it->first);
      }
      restarts_.fetch_add(1);
      LOG_INFO << "restarted " << it->first;
      it = pending.erase(it);
    }
  }
  return Status::Ok();
}

}  // namespace kvrelay::deploy
