// kvrelay launch: the cluster topology on this machine over TCP (no MPI).
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "cli/command.h"
#include "common/flags.h"
#include "common/http_client.h"
#include "common/logging.h"
#include "deploy/local_launcher.h"
#include "engine/kv_cache/kv_cache.h"
#include "nlohmann/json.hpp"

namespace kvrelay::cli {
namespace {

std::atomic<bool> g_stop{false};

// The RocksDB prefix tier is on by default, one directory per worker under
// this one (relative to the working directory; scripts/serve.sh runs from the
// repository root, where /kvstore/ is git-ignored).
constexpr char kDefaultKvStoreDir[] = "kvstore";

// Repeatable, so taken out of the arguments before Flags (one value a flag).
constexpr char kCoordinatorArgFlag[] = "coordinator-arg";

// Removes every --coordinator-arg VALUE / --coordinator-arg=VALUE from `args`
// and returns the values in order. A VALUE may itself start with "--" (it is
// a coordinator flag), so the separate form takes the next argument as is.
Result<std::vector<std::string>> TakeCoordinatorArgs(std::vector<std::string>* args) {
  const std::string flag = std::string("--") + kCoordinatorArgFlag;
  std::vector<std::string> taken, rest;
  for (size_t i = 0; i < args->size(); ++i) {
    const std::string& a = (*args)[i];
    if (a == flag) {
      if (i + 1 >= args->size()) return InvalidArgument(flag + " needs a value");
      taken.push_back((*args)[++i]);
    } else if (a.starts_with(flag + "=")) {
      taken.push_back(a.substr(flag.size() + 1));
    } else {
      rest.push_back(a);
    }
  }
  *args = std::move(rest);
  return taken;
}

FlagSpec LaunchSpec() {
  const deploy::LaunchOptions d;
  return {
      "kvrelay launch",
      "The cluster on this machine over TCP: a coordinator, prefill and decode workers\n"
      "(or colocated ones). Serves until Ctrl-C; with --demo PROMPT it answers one chat\n"
      "request (the answer on stdout, logs on stderr) and stops. A process that dies is\n"
      "restarted with backoff (a TP group as a whole) unless --no-restart.",
      "",
      0,
      {{"model", d.model_path, "GGUF model path"},
       {"host", d.host, "HTTP bind address"},
       {"port", std::to_string(d.port), "HTTP port (0 = pick a free one; --demo: 0)"},
       {"control-port", "0", "worker control port (0 = pick a free one)"},
       {"prefill", std::to_string(d.prefill), "prefill workers"},
       {"decode", std::to_string(d.decode), "decode groups"},
       {"tp", std::to_string(d.tp), "tensor-parallel ranks per decode group"},
       {"tp-mode", d.tp_mode, "exact|reduce"},
       {"colocated", std::to_string(d.colocated), "colocated (prefill+decode) workers"},
       {"threads-per-worker", std::to_string(d.threads_per_worker), "engine threads per worker"},
       {"prefill-threads", "0", "engine threads per prefill worker (0 = --threads-per-worker)"},
       {"kv-dtype", d.kv_dtype, "KV cache dtype: f32|f16|bf16|int8|kivi4|kivi2"},
       {"kv-capacity-mb", std::to_string(d.kv_capacity_mb), "KV pool per worker"},
       {"kv-store", kDefaultKvStoreDir, "RocksDB prefix store directory (one per worker)"},
       {"no-kv-store", "", "turn the prefix store off", true},
       {"prefill-device", d.prefill_device, "device of the prefill workers: cpu|cuda[:N]"},
       {"decode-device", d.decode_device,
        "device of the decode (and colocated) workers: cpu|cuda[:N]; with --tp, plain cuda puts "
        "rank r on cuda:r"},
       {"router", d.router, "coordinator routing policy"},
       {"kv-timeout-ms", "0", "KV transfer deadline (0 = the workers' default, 30000)"},
       {"heartbeat-ms", "0", "worker heartbeat interval (0 = the default, 500)"},
       {"heartbeat-timeout-ms", "0",
        "coordinator: drop a worker silent this long (0 = 3 heartbeat intervals)"},
       {"tp-step-timeout-ms", "0", "workers: TP step deadline (0 = their default, 2000)"},
       {"kv-progress-timeout-ms", "0",
        "workers: a KV stream moving nothing this long fails (0 = their default, 2000)"},
       {"coordinator-timeout-ms", "0",
        "workers: re-register after hearing nothing from the coordinator this long (0 = 3 "
        "heartbeat intervals, at least 2000)"},
       {"bin-dir", "", "where kvrelay-coordinator etc. live (default: next to kvrelay)"},
       {"ready-timeout-ms", std::to_string(d.ready_timeout_ms),
        "how long to wait for the cluster to be ready"},
       {"demo", "", "send this prompt as one chat request, print the answer, stop"},
       {"max-tokens", "128",
        "max_tokens of the --demo request (which sends $KVRELAY_API_KEY as its bearer token "
        "when set)"},
       {kCoordinatorArgFlag, "",
        "one argument for kvrelay-coordinator, repeatable, e.g. --coordinator-arg=--api-keys=FILE "
        "--coordinator-arg=--cors-allow-origin=*"},
       {"cluster-key-file", "", "the cluster secret (default: a fresh one for this launch)"},
       {"control-tls-dir", "",
        "mutual TLS on the control plane with the certificates scripts/make-cluster-certs.sh "
        "wrote to this directory"},
       {"max-running", "0", "coordinator: requests in the backend at most (0 = its default, 64)"},
       {"max-queue-delay-ms", "",
        "coordinator: refuse (429) a request whose predicted time to its first token behind "
        "others exceeds this many ms (default: the coordinator's, 2000; 0 = no bound)"},
       {"no-restart", "", "stop the whole cluster when any process exits", true},
       {"max-restarts", std::to_string(d.max_restarts),
        "restarts of one process (a TP group counts as one) within --restart-window-s"},
       {"restart-window-s", std::to_string(d.restart_window_s),
        "the window --max-restarts counts in; past it the launcher stops"}}};
}
void OnSignal(int) { g_stop.store(true); }

Result<deploy::LaunchOptions> ParseLaunchFlags(const Flags& flags,
                                               std::vector<std::string> coordinator_args) {
  deploy::LaunchOptions o;
  o.coordinator_args = std::move(coordinator_args);
  o.model_path = flags.Get("model", o.model_path);
  o.host = flags.Get("host", o.host);
  ASSIGN_OR_RETURN(int64_t port, flags.GetInt("port", 8080));
  ASSIGN_OR_RETURN(int64_t control, flags.GetInt("control-port", 0));
  if (port < 0 || port > 65535 || control < 0 || control > 65535) {
    return InvalidArgument("--port and --control-port must be 0..65535");
  }
  o.port = static_cast<uint16_t>(port);
  if (flags.Has("demo") && !flags.Has("port")) o.port = 0;  // a demo never needs a fixed port
  o.control_port = static_cast<uint16_t>(control);
  ASSIGN_OR_RETURN(int64_t prefill, flags.GetInt("prefill", 1));
  ASSIGN_OR_RETURN(int64_t decode, flags.GetInt("decode", 1));
  ASSIGN_OR_RETURN(int64_t tp, flags.GetInt("tp", 1));
  ASSIGN_OR_RETURN(int64_t colocated, flags.GetInt("colocated", 0));
  ASSIGN_OR_RETURN(int64_t threads, flags.GetInt("threads-per-worker", 1));
  ASSIGN_OR_RETURN(int64_t prefill_threads, flags.GetInt("prefill-threads", 0));
  ASSIGN_OR_RETURN(int64_t cap, flags.GetInt("kv-capacity-mb", 256));
  ASSIGN_OR_RETURN(int64_t ready, flags.GetInt("ready-timeout-ms", 120000));
  ASSIGN_OR_RETURN(o.kv_timeout_ms, flags.GetInt("kv-timeout-ms", 0));
  ASSIGN_OR_RETURN(o.heartbeat_ms, flags.GetInt("heartbeat-ms", 0));
  ASSIGN_OR_RETURN(o.heartbeat_timeout_ms, flags.GetInt("heartbeat-timeout-ms", 0));
  ASSIGN_OR_RETURN(o.tp_step_timeout_ms, flags.GetInt("tp-step-timeout-ms", 0));
  ASSIGN_OR_RETURN(o.kv_progress_timeout_ms, flags.GetInt("kv-progress-timeout-ms", 0));
  ASSIGN_OR_RETURN(o.coordinator_timeout_ms, flags.GetInt("coordinator-timeout-ms", 0));
  o.prefill = static_cast<int>(prefill);
  o.decode = static_cast<int>(decode);
  o.tp = static_cast<int>(tp);
  o.colocated = static_cast<int>(colocated);
  o.threads_per_worker = static_cast<int>(threads);
  o.prefill_threads = static_cast<int>(prefill_threads);
  o.kv_capacity_mb = cap;
  o.ready_timeout_ms = static_cast<int>(ready);
  o.kv_dtype = flags.Get("kv-dtype", o.kv_dtype);
  // Refused here, not after every process has loaded the model.
  RETURN_IF_ERROR(engine::ParseKvDtype(o.kv_dtype).status().WithContext("--kv-dtype"));
  if (flags.Has("no-kv-store") && flags.Has("kv-store")) {
    return InvalidArgument("--kv-store DIR and --no-kv-store contradict each other");
  }
  o.kv_store_dir = flags.Has("no-kv-store") ? "" : flags.Get("kv-store", kDefaultKvStoreDir);
  o.router = flags.Get("router", o.router);
  o.bin_dir = flags.Get("bin-dir", "");
  o.tp_mode = flags.Get("tp-mode", o.tp_mode);
  o.prefill_device = flags.Get("prefill-device", o.prefill_device);
  o.decode_device = flags.Get("decode-device", o.decode_device);
  o.cluster_key_file = flags.Get("cluster-key-file", "");  // empty: one is generated
  o.control_tls_dir = flags.Get("control-tls-dir", "");
  o.restart = !flags.Has("no-restart");
  ASSIGN_OR_RETURN(int64_t max_running, flags.GetInt("max-running", 0));
  ASSIGN_OR_RETURN(int64_t max_delay, flags.GetInt("max-queue-delay-ms", -1));
  if (flags.Has("max-queue-delay-ms") && max_delay < 0) {
    return InvalidArgument("--max-queue-delay-ms must be >= 0");
  }
  if (max_running < 0 || max_running > 1'000'000 || max_delay > 86'400'000) {
    return InvalidArgument("--max-running and --max-queue-delay-ms must be >= 0");
  }
  o.coordinator_max_running = static_cast<int>(max_running);
  o.coordinator_max_queue_delay_ms = static_cast<int>(max_delay);
  ASSIGN_OR_RETURN(int64_t max_restarts, flags.GetInt("max-restarts", o.max_restarts));
  ASSIGN_OR_RETURN(int64_t window, flags.GetInt("restart-window-s", o.restart_window_s));
  if (max_restarts < 0 || max_restarts > 1000 || window < 1 || window > 86400) {
    return InvalidArgument("--max-restarts must be 0..1000 and --restart-window-s 1..86400");
  }
  o.max_restarts = static_cast<int>(max_restarts);
  o.restart_window_s = static_cast<int>(window);
  RETURN_IF_ERROR(o.Validate());
  return o;
}

struct DemoFlags {
  std::string prompt;
  int max_tokens = 128;
};

Result<DemoFlags> ParseDemoFlags(const Flags& flags) {
  DemoFlags d;
  d.prompt = flags.Get("demo", "");
  ASSIGN_OR_RETURN(int64_t max_tokens, flags.GetInt("max-tokens", 128));
  d.max_tokens = static_cast<int>(max_tokens);
  return d;
}

// Streams one chat completion from the cluster and prints the text as it arrives.
Status RunDemo(const std::string& host, uint16_t port, const std::string& prompt, int max_tokens) {
  // A coordinator given --api-keys answers 401 without one of its keys.
  std::vector<std::pair<std::string, std::string>> auth;
  if (const char* key = std::getenv("KVRELAY_API_KEY"); key != nullptr && *key != '\0') {
    auth.push_back({"Authorization", std::string("Bearer ") + key});
  }
  // The served model's name, from /v1/models.
  HttpCallSpec models;
  models.headers = auth;
  models.host = host;
  models.port = port;
  models.target = "/v1/models";
  ASSIGN_OR_RETURN(auto listing, HttpCall(models));
  auto parsed = nlohmann::json::parse(listing.body, nullptr, false);
  if (listing.status != 200 || parsed.is_discarded() || !parsed.contains("data") ||
      parsed["data"].empty()) {
    return Unavailable("GET /v1/models failed: HTTP " + std::to_string(listing.status));
  }
  const std::string model = parsed["data"][0].value("id", "");
  nlohmann::json body = {{"model", model},
                         {"messages", {{{"role", "user"}, {"content", prompt}}}},
                         {"max_tokens", max_tokens},
                         {"temperature", 0},
                         {"stream", true}};
  HttpCallSpec spec;
  spec.method = "POST";
  spec.host = host;
  spec.port = port;
  spec.target = "/v1/chat/completions";
  spec.body = body.dump();
  spec.headers = auth;
  spec.headers.push_back({"Content-Type", "application/json"});
  spec.timeout_ms = 300'000;
  std::string pending;
  Status parse_error;
  auto on_body = [&](std::string_view bytes) {
    pending.append(bytes);
    size_t end;
    while ((end = pending.find("\n\n")) != std::string::npos) {
      std::string event = pending.substr(0, end);
      pending.erase(0, end + 2);
      if (event.rfind("data: ", 0) != 0) continue;
      std::string data = event.substr(6);
      if (data == "[DONE]") return true;
      auto j = nlohmann::json::parse(data, nullptr, false);
      if (j.is_discarded()) {
        parse_error = DataLoss("unparseable SSE event: " + data);
        return false;
      }
      if (j.contains("error")) {
        parse_error = Unavailable("server error: " + j["error"].dump());
        return false;
      }
      for (const auto& choice : j.value("choices", nlohmann::json::array())) {
        auto delta = choice.value("delta", nlohmann::json::object());
        if (delta.contains("content") && delta["content"].is_string()) {
          std::fputs(delta["content"].get<std::string>().c_str(), stdout);
          std::fflush(stdout);
        }
      }
    }
    return true;
  };
  auto result = HttpCall(spec, on_body);
  std::fputs("\n", stdout);
  RETURN_IF_ERROR(parse_error);
  if (!result.ok()) return result.status();
  if (result->status != 200) {
    return Unavailable("HTTP " + std::to_string(result->status) + ": " + result->body);
  }
  return Status::Ok();
}

int RunLaunch(const std::vector<std::string>& all_args) {
  std::vector<std::string> args = all_args;
  auto coordinator_args = TakeCoordinatorArgs(&args);
  if (!coordinator_args.ok()) {
    std::fprintf(stderr, "kvrelay launch: %s\n", coordinator_args.status().ToString().c_str());
    return 2;
  }
  int exit_code = 0;
  auto flags = ParseCommandFlags(args, LaunchSpec(), &exit_code);
  if (!flags) return exit_code;
  auto options = ParseLaunchFlags(*flags, *std::move(coordinator_args));
  if (!options.ok()) {
    std::fprintf(stderr, "kvrelay launch: %s\n", options.status().ToString().c_str());
    return 2;
  }
  SetLogTag("launch");
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  auto demo = ParseDemoFlags(*flags);
  if (!demo.ok()) {
    std::fprintf(stderr, "kvrelay launch: %s\n", demo.status().ToString().c_str());
    return 2;
  }
  deploy::LocalLauncher launcher(*options);
  Status s = launcher.Start();
  if (s.ok() && !demo->prompt.empty()) {
    s = RunDemo(options->host, launcher.http_port(), demo->prompt, demo->max_tokens);
  } else if (s.ok()) {
    std::printf("kvrelay cluster serving on http://%s:%u (Ctrl-C stops it)\n",
                options->host.c_str(), launcher.http_port());
    if (options->kv_store_dir.empty()) {
      std::printf("prefix store: off (--no-kv-store)\n");
    } else {
      std::printf(
          "prefix store: %s/<worker id> (reused after a restart; --no-kv-store turns it off)\n",
          options->kv_store_dir.c_str());
    }
    std::fflush(stdout);
    s = launcher.Supervise(g_stop);
  }
  launcher.Stop();
  if (!s.ok()) {
    LOG_ERROR << s.ToString();
    return 1;
  }
  return 0;
}

}  // namespace

KVRELAY_COMMAND(
    launch, "launch",
    "launch [--prefill P] [--decode D] [--tp T] [--tp-mode exact|reduce] [--colocated C] "
    "[--model PATH] [--port 8080] [--kv-dtype f32] [--kv-store DIR (default kvstore) | "
    "--no-kv-store] [--prefill-device cpu|cuda[:N]] [--decode-device cpu|cuda[:N]] "
    "[--coordinator-arg ARG]... [--demo PROMPT]",
    RunLaunch);

}  // namespace kvrelay::cli
