#include "tests/faults/fault_harness.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "coordinator/engine_text_codec.h"
#include "coordinator/http_client.h"
#include "deploy/local_launcher.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/model.h"

namespace kvrelay::faults {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

}  // namespace

std::string ModelPath() {
  return std::string(KVRELAY_FAULTS_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

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

// ---------------------------------------------------------------- metrics

bool HealthyWith(uint16_t port, const std::vector<std::string>& ids) {
  coordinator::HttpCallSpec spec;
  spec.port = port;
  spec.target = "/health";
  spec.timeout_ms = 2000;
  auto r = coordinator::HttpCall(spec);
  if (!r.ok() || r->status != 200) return false;
  json j = json::parse(r->body, nullptr, false);
  if (!j.is_object() || !j.contains("workers")) return false;
  for (const std::string& id : ids) {
    bool found = false;
    for (const auto& w : j["workers"]) found = found || w.value("id", "") == id;
    if (!found) return false;
  }
  return true;
}

bool WaitFor(const std::function<bool()>& cond, std::chrono::milliseconds timeout) {
  const Deadline deadline = Deadline::After(timeout);
  while (!deadline.Expired()) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return cond();
}

// ---------------------------------------------------------------- client

Outcome Complete(uint16_t port, const std::vector<int32_t>& prompt, int max_tokens,
                 int timeout_ms) {
  Outcome out;
  out.sent = Clock::now();
  json body = {{"model", fs::path(ModelPath()).stem().string()},
               {"prompt", prompt},
               {"max_tokens", max_tokens},
               {"temperature", 0},
               {"ignore_eos", true}};
  coordinator::HttpCallSpec spec;
  spec.method = "POST";
  spec.port = port;
  spec.target = "/v1/completions";
  spec.body = body.dump();
  spec.headers = {{"Content-Type", "application/json"}};
  spec.timeout_ms = timeout_ms;
  auto r = coordinator::HttpCall(spec);
  out.ended = Clock::now();
  if (!r.ok()) {
    out.error = r.status().ToString();
    return out;
  }
  out.http_status = r->status;
  json j = json::parse(r->body, nullptr, false);
  if (r->status == 200 && j.is_object() && j.contains("choices") && !j["choices"].empty()) {
    out.text = j["choices"][0].value("text", "");
  } else {
    out.error = r->body;
  }
  return out;
}

void LoadClient::Start(double rate_per_s) {
  const auto interval =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(1.0 / rate_per_s));
  sender_ = std::thread([this, interval] {
    auto next = Clock::now();
    for (int i = 0; !stop_.load(); ++i) {
      {
        std::lock_guard lock(mu_);
        outs_.push_back(std::make_unique<Outcome>());
        Outcome* slot = outs_.back().get();
        const int p = i % static_cast<int>(prompts_.size());
        slot->prompt = p;
        in_flight_.fetch_add(1);
        requests_.emplace_back([this, slot, p] {
          *slot = Complete(port_, prompts_[p], max_tokens_, timeout_ms_);
          slot->prompt = p;
          in_flight_.fetch_sub(1);
        });
      }
      next += interval;
      while (!stop_.load() && Clock::now() < next) {
        std::this_thread::sleep_for(
            std::min<Clock::duration>(next - Clock::now(), std::chrono::milliseconds(20)));
      }
    }
  });
}

std::vector<Outcome> LoadClient::Stop() {
  stop_.store(true);
  if (sender_.joinable()) sender_.join();
  std::vector<std::thread> requests;
  {
    std::lock_guard lock(mu_);
    requests.swap(requests_);
  }
  for (auto& t : requests) t.join();  // each ends within its timeout
  std::lock_guard lock(mu_);
  std::vector<Outcome> out;
  for (auto& o : outs_) out.push_back(*o);
  outs_.clear();
  return out;
}

// ---------------------------------------------------------------- reference

struct GreedyReference::Impl {
  std::shared_ptr<const engine::Model> model;
  std::unique_ptr<coordinator::EngineTextCodec> codec;
  std::unique_ptr<engine::Engine> engine;
  std::map<std::pair<std::vector<int32_t>, int>, std::string> cache;
  int next_id = 0;
};

GreedyReference* GreedyReference::Get() {
  static GreedyReference* ref = []() -> GreedyReference* {
    if (!fs::exists(ModelPath())) return nullptr;
    auto model = engine::Model::Load(ModelPath());
    if (!model.ok()) return nullptr;
    auto* r = new GreedyReference();
    r->impl_ = std::make_unique<Impl>();
    r->impl_->model = std::shared_ptr<const engine::Model>(std::move(*model));
    r->impl_->codec = std::make_unique<coordinator::EngineTextCodec>(
        r->impl_->model->tokenizer(), r->impl_->model->chat_template());
    engine::EngineOptions eo;
    eo.model_path = ModelPath();
    eo.kv_dtype = engine::KvDtype::kF32;
    eo.kv_capacity_bytes = 64 << 20;
    eo.threads = 1;
    auto eng = engine::Engine::Create(eo, r->impl_->model);
    if (!eng.ok()) {
      delete r;
      return nullptr;
    }
    r->impl_->engine = std::move(*eng);
    return r;
  }();
  return ref;
}

std::vector<int32_t> GreedyReference::Encode(const std::string& text) const {
  auto r = impl_->codec->Encode(text, true);
  return r.ok() ? *r : std::vector<int32_t>{};
}

std::string GreedyReference::Text(const std::vector<int32_t>& prompt, int max_tokens) {
  auto key = std::make_pair(prompt, max_tokens);
  if (auto it = impl_->cache.find(key); it != impl_->cache.end()) return it->second;
  engine::RequestSpec spec;
  spec.id = static_cast<engine::RequestId>(++impl_->next_id);
  spec.prompt = prompt;
  spec.sampling.temperature = 0;
  spec.sampling.max_tokens = max_tokens;
  spec.sampling.ignore_eos = true;
  std::vector<int32_t> tokens;
  if (impl_->engine->Submit(spec).ok()) {
    while (impl_->engine->HasWork()) {
      auto events = impl_->engine->Step();
      if (!events.ok()) break;
      for (const auto& e : *events) {
        if (e.token >= 0) tokens.push_back(e.token);
      }
    }
  }
  auto d = impl_->codec->NewDecoder();
  std::string s;
  for (int32_t t : tokens) s += d->Push(t);
  s += d->Flush();
  impl_->cache[key] = s;
  return s;
}

}  // namespace kvrelay::faults
