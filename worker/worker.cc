#include "worker/worker.h"

#include <algorithm>
#include <thread>

#include "common/logging.h"
#include "common/process_stats.h"
#include "kv_transfer/transport_factory.h"
#include "protocols/messages.h"

namespace kvrelay::worker {

using protocols::MessageType;

namespace {

proto::WorkerRole ToProto(RoleKind r) {
  switch (r) {
    case RoleKind::kPrefill:
      return proto::WORKER_ROLE_PREFILL;
    case RoleKind::kDecode:
      return proto::WORKER_ROLE_DECODE;
    case RoleKind::kColocated:
      return proto::WORKER_ROLE_COLOCATED;
  }
  return proto::WORKER_ROLE_UNSPECIFIED;
}

}  // namespace

Result<ProcessBase> LoadProcessBase(const WorkerOptions& options) {
  RETURN_IF_ERROR(options.Validate());
  ProcessBase base;
  engine::ModelLoadOptions load;
  load.shard = {options.tp_rank, options.tp_size, options.tp_mode};
  ASSIGN_OR_RETURN(std::unique_ptr<engine::Model> model,
                   engine::Model::Load(options.engine.model_path, load));
  base.model = std::move(model);
  base.layout = base.model->MakeKvLayout(options.engine.kv_dtype, options.engine.block_tokens);
  protocols::PeerConfig& pc = base.peer_config;
  pc.model_fingerprint = base.model->fingerprint();
  pc.kv_dtype = base.layout.dtype;
  pc.block_tokens = base.layout.block_tokens;
  pc.layers = base.layout.layers;
  pc.kv_heads = base.model->full_config().n_kv_heads;
  pc.head_dim = base.layout.head_dim;
  pc.tp_size = options.tp_size;
  pc.tp_rank = options.tp_rank;

  kv_transfer::TransportOptions t;
  t.name = options.kv_transport;
  t.rank = options.rank;
  t.world_size = options.world_size;
  t.listen_host = options.kv_host;
  t.listen_port = options.kv_port;
  t.advertise_host = options.advertise_host;
  t.cluster_key = options.cluster_key;
  ASSIGN_OR_RETURN(base.transport, kv_transfer::CreateTransport(t));
  return base;
}

Worker::Worker(WorkerOptions options, std::unique_ptr<Role> role)
    : options_(std::move(options)), role_(std::move(role)) {}

Worker::~Worker() {
  if (role_) role_->Shutdown();
}

Result<std::unique_ptr<Worker>> Worker::Create(WorkerOptions options, std::unique_ptr<Role> role) {
  if (role == nullptr) return InvalidArgument("a worker needs a role");
  std::unique_ptr<Worker> w(new Worker(std::move(options), std::move(role)));
  RETURN_IF_ERROR(w->Init());
  return w;
}

Status Worker::Init() {
  ASSIGN_OR_RETURN(base_, LoadProcessBase(options_));
  ControlLink::Options c;
  c.worker_id = options_.worker_id;
  c.host = options_.coordinator_host;
  c.port = options_.coordinator_port;
  c.peer_config = base_.peer_config;
  c.cluster_key = options_.cluster_key;
  if (options_.control_tls.enabled()) {
    ASSIGN_OR_RETURN(c.tls, protocols::TlsContext::Create(options_.control_tls));
  }
  c.connect_timeout = options_.connect_timeout;
  c.coordinator_timeout = options_.coordinator_timeout;
  control_ = std::make_unique<ControlLink>(c);
  events_ = std::make_unique<EventReporter>(control_.get(), base_.model->tokenizer(), &requests_);
  ctx_.options = &options_;
  ctx_.model = base_.model;
  ctx_.layout = base_.layout;
  ctx_.peer_config = base_.peer_config;
  ctx_.transport = base_.transport.get();
  ctx_.control = control_.get();
  ctx_.requests = &requests_;
  ctx_.counters = &counters_;
  RETURN_IF_ERROR(role_->Init(ctx_));
  engine::Engine* engine = role_->engine();
  engine->pool()->SetEventListener([this](const engine::KvEvent& ev) {
    if (!role_->OnPoolEvent(ev)) control_->OnKvEvent(ev);
  });
  control_->SetHeartbeatSource([this](proto::Heartbeat* hb) { FillHeartbeat(hb); });
  return Status::Ok();
}

namespace {
// The pool's total (or available) blocks in blocks of every layer, the unit
// the coordinator's router counts a request's need in: an engine with KV
// cache groups has groups-times smaller blocks (a conservative count, as its
// sliding-window groups need fewer).
int64_t WholeBlocks(engine::Engine& e, bool available) {
  engine::KvBlockPool* pool = e.pool();
  const int64_t n = available ? pool->available_blocks() : pool->total_blocks();
  return n / e.kv_groups().size();
}
}  // namespace

proto::RegisterWorker Worker::Registration() const {
  proto::RegisterWorker reg;
  reg.set_worker_id(options_.worker_id);
  reg.set_role(ToProto(options_.role));
  reg.set_rank(static_cast<uint32_t>(options_.rank));
  reg.set_tp_size(static_cast<uint32_t>(options_.tp_size));
  protocols::ToProto(base_.peer_config, reg.mutable_config());
  reg.set_capacity_blocks(static_cast<uint64_t>(WholeBlocks(*role_->engine(), false)));
  reg.set_kv_address(base_.transport->conn_info());
  role_->DescribeRegistration(&reg);
  if (reg.tp_ranks_size() == 0) reg.add_tp_ranks(static_cast<uint32_t>(options_.rank));
  return reg;
}

void Worker::FillHeartbeat(proto::Heartbeat* hb) const {
  engine::Engine* e = role_->engine();
  hb->set_free_blocks(static_cast<uint64_t>(WholeBlocks(*e, true)));
  hb->set_capacity_blocks(static_cast<uint64_t>(WholeBlocks(*e, false)));
  // Counted from the requests' records: the batch computes the prompts of
  // kComputing requests and decodes kRunning ones; prompt tokens are queued
  // until their first token is sampled.
  using S = RequestState;
  hb->set_running_requests(static_cast<uint32_t>(requests_.Count({S::kComputing, S::kRunning})));
  hb->set_queued_tokens(static_cast<uint32_t>(requests_.PromptTokens({S::kQueued, S::kComputing})));
  hb->set_prefix_hit_tokens(static_cast<uint64_t>(e->stats().prompt_tokens_cached));
  hb->set_transfer_bytes(static_cast<uint64_t>(counters_.transfer_bytes));
  hb->set_transfer_seconds(counters_.transfer_seconds);
  hb->set_quarantined_kv_blocks(static_cast<uint64_t>(counters_.quarantined_blocks));
  const engine::KvCacheGroups& groups = e->kv_groups();
  const std::vector<int64_t> peaks = e->stats().peak_group_blocks;
  for (int g = 0; g < groups.size(); ++g) {
    hb->add_kv_group_window(static_cast<uint32_t>(groups.window[static_cast<size_t>(g)]));
    hb->add_kv_group_peak_blocks(static_cast<uint64_t>(
        g < static_cast<int>(peaks.size()) ? peaks[static_cast<size_t>(g)] : 0));
  }
  auto fill = [](const protocols::PortSecurityCounters& c, proto::PortSecurityCounters* out) {
    out->set_auth_failures(c.auth_failures);
    out->set_refused_connections(c.refused_connections);
    out->set_oversized_frames(c.oversized_frames);
    out->set_foreign_frames(c.foreign_frames);
  };
  // The KV data ports of every rank of the worker: a TP group's followers
  // report theirs to rank 0 (in their pongs).
  protocols::PortSecurityCounters kv = role_->follower_kv_port_counters();
  if (base_.transport) {
    const protocols::PortSecurityCounters own = base_.transport->security_counters();
    kv.auth_failures += own.auth_failures;
    kv.refused_connections += own.refused_connections;
    kv.oversized_frames += own.oversized_frames;
    kv.foreign_frames += own.foreign_frames;
  }
  fill(kv, hb->mutable_kv_port());
  fill(role_->tp_security_counters(), hb->mutable_tp_port());
  hb->set_kv_integrity_failures(role_->kv_integrity_failures());
  hb->set_data_plane_error(role_->data_plane_error());
  const engine::Engine::Stats stats = e->stats();
  hb->set_prompt_tokens_computed(static_cast<uint64_t>(stats.prompt_tokens_computed));
  hb->set_generated_tokens(static_cast<uint64_t>(stats.generated_tokens));
  hb->set_preemptions(static_cast<uint64_t>(stats.preemptions));
  const ProcessStats process = ReadProcessStats();
  hb->set_process_cpu_seconds(process.cpu_seconds);
  hb->set_process_resident_bytes(static_cast<uint64_t>(process.resident_bytes));
  proto::PrefixStoreCounters store;
  if (role_->FillPrefixStore(&store)) *hb->mutable_prefix_store() = std::move(store);
}

std::chrono::nanoseconds Worker::Idle() const {
  engine::Engine* e = role_->engine();
  std::chrono::nanoseconds wait;
  if (e->HasWork()) {
    wait = std::chrono::nanoseconds(0);
  } else if (role_->polling() || e->loading() > 0) {
    wait = std::chrono::milliseconds(1);
  } else {
    wait = std::chrono::milliseconds(100);
  }
  return std::min<std::chrono::nanoseconds>(wait, std::chrono::milliseconds(100));
}

Status Worker::Register(const std::atomic<bool>& stop, bool first) {
  // The first registration waits up to connect_timeout (the coordinator may
  // still be starting) and a refusal is final; after a lost link the worker
  // retries with backoff until it is back or told to stop.
  const auto started = Clock::now();
  std::chrono::milliseconds delay(100);
  while (!stop.load()) {
    const auto attempt = first ? options_.connect_timeout : std::chrono::milliseconds(2000);
    Status s = control_->Connect(Registration(), Deadline::After(attempt));
    if (s.ok()) return s;
    const bool retryable =
        s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDeadlineExceeded;
    if (!retryable || (first && Clock::now() - started >= options_.connect_timeout)) return s;
    LOG_WARNING << "coordinator " << options_.coordinator_host << ":" << options_.coordinator_port
                << " unreachable (" << s.message() << "); retrying in " << delay.count() << " ms";
    const Deadline wake = Deadline::After(delay);
    while (!stop.load() && !wake.Expired()) {
      std::this_thread::sleep_for(
          std::min<std::chrono::milliseconds>(std::chrono::milliseconds(50), delay));
    }
    delay = std::min<std::chrono::milliseconds>(delay * 2, std::chrono::milliseconds(2000));
  }
  return Cancelled("stopped while connecting to the coordinator");
}

Status Worker::OnPeerLost(const protocols::Frame& frame) {
  proto::PeerLost m;
  RETURN_IF_ERROR(protocols::DecodeMessage(frame, protocols::MessageType::kPeerLost, &m));
  std::vector<int> ranks;
  for (uint32_t r : m.ranks()) {
    const int peer = static_cast<int>(r);
    if (peer == options_.rank || peer >= base_.transport->world_size()) continue;
    ranks.push_back(peer);
    base_.transport->AbandonPeer(
        peer, Unavailable("worker " + m.worker_id().substr(0, 64) + " (data-plane rank " +
                          std::to_string(peer) +
                          ") was dropped by the coordinator: " + m.reason().substr(0, 200)));
  }
  role_->OnPeersLost(ranks);
  return Status::Ok();
}

void Worker::DropRequests() {
  // The coordinator has failed or will re-run whatever it had sent here:
  // the records go first (their streams and receives end before the engine
  // lets go of the blocks), then every engine request. The engine's prefix
  // cache stays for the next registration.
  requests_.Clear();
  engine::Engine* engine = role_->engine();
  const int64_t n = engine->CancelAll();
  (void)engine->Step();  // drains the cancel events nobody is waiting for
  if (n > 0) {
    LOG_WARNING << "dropped " << n << " request(s); the coordinator ends or re-runs them";
  }
}

void Worker::LeaveOnce(const Status& why) {
  // This worker cannot serve any more (its TP group broke): it says why
  // before the link closes, so the coordinator stops routing here at once
  // and ends or re-runs every request it had here.
  if (left_) return;
  left_ = true;
  control_->Leave(options_.worker_id, why.ToString());
}

Status Worker::Serve(const std::atomic<bool>& stop, bool* link_lost) {
  *link_lost = false;
  engine::Engine* engine = role_->engine();
  while (!stop.load()) {
    auto frame = control_->Receive(Deadline::After(Idle()));
    while (frame.ok()) {
      Status s;
      if (frame->type == static_cast<uint16_t>(protocols::MessageType::kHeartbeat)) {
        // The coordinator's keep-alive: its arrival re-armed the link's idle
        // timer (ControlLink::Options::coordinator_timeout); nothing to do.
      } else if (frame->type == static_cast<uint16_t>(protocols::MessageType::kPeerLost)) {
        s = OnPeerLost(*frame);
      } else {
        s = role_->OnControlFrame(*frame);
      }
      if (!s.ok()) LOG_WARNING << "bad control frame: " << s.ToString();
      frame = control_->Receive(Deadline::After(std::chrono::nanoseconds(0)));
    }
    // A link closed by its idle timer (the coordinator went silent) reports
    // DeadlineExceeded too: a closed link is lost whatever the code.
    if (frame.status().code() != StatusCode::kDeadlineExceeded || !control_->connected()) {
      *link_lost = true;
      return Unavailable("coordinator connection lost: " + frame.status().message());
    }
    role_->Progress();
    if (engine->HasWork() || engine->loading() > 0) {
      auto events = engine->Step();
      if (!events.ok()) {
        LOG_ERROR << "engine step failed: " << events.status().ToString();
        return events.status();
      }
      // A TP group cannot go on without a rank. It leaves before it reports
      // the step's failed requests, so the coordinator, which moves them on
      // to other workers (--migration-limit), no longer counts this one.
      if (Status health = role_->health(); !health.ok()) {
        LeaveOnce(health);
        events_->Report(*events);
        return health;
      }
      events_->Report(*events);
    }
    control_->FlushCacheEvents();
    // The same for a rank lost between steps.
    if (Status health = role_->health(); !health.ok()) {
      LeaveOnce(health);
      return health;
    }
    control_->PublishHeartbeat();
  }
  return Status::Ok();
}

Status Worker::Run(const std::atomic<bool>& stop) {
  Status result;
  for (bool first = true; !stop.load(); first = false) {
    result = Register(stop, first);
    if (!result.ok()) break;
    role_->OnRegistered();
    LOG_INFO << "registered as " << options_.worker_id << " (" << RoleKindName(options_.role)
             << "), kv data " << base_.transport->name() << " " << base_.transport->conn_info();
    bool link_lost = false;
    left_ = false;
    result = Serve(stop, &link_lost);
    if (!link_lost && !stop.load() && !result.ok()) LeaveOnce(result);
    DropRequests();
    if (!link_lost || stop.load()) break;
    role_->OnRegistrationEnded();
    LOG_WARNING << result.ToString() << "; reconnecting";
  }
  if (stop.load()) result = Status::Ok();
  role_->Shutdown();
  if (stop.load()) control_->Leave(options_.worker_id, "worker stopping");
  control_->Close(Cancelled("worker stopping"));
  return result;
}

}  // namespace kvrelay::worker
