// kvrelay-coordinator: the OpenAI-compatible front end.
//
// Local mode (--model PATH): one process, colocated engine on this machine.
// Cluster mode (workers over the control plane) is wired by the cluster backend.
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "common/flags.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "coordinator/cluster/cluster_backend.h"
#include "coordinator/cluster/router.h"
#include "coordinator/http/server.h"
#include "coordinator/local_engine_backend.h"
#include "coordinator/openai/engine_text_codec.h"
#include "coordinator/stats_logger.h"
#include "engine/gguf/gguf.h"
#include "engine/runtime/model.h"
#include "engine/tokenizer/tokenizer.h"
#include "kv_transfer/mpi_session.h"

namespace kvrelay::coordinator {
namespace {

// Every flag the coordinator takes, with its default; --help prints it.
const FlagSpec kSpec = {
    "kvrelay-coordinator",
    "The OpenAI-compatible front end. Local mode (--model only): one process with a\n"
    "colocated engine. Cluster mode (--control-port): workers register over the control\n"
    "plane (started by kvrelay launch or mpirun).",
    "",
    0,
    {{"model", "", "GGUF model path (required)"},
     {"served-model-name", "the file name without .gguf",
      "NAME[,ALIAS...]: the model id /v1/models lists and responses echo, then other names "
      "accepted in 'model' (the file name and the GGUF's general.name always are)"},
     {"model-name", "", "the same as --served-model-name (older spelling)"},
     {"max-model-len", "the model's context length", "context length: prompt + max_tokens at most"},
     {"host", "127.0.0.1", "HTTP bind address"},
     {"port", "8080", "HTTP port (0 = pick a free one)"},
     {"api-keys", "", "file of accepted bearer tokens, one a line (default: no auth)"},
     {"max-queue", "256", "requests waiting at most"},
     {"max-running", "64", "requests running at most"},
     {"router", "prefix_aware", "cluster routing policy"},
     {"threads", "2", "HTTP threads"},
     {"engine-threads", "0", "engine threads, local mode (0 = all cores)"},
     {"kv-dtype", std::string(engine::KvDtypeName(engine::kDefaultKvDtype)), "KV cache dtype"},
     {"kv-capacity-mb", "0", "KV pool, local mode (0 = the engine's default)"},
     {"block-tokens", "16", "tokens per KV block"},
     {"max-step-tokens", "512", "tokens per engine step at most"},
     {"max-prompt-tokens", "8192", "longest prompt accepted"},
     {"max-body-bytes", "1048576", "largest request body"},
     {"request-timeout-ms", "600000", "per-request deadline"},
     {"default-max-tokens", "0",
      "max_tokens when a request gives none (0 = all the remaining context, as vLLM)"},
     {"max-queue-delay-ms", std::to_string(kDefaultMaxQueueDelayMs),
      "refuse (429, Retry-After from the estimate) a request with others ahead of it whose "
      "predicted time to its first token is longer (0 = no limit)"},
     {"cors-allow-origin", "",
      "send CORS headers allowing this origin ('*' or e.g. https://app.example); empty = none"},
     {"max-connections", "4096", "open connections at most"},
     {"max-connections-per-client", "1024", "open connections per client address"},
     {"control-port", "", "cluster mode: the workers' control port (0 = pick a free one)"},
     {"heartbeat-ms", "500", "cluster mode: worker heartbeat interval"},
     {"log-stats-interval-ms", "10000",
      "a stats line (throughput, running, queued, KV use, prefix hit rate) this often while "
      "serving (0 = none)"},
     {"heartbeat-timeout-ms", "0",
      "cluster mode: drop a worker silent this long (0 = 3 heartbeat intervals)"},
     {"worker-wait-ms", "1 heartbeat interval",
      "cluster mode: a request that finds no healthy worker (new, or moving after a loss) "
      "waits this long for one to register before it fails (0 = fail at once)"},
     {"migration-limit", "3",
      "cluster mode: a request whose worker is lost or fails (a TP rank, its KV path) "
      "continues on another worker (prompt + tokens sent re-prefilled) at most this many "
      "times (0 = it fails)"},
     {"control-host", "127.0.0.1", "cluster mode: the control port's bind address"},
     {"cluster-key-file", "",
      "cluster mode: the cluster secret every worker must prove (required)"},
     {protocols::kControlTlsCertFlag, "",
      "cluster mode: control-port TLS certificate (PEM; with -key and -ca: mutual TLS 1.3)"},
     {protocols::kControlTlsKeyFlag, "", "cluster mode: the control-port certificate's key"},
     {protocols::kControlTlsCaFlag, "",
      "cluster mode: the cluster CA every worker's certificate must chain to"}}};

std::string ModelNameFromPath(const std::string& path) {
  std::string name = path.substr(path.find_last_of('/') + 1);
  if (name.size() > 5 && name.substr(name.size() - 5) == ".gguf") name.resize(name.size() - 5);
  return name;
}

struct ServedNames {
  std::vector<std::string> names;    // --served-model-name, the first one listed
  std::vector<std::string> aliases;  // every other accepted name
};

// --served-model-name NAME[,ALIAS...] (or --model-name); accepted besides:
// the file name without .gguf and the GGUF's general.name.
Result<ServedNames> ParseServedNames(const Flags& flags, const std::string& model_path) {
  const std::string file_name = ModelNameFromPath(model_path);
  std::string spec = flags.Get("served-model-name", flags.Get("model-name", file_name));
  ServedNames out;
  for (size_t at = 0; at <= spec.size();) {
    size_t comma = spec.find(',', at);
    if (comma == std::string::npos) comma = spec.size();
    std::string name = spec.substr(at, comma - at);
    if (name.empty()) {
      return InvalidArgument("--served-model-name has an empty name: '" + spec + "'");
    }
    out.names.push_back(std::move(name));
    at = comma + 1;
  }
  std::vector<std::string> accepted(out.names.begin() + 1, out.names.end());
  accepted.push_back(file_name);
  auto gguf = engine::GgufFile::Open(model_path);
  if (gguf.ok()) {
    if (auto general = (*gguf)->GetString("general.name"); general.ok() && !general->empty()) {
      accepted.push_back(*general);
    }
  }
  for (std::string& a : accepted) {
    if (a != out.names.front() &&
        std::find(out.aliases.begin(), out.aliases.end(), a) == out.aliases.end()) {
      out.aliases.push_back(std::move(a));
    }
  }
  return out;
}

Status Run(const std::vector<std::string>& args) {
  ASSIGN_OR_RETURN(auto flags, Flags::Parse(args, kSpec));
  if (flags.help_requested()) {
    std::fputs(Flags::Usage(kSpec).c_str(), stdout);
    return Status::Ok();
  }
  if (!flags.Has("model")) {
    return InvalidArgument(
        "--model PATH is required (cluster mode is started by the cluster launcher)");
  }
  ServerOptions so;
  so.host = flags.Get("host", "127.0.0.1");
  ASSIGN_OR_RETURN(int64_t port, flags.GetInt("port", 8080));
  if (port < 0 || port > 65535) return InvalidArgument("--port must be 0..65535");
  so.port = static_cast<uint16_t>(port);
  ASSIGN_OR_RETURN(int64_t threads, flags.GetInt("threads", 2));
  ASSIGN_OR_RETURN(int64_t max_queue, flags.GetInt("max-queue", 256));
  ASSIGN_OR_RETURN(int64_t max_running, flags.GetInt("max-running", 64));
  ASSIGN_OR_RETURN(int64_t max_prompt, flags.GetInt("max-prompt-tokens", 8192));
  ASSIGN_OR_RETURN(int64_t max_body, flags.GetInt("max-body-bytes", 1 << 20));
  ASSIGN_OR_RETURN(int64_t timeout_ms, flags.GetInt("request-timeout-ms", 600'000));
  ASSIGN_OR_RETURN(int64_t default_max_tokens, flags.GetInt("default-max-tokens", 0));
  ASSIGN_OR_RETURN(int64_t max_queue_delay,
                   flags.GetInt("max-queue-delay-ms", kDefaultMaxQueueDelayMs));
  ASSIGN_OR_RETURN(int64_t max_conn, flags.GetInt("max-connections", 4096));
  ASSIGN_OR_RETURN(int64_t max_conn_client, flags.GetInt("max-connections-per-client", 1024));
  if (max_queue_delay < 0) return InvalidArgument("--max-queue-delay-ms must be >= 0");
  if (max_conn < 1 || max_conn_client < 1) {
    return InvalidArgument("--max-connections and --max-connections-per-client must be >= 1");
  }
  so.max_queue_delay_ms = static_cast<int>(max_queue_delay);
  so.cors_allow_origin = flags.Get("cors-allow-origin", "");
  so.max_connections = static_cast<int>(max_conn);
  so.max_connections_per_client = static_cast<int>(max_conn_client);
  if (threads < 1 || threads > 256) return InvalidArgument("--threads must be 1..256");
  if (max_queue < 0) return InvalidArgument("--max-queue must be >= 0");
  if (max_running < 1) return InvalidArgument("--max-running must be >= 1");
  if (max_prompt < 1) return InvalidArgument("--max-prompt-tokens must be >= 1");
  if (max_body < 1024) return InvalidArgument("--max-body-bytes must be >= 1024");
  if (timeout_ms < 1000) return InvalidArgument("--request-timeout-ms must be >= 1000");
  if (default_max_tokens < 0) return InvalidArgument("--default-max-tokens must be >= 0");
  so.threads = static_cast<int>(threads);
  so.max_queue = static_cast<int>(max_queue);
  so.max_running = static_cast<int>(max_running);
  so.max_prompt_tokens = static_cast<int>(max_prompt);
  so.max_body_bytes = static_cast<size_t>(max_body);
  so.request_timeout_ms = static_cast<int>(timeout_ms);
  so.limits.max_tokens_default = static_cast<int>(default_max_tokens);
  ASSIGN_OR_RETURN(RouterPolicy policy, ParseRouterPolicy(flags.Get("router", "prefix_aware")));
  if (flags.Has("api-keys")) {
    ASSIGN_OR_RETURN(so.api_keys, ApiKeys::LoadFile(flags.Get("api-keys")));
    LOG_INFO << "loaded " << so.api_keys.size() << " API keys";
  }

  // --- local engine ---
  const std::string model_path = flags.Get("model");
  ASSIGN_OR_RETURN(ServedNames names, ParseServedNames(flags, model_path));
  so.model_name = names.names.front();
  so.limits.model_aliases = std::move(names.aliases);
  auto loaded = engine::Model::Load(model_path);
  if (!loaded.ok()) return loaded.status().WithContext("loading " + model_path);
  std::shared_ptr<const engine::Model> model = std::move(*loaded);
  if (model->tokenizer() == nullptr) return FailedPrecondition("the model has no tokenizer");
  engine::EngineOptions eo;
  eo.model_path = model_path;
  ASSIGN_OR_RETURN(int64_t engine_threads, flags.GetInt("engine-threads", 0));
  ASSIGN_OR_RETURN(int64_t kv_mb, flags.GetInt("kv-capacity-mb", 0));
  ASSIGN_OR_RETURN(int64_t block_tokens, flags.GetInt("block-tokens", 16));
  ASSIGN_OR_RETURN(int64_t max_step_tokens, flags.GetInt("max-step-tokens", 512));
  ASSIGN_OR_RETURN(eo.kv_dtype,
                   engine::ParseKvDtype(flags.Get(
                       "kv-dtype", std::string(engine::KvDtypeName(engine::kDefaultKvDtype)))));
  eo.threads = static_cast<int>(engine_threads);
  eo.kv_capacity_bytes = kv_mb << 20;
  eo.block_tokens = static_cast<int>(block_tokens);
  eo.max_step_tokens = static_cast<int>(max_step_tokens);
  eo.max_running = so.max_running;
  RETURN_IF_ERROR(eo.Validate());
  const int64_t context_length = model->config().context_length;
  ASSIGN_OR_RETURN(int64_t max_model_len, flags.GetInt("max-model-len", context_length));
  if (max_model_len < 2 || max_model_len > context_length) {
    return InvalidArgument("--max-model-len must be 2.." + std::to_string(context_length) +
                           " (the model's context length), got " + std::to_string(max_model_len));
  }
  so.max_context_tokens = static_cast<int>(max_model_len);
  EngineTextCodec codec(model->tokenizer(), model->chat_template());
  std::unique_ptr<Backend> backend;
  if (flags.Has("control-port")) {
    // Cluster mode: workers register over the control plane; this process
    // only tokenizes, routes and streams. The model is loaded for its
    // tokenizer, chat template, fingerprint and KV layout.
    ClusterBackendOptions co;
    ASSIGN_OR_RETURN(int64_t control_port, flags.GetInt("control-port", 9000));
    ASSIGN_OR_RETURN(int64_t heartbeat_ms, flags.GetInt("heartbeat-ms", 500));
    ASSIGN_OR_RETURN(int64_t heartbeat_timeout_ms, flags.GetInt("heartbeat-timeout-ms", 0));
    if (flags.Has("worker-wait-ms")) {
      ASSIGN_OR_RETURN(int64_t wait_ms, flags.GetInt("worker-wait-ms", 0));
      if (wait_ms < 0) return InvalidArgument("--worker-wait-ms must be >= 0");
      co.worker_wait = std::chrono::milliseconds(wait_ms);
    }
    ASSIGN_OR_RETURN(int64_t migration_limit, flags.GetInt("migration-limit", 3));
    if (migration_limit < 0 || migration_limit > 1000) {
      return InvalidArgument("--migration-limit must be 0..1000 (0 = no migration), got " +
                             std::to_string(migration_limit));
    }
    co.migration_limit = static_cast<int>(migration_limit);
    if (control_port < 0 || control_port > 65535)
      return InvalidArgument("--control-port must be 0..65535");
    co.vocab_size = model->config().vocab;
    // The control plane is internal: loopback unless asked, whatever --host the HTTP API uses.
    co.host = flags.Get("control-host", "127.0.0.1");
    if (!flags.Has("cluster-key-file")) {
      return InvalidArgument(
          "--cluster-key-file FILE is required with --control-port: workers must prove the "
          "cluster secret to join (create one with: (umask 077; openssl rand -hex 32 > FILE))");
    }
    ASSIGN_OR_RETURN(co.cluster_key,
                     protocols::ClusterKey::LoadFile(flags.Get("cluster-key-file")));
    protocols::TlsOptions tls;
    tls.cert_file = flags.Get(protocols::kControlTlsCertFlag, "");
    tls.key_file = flags.Get(protocols::kControlTlsKeyFlag, "");
    tls.ca_file = flags.Get(protocols::kControlTlsCaFlag, "");
    if (tls.enabled()) {
      ASSIGN_OR_RETURN(co.tls, protocols::TlsContext::Create(tls));
    }
    co.control_port = static_cast<uint16_t>(control_port);
    co.heartbeat_interval = std::chrono::milliseconds(heartbeat_ms);
    co.heartbeat_timeout = std::chrono::milliseconds(heartbeat_timeout_ms);
    co.router.policy = policy;
    const engine::KvLayout layout = model->MakeKvLayout(eo.kv_dtype, eo.block_tokens);
    co.config.model_fingerprint = model->fingerprint();
    co.config.kv_dtype = layout.dtype;
    co.config.block_tokens = layout.block_tokens;
    co.config.layers = layout.layers;
    co.config.kv_heads = layout.kv_heads;
    co.config.head_dim = layout.head_dim;
    const engine::ModelFingerprint fingerprint = model->fingerprint();
    const int block = eo.block_tokens;
    so.prefix_hasher = [fingerprint, block](std::span<const int32_t> tokens,
                                            std::string_view salt) {
      return engine::HashPrefixBlocks(tokens, block, fingerprint, salt);
    };
    ASSIGN_OR_RETURN(backend, ClusterBackend::Create(co));
  } else {
    ASSIGN_OR_RETURN(auto eng, engine::Engine::Create(eo, model));
    LocalEngineBackend::Options bo;
    const engine::Tokenizer* tok = model->tokenizer();
    bo.is_end_of_generation = [tok](int32_t id) { return tok->IsEndOfGeneration(id); };
    ASSIGN_OR_RETURN(backend, LocalEngineBackend::Create(std::move(eng), bo));
  }

  // Signals are taken synchronously by this thread; every other thread
  // (created below) inherits the blocked mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  MetricsRegistry metrics;
  ASSIGN_OR_RETURN(auto server, Server::Create(so, backend.get(), &codec, &metrics));
  RETURN_IF_ERROR(server->Start());
  ASSIGN_OR_RETURN(int64_t stats_ms, flags.GetInt("log-stats-interval-ms", 10'000));
  if (stats_ms < 0) return InvalidArgument("--log-stats-interval-ms must be >= 0");
  std::unique_ptr<StatsLogger> stats;
  if (stats_ms > 0) {
    stats = std::make_unique<StatsLogger>(backend.get(), std::chrono::milliseconds(stats_ms));
  }
  std::printf("kvrelay-coordinator listening on http://%s:%u (model '%s')\n", so.host.c_str(),
              static_cast<unsigned>(server->port()), so.model_name.c_str());
  std::fflush(stdout);
  int sig = 0;
  sigwait(&signals, &sig);
  LOG_INFO << "signal " << sig << ": shutting down";
  stats.reset();
  server->Stop();
  server.reset();
  backend.reset();
  return Status::Ok();
}

}  // namespace
}  // namespace kvrelay::coordinator

int main(int argc, char** argv) {
  kvrelay::SetLogTag("coordinator");
  // Under mpirun every process of the job initialises MPI (the coordinator
  // only idles in it); see kv_transfer/mpi_session.h.
  auto mpi = kvrelay::kv_transfer::MpiSession::Start(&argc, &argv);
  if (!mpi.ok()) {
    std::fprintf(stderr, "kvrelay-coordinator: %s\n", mpi.status().ToString().c_str());
    return 1;
  }
  std::vector<std::string> args(argv + 1, argv + argc);
  kvrelay::Status st = kvrelay::coordinator::Run(args);
  if (!st.ok()) {
    std::fprintf(stderr, "kvrelay-coordinator: %s\n(kvrelay-coordinator --help lists the flags)\n",
                 st.ToString().c_str());
    return 2;
  }
  return 0;
}
