#include <csignal>
#include <cstdio>
#include <cstdlib>

#include "common/flags.h"
#include "common/logging.h"
#include "kv_transfer/mpi_session.h"
#include "kv_transfer/transport_factory.h"
#include "worker/worker.h"

namespace kvrelay::worker {
namespace {

std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop.store(true); }

// Every flag a worker takes, with its default; --help prints it.
// The binary of each role (kvrelay-worker is the colocated one).
std::string ProgramName(RoleKind role) {
  switch (role) {
    case RoleKind::kPrefill:
      return "kvrelay-prefill";
    case RoleKind::kDecode:
      return "kvrelay-decode";
    case RoleKind::kColocated:
      return "kvrelay-worker";
  }
  return "kvrelay-worker";
}

std::string RoleSummary(RoleKind role) {
  const char* what = "";
  switch (role) {
    case RoleKind::kPrefill:
      what =
          "A prefill worker: runs prompts (reusing cached prefixes, from its prefix store too)\n"
          "and streams their KV, layer by layer, to the decode group the coordinator names.";
      break;
    case RoleKind::kDecode:
      what =
          "A decode worker, or one rank of a tensor-parallel decode group (--tp-size,\n"
          "--tp-rank): receives a prompt's KV from a prefill worker and generates its tokens.";
      break;
    case RoleKind::kColocated:
      what =
          "A colocated worker: prefill and decode of each request in one process (no KV\n"
          "transfer).";
      break;
  }
  return std::string(what) +
         "\nIt registers with the coordinator's control plane (started by kvrelay launch or "
         "mpirun).";
}

FlagSpec WorkerSpec(RoleKind role) {
  return {ProgramName(role),
          RoleSummary(role),
          "",
          0,
          {{"id", "<role>-<rank>", "worker id"},
           {"coordinator", "127.0.0.1:9000", "coordinator control plane HOST:PORT"},
           {"coordinator-timeout-ms", "0",
            "nothing from the coordinator for this long: drop the link and re-register "
            "(0 = 3 of its heartbeat intervals, at least 2000)"},
           {protocols::kControlTlsCertFlag, "",
            "control link TLS: this worker's certificate (PEM; with -key and -ca)"},
           {protocols::kControlTlsKeyFlag, "", "control link TLS: the certificate's private key"},
           {protocols::kControlTlsCaFlag, "",
            "control link TLS: the cluster CA the coordinator's certificate must chain to"},
           {"model", "models/SmolLM2-135M-Instruct.Q4_1.gguf", "GGUF model path"},
           {"kv-dtype", std::string(engine::KvDtypeName(engine::kDefaultKvDtype)),
            "KV cache dtype: f32|f16|bf16|int8|kivi4|kivi2"},
           {"device", "cpu", "compute device: cpu|cuda[:N]"},
           {"kv-capacity-mb", "256", "KV pool"},
           {"block-tokens", "16", "tokens per KV block"},
           {"threads", "0", "engine threads (0 = all cores)"},
           {"max-step-tokens", "512", "tokens per engine step at most"},
           {"max-running", "64", "requests running at most"},
           {"rank", "$OMPI_COMM_WORLD_RANK or 0", "data-plane peer index"},
           {"world-size", "$OMPI_COMM_WORLD_SIZE or 2", "data-plane peers"},
           {"kv-transport", "auto", "KV transport: tcp|mpi|auto"},
           {"kv-host", "127.0.0.1", "KV listener bind address"},
           {"advertise-host", "", "address peers dial (default: --kv-host)"},
           {"kv-port", "0", "KV listener port (0 = pick a free one)"},
           {"kv-store", "", "RocksDB prefix store directory (default: none)"},
           {"kv-store-capacity-mb", "2048", "prefix store capacity"},
           {"kv-timeout-ms", "30000", "KV transfer deadline"},
           {"kv-progress-timeout-ms", "2000",
            "a handed-over KV stream that moves no byte for this long fails (a cut link)"},
           {"tp-size", "1", "tensor-parallel ranks of the decode group"},
           {"tp-rank", "0", "this process's TP rank"},
           {"tp-leader", "127.0.0.1:0", "TP group leader HOST:PORT"},
           {"tp-mode", "exact", "exact|reduce"},
           {"tp-comm", "auto", "TP communicator: tcp|mpi|auto"},
           {"tp-step-timeout-ms", "2000",
            "a TP rank that does not answer a step (or ping) in this long breaks the group"},
           {"cluster-key-file", "", "the cluster secret (required)"}}};
}

Result<WorkerOptions> ParseWorkerFlags(RoleKind role, const Result<Flags>& parsed) {
  if (!parsed.ok()) return parsed.status();
  const Flags& flags = *parsed;
  WorkerOptions o;
  o.role = role;
  o.worker_id = flags.Get("id", "");
  const std::string coord = flags.Get("coordinator", "127.0.0.1:9000");
  auto colon = coord.rfind(':');
  if (colon == std::string::npos)
    return InvalidArgument("--coordinator must be HOST:PORT, got '" + coord + "'");
  o.coordinator_host = coord.substr(0, colon);
  char* end = nullptr;
  long port = std::strtol(coord.c_str() + colon + 1, &end, 10);
  if (*end != '\0' || port <= 0 || port > 65535)
    return InvalidArgument("--coordinator has a bad port: '" + coord + "'");
  o.coordinator_port = static_cast<uint16_t>(port);
  ASSIGN_OR_RETURN(int64_t coordinator_timeout, flags.GetInt("coordinator-timeout-ms", 0));
  o.coordinator_timeout = std::chrono::milliseconds(coordinator_timeout);
  o.engine.model_path = flags.Get("model", "models/SmolLM2-135M-Instruct.Q4_1.gguf");
  ASSIGN_OR_RETURN(o.engine.kv_dtype,
                   engine::ParseKvDtype(flags.Get(
                       "kv-dtype", std::string(engine::KvDtypeName(engine::kDefaultKvDtype)))));
  o.engine.device = flags.Get("device", "cpu");  // cpu | cuda[:N]; checked by Engine::Create
  ASSIGN_OR_RETURN(int64_t cap_mb, flags.GetInt("kv-capacity-mb", 256));
  o.engine.kv_capacity_bytes = cap_mb << 20;
  ASSIGN_OR_RETURN(int64_t block_tokens, flags.GetInt("block-tokens", 16));
  o.engine.block_tokens = static_cast<int>(block_tokens);
  ASSIGN_OR_RETURN(int64_t threads, flags.GetInt("threads", 0));
  o.engine.threads = static_cast<int>(threads);
  ASSIGN_OR_RETURN(int64_t step_tokens, flags.GetInt("max-step-tokens", 512));
  o.engine.max_step_tokens = static_cast<int>(step_tokens);
  ASSIGN_OR_RETURN(int64_t max_running, flags.GetInt("max-running", 64));
  o.engine.max_running = static_cast<int>(max_running);
  // Under mpirun the data-plane peer index defaults to the MPI world rank.
  const char* mpi_rank = std::getenv("OMPI_COMM_WORLD_RANK");
  const char* mpi_size = std::getenv("OMPI_COMM_WORLD_SIZE");
  ASSIGN_OR_RETURN(int64_t rank, flags.GetInt("rank", mpi_rank ? std::atoll(mpi_rank) : 0));
  ASSIGN_OR_RETURN(int64_t world, flags.GetInt("world-size", mpi_size ? std::atoll(mpi_size) : 2));
  o.rank = static_cast<int>(rank);
  o.world_size = static_cast<int>(world);
  if (o.worker_id.empty()) {
    o.worker_id = std::string(RoleKindName(role)) + "-" + std::to_string(rank);
  }
  o.kv_transport = flags.Get("kv-transport", "auto");
  o.kv_host = flags.Get("kv-host", "127.0.0.1");
  o.advertise_host = flags.Get("advertise-host", "");
  ASSIGN_OR_RETURN(int64_t kv_port, flags.GetInt("kv-port", 0));
  if (kv_port < 0 || kv_port > 65535) return InvalidArgument("--kv-port out of range");
  o.kv_port = static_cast<uint16_t>(kv_port);
  o.kv_store_path = flags.Get("kv-store", "");
  ASSIGN_OR_RETURN(int64_t store_mb, flags.GetInt("kv-store-capacity-mb", 2048));
  o.kv_store_capacity_bytes = store_mb << 20;
  ASSIGN_OR_RETURN(int64_t kv_timeout, flags.GetInt("kv-timeout-ms", 30000));
  o.kv_timeout = std::chrono::milliseconds(kv_timeout);
  ASSIGN_OR_RETURN(int64_t kv_progress, flags.GetInt("kv-progress-timeout-ms", 2000));
  o.kv_progress_timeout = std::chrono::milliseconds(kv_progress);
  ASSIGN_OR_RETURN(int64_t tp_step, flags.GetInt("tp-step-timeout-ms", 2000));
  o.tp_step_timeout = std::chrono::milliseconds(tp_step);
  ASSIGN_OR_RETURN(int64_t tp_size, flags.GetInt("tp-size", 1));
  ASSIGN_OR_RETURN(int64_t tp_rank, flags.GetInt("tp-rank", 0));
  o.tp_size = static_cast<int>(tp_size);
  o.tp_rank = static_cast<int>(tp_rank);
  if (tp_size > 1) {
    const std::string leader = flags.Get("tp-leader", "127.0.0.1:0");
    auto c = leader.rfind(':');
    char* e = nullptr;
    long p = c == std::string::npos ? -1 : std::strtol(leader.c_str() + c + 1, &e, 10);
    if (c == std::string::npos || *e != '\0' || p < 0 || p > 65535) {
      return InvalidArgument("--tp-leader must be HOST:PORT, got '" + leader + "'");
    }
    o.tp_host = leader.substr(0, c);
    o.tp_port = static_cast<uint16_t>(p);
  }
  o.tp_comm = flags.Get("tp-comm", "auto");
  const std::string mode = flags.Get("tp-mode", "exact");
  if (mode == "exact") {
    o.tp_mode = engine::TpMode::kExact;
  } else if (mode == "reduce") {
    o.tp_mode = engine::TpMode::kReduce;
  } else {
    return InvalidArgument("--tp-mode must be exact or reduce, got '" + mode + "'");
  }
  if (!flags.Has("cluster-key-file")) {
    return InvalidArgument("--cluster-key-file FILE is required (the coordinator's cluster key)");
  }
  ASSIGN_OR_RETURN(o.cluster_key, protocols::ClusterKey::LoadFile(flags.Get("cluster-key-file")));
  o.control_tls.cert_file = flags.Get(protocols::kControlTlsCertFlag, "");
  o.control_tls.key_file = flags.Get(protocols::kControlTlsKeyFlag, "");
  o.control_tls.ca_file = flags.Get(protocols::kControlTlsCaFlag, "");
  RETURN_IF_ERROR(o.Validate());
  return o;
}

// Creates and serves; the process's exit status.
int Serve(const WorkerOptions& options, const RoleFactory& make_role,
          const FollowerMain& run_follower) {
  SetLogTag(options.worker_id);
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  std::signal(SIGPIPE, SIG_IGN);
  Status s;
  if (options.tp_follower()) {
    s = run_follower(options, g_stop);
  } else {
    auto worker = Worker::Create(options, make_role(options));
    if (!worker.ok()) {
      LOG_ERROR << "cannot start: " << worker.status().ToString();
      return 1;
    }
    s = (*worker)->Run(g_stop);
  }
  if (!s.ok() && !g_stop.load()) {
    LOG_ERROR << "stopped: " << s.ToString();
    return 1;
  }
  LOG_INFO << "stopped";
  return 0;
}

}  // namespace

int WorkerMain(RoleKind role, const RoleFactory& make_role, const FollowerMain& run_follower,
               int argc, char** argv) {
  const std::string name = ProgramName(role);
  const FlagSpec spec = WorkerSpec(role);
  const Result<Flags> flags = Flags::Parse(std::vector<std::string>(argv + 1, argv + argc), spec);
  if (flags.ok() && flags->help_requested()) {
    std::fputs(Flags::Usage(spec).c_str(), stdout);
    return 0;
  }
  auto options = ParseWorkerFlags(role, flags);
  // Under mpirun every process of the job initialises MPI and joins the TP
  // split (also one that is about to exit on a bad flag, so the others'
  // collective start completes); see kv_transfer/mpi_session.h.
  int tp_color = kv_transfer::kNoTpGroup, tp_key = 0;
  if (options.ok() && options->tp_over_mpi()) {
    tp_color = options->rank - options->tp_rank;  // the group leader's world rank
    tp_key = options->tp_rank;
  }
  auto mpi = kv_transfer::MpiSession::Start(&argc, &argv, tp_color, tp_key);
  if (!mpi.ok()) {
    std::fprintf(stderr, "%s: %s\n", name.c_str(), mpi.status().ToString().c_str());
    return 1;
  }
  int rc = 2;
  if (!options.ok()) {
    std::fprintf(stderr, "%s: %s\n(%s --help lists the flags)\n", name.c_str(),
                 options.status().ToString().c_str(), name.c_str());
  } else {
    rc = Serve(*options, make_role, run_follower);
  }
  mpi->set_exit_code(rc);
  return rc;
}

}  // namespace kvrelay::worker
