// See serve_harness.h.
#include "sim/calibrate/serve_harness.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "deploy/local_launcher.h"
#include "sim/profile.h"

namespace kvrelay::sim::calibrate {

namespace fs = std::filesystem;

namespace {

std::string SelfExe() {
  std::error_code ec;
  auto p = fs::read_symlink("/proc/self/exe", ec);
  return ec ? "kvrelay" : p.string();
}

// Starts this binary with `args` in the background (output discarded);
// the caller kills and reaps it (and it is killed if the caller dies).
Result<pid_t> SpawnSelf(const std::vector<std::string>& args) {
  std::vector<std::string> argv_s = {SelfExe()};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  const pid_t pid = fork();
  if (pid < 0) return Internal("fork failed");
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlives the calibration
    const int devnull = open("/dev/null", O_WRONLY);
    if (devnull >= 0) {
      dup2(devnull, STDOUT_FILENO);
      dup2(devnull, STDERR_FILENO);
    }
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  return pid;
}

// CPU seconds (user + system) of a process so far, from /proc/PID/stat; its
// short name (comm) in *name. -1 when it cannot be read.
double ProcessCpuSeconds(pid_t pid, std::string* name) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(f, line)) return -1;
  const size_t open = line.find('('), close = line.rfind(')');
  if (open == std::string::npos || close == std::string::npos) return -1;
  if (name) *name = line.substr(open + 1, close - open - 1);
  std::istringstream rest(line.substr(close + 2));
  std::string field;
  double utime = 0, stime = 0;
  // Fields 3..15 of proc(5): state ... utime (14) stime (15).
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i == 14) utime = std::atof(field.c_str());
    if (i == 15) stime = std::atof(field.c_str());
  }
  return (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// CPU seconds of each process of a launched cluster (its short name:
// "kvrelay-coordin", "kvrelay-prefill", "kvrelay-decode", "kvrelay-worker"),
// in spawn order.
std::vector<std::pair<std::string, double>> ClusterCpu(const deploy::LocalLauncher& launcher) {
  std::vector<std::pair<std::string, double>> out;
  for (pid_t pid : launcher.processes().LivePids()) {
    std::string name;
    const double s = ProcessCpuSeconds(pid, &name);
    if (s >= 0) out.push_back({name, s});
  }
  return out;
}

Result<deploy::LaunchOptions> LaunchFor(const Topology& t, const std::string& model, int threads,
                                        const std::string& kv_dtype) {
  deploy::LaunchOptions o;
  o.model_path = model;
  o.port = 0;
  o.colocated = t.colocated;
  o.prefill = t.prefill;
  o.decode = t.decode;
  o.tp = t.tp;
  o.threads_per_worker = threads;
  o.kv_dtype = kv_dtype;
  // The simulator models the slot queue, not the coordinator's early
  // shedding: the real cluster must not refuse what the model would run.
  o.coordinator_max_queue_delay_ms = 0;
  o.bin_dir = (fs::path(SelfExe()).parent_path().parent_path() / "bin").string();
  if (!fs::exists(fs::path(o.bin_dir) / "kvrelay-coordinator")) o.bin_dir.clear();
  RETURN_IF_ERROR(o.Validate());
  return o;
}

}  // namespace

std::string UtcNow() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

std::string CpuModel() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0) {
      auto c = line.find(':');
      return c == std::string::npos ? line : line.substr(c + 2);
    }
  }
  return "unknown CPU";
}

int UsableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

std::string LoadLine() {
  std::ifstream f("/proc/loadavg");
  double one = -1;
  f >> one;
  char buf[96];
  std::snprintf(buf, sizeof(buf), "load average %.2f (%d cores)%s", one, UsableCores(),
                one > UsableCores() ? ": a busy machine, the figures are noisy" : "");
  return buf;
}

Result<std::string> RunSelf(const std::vector<std::string>& args, int timeout_s, bool allow_failure,
                            double* cpu_s) {
  char tmpl[] = "/tmp/kvrelay-sim-XXXXXX";
  const int fd = mkstemp(tmpl);
  if (fd < 0) return Internal("mkstemp failed");
  std::vector<std::string> argv_s = {SelfExe()};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::string cmd;
  for (const auto& a : argv_s) cmd += a + " ";
  std::fprintf(stderr, "sim: running %s\n", cmd.c_str());
  const pid_t pid = fork();
  if (pid < 0) {
    close(fd);
    unlink(tmpl);
    return Internal("fork failed");
  }
  if (pid == 0) {
    dup2(fd, STDOUT_FILENO);
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(fd);
  const Deadline deadline = Deadline::AfterMs(static_cast<int64_t>(timeout_s) * 1000);
  int status = 0;
  bool exited = false;
  while (!exited) {
    struct rusage ru {};
    const pid_t r = wait4(pid, &status, WNOHANG, &ru);
    if (r == pid && cpu_s) {
      *cpu_s = static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
               static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
    }
    if (r == pid) {
      exited = true;
      break;
    }
    if (deadline.Expired()) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      unlink(tmpl);
      return DeadlineExceeded("'" + cmd + "' ran past " + std::to_string(timeout_s) + " s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::ifstream f(tmpl);
  std::stringstream ss;
  ss << f.rdbuf();
  unlink(tmpl);
  if (!WIFEXITED(status) || (WEXITSTATUS(status) != 0 && !allow_failure)) {
    return Internal("'" + cmd + "' failed (status " + std::to_string(status) +
                    "): " + ss.str().substr(0, 500));
  }
  return ss.str();
}

Result<json> ReadJson(const std::string& path) {
  std::ifstream f(path);
  if (!f) return NotFound("cannot read " + path);
  json j = json::parse(f, nullptr, false);
  if (j.is_discarded()) return DataLoss(path + " is not JSON");
  return j;
}

std::string TempPath(const std::string& name) {
  return (fs::temp_directory_path() / ("kvrelay-sim-" + std::to_string(getpid()) + "-" + name))
      .string();
}

const std::vector<Topology>& Topologies(int colocated) {
  static std::vector<Topology> t;
  t = {{"colocated x" + std::to_string(colocated), colocated, 0, 0, 1},
       {"1P+1D", 0, 1, 1, 1},
       {"1P+1D TP2", 0, 1, 1, 2}};
  return t;
}

void FitServingTerms(const Topology& t, const ServePoint& low, double prefill_s, double decode_s,
                     bool refit_prefill, sim::Profile* p) {
  sim::FitServingTerms(t.colocated > 0, t.tp, low.ttft_s, low.tpot_s, prefill_s, decode_s,
                       refit_prefill, p);
}

void FitJitter(const Topology& t, const json& low_report, sim::Profile* p) {
  std::vector<double> ttft, tpot;
  for (const auto& q : low_report["requests"]) {
    const double a = q.value("ttft_ms", 0.0), t = RequestTpotMs(q);
    if (!q.value("ok", true) || !(a > 0)) continue;
    ttft.push_back(a);
    if (t > 0) tpot.push_back(t);
  }
  sim::ServingOverhead& first = t.colocated > 0 ? p->colocated : p->prefill;
  sim::ServingOverhead& rest = t.colocated > 0 ? p->colocated : p->decode;
  first.ttft_jitter = sim::JitterRatios(std::move(ttft));
  rest.tpot_jitter = sim::JitterRatios(std::move(tpot));
}

double RequestTpotMs(const json& q) {
  const int o = q.value("output_tokens", 0);
  return o > 1 ? (q.value("e2e_ms", 0.0) - q.value("ttft_ms", 0.0)) / (o - 1) : 0;
}

std::pair<double, double> LowLoadModel(const sim::Profile& p, int64_t in, int64_t out) {
  const double i = static_cast<double>(in), o = static_cast<double>(out);
  return {p.step.Seconds(1, i, i * (i + 1) / 2), p.step.DecodeOnlySeconds(1, i + o / 2)};
}

Result<pid_t> StartBusy(const std::vector<std::string>& args) {
  ASSIGN_OR_RETURN(pid_t pid, SpawnSelf(args));
  const Deadline ready = Deadline::AfterMs(60'000);
  while (ProcessCpuSeconds(pid, nullptr) < 0.5 && !ready.Expired()) {
    if (waitpid(pid, nullptr, WNOHANG) == pid) {
      return Internal("the background process exited before it computed");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return pid;
}

void StopBusy(pid_t pid) {
  if (pid <= 0) return;
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}

Result<std::vector<ServeRun>> ServeRuns(const Topology& t, const std::string& model, int threads,
                                        const std::string& kv_dtype, int64_t input_len,
                                        const std::vector<std::vector<std::string>>& serve_args,
                                        const std::vector<Background>& backgrounds,
                                        std::map<std::string, double>* idle_cpu_per_s,
                                        double idle_probe_s) {
  ASSIGN_OR_RETURN(auto opts, LaunchFor(t, model, threads, kv_dtype));
  deploy::LocalLauncher launcher(opts);
  std::fprintf(stderr, "sim: starting %s\n", t.name.c_str());
  RETURN_IF_ERROR(launcher.Start().WithContext("starting " + t.name));
  const std::string url = "http://127.0.0.1:" + std::to_string(launcher.http_port());
  std::vector<ServeRun> out;
  // Warm-up, not reported: page faults, lazy initialisation and the first
  // KV transfers, at the measured prompt size, on every worker (4 at once
  // reach both colocated workers), then one alone.
  for (const char* n : {"4", "1"}) {
    auto warm =
        RunSelf({"bench", "serve", "--url", url, "--rate", "inf", "--num-prompts", n, "--input-len",
                 std::to_string(input_len), "--output-len", "8", "--seed", "999"},
                300);
    if (!warm.ok()) {
      launcher.Stop();
      return warm.status();
    }
  }
  if (idle_cpu_per_s) {
    const auto before = ClusterCpu(launcher);
    const TimePoint t0 = Clock::now();
    std::this_thread::sleep_for(
        std::chrono::milliseconds(static_cast<int64_t>(idle_probe_s * 1e3)));
    const auto after = ClusterCpu(launcher);
    const double wall = SecondsSince(t0);
    for (size_t k = 0; k < after.size() && k < before.size(); ++k) {
      (*idle_cpu_per_s)[after[k].first] += (after[k].second - before[k].second) / wall;
    }
  }
  for (size_t i = 0; i < serve_args.size(); ++i) {
    const std::string path = TempPath("serve-" + std::to_string(i) + ".json");
    std::vector<std::string> a = {"bench", "serve", "--url", url, "--json", path};
    a.insert(a.end(), serve_args[i].begin(), serve_args[i].end());
    pid_t busy = -1;
    auto bgi = std::find_if(backgrounds.begin(), backgrounds.end(),
                            [&](const Background& b) { return b.run == i; });
    if (bgi != backgrounds.end()) {
      const Background& background = *bgi;
      std::vector<std::string> args = background.args;
      for (auto& a : args) {
        if (a == "{url}") a = url;
      }
      auto cpu_of = [&]() {
        double sum = 0;
        for (const auto& [name, sec] : ClusterCpu(launcher)) {
          if (name == background.busy_process) sum += sec;
        }
        return sum;
      };
      Result<pid_t> b = Internal("not started");
      if (background.busy_process.empty()) {
        b = StartBusy(args);
      } else {
        const double before = cpu_of();
        b = SpawnSelf(args);
        const Deadline ready = Deadline::AfterMs(60'000);
        while (b.ok() && cpu_of() < before + 0.3 && !ready.Expired()) {
          if (waitpid(*b, nullptr, WNOHANG) == *b) {
            b = Internal("the background load exited before " + background.busy_process +
                         " computed");
            break;
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        if (b.ok() && ready.Expired()) {
          StopBusy(*b);
          b = DeadlineExceeded("the background load did not keep " + background.busy_process +
                               " busy within 60 s");
        }
      }
      if (!b.ok()) {
        launcher.Stop();
        return b.status();
      }
      busy = *b;
    }
    const auto cpu0 = ClusterCpu(launcher);
    const TimePoint started = Clock::now();
    double client_cpu_s = 0;
    auto r = RunSelf(a, 900, /*allow_failure=*/true, &client_cpu_s);
    const double wall_s = SecondsSince(started);
    auto cpu1 = ClusterCpu(launcher);
    StopBusy(busy);
    auto j = r.ok() ? ReadJson(path) : Result<json>(r.status());
    fs::remove(path);
    if (j.ok() && j->value("completed", 0) == 0) j = Unavailable("no request completed");
    if (!j.ok()) {
      launcher.Stop();
      return j.status().WithContext(t.name);
    }
    if (j->value("failed", 0) > 0) {
      std::fprintf(stderr, "sim: warning: %d of %d requests failed on %s (%s)\n",
                   j->value("failed", 0), j->value("num_prompts", 0), t.name.c_str(),
                   j->value("errors", json::array()).dump().c_str());
    }
    ServeRun run;
    run.report = std::move(*j);
    run.client_cpu_s = client_cpu_s;
    run.wall_s = wall_s;
    json cpu = json::array();
    for (size_t k = 0; k < cpu1.size(); ++k) {
      const double d = cpu1[k].second - (k < cpu0.size() ? cpu0[k].second : 0);
      run.cpu_per_process.push_back({cpu1[k].first, d});
      run.cpu_s[cpu1[k].first] += d;
      cpu.push_back({cpu1[k].first, d});
    }
    // Kept with the report (sim validate --save-real): which process did the work.
    run.report["cluster_cpu_s"] = cpu;
    run.report["client_cpu_s"] = client_cpu_s;
    out.push_back(std::move(run));
  }
  launcher.Stop();
  return out;
}

}  // namespace kvrelay::sim::calibrate
