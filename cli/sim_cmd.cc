// kvrelay sim: the cluster simulator (sim/cluster_sim.h) from the command line.
//   kvrelay sim --profile P [workload] [topology]      simulate and report like bench serve
//   kvrelay sim calibrate --model M --out P            measure this machine into a profile
//   kvrelay sim validate --model M --profile P         real topologies vs the simulator
// Calibration and validation run this same binary's `bench engine`,
// `bench transfer`, `bench prefix` and `bench serve` as child processes (the
// measurements are theirs, not re-implemented here) and read their --json
// reports or their printed tables.
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
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cli/command.h"
#include "common/clock.h"
#include "common/flags.h"
#include "deploy/local_launcher.h"
#include "engine/kv_cache/kv_cache.h"
#include "engine/runtime/model.h"
#include "sim/cluster_sim.h"
#include "sim/profile.h"
#include "sim/workload.h"

namespace kvrelay::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// ---------------------------------------------------------------- helpers

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

// The cores this process may run on (its affinity mask: taskset, cgroup
// cpusets), which the launched cluster inherits.
int UsableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

// "load average 0.52 (2 cores)": printed by calibrate and validate at their
// start and end, because their figures mean little on a busy machine.
std::string LoadLine() {
  std::ifstream f("/proc/loadavg");
  double one = -1;
  f >> one;
  char buf[96];
  std::snprintf(buf, sizeof(buf), "load average %.2f (%d cores)%s", one, UsableCores(),
                one > UsableCores() ? ": a busy machine, the figures are noisy" : "");
  return buf;
}

std::string SelfExe() {
  std::error_code ec;
  auto p = fs::read_symlink("/proc/self/exe", ec);
  return ec ? "kvrelay" : p.string();
}

// Runs this binary with `args`, stdout to a string (stderr passes through),
// killed at the deadline; *cpu_s (when given) receives the CPU seconds it used. Error unless it
// exits 0 (or, with allow_failure, unless it was killed: bench serve exits 1 when some requests
// failed and still writes its report).
Result<std::string> RunSelf(const std::vector<std::string>& args, int timeout_s,
                            bool allow_failure = false, double* cpu_s = nullptr) {
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

// ----------------------------------------------------------- kvrelay sim

Result<sim::ClusterConfig> ParseTopology(const Flags& f) {
  sim::ClusterConfig c;
  ASSIGN_OR_RETURN(int64_t colocated, f.GetInt("colocated", 0));
  ASSIGN_OR_RETURN(int64_t prefill, f.GetInt("prefill", colocated > 0 ? 0 : 1));
  ASSIGN_OR_RETURN(int64_t decode, f.GetInt("decode", colocated > 0 ? 0 : 1));
  ASSIGN_OR_RETURN(int64_t tp, f.GetInt("tp", 1));
  ASSIGN_OR_RETURN(int64_t max_running, f.GetInt("max-running", 64));
  ASSIGN_OR_RETURN(int64_t max_queue, f.GetInt("max-queue", 256));
  ASSIGN_OR_RETURN(int64_t store, f.GetInt("store-blocks", 0));
  ASSIGN_OR_RETURN(int64_t host_cores, f.GetInt("shared-host-cores", 0));
  ASSIGN_OR_RETURN(double heartbeat_ms, f.GetDouble("heartbeat-ms", sim::kDefaultHeartbeatS * 1e3));
  c.heartbeat_s = heartbeat_ms / 1e3;
  c.shared_host_cores = static_cast<int>(std::clamp<int64_t>(host_cores, 0, 1 << 20));
  for (int64_t v : {colocated, prefill, decode, tp, max_running, max_queue}) {
    if (v < 0 || v > 1'000'000'000) return InvalidArgument("topology flags must be in [0, 1e9]");
  }
  c.colocated = static_cast<int>(colocated);
  c.prefill = static_cast<int>(prefill);
  c.decode = static_cast<int>(decode);
  c.tp = static_cast<int>(tp);
  c.coordinator_max_running = static_cast<int>(max_running);
  c.coordinator_max_queue = static_cast<int>(max_queue);
  c.store_blocks = store;
  ASSIGN_OR_RETURN(c.router, coordinator::ParseRouterPolicy(f.Get("router", "prefix_aware")));
  RETURN_IF_ERROR(c.Validate());
  return c;
}

Result<std::vector<sim::SimRequest>> ParseWorkload(const Flags& f) {
  if (f.Has("trace")) return sim::LoadTrace(f.Get("trace"));
  sim::WorkloadOptions w;
  ASSIGN_OR_RETURN(w.rate, f.GetDouble("rate", 1.0));
  ASSIGN_OR_RETURN(w.num_requests, f.GetInt("num-prompts", 1000));
  ASSIGN_OR_RETURN(w.prompt_tokens, f.GetInt("input-len", 128));
  ASSIGN_OR_RETURN(w.output_tokens, f.GetInt("output-len", 32));
  ASSIGN_OR_RETURN(w.shared_prefix, f.GetInt("shared-prefix", 0));
  ASSIGN_OR_RETURN(w.prefix_groups, f.GetInt("prefix-groups", 1));
  ASSIGN_OR_RETURN(int64_t seed, f.GetInt("seed", 0));
  w.seed = static_cast<uint64_t>(seed);
  if (f.Get("arrivals", "poisson") == "uniform") {
    w.arrivals = sim::WorkloadOptions::Arrivals::kUniform;
  } else if (f.Get("arrivals", "poisson") != "poisson") {
    return InvalidArgument("--arrivals must be poisson or uniform");
  }
  return sim::GenerateWorkload(w);
}

json SummaryJson(const sim::SimResult& r) {
  auto stats = [](const sim::Percentiles& p) {
    return json{{"mean", p.mean}, {"p50", p.p50}, {"p90", p.p90}, {"p99", p.p99}};
  };
  return {{"completed", r.completed},
          {"rejected", r.rejected},
          {"duration_s", r.duration_s},
          {"request_throughput", r.request_throughput},
          {"output_token_throughput", r.output_token_throughput},
          {"ttft_ms", stats(r.ttft_ms)},
          {"tpot_ms", stats(r.tpot_ms)},
          {"e2e_ms", stats(r.e2e_ms)},
          {"prefix_hit_rate", r.prefix_hit_rate()},
          {"good_requests", r.good},
          {"goodput_rps", r.goodput_rps},
          {"preemptions", r.preemptions},
          {"transfers", r.transfers},
          {"transfer_bytes", r.transfer_bytes},
          {"events", r.events}};
}

constexpr char kSimUsage[] =
    "sim --profile P [--trace CSV | --rate R --num-prompts N --input-len I "
    "--output-len O [--shared-prefix L --prefix-groups G] [--seed S]] "
    "[--colocated C | --prefill P --decode D --tp T] [--router R] [--shared-host-cores N] "
    "[--heartbeat-ms 500 (the router sees the workers' heartbeats, as the real coordinator; 0 = "
    "exact router inputs)] [--json OUT]";

int RunSim(const std::vector<std::string>& args) {
  if (PrintHelpIfAsked(args, kSimUsage)) return 0;
  auto f = Flags::Parse(args,
                        {"profile",
                         "trace",
                         "rate",
                         "num-prompts",
                         "input-len",
                         "output-len",
                         "shared-prefix",
                         "prefix-groups",
                         "seed",
                         "arrivals",
                         "colocated",
                         "prefill",
                         "decode",
                         "tp",
                         "router",
                         "max-running",
                         "max-queue",
                         "store-blocks",
                         "shared-host-cores",
                         "heartbeat-ms",
                         "ttft-slo-ms",
                         "tpot-slo-ms",
                         "json",
                         "save-trace"},
                        {"help"});
  if (!f.ok()) {
    std::fprintf(stderr, "sim: %s\n", f.status().message().c_str());
    return 2;
  }
  if (!f->Has("profile")) {
    std::fprintf(stderr,
                 "sim: --profile PATH is required (make one with `kvrelay sim calibrate`)\n");
    return 2;
  }
  auto profile = sim::LoadProfile(f->Get("profile"));
  if (!profile.ok()) {
    std::fprintf(stderr, "sim: %s\n", profile.status().ToString().c_str());
    return 2;
  }
  auto config = ParseTopology(*f);
  auto workload =
      config.ok() ? ParseWorkload(*f) : Result<std::vector<sim::SimRequest>>(config.status());
  auto ttft_slo = f->GetDouble("ttft-slo-ms", 0);
  auto tpot_slo = f->GetDouble("tpot-slo-ms", 0);
  for (const Status& s :
       {config.status(), workload.status(), ttft_slo.status(), tpot_slo.status()}) {
    if (!s.ok()) {
      std::fprintf(stderr, "sim: %s\n", s.ToString().c_str());
      return 2;
    }
  }
  if (f->Has("save-trace")) {
    if (Status s = sim::SaveTrace(f->Get("save-trace"), *workload); !s.ok()) {
      std::fprintf(stderr, "sim: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  sim::SimOptions so;
  so.keep_requests = false;
  so.ttft_slo_s = *ttft_slo / 1e3;
  so.tpot_slo_s = *tpot_slo / 1e3;
  const TimePoint t0 = Clock::now();
  const std::clock_t c0 = std::clock();
  auto r = sim::Simulate(*profile, *config, *workload, so);
  const double wall = SecondsSince(t0);
  const double cpu = static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC;
  if (!r.ok()) {
    std::fprintf(stderr, "sim: %s\n", r.status().ToString().c_str());
    return 1;
  }
  std::printf(
      "simulated %s (%d nodes), profile '%s': %zu requests; router inputs: %s\n",
      config->Name().c_str(), config->Nodes(), profile->name.c_str(), workload->size(),
      config->heartbeat_s > 0
          ? ("heartbeats every " + std::to_string(std::lround(config->heartbeat_s * 1e3)) + " ms")
                .c_str()
          : "exact (--heartbeat-ms 0)");
  std::printf("completed %lld, rejected %lld, in %.2f simulated s\n",
              static_cast<long long>(r->completed), static_cast<long long>(r->rejected),
              r->duration_s);
  std::printf("throughput: %.3f req/s, %.1f output tok/s; prefix hit %.1f%%; preemptions %lld\n",
              r->request_throughput, r->output_token_throughput, 100 * r->prefix_hit_rate(),
              static_cast<long long>(r->preemptions));
  auto line = [](const char* name, const sim::Percentiles& s) {
    std::printf("%-8s mean %9.2f  p50 %9.2f  p90 %9.2f  p99 %9.2f ms\n", name, s.mean, s.p50, s.p90,
                s.p99);
  };
  line("TTFT", r->ttft_ms);
  line("TPOT", r->tpot_ms);
  line("E2E", r->e2e_ms);
  if (so.ttft_slo_s > 0 || so.tpot_slo_s > 0) {
    std::printf("goodput: %.3f req/s (%lld within SLO)\n", r->goodput_rps,
                static_cast<long long>(r->good));
  }
  std::printf("simulator: %llu events in %.2f s wall, %.2f s CPU (%.2f M events per CPU s)\n",
              static_cast<unsigned long long>(r->events), wall, cpu,
              static_cast<double>(r->events) / cpu / 1e6);
  if (f->Has("json")) {
    json j = SummaryJson(*r);
    j["config"] = config->Name();
    j["nodes"] = config->Nodes();
    j["heartbeat_ms"] = config->heartbeat_s * 1e3;
    j["requests"] = workload->size();
    j["wall_s"] = wall;
    j["cpu_s"] = cpu;
    std::ofstream out(f->Get("json"));
    out << j.dump(2) << "\n";
    if (!out) {
      std::fprintf(stderr, "sim: cannot write %s\n", f->Get("json").c_str());
      return 1;
    }
  }
  return 0;
}

// ------------------------------------------------------ kvrelay sim calibrate

struct Sample {
  double seqs, tokens, attn, decode_attn, ctx_attn, seconds;
  std::string what;
  int decode_batch = 0;  // a decode-only step of this many sequences (0: a prefill)
};

// The step model's inputs for the bench engine measurements of one --json report.
void EngineSamples(const json& j, std::vector<Sample>* out) {
  const double ctx = j.value("context", 0.0);
  if (j.contains("prefill")) {
    const double n = j["prefill"].value("tokens", 0.0);
    out->push_back({1, n, n * (n + 1) / 2, 0, n * ctx, j["prefill"].value("median_s", 0.0),
                    "prefill " + std::to_string(static_cast<int>(n)) + " tok, ctx " +
                        std::to_string(static_cast<int>(ctx))});
  }
  for (const auto& d : j.value("decode", json::array())) {
    const double b = d.value("batch", 1.0), k = d.value("steps", 1.0);
    out->push_back({b, b, 0, b * (ctx + (k + 1) / 2), 0, d.value("median_step_s", 0.0),
                    "decode batch " + std::to_string(static_cast<int>(b)) + ", ctx " +
                        std::to_string(static_cast<int>(ctx)),
                    static_cast<int>(b)});
  }
}

// Fits latency + bytes / bandwidth through (bytes, seconds) points.
Result<sim::LinkCost> FitLink(const std::vector<std::pair<double, double>>& pts,
                              const std::string& source) {
  std::vector<double> a, b, w;
  for (const auto& [bytes, s] : pts) {
    a.insert(a.end(), {1.0, bytes});
    b.push_back(s);
    w.push_back(1.0 / (s * s));
  }
  ASSIGN_OR_RETURN(auto x, sim::NonNegativeLeastSquares(a, 2, b, w));
  if (x[1] <= 0) return Internal("link fit: no bandwidth term (" + source + ")");
  return sim::LinkCost{x[0], 1.0 / x[1], source};
}

// One low-load serving measurement: requests one at a time (closed loop).
struct ServePoint {
  double ttft_s = 0, tpot_s = 0;
};

struct Topology {
  std::string name;
  int colocated = 0, prefill = 0, decode = 0, tp = 1;
};

// The serving-path terms one topology's low-load run fixes (sim::
// FitServingTerms); `refit_prefill` for a TP topology re-timed on its own.
void FitServingTerms(const Topology& t, const ServePoint& low, double prefill_s, double decode_s,
                     bool refit_prefill, sim::Profile* p) {
  sim::FitServingTerms(t.colocated > 0, t.tp, low.ttft_s, low.tpot_s, prefill_s, decode_s,
                       refit_prefill, p);
}

// The request-to-request variation of a low-load run (ServingOverhead::
// ttft_jitter / tpot_jitter): its requests' TTFT and TPOT over their medians,
// into the colocated role, or the prefill (TTFT) and decode (TPOT) roles.
void FitJitter(const Topology& t, const json& low_report, sim::Profile* p) {
  std::vector<double> ttft, tpot;
  for (const auto& q : low_report["requests"]) {
    const double a = q.value("ttft_ms", 0.0), e2e = q.value("e2e_ms", 0.0);
    const int o = q.value("output_tokens", 0);
    if (!q.value("ok", true) || !(a > 0)) continue;
    ttft.push_back(a);
    if (o > 1 && e2e > a) tpot.push_back((e2e - a) / (o - 1));
  }
  sim::ServingOverhead& first = t.colocated > 0 ? p->colocated : p->prefill;
  sim::ServingOverhead& rest = t.colocated > 0 ? p->colocated : p->decode;
  first.ttft_jitter = sim::JitterRatios(std::move(ttft));
  rest.tpot_jitter = sim::JitterRatios(std::move(tpot));
}

// The step model's prefill pass of one `in`-token prompt and its decode step
// at the mean context of an `out`-token answer (what FitServingTerms fits
// the low-load runs against).
std::pair<double, double> LowLoadModel(const sim::Profile& p, int64_t in, int64_t out) {
  const double i = static_cast<double>(in), o = static_cast<double>(out);
  return {p.step.Seconds(1, i, i * (i + 1) / 2), p.step.DecodeOnlySeconds(1, i + o / 2)};
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
  o.bin_dir = (fs::path(SelfExe()).parent_path().parent_path() / "bin").string();
  if (!fs::exists(fs::path(o.bin_dir) / "kvrelay-coordinator")) o.bin_dir.clear();
  RETURN_IF_ERROR(o.Validate());
  return o;
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

// One bench serve run on a launched topology, with the CPU each process
// spent during it (per process, and summed per kind of process).
struct ServeRun {
  json report;
  std::vector<std::pair<std::string, double>> cpu_per_process;
  std::map<std::string, double> cpu_s;
  double client_cpu_s = 0;  // the bench serve process itself (getrusage)
  double wall_s = 0;        // of the bench serve process
};

// Starts `t`, warms it up, runs `bench serve` with `serve_args` once per
// entry, stops it.
// A process of this binary that keeps a core busy during one of the runs.
struct Background {
  size_t run = SIZE_MAX;          // index into serve_args; SIZE_MAX = none
  std::vector<std::string> args;  // "{url}" stands for the cluster's URL
  // When set: the foreground starts once this process of the cluster (its
  // short name, e.g. "kvrelay-decode") has computed 0.3 s more than when the
  // background started (a load generator computes little itself).
  std::string busy_process;
};

// Starts `args` in the background and waits until it computes (0.5 s of CPU).
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

// With idle_cpu_per_s, the cluster's CPU per second while it serves nothing
// (heartbeats, polling) is measured first, over idle_probe_s, per kind of
// process.
Result<std::vector<ServeRun>> ServeRuns(const Topology& t, const std::string& model, int threads,
                                        const std::string& kv_dtype, int64_t input_len,
                                        const std::vector<std::vector<std::string>>& serve_args,
                                        const std::vector<Background>& backgrounds = {},
                                        std::map<std::string, double>* idle_cpu_per_s = nullptr,
                                        double idle_probe_s = 3) {
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

const std::vector<Topology>& Topologies(int colocated) {
  static std::vector<Topology> t;
  t = {{"colocated x" + std::to_string(colocated), colocated, 0, 0, 1},
       {"1P+1D", 0, 1, 1, 1},
       {"1P+1D TP2", 0, 1, 1, 2}};
  return t;
}

constexpr char kSimCalibrateUsage[] =
    "sim calibrate --model M [--out sim-profile.json] [--threads 1] [--kv-dtype f16] "
    "[--quick] [--skip-serve] [--skip-store] [--skip-contention]";

int RunCalibrate(const std::vector<std::string>& args) {
  if (PrintHelpIfAsked(args, kSimCalibrateUsage)) return 0;
  auto f = Flags::Parse(args,
                        {"model", "out", "threads", "kv-dtype", "kv-capacity-mb", "reps",
                         "input-len", "output-len", "colocated", "name"},
                        {"quick", "skip-serve", "skip-store", "skip-contention", "help"});
  if (!f.ok()) {
    std::fprintf(stderr, "sim calibrate: %s\n", f.status().message().c_str());
    return 2;
  }
  const std::string model = f->Get("model", "models/SmolLM2-135M-Instruct.Q4_1.gguf");
  const std::string out_path = f->Get("out", "sim-profile.json");
  const std::string kv_dtype = f->Get("kv-dtype", "f16");
  auto threads = f->GetInt("threads", 1);
  auto reps = f->GetInt("reps", f->Has("quick") ? 2 : 3);
  auto cap_mb = f->GetInt("kv-capacity-mb", 256);
  auto input_len = f->GetInt("input-len", 128);
  auto output_len = f->GetInt("output-len", 32);
  auto colocated = f->GetInt("colocated", 2);
  for (const Status& s : {threads.status(), reps.status(), cap_mb.status(), input_len.status(),
                          output_len.status(), colocated.status()}) {
    if (!s.ok()) {
      std::fprintf(stderr, "sim calibrate: %s\n", s.ToString().c_str());
      return 2;
    }
  }
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "sim calibrate: %s\n", s.ToString().c_str());
    return 1;
  };
  auto dtype = engine::ParseKvDtype(kv_dtype);
  if (!dtype.ok()) return fail(dtype.status());
  engine::ModelLoadOptions lo;
  lo.load_tokenizer = false;
  auto m = engine::Model::Load(model, lo);
  if (!m.ok()) return fail(m.status());
  sim::Profile p;
  p.name = f->Get("name", "calibrated");
  p.hardware = CpuModel() + ", " + std::to_string(UsableCores()) + " cores";
  p.model = fs::path(model).filename().string();
  p.measured_at = UtcNow();
  const engine::KvLayout layout = (*m)->MakeKvLayout(*dtype, 16);
  p.layers = layout.layers;
  p.block_tokens = 16;
  p.kv_bytes_per_token = layout.BlockBytes() / 16;
  p.kv_pool_blocks = *cap_mb * (1 << 20) / layout.BlockBytes();
  const std::string th = std::to_string(*threads), rp = std::to_string(*reps);
  const std::string date = p.measured_at;
  std::printf("calibrating at %s, %s\n", date.c_str(), LoadLine().c_str());

  // 1. Engine steps: prefill (tokens x cached context), decode (batch x context).
  std::vector<std::vector<std::string>> runs = {
      // Batches 2, 3 and 8 too: a decode-only step is not linear in a small
      // batch (StepCost::decode_batch_s).
      {"--pp", "32", "--tg", "16", "--batches", "2,3,4,8,16,64", "--batch-steps", "16", "--context",
       "0"},
      {"--pp", "128", "--tg", "16", "--batches", "4,16", "--batch-steps", "16", "--context", "256"},
      {"--pp", "256", "--tg", "8", "--skip-batches", "--context", "0"}};
  if (!f->Has("quick")) {
    runs.push_back({"--pp", "512", "--tg", "8", "--skip-batches", "--context", "0"});
    runs.push_back(
        {"--pp", "64", "--tg", "16", "--batches", "4", "--batch-steps", "16", "--context", "768"});
  }
  std::vector<Sample> samples;
  for (const auto& r : runs) {
    const std::string path = TempPath("engine.json");
    std::vector<std::string> a = {"bench",  "engine", "--model",    model,    "--threads", th,
                                  "--reps", rp,       "--kv-dtype", kv_dtype, "--json",    path};
    a.insert(a.end(), r.begin(), r.end());
    auto o = RunSelf(a, 900);
    if (!o.ok()) return fail(o.status());
    auto j = ReadJson(path);
    fs::remove(path);
    if (!j.ok()) return fail(j.status());
    EngineSamples(*j, &samples);
    // tg: batch 1 from the context, averaged over its steps.
    const double ctx = j->value("context", 0.0), k = (*j)["tg"].value("tokens", 1.0);
    samples.push_back({1, 1, 0, ctx + (k + 1) / 2, 0, (*j)["tg"].value("median_step_s", 0.0),
                       "decode batch 1, ctx " + std::to_string(static_cast<int>(ctx)), 1});
  }
  {
    std::vector<double> a, b, w;
    for (const auto& s : samples) {
      a.insert(a.end(), {1.0, s.seqs, s.tokens, s.attn, s.decode_attn, s.ctx_attn});
      b.push_back(s.seconds);
      w.push_back(1.0 / (s.seconds * s.seconds));  // relative error
    }
    auto x = sim::NonNegativeLeastSquares(a, 6, b, w);
    if (!x.ok()) return fail(x.status());
    p.step = {
        (*x)[0],
        (*x)[1],
        (*x)[2],
        (*x)[3],
        (*x)[4],
        (*x)[5],
        "kvrelay bench engine --threads " + th + " --reps " + rp +
            " (pp 32/256/512 at context 0, 128 at 256, 64 at 768; decode batch 1/2/3/4/8/16/64 "
            "at context 0, 1/4/16 at 256, 1/4 at 768), non-negative least squares weighted by "
            "1/t^2, " +
            date + ", " + p.hardware,
        {},
        ""};
    std::printf(
        "step model: %.3f ms + %.3f ms/seq + %.4f ms/token + %.3g ms/(in-chunk pair) + "
        "%.3g ms/(cached-context pair) + %.3g ms/(decode pair)\n",
        p.step.base_s * 1e3, p.step.per_seq_s * 1e3, p.step.per_token_s * 1e3,
        p.step.per_attn_s * 1e3, p.step.per_ctx_attn_s * 1e3, p.step.per_decode_attn_s * 1e3);
    // Decode-only steps by batch size: each size's measurements less the
    // fitted decode attention, weighted by 1/t^2 as above.
    std::map<int, std::pair<double, double>> by_batch;  // sum w x, sum w
    for (const auto& s : samples) {
      if (s.decode_batch < 1) continue;
      const double w = 1.0 / (s.seconds * s.seconds);
      auto& acc = by_batch[s.decode_batch];
      acc.first += w * (s.seconds - p.step.per_decode_attn_s * s.decode_attn);
      acc.second += w;
    }
    std::string sizes;
    for (const auto& [b, acc] : by_batch) {
      if (acc.first / acc.second > 0) p.step.decode_batch_s[b] = acc.first / acc.second;
      sizes += (sizes.empty() ? "" : "/") + std::to_string(b);
    }
    p.step.decode_batch_source =
        "kvrelay bench engine --threads " + th + " --reps " + rp + " batched decode (batches " +
        sizes +
        ") and tg (batch 1): per batch size, the weighted (1/t^2) mean of each measured step "
        "less per_decode_attn_s x its decode pairs, " +
        date + ", " + p.hardware;
    std::printf("%-32s %12s %12s %8s %12s\n", "measurement", "measured ms", "model ms", "error",
                "by batch ms");
    for (const auto& s : samples) {
      const double m2 = p.step.Seconds(s.seqs, s.tokens, s.attn, s.decode_attn, s.ctx_attn);
      std::printf("%-32s %12.3f %12.3f %+7.1f%%", s.what.c_str(), s.seconds * 1e3, m2 * 1e3,
                  100 * (m2 - s.seconds) / s.seconds);
      if (s.decode_batch > 0) {
        const double m3 = p.step.DecodeOnlySeconds(s.decode_batch, s.decode_attn);
        std::printf(" %12.3f (%+.1f%%)", m3 * 1e3, 100 * (m3 - s.seconds) / s.seconds);
      }
      std::printf("\n");
    }
    std::printf("decode-only step by batch (less decode attention):");
    for (const auto& [b, sec] : p.step.decode_batch_s) std::printf(" %d: %.3f ms", b, sec * 1e3);
    std::printf("\n");
  }

  // 1b. Two engine processes at once (each with a core of its own): how much
  //     a step slows down while another process computes next to it.
  p.contention = {0, 0, "not measured (--skip-contention or fewer than 2 cores): none"};
  if (UsableCores() >= 2 && !f->Has("skip-contention")) {
    const std::vector<std::string> base = {"bench",      "engine",    "--model",
                                           model,        "--threads", th,
                                           "--kv-dtype", kv_dtype,    "--skip-batches"};
    auto with = [&](std::vector<std::string> a, const std::vector<std::string>& more) {
      a.insert(a.end(), more.begin(), more.end());
      return a;
    };
    const auto decode_fg = with(base, {"--pp", "16", "--tg", "64", "--reps", "3"});
    const auto prefill_fg = with(base, {"--pp", "128", "--tg", "1", "--reps", "5"});
    // Backgrounds long enough for any foreground (minutes), and finite.
    const auto prefill_bg = with(base, {"--pp", "512", "--tg", "1", "--reps", "200"});
    const auto decode_bg = with(base, {"--pp", "16", "--tg", "1024", "--reps", "30"});
    // The foreground's median (decode step or prefill pass) and its CPU
    // seconds in all, with `bg` running next to it when given.
    struct Timed {
      double median_s = 0, cpu_s = 0;
    };
    auto timed = [&](const std::vector<std::string>& fg, const std::vector<std::string>* bg,
                     bool decode) -> Result<Timed> {
      pid_t pid = -1;
      if (bg) {
        // Running (model loaded, computing) before the foreground starts.
        ASSIGN_OR_RETURN(pid, StartBusy(*bg));
      }
      const std::string path = TempPath("contention.json");
      Timed t;
      auto o = RunSelf(with(fg, {"--json", path}), 600, false, &t.cpu_s);
      StopBusy(pid);
      if (!o.ok()) return o.status();
      ASSIGN_OR_RETURN(json j, ReadJson(path));
      fs::remove(path);
      t.median_s =
          decode ? j["tg"].value("median_step_s", 0.0) : j["prefill"].value("median_s", 0.0);
      return t;
    };
    // The slowdown is read from the foreground's CPU time, not its wall
    // time: cache and memory-bandwidth interference make the same work take
    // more CPU, while other load on the machine (which the simulator does not
    // model) only delays it. On a quiet machine the two agree.
    std::vector<double> dr, pr;
    for (int round = 0; round < 2; ++round) {
      auto ds = timed(decode_fg, nullptr, true);
      auto dc = timed(decode_fg, &prefill_bg, true);
      auto ps = timed(prefill_fg, nullptr, false);
      auto pc = timed(prefill_fg, &decode_bg, false);
      for (const Status& st : {ds.status(), dc.status(), ps.status(), pc.status()}) {
        if (!st.ok()) return fail(st);
      }
      if (ds->cpu_s > 0 && ps->cpu_s > 0) {
        dr.push_back(dc->cpu_s / ds->cpu_s);
        pr.push_back(pc->cpu_s / ps->cpu_s);
      }
      std::printf(
          "contention round %d: decode (tg 64 x4) alone %.3f ms/step, %.2f s CPU; next to a "
          "prefill %.3f ms/step, %.2f s CPU. prefill (pp 128 x6) alone %.1f ms, %.2f s CPU; next "
          "to a decode %.1f ms, %.2f s CPU\n",
          round + 1, ds->median_s * 1e3, ds->cpu_s, dc->median_s * 1e3, dc->cpu_s,
          ps->median_s * 1e3, ps->cpu_s, pc->median_s * 1e3, pc->cpu_s);
    }
    if (!dr.empty()) {
      auto mean = [](const std::vector<double>& v) {
        double sum = 0;
        for (double x : v) sum += x;
        return sum / static_cast<double>(v.size());
      };
      p.contention.decode_alpha = std::max(0.0, mean(dr) - 1);
      p.contention.prefill_alpha = std::max(0.0, mean(pr) - 1);
      p.contention.source =
          "kvrelay bench engine --threads " + th +
          " alone and next to a second bench engine process (decode tg 64 next to pp 512; pp "
          "128 next to tg 1024): the foreground's CPU seconds (model load included), the "
          "mean ratio of 2 rounds - 1 (0 at least), " +
          date;
      std::printf("contention: decode_alpha %.3f, prefill_alpha %.3f\n", p.contention.decode_alpha,
                  p.contention.prefill_alpha);
    }
  }

  // 2. KV transfer: bytes -> seconds over the cluster's transport (tcp).
  {
    auto o = RunSelf({"bench", "transfer", "--backend", "tcp", "--min-bytes", "65536",
                      "--max-bytes", "16777216", "--no-overlap", "--no-raw"},
                     600);
    if (!o.ok()) return fail(o.status());
    std::vector<std::pair<double, double>> pts;
    std::istringstream in(*o);
    std::string line;
    const std::regex row(R"(^\s*(\d+)\s+([0-9.]+)\s+([0-9.]+)\s+\d+%)");
    std::smatch mt;
    while (std::getline(in, line)) {
      if (std::regex_search(line, mt, row)) {
        const double n = std::stod(mt[1]), gbps = std::stod(mt[3]);
        if (gbps > 0) pts.push_back({n, n / (gbps * 1e9)});
      }
    }
    if (pts.size() < 2) return fail(DataLoss("bench transfer printed no bandwidth table"));
    auto l = FitLink(pts,
                     "kvrelay bench transfer --backend tcp --min-bytes 65536 --max-bytes "
                     "16777216 (forked receiver on this machine), latency + bytes/bandwidth "
                     "fit, " +
                         date);
    if (!l.ok()) return fail(l.status());
    p.transports["tcp"] = *l;
    std::printf("tcp: %.1f us + bytes / %.2f GB/s\n", l->latency_s * 1e6, l->bytes_per_s / 1e9);
  }

  // 3. Prefix store: RocksDB restore bytes -> seconds (after a restart, cold page cache).
  if (!f->Has("skip-store")) {
    std::vector<std::pair<double, double>> pts;
    for (int seen : {256, 1024}) {
      auto o = RunSelf({"bench", "prefix", "--model", model, "--prompt-tokens",
                        std::to_string(seen + 16), "--seen-tokens", std::to_string(seen), "--reps",
                        "2", "--threads", th, "--kv-dtype", kv_dtype},
                       900);
      if (!o.ok()) return fail(o.status());
      std::smatch mt;
      const std::regex re(R"(median restore only: ram ([0-9.]+) s, rocksdb ([0-9.]+) s)");
      if (!std::regex_search(*o, mt, re))
        return fail(DataLoss("bench prefix printed no restore time"));
      pts.push_back({static_cast<double>(seen) * static_cast<double>(p.kv_bytes_per_token),
                     std::stod(mt[2])});
    }
    auto l = FitLink(pts,
                     "kvrelay bench prefix --seen-tokens 256/1024 (RocksDB after restart, "
                     "cold page cache), latency + bytes/bandwidth fit, " +
                         date);
    if (!l.ok()) return fail(l.status());
    p.store_restore = *l;
    std::printf("prefix store restore: %.2f ms + bytes / %.1f MB/s\n", l->latency_s * 1e3,
                l->bytes_per_s / 1e6);
  } else {
    p.store_restore = {0, 1e9, "not measured (--skip-store): placeholder, do not use"};
  }

  // 4. The serving path around the engine: low-load bench serve (one request
  //    at a time) on each real topology; what the step model does not explain.
  p.colocated.source = p.prefill.source = p.decode.source = "not measured (--skip-serve)";
  p.serving_cpu.source = "not measured (--skip-serve): none";
  if (!f->Has("skip-serve")) {
    const auto [prefill_s, decode_s] = LowLoadModel(p, *input_len, *output_len);
    const std::vector<std::string> serve = {"--rate",
                                            "inf",
                                            "--max-concurrency",
                                            "1",
                                            "--num-prompts",
                                            f->Has("quick") ? "4" : "24",
                                            "--input-len",
                                            std::to_string(*input_len),
                                            "--output-len",
                                            std::to_string(*output_len),
                                            "--seed",
                                            "4242"};
    std::vector<ServePoint> pts;
    std::vector<double> decode_cores;  // per topology: decode CPU / decode wall
    double tp_busy_slowdown = 0;       // TP 2 TPOT next to a busy core / alone
    for (const auto& t : Topologies(static_cast<int>(*colocated))) {
      // The TP 2 group runs a second time next to a process that keeps one
      // core busy (a prefill bench engine), as the prefill worker does.
      const bool tp = t.tp > 1 && UsableCores() >= 2;
      // 1P+1D runs twice more, each role next to the other one kept busy by
      // a second load generator through the same coordinator (the roles'
      // busy_alpha): the prefill while the decode worker streams long outputs
      // (fresh prompts: the first run's are in its prefix cache), the decode
      // while the prefill worker computes long prompts one after another.
      const bool roles = t.colocated == 0 && t.tp == 1 && UsableCores() >= 2;
      std::vector<Background> bg;
      std::vector<std::vector<std::string>> runs = {serve};
      if (tp) {
        bg.push_back({1,
                      {"bench", "engine", "--model", model, "--threads", th, "--kv-dtype", kv_dtype,
                       "--pp", "512", "--tg", "1", "--reps", "200", "--skip-batches"},
                      ""});
        runs.push_back(serve);
      }
      if (roles) {
        auto with_seed = [&](const char* seed) {
          std::vector<std::string> a = serve;
          a.back() = seed;  // serve ends with --seed S
          return a;
        };
        bg.push_back(
            {1,
             {"bench", "serve", "--url", "{url}", "--rate", "inf", "--max-concurrency", "1",
              "--num-prompts", "40", "--input-len", "16", "--output-len", "1024", "--seed", "7001"},
             "kvrelay-decode"});
        runs.push_back(with_seed("4243"));
        bg.push_back(
            {2,
             {"bench", "serve", "--url", "{url}", "--rate", "inf", "--max-concurrency", "1",
              "--num-prompts", "400", "--input-len", "512", "--output-len", "1", "--seed", "7002"},
             "kvrelay-prefill"});
        runs.push_back(with_seed("4244"));
      }
      auto r = ServeRuns(t, model, static_cast<int>(*threads), kv_dtype, *input_len, runs, bg);
      if (!r.ok()) return fail(r.status());
      if (roles) {
        // s = busy / alone of the role's figure; busy_alpha as the TP
        // group's below: 1 / s = share / (1 + busy_alpha x others), the other
        // role keeping one core busy.
        const double n_cores = UsableCores(), demand = 2;
        const double share = demand > n_cores ? n_cores / demand : 1.0;
        const double others = std::max(1e-9, std::min(demand - 1, n_cores - 1));
        auto p50 = [&](size_t run, const char* what) {
          return (*r)[run].report[what].value("p50", 0.0);
        };
        const double ttft_alone = p50(0, "ttft_ms"), ttft_busy = p50(1, "ttft_ms");
        const double tpot_alone = p50(0, "tpot_ms"), tpot_busy = p50(2, "tpot_ms");
        const double sp = ttft_alone > 0 ? ttft_busy / ttft_alone : 0;
        const double sd = tpot_alone > 0 ? tpot_busy / tpot_alone : 0;
        if (sp > 0 && sd > 0) {
          p.prefill.busy_alpha = std::max(0.0, (sp * share - 1) / others);
          p.decode.busy_alpha = std::max(0.0, (sd * share - 1) / others);
          const std::string how =
              "kvrelay bench serve --max-concurrency 1 --input-len " + std::to_string(*input_len) +
              " --output-len " + std::to_string(*output_len) + " on kvrelay launch (1P+1D, " + th +
              " thread per worker, KV " + kv_dtype +
              ") alone and next to a second bench serve (--max-concurrency 1) that keeps ";
          char fig[160];
          std::snprintf(fig, sizeof(fig), "TTFT p50 %.1f ms vs %.1f alone (x%.3f)", ttft_busy,
                        ttft_alone, sp);
          p.prefill.busy_source =
              how + "the decode worker busy (--input-len 16 --output-len 1024): " + fig +
              ", busy_alpha = (s x share - 1) / others, " + date;
          std::snprintf(fig, sizeof(fig), "TPOT p50 %.2f ms vs %.2f alone (x%.3f)", tpot_busy,
                        tpot_alone, sd);
          p.decode.busy_source =
              how + "the prefill worker busy (--input-len 512 --output-len 1): " + fig +
              ", busy_alpha = (s x share - 1) / others, " + date;
        }
        std::printf(
            "%-14s prefill next to a busy decode worker: TTFT p50 %.1f ms (alone %.1f, x%.3f) "
            "-> prefill busy_alpha %.3f; decode next to a busy prefill worker: TPOT p50 %.2f "
            "ms (alone %.2f, x%.3f) -> decode busy_alpha %.3f\n",
            t.name.c_str(), ttft_busy, ttft_alone, sp, p.prefill.busy_alpha, tpot_busy, tpot_alone,
            sd, p.decode.busy_alpha);
        // A check of the decode-only batch model in the serving path: next to
        // the long outputs, this run's tokens came from batch-2 steps (its
        // context ~ input + output / 2, the background's ~ 16 + 512).
        const double own = static_cast<double>(*input_len) + static_cast<double>(*output_len) / 2;
        const double ratio_model =
            p.step.DecodeOnlySeconds(2, own + 528) / p.step.DecodeOnlySeconds(1, own);
        const double tpot_b2 = p50(1, "tpot_ms");
        std::printf(
            "%-14s next to the long outputs (batch 2): TPOT p50 %.2f ms, x%.2f of alone; the "
            "decode-only step model says x%.2f\n",
            t.name.c_str(), tpot_b2, tpot_alone > 0 ? tpot_b2 / tpot_alone : 0, ratio_model);
      }
      if (tp) {
        const double alone = (*r)[0].report["tpot_ms"].value("p50", 0.0);
        const double busy = (*r)[1].report["tpot_ms"].value("p50", 0.0);
        tp_busy_slowdown = alone > 0 ? busy / alone : 0;
        std::printf("%-14s next to a busy core: TPOT p50 %.2f ms (alone %.2f, x%.2f)\n",
                    t.name.c_str(), busy, alone, tp_busy_slowdown);
      }
      const json& j = r->front().report;
      const auto& cpu = r->front().cpu_s;
      // The TP topology's variation is not kept (its roles' are 1P+1D's);
      // sim validate re-measures each topology's own.
      if (t.tp == 1) FitJitter(t, j, &p);
      pts.push_back({j["ttft_ms"].value("p50", 0.0) / 1e3, j["tpot_ms"].value("p50", 0.0) / 1e3});
      // One request at a time: the decode processes step from the first
      // token to the last of each request and wait otherwise.
      double decode_wall = 0, tokens = 0;
      for (const auto& q : j["requests"]) {
        decode_wall += (q.value("e2e_ms", 0.0) - q.value("ttft_ms", 0.0)) / 1e3;
        tokens += q.value("output_tokens", 0.0);
      }
      auto cpu_of = [&](const char* name) {
        auto it = cpu.find(name);
        return it == cpu.end() ? 0.0 : it->second;
      };
      decode_cores.push_back(decode_wall > 0 ? cpu_of("kvrelay-decode") / decode_wall : 0);
      std::printf(
          "%-14s low load: TTFT p50 %.1f ms (engine model %.1f), TPOT p50 %.2f ms (engine "
          "model %.2f); CPU per output token: coordinator %.3f ms, decode %.2f ms (%.2f cores "
          "while decoding)\n",
          t.name.c_str(), pts.back().ttft_s * 1e3, prefill_s * 1e3, pts.back().tpot_s * 1e3,
          decode_s * 1e3, tokens > 0 ? cpu_of("kvrelay-coordin") / tokens * 1e3 : 0,
          tokens > 0 ? cpu_of("kvrelay-decode") / tokens * 1e3 : 0, decode_cores.back());
    }
    const std::string src =
        "kvrelay bench serve --max-concurrency 1 --input-len " + std::to_string(*input_len) +
        " --output-len " + std::to_string(*output_len) + " on kvrelay launch (%s, " + th +
        " thread per worker, KV " + kv_dtype + "), p50 vs the step model, " + date;
    auto source = [&](const std::string& topo) {
      std::string s = src;
      s.replace(s.find("%s"), 2, topo);
      return s;
    };
    const auto& topos = Topologies(static_cast<int>(*colocated));
    FitServingTerms(topos[0], pts[0], prefill_s, decode_s, false, &p);
    p.colocated.source = source(topos[0].name);
    FitServingTerms(topos[1], pts[1], prefill_s, decode_s, false, &p);
    p.prefill.source = source("1P+1D") + "; step_scale 1 (its steps have no decode part)";
    p.decode.source = source("1P+1D");
    // The TP 2 group's cores: its ranks' CPU over its stepping time (they
    // block in the collectives), at most 2 (0 = 2 when not measurable). Its
    // busy_alpha: what makes the model reproduce its slowdown s next to one
    // busy core, 1 / s = share / (1 + busy_alpha x others), with the share
    // and the other busy cores the fluid model gives that situation.
    const double n_cores = UsableCores();
    const double tp_cores = decode_cores[2] > 0.05 ? std::min(2.0, decode_cores[2]) : 0.0;
    double busy_alpha = 0;
    if (tp_busy_slowdown > 0) {
      const double c = tp_cores > 0 ? tp_cores : 2.0, demand = 1 + c;
      const double share = demand > n_cores ? n_cores / demand : 1.0;
      const double others = std::max(1e-9, std::min(demand - c, n_cores - c));
      busy_alpha = std::max(0.0, (tp_busy_slowdown * share - 1) / others);
    }
    std::printf(
        "TP 2 group: %.2f cores from its CPU, TPOT x%.2f next to a busy core -> busy_alpha "
        "%.3f\n",
        decode_cores[2], tp_busy_slowdown, busy_alpha);
    // 4b. The serving path's own CPU (Profile::serving_cpu): the coordinator's
    //     (/proc) and the bench serve client's (getrusage) over two runs on
    //     the colocated topology that differ only in output length, less the
    //     coordinator's idle CPU (heartbeats) over the same wall time; per
    //     request and per output token by solving the two. The client's
    //     start and exit fall in its per-request figure (the same N both runs).
    {
      const Topology& t = Topologies(static_cast<int>(*colocated))[0];
      const std::string n = f->Has("quick") ? "16" : "48";
      auto run_with = [&](const char* out_len, const char* seed) {
        return std::vector<std::string>{"--rate",
                                        "inf",
                                        "--max-concurrency",
                                        "2",
                                        "--num-prompts",
                                        n,
                                        "--input-len",
                                        std::to_string(*input_len),
                                        "--output-len",
                                        out_len,
                                        "--seed",
                                        seed};
      };
      std::map<std::string, double> idle;
      auto r =
          ServeRuns(t, model, static_cast<int>(*threads), kv_dtype, *input_len,
                    {run_with(std::to_string(*output_len).c_str(), "5151"), run_with("2", "5252")},
                    {}, &idle);
      if (!r.ok()) return fail(r.status());
      auto fit = [&](auto cpu_of_run, double idle_per_s, double* per_request, double* per_token) {
        std::vector<double> a, b, w;
        for (const ServeRun& run : *r) {
          a.push_back(run.report.value("completed", 0.0));
          a.push_back(run.report.value("total_output_tokens", 0.0));
          b.push_back(std::max(0.0, cpu_of_run(run) - idle_per_s * run.wall_s));
          w.push_back(1.0);
        }
        auto x = sim::NonNegativeLeastSquares(a, 2, b, w);
        if (!x.ok()) return x.status();
        *per_request = std::max(0.0, (*x)[0]);  // no "-0" from the refit
        *per_token = std::max(0.0, (*x)[1]);
        return Status::Ok();
      };
      sim::ServingCpu& s = p.serving_cpu;
      const double coord_idle = idle.count("kvrelay-coordin") ? idle["kvrelay-coordin"] : 0.0;
      Status st = fit(
          [](const ServeRun& run) {
            auto it = run.cpu_s.find("kvrelay-coordin");
            return it == run.cpu_s.end() ? 0.0 : it->second;
          },
          coord_idle, &s.coordinator_per_request_s, &s.coordinator_per_token_s);
      if (st.ok()) {
        st = fit([](const ServeRun& run) { return run.client_cpu_s; }, 0.0, &s.client_per_request_s,
                 &s.client_per_token_s);
      }
      if (!st.ok()) return fail(st);
      char line[400];
      std::snprintf(line, sizeof(line),
                    "coordinator %.3f s + %.3f s CPU, client %.3f s + %.3f s CPU over %s "
                    "requests of %lld / 2 output tokens (wall %.1f s + %.1f s); coordinator "
                    "idle %.4f cores",
                    (*r)[0].cpu_s["kvrelay-coordin"], (*r)[1].cpu_s["kvrelay-coordin"],
                    (*r)[0].client_cpu_s, (*r)[1].client_cpu_s, n.c_str(),
                    static_cast<long long>(*output_len), (*r)[0].wall_s, (*r)[1].wall_s,
                    coord_idle);
      s.source = "kvrelay bench serve --rate inf --max-concurrency 2 --num-prompts " + n +
                 " --input-len " + std::to_string(*input_len) + " --output-len " +
                 std::to_string(*output_len) + " and 2 on kvrelay launch (" + t.name +
                 "): the coordinator's CPU (/proc, 10 ms ticks) less its idle CPU over the "
                 "same wall time, the client's (getrusage); per request and per output token "
                 "solved from the two runs: " +
                 line + ", " + date;
      std::printf(
          "serving path CPU: coordinator %.2f ms/request + %.3f ms/output token, client %.2f "
          "ms/request + %.3f ms/output token (%s)\n",
          s.coordinator_per_request_s * 1e3, s.coordinator_per_token_s * 1e3,
          s.client_per_request_s * 1e3, s.client_per_token_s * 1e3, line);
    }
    p.tp[2] = {1.0, 0.0,
               source("1P+1D TP2") +
                   "; TP 2 step / TP 1 step; cores = the ranks' CPU seconds (/proc) over the "
                   "decode time; busy_alpha from the TPOT p50 of a second run next to a bench "
                   "engine prefill that keeps a core busy",
               tp_cores, busy_alpha};
    FitServingTerms(topos[2], pts[2], prefill_s, decode_s, false, &p);
  } else {
    p.tp[2] = {1.0, 0.0, "not measured (--skip-serve): placeholder", 0.0, 0.0};
  }
  if (Status s = sim::SaveProfile(out_path, p); !s.ok()) return fail(s);
  std::printf("wrote %s (%s at the end)\n", out_path.c_str(), LoadLine().c_str());
  return 0;
}

// ------------------------------------------------------- kvrelay sim validate

double RelErr(double sim, double real) {
  return real != 0 ? std::fabs(sim - real) / std::fabs(real) : (sim == 0 ? 0 : 1);
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

constexpr int kMetrics = 5;
constexpr const char* kMetricNames[kMetrics] = {"ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms",
                                                "tpot_p90_ms", "output_tok_s"};

// One (topology, rate) point: its real runs (one per repeat) and their replays.
struct Compared {
  std::string topology;
  double rate = 0;
  std::vector<json> real;
  std::vector<sim::SimResult> sim;
  double real_m[kMetrics] = {}, sim_m[kMetrics] = {};  // medians over the repeats
  double real_spread[kMetrics] = {};                   // (max - min) / median of the real runs
  // With the profile as given (no re-timing of the serving terms): medians.
  double sim_as_given_m[kMetrics] = {};
};

// The five compared figures of a real run and of its simulation.
void RealMetrics(const json& j, double* m) {
  m[0] = j["ttft_ms"].value("p50", 0.0);
  m[1] = j["ttft_ms"].value("p90", 0.0);
  m[2] = j["tpot_ms"].value("p50", 0.0);
  m[3] = j["tpot_ms"].value("p90", 0.0);
  m[4] = j.value("output_token_throughput", 0.0);
}
void SimMetrics(const sim::SimResult& r, double* m) {
  m[0] = r.ttft_ms.p50;
  m[1] = r.ttft_ms.p90;
  m[2] = r.tpot_ms.p50;
  m[3] = r.tpot_ms.p90;
  m[4] = r.output_token_throughput;
}

// The requests of a real run, arriving when bench serve actually sent them
// (workload order kept: index i of the result is request i of the run).
std::vector<sim::SimRequest> ReplayOf(const json& j, int64_t in, int64_t out) {
  std::vector<sim::SimRequest> w;
  for (const auto& q : j["requests"]) {
    const int64_t p = q.value("prompt_tokens", 0), o = q.value("output_tokens", 0);
    w.push_back({q.value("start_s", 0.0), p > 0 ? p : in, o > 0 ? o : out, -1, 0});
  }
  return w;
}

constexpr char kSimValidateUsage[] =
    "sim validate --model M --profile P [--rates 0.5,1,1.5] [--seconds-per-point 40 | "
    "--num-prompts N] [--min-prompts 16] [--repeats 1] [--input-len 128] [--output-len 32] "
    "[--topologies colocated,1p1d,1p1d-tp2] [--save-real DIR | --from-real DIR] "
    "[--phases 8] [--no-retime] [--no-jitter] [--per-request] [--json OUT]";

int RunValidate(const std::vector<std::string>& args) {
  if (PrintHelpIfAsked(args, kSimValidateUsage)) return 0;
  auto f = Flags::Parse(args,
                        {"model", "profile", "rates", "num-prompts", "seconds-per-point",
                         "min-prompts", "repeats", "phases", "input-len", "output-len", "threads",
                         "kv-dtype", "colocated", "json", "topologies", "save-real", "from-real"},
                        {"help", "per-request", "no-retime", "no-jitter"});
  if (!f.ok()) {
    std::fprintf(stderr, "sim validate: %s\n", f.status().message().c_str());
    return 2;
  }
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "sim validate: %s\n", s.ToString().c_str());
    return 1;
  };
  const std::string model = f->Get("model", "models/SmolLM2-135M-Instruct.Q4_1.gguf");
  if (!f->Has("profile")) {
    std::fprintf(stderr, "sim validate: --profile PATH is required (kvrelay sim calibrate)\n");
    return 2;
  }
  auto profile = sim::LoadProfile(f->Get("profile"));
  if (!profile.ok()) return fail(profile.status());
  // --no-jitter: every request its model's cost (no request-to-request variation).
  auto drop_jitter = [](sim::Profile* q) {
    for (auto* o : {&q->colocated, &q->prefill, &q->decode}) {
      o->ttft_jitter.clear();
      o->tpot_jitter.clear();
    }
  };
  if (f->Has("no-jitter")) drop_jitter(&*profile);
  auto n = f->GetInt("num-prompts", 0);
  // 40 s a point: 20 / 40 / 60 requests at 0.5 / 1 / 1.5 req/s (a p90 of 16
  // spread by up to 58 % between repeats); ~18 minutes with --repeats 3.
  auto seconds = f->GetDouble("seconds-per-point", 40);
  auto min_prompts = f->GetInt("min-prompts", 16);
  auto repeats = f->GetInt("repeats", 1);
  auto phases = f->GetInt("phases", 8);
  auto in = f->GetInt("input-len", 128);
  auto out = f->GetInt("output-len", 32);
  auto threads = f->GetInt("threads", 1);
  auto colocated = f->GetInt("colocated", 2);
  for (const Status& s :
       {n.status(), seconds.status(), min_prompts.status(), repeats.status(), phases.status(),
        in.status(), out.status(), threads.status(), colocated.status()}) {
    if (!s.ok()) return fail(s);
  }
  if (*repeats < 1 || *repeats > 9 || *phases < 1 || *phases > 64 || *n < 0 || !(*seconds > 0) ||
      *min_prompts < 1) {
    std::fprintf(stderr,
                 "sim validate: --repeats in [1, 9], --phases in [1, 64], --num-prompts >= 0, "
                 "--seconds-per-point > 0, --min-prompts >= 1\n");
    return 2;
  }
  if (f->Has("save-real") && f->Has("from-real")) {
    std::fprintf(stderr, "sim validate: --save-real and --from-real exclude each other\n");
    return 2;
  }
  std::vector<double> rates;
  {
    std::stringstream ss(f->Get("rates", "0.5,1,1.5"));
    std::string tok;
    while (std::getline(ss, tok, ',')) {
      char* end = nullptr;
      const double r = std::strtod(tok.c_str(), &end);
      if (end == tok.c_str() || !(r > 0)) {
        std::fprintf(stderr, "sim validate: bad --rates entry '%s'\n", tok.c_str());
        return 2;
      }
      rates.push_back(r);
    }
  }
  // Requests per point: the same duration at every rate (unless --num-prompts).
  auto prompts_at = [&](double rate) {
    return *n > 0 ? *n : std::max<int64_t>(*min_prompts, std::llround(rate * *seconds));
  };
  const std::string which = f->Get("topologies", "colocated,1p1d,1p1d-tp2");
  const std::string save_dir = f->Get("save-real"), from_dir = f->Get("from-real");
  if (!save_dir.empty()) {
    std::error_code ec;
    fs::create_directories(save_dir, ec);
    if (ec) return fail(InvalidArgument("cannot create " + save_dir + ": " + ec.message()));
  }
  auto real_path = [&](const std::string& dir, const char* key, size_t ri, int64_t rep) {
    char name[96];
    std::snprintf(name, sizeof(name), "%s-rate%g-rep%lld.json", key, rates[ri],
                  static_cast<long long>(rep));
    return (fs::path(dir) / name).string();
  };
  auto low_path = [&](const std::string& dir, const char* key, int64_t rep) {
    char name[96];
    std::snprintf(name, sizeof(name), "%s-low-rep%lld.json", key, static_cast<long long>(rep));
    return (fs::path(dir) / name).string();
  };
  // Re-timing (the default): before each repeat's points, one low-load run
  // of the topology (calibrate's: bench serve one request at a time) re-fits
  // the profile's serving-path terms of that topology (FitServingTerms), and
  // that repeat is simulated with them. On this kind of host the serving
  // path's speed level drifts by up to ~20 % within minutes (sim calibrate's
  // measurement minutes before no longer describes it), which is not what
  // the validation is about; the step model, the batch curve, the
  // contention and busy alphas, the links and the serving CPU stay the
  // profile's, and every compared cell is a loaded run the low-load run does
  // not contain. The table with the profile as given is printed as well.
  const bool retime = !f->Has("no-retime");
  const auto [low_prefill_s, low_decode_s] = LowLoadModel(*profile, *in, *out);
  std::vector<Compared> rows;
  const auto& topos = Topologies(static_cast<int>(*colocated));
  const char* keys[] = {"colocated", "1p1d", "1p1d-tp2"};
  const TimePoint t0 = Clock::now();
  const std::string load_start = LoadLine();
  for (size_t ti = 0; ti < topos.size(); ++ti) {
    if (("," + which + ",").find("," + std::string(keys[ti]) + ",") == std::string::npos) continue;
    const Topology& t = topos[ti];
    std::vector<json> reals;  // rate-major, then repeat
    std::vector<json> lows;   // per repeat: the low-load run before its points (re-timing)
    if (!from_dir.empty()) {
      for (size_t ri = 0; ri < rates.size(); ++ri) {
        for (int64_t rep = 0; rep < *repeats; ++rep) {
          auto j = ReadJson(real_path(from_dir, keys[ti], ri, rep));
          if (!j.ok()) return fail(j.status());
          reals.push_back(*j);
        }
      }
      // Saved sets from before re-timing have no low-load runs: as given.
      for (int64_t rep = 0; retime && rep < *repeats; ++rep) {
        if (!fs::exists(low_path(from_dir, keys[ti], rep))) break;
        auto j = ReadJson(low_path(from_dir, keys[ti], rep));
        if (!j.ok()) return fail(j.status());
        lows.push_back(*j);
      }
      if (static_cast<int64_t>(lows.size()) != *repeats) lows.clear();
    } else {
      // Repeats interleaved (rate 1, 2, 3, 1, 2, 3, ...) so a slow spell of
      // the machine does not fall on one point's every repeat.
      std::vector<std::vector<std::string>> serve;
      const size_t per_rep = rates.size() + (retime ? 1 : 0);
      for (int64_t rep = 0; rep < *repeats; ++rep) {
        if (retime) {
          serve.push_back({"--rate", "inf", "--max-concurrency", "1", "--num-prompts", "24",
                           "--input-len", std::to_string(*in), "--output-len", std::to_string(*out),
                           "--seed", std::to_string(500 + 1000 * rep)});
        }
        for (size_t ri = 0; ri < rates.size(); ++ri) {
          char rate[32];
          std::snprintf(rate, sizeof(rate), "%g", rates[ri]);
          serve.push_back({"--rate", rate, "--num-prompts", std::to_string(prompts_at(rates[ri])),
                           "--input-len", std::to_string(*in), "--output-len", std::to_string(*out),
                           // Other prompts per repeat: the same seed again would
                           // be a prefix-cache hit on a colocated worker (seen: a
                           // TTFT of 11 ms instead of 150 in repeats 2 and 3).
                           "--seed", std::to_string(ri + 1 + 1000 * rep)});
        }
      }
      auto real =
          ServeRuns(t, model, static_cast<int>(*threads), f->Get("kv-dtype", "f16"), *in, serve);
      if (!real.ok()) return fail(real.status());
      reals.resize(rates.size() * static_cast<size_t>(*repeats));
      for (int64_t rep = 0; rep < *repeats; ++rep) {
        const size_t first = static_cast<size_t>(rep) * per_rep;
        if (retime) {
          lows.push_back((*real)[first].report);
          if (!save_dir.empty()) {
            std::ofstream o(low_path(save_dir, keys[ti], rep));
            o << lows.back().dump() << "\n";
            if (!o) return fail(DataLoss("cannot write " + low_path(save_dir, keys[ti], rep)));
          }
        }
        for (size_t ri = 0; ri < rates.size(); ++ri) {
          json& j = reals[ri * static_cast<size_t>(*repeats) + static_cast<size_t>(rep)];
          j = (*real)[first + (retime ? 1 : 0) + ri].report;
          if (!save_dir.empty()) {
            std::ofstream o(real_path(save_dir, keys[ti], ri, rep));
            o << j.dump() << "\n";
            if (!o) return fail(DataLoss("cannot write " + real_path(save_dir, keys[ti], ri, rep)));
          }
        }
      }
    }
    // The profile each repeat is simulated with: re-timed from its low-load run.
    std::vector<sim::Profile> timed(static_cast<size_t>(*repeats), *profile);
    for (size_t rep = 0; rep < lows.size(); ++rep) {
      const ServePoint low{lows[rep]["ttft_ms"].value("p50", 0.0) / 1e3,
                           lows[rep]["tpot_ms"].value("p50", 0.0) / 1e3};
      if (!(low.ttft_s > 0 && low.tpot_s > 0)) continue;  // as given
      FitServingTerms(t, low, low_prefill_s, low_decode_s, /*refit_prefill=*/true, &timed[rep]);
      FitJitter(t, lows[rep], &timed[rep]);
      if (f->Has("no-jitter")) drop_jitter(&timed[rep]);
      const sim::Profile& a = *profile;
      const sim::Profile& b = timed[rep];
      const bool colo = t.colocated > 0;
      const double fixed_a = colo       ? a.colocated.step_scale
                             : t.tp > 1 ? a.Tp(t.tp).step_scale
                                        : a.decode.step_scale;
      const double fixed_b = colo       ? b.colocated.step_scale
                             : t.tp > 1 ? b.Tp(t.tp).step_scale
                                        : b.decode.step_scale;
      const double pre_a = colo ? a.colocated.prefill_scale : a.prefill.prefill_scale;
      const double pre_b = colo ? b.colocated.prefill_scale : b.prefill.prefill_scale;
      std::printf(
          "%-14s repeat %zu re-timed at low load: TTFT p50 %.1f ms, TPOT p50 %.2f ms -> %s "
          "%.3f (profile %.3f, %+.1f%%), prefill_scale %.3f (profile %.3f, %+.1f%%)\n",
          t.name.c_str(), rep + 1, low.ttft_s * 1e3, low.tpot_s * 1e3,
          colo       ? "step_scale"
          : t.tp > 1 ? "tp step_scale"
                     : "decode step_scale",
          fixed_b, fixed_a, 100 * (fixed_b / fixed_a - 1), pre_b, pre_a, 100 * (pre_b / pre_a - 1));
    }
    for (size_t ri = 0; ri < rates.size(); ++ri) {
      Compared row;
      row.topology = t.name;
      row.rate = rates[ri];
      std::vector<double> rm[kMetrics], sm[kMetrics], gm[kMetrics];
      for (int64_t rep = 0; rep < *repeats; ++rep) {
        const json& j = reals[ri * static_cast<size_t>(*repeats) + static_cast<size_t>(rep)];
        sim::ClusterConfig c;
        c.colocated = t.colocated;
        c.prefill = t.prefill;
        c.decode = t.decode;
        c.tp = t.tp;
        c.shared_host_cores = UsableCores();
        // The router sees heartbeats, every 500 ms (kvrelay launch's default),
        // whose phase against the arrivals is unknown: each figure is the
        // median over --phases evenly spaced phases.
        c.heartbeat_s = 0.5;
        const auto replay = ReplayOf(j, *in, *out);
        std::vector<double> by_phase[kMetrics], as_given[kMetrics];
        for (int64_t ph = 0; ph < *phases; ++ph) {
          c.heartbeat_phase_s = c.heartbeat_s * static_cast<double>(ph) / *phases;
          auto r = sim::Simulate(timed[static_cast<size_t>(rep)], c, replay);
          if (!r.ok()) return fail(r.status());
          double b[kMetrics];
          SimMetrics(*r, b);
          for (int k = 0; k < kMetrics; ++k) by_phase[k].push_back(b[k]);
          if (ph == 0) row.sim.push_back(std::move(*r));
          if (lows.empty()) continue;
          auto g = sim::Simulate(*profile, c, replay);
          if (!g.ok()) return fail(g.status());
          SimMetrics(*g, b);
          for (int k = 0; k < kMetrics; ++k) as_given[k].push_back(b[k]);
        }
        double a[kMetrics];
        RealMetrics(j, a);
        for (int k = 0; k < kMetrics; ++k) {
          rm[k].push_back(a[k]);
          sm[k].push_back(Median(by_phase[k]));
          gm[k].push_back(lows.empty() ? sm[k].back() : Median(as_given[k]));
        }
        row.real.push_back(j);
      }
      for (int k = 0; k < kMetrics; ++k) {
        row.real_m[k] = Median(rm[k]);
        row.sim_m[k] = Median(sm[k]);
        row.sim_as_given_m[k] = Median(gm[k]);
        // How far the real system is from itself over the repeats.
        const auto [lo, hi] = std::minmax_element(rm[k].begin(), rm[k].end());
        row.real_spread[k] = row.real_m[k] != 0 ? (*hi - *lo) / std::fabs(row.real_m[k]) : 0;
      }
      rows.push_back(std::move(row));
    }
  }
  const double wall_s = SecondsSince(t0);
  double max_err = 0;
  std::vector<double> errs, spreads;
  std::printf("\n%-14s %5s | %-23s | %-23s | %-23s | %-23s | %-21s\n", "topology", "rate",
              "TTFT p50 real/sim ms", "TTFT p90 real/sim ms", "TPOT p50 real/sim ms",
              "TPOT p90 real/sim ms", "out tok/s real/sim");
  json report = json::array();
  for (const auto& row : rows) {
    std::printf("%-14s %5.2f |", row.topology.c_str(), row.rate);
    json e = {{"topology", row.topology}, {"rate", row.rate}, {"repeats", row.real.size()}};
    for (int k = 0; k < kMetrics; ++k) {
      const double real = row.real_m[k], sim = row.sim_m[k];
      const double err = RelErr(sim, real);
      max_err = std::max(max_err, err);
      errs.push_back(err);
      std::printf(" %7.1f/%7.1f %+5.0f%% |", real, sim, real != 0 ? 100 * (sim - real) / real : 0);
      e[kMetricNames[k]] = {
          {"real", real}, {"sim", sim}, {"rel_err", err}, {"real_spread", row.real_spread[k]}};
      spreads.push_back(row.real_spread[k]);
    }
    std::printf("\n");
    // Per request, real vs simulated (the first repeat): where the model misses.
    json per = json::array();
    const json& j = row.real.front();
    const auto& sr = row.sim.front().requests;
    for (size_t i = 0; i < sr.size() && i < j["requests"].size(); ++i) {
      const json& q = j["requests"][i];
      const double ttft = q.value("ttft_ms", 0.0), e2e = q.value("e2e_ms", 0.0);
      const int o = q.value("output_tokens", 0);
      const double tpot = o > 1 ? (e2e - ttft) / (o - 1) : 0;
      per.push_back({{"start_s", q.value("start_s", 0.0)},
                     {"ttft_ms", {ttft, sr[i].ttft_s() * 1e3}},
                     {"tpot_ms", {tpot, sr[i].tpot_s() * 1e3}}});
      if (f->Has("per-request")) {
        std::printf("    req %2zu at %7.3f s: TTFT %7.1f/%7.1f ms  TPOT %6.2f/%6.2f ms\n", i,
                    q.value("start_s", 0.0), ttft, sr[i].ttft_s() * 1e3, tpot,
                    sr[i].tpot_s() * 1e3);
      }
    }
    if (f->Has("per-request")) {
      std::map<int, int> by_worker;
      for (const auto& t : sr) ++by_worker[t.prefill_worker];
      std::printf("    simulated requests per (prefill/colocated) worker:");
      for (const auto& [wk, cnt] : by_worker) std::printf(" #%d %d", wk, cnt);
      std::printf("\n");
    }
    if (f->Has("per-request") && j.contains("cluster_cpu_s")) {
      std::printf("    CPU during the run:");
      for (const auto& c : j["cluster_cpu_s"]) {
        std::printf(" %s %.2f s", c[0].get<std::string>().c_str(), c[1].get<double>());
      }
      if (j.contains("client_cpu_s")) std::printf(" client %.2f s", j.value("client_cpu_s", 0.0));
      std::printf("; simulated: workers %.2f s (solo), serving path %.2f s\n",
                  row.sim.front().worker_cpu_s, row.sim.front().serving_cpu_s);
    }
    e["requests"] = per;
    // Every repeat's requests, real vs simulated (phase 0), for offline analysis.
    json by_repeat = json::array();
    for (size_t rep = 0; rep < row.real.size() && rep < row.sim.size(); ++rep) {
      const json& rq = row.real[rep]["requests"];
      const auto& sq = row.sim[rep].requests;
      json one = json::array();
      for (size_t i = 0; i < sq.size() && i < rq.size(); ++i) {
        const double ttft = rq[i].value("ttft_ms", 0.0), e2e = rq[i].value("e2e_ms", 0.0);
        const int o = rq[i].value("output_tokens", 0);
        one.push_back({{"start_s", rq[i].value("start_s", 0.0)},
                       {"ttft_ms", {ttft, sq[i].ttft_s() * 1e3}},
                       {"tpot_ms", {o > 1 ? (e2e - ttft) / (o - 1) : 0, sq[i].tpot_s() * 1e3}}});
      }
      by_repeat.push_back(std::move(one));
    }
    e["requests_by_repeat"] = std::move(by_repeat);
    if (j.contains("cluster_cpu_s")) e["cluster_cpu_s"] = j["cluster_cpu_s"];
    report.push_back(e);
  }
  // Whether the profile still describes the machine: requests that had the
  // cluster to themselves (no other request in flight at any time during
  // theirs) depend on nothing but the calibrated costs, so their real vs
  // simulated medians show the drift since `sim calibrate` apart from the
  // queueing and contention the other cells test.
  {
    std::map<std::string, std::vector<double>> ttft_ratio, tpot_ratio;
    std::vector<std::string> order;
    for (const auto& row : rows) {
      if (!ttft_ratio.count(row.topology)) order.push_back(row.topology);
      auto& tr = ttft_ratio[row.topology];
      auto& pr = tpot_ratio[row.topology];
      for (size_t rep = 0; rep < row.real.size() && rep < row.sim.size(); ++rep) {
        const json& q = row.real[rep]["requests"];
        const auto& sr = row.sim[rep].requests;
        std::vector<std::pair<double, double>> span;
        for (const auto& x : q) {
          const double s = x.value("start_s", 0.0);
          span.push_back({s, s + x.value("e2e_ms", 0.0) / 1e3});
        }
        for (size_t i = 0; i < span.size() && i < sr.size(); ++i) {
          bool alone = true;
          for (size_t k = 0; k < span.size() && alone; ++k) {
            alone = k == i || span[k].second <= span[i].first || span[k].first >= span[i].second;
          }
          const int o = q[i].value("output_tokens", 0);
          if (!alone || o < 2 || sr[i].ttft_s() <= 0 || sr[i].tpot_s() <= 0) continue;
          const double ttft = q[i].value("ttft_ms", 0.0) / 1e3;
          tr.push_back(ttft / sr[i].ttft_s());
          pr.push_back((q[i].value("e2e_ms", 0.0) / 1e3 - ttft) / (o - 1) / sr[i].tpot_s());
        }
      }
    }
    std::printf("requests alone in the cluster, real / simulated (medians; the profile's drift):");
    for (const auto& t : order) {
      std::printf(" %s n=%zu TTFT %+.1f%% TPOT %+.1f%%;", t.c_str(), ttft_ratio[t].size(),
                  100 * (Median(ttft_ratio[t]) - 1), 100 * (Median(tpot_ratio[t]) - 1));
    }
    std::printf("\n");
  }
  // The real system against itself, per cell: (max - min) / median of its
  // repeats. A cell whose error is within its own spread is within noise.
  if (*repeats > 1) {
    std::printf(
        "\nreal repeat spread per cell ((max - min) / median over %lld repeats; * = the "
        "cell's error exceeds 15%% but not this spread)\n",
        static_cast<long long>(*repeats));
    std::printf("%-14s %5s | %9s | %9s | %9s | %9s | %9s\n", "topology", "rate", "TTFT p50",
                "TTFT p90", "TPOT p50", "TPOT p90", "out tok/s");
    for (const auto& row : rows) {
      std::printf("%-14s %5.2f |", row.topology.c_str(), row.rate);
      for (int k = 0; k < kMetrics; ++k) {
        const double err = RelErr(row.sim_m[k], row.real_m[k]);
        std::printf(" %7.0f%%%s |", 100 * row.real_spread[k],
                    err > 0.15 && err <= row.real_spread[k] ? "*" : " ");
      }
      std::printf("\n");
    }
  }
  // The same comparison with the profile as given (the serving terms as
  // sim calibrate measured them, not re-timed): how much of the error is the
  // machine's drift since then.
  double max_as_given = 0;
  int64_t within_as_given = 0, cells = 0;
  for (const auto& row : rows) {
    for (int k = 0; k < kMetrics; ++k) {
      const double e = RelErr(row.sim_as_given_m[k], row.real_m[k]);
      max_as_given = std::max(max_as_given, e);
      within_as_given += e <= 0.15;
      ++cells;
    }
  }
  std::printf(
      "with the profile as given (serving terms not re-timed): cells within 15%%: %lld of %lld; "
      "max relative error %.3f\n",
      static_cast<long long>(within_as_given), static_cast<long long>(cells), max_as_given);
  if (!retime) std::printf("(--no-retime: the table above is the profile as given)\n");
  const double median_err = Median(errs);
  const auto within = std::count_if(errs.begin(), errs.end(), [](double x) { return x <= 0.15; });
  if (from_dir.empty()) {
    std::printf("%s; real runs from %s (start) to %s (end)\n", UtcNow().c_str(), load_start.c_str(),
                LoadLine().c_str());
  }
  std::printf("cells within 15%%: %lld of %zu; median relative error %.3f; %.0f s\n",
              static_cast<long long>(within), errs.size(), median_err, wall_s);
  if (*repeats > 1) {
    std::printf(
        "real run-to-run spread over %lld repeats ((max - min) / median): median %.3f, max %.3f\n",
        static_cast<long long>(*repeats), Median(spreads),
        *std::max_element(spreads.begin(), spreads.end()));
  }
  if (f->Has("json")) {
    std::ofstream o(f->Get("json"));
    o << json{{"profile", f->Get("profile")},
              {"date", UtcNow()},
              {"cpu", CpuModel()},
              {"rows", report},
              {"median_relative_error", median_err},
              {"retimed", retime},
              {"max_relative_error_as_given", max_as_given},
              {"max_relative_error", max_err}}
             .dump(2)
      << "\n";
  }
  std::printf("max relative error: %.3f\n", max_err);
  return 0;
}

}  // namespace

KVRELAY_COMMAND(sim, "sim", kSimUsage, RunSim);
KVRELAY_COMMAND(sim_calibrate, "sim calibrate", kSimCalibrateUsage, RunCalibrate);
KVRELAY_COMMAND(sim_validate, "sim validate", kSimValidateUsage, RunValidate);

}  // namespace kvrelay::cli
