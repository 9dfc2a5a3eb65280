#include "worker/control_link.h"

#include <pthread.h>

#include <algorithm>

namespace kvrelay::worker {

using protocols::MessageType;

proto::Finish::Reason ToProto(engine::FinishReason r) {
  switch (r) {
    case engine::FinishReason::kStop:
      return proto::Finish::REASON_STOP;
    case engine::FinishReason::kLength:
      return proto::Finish::REASON_LENGTH;
    case engine::FinishReason::kCancelled:
      return proto::Finish::REASON_CANCELLED;
    default:
      return proto::Finish::REASON_ERROR;
  }
}

ControlLink::ControlLink(Options options)
    : options_(std::move(options)), io_(std::make_unique<protocols::IoThread>("worker-ctl")) {}

ControlLink::~ControlLink() { Close(Cancelled("worker stopping")); }

void ControlLink::StartHeartbeats() {
  StopHeartbeats();
  {
    std::lock_guard lock(hb_mu_);
    hb_stop_ = false;
  }
  hb_thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "worker-hb");
    HeartbeatLoop();
  });
}

void ControlLink::StopHeartbeats() {
  {
    std::lock_guard lock(hb_mu_);
    hb_stop_ = true;
  }
  hb_cv_.notify_all();
  if (hb_thread_.joinable()) hb_thread_.join();
}

void ControlLink::HeartbeatLoop() {
  std::unique_lock lock(hb_mu_);
  bool stalled = false;
  while (!hb_stop_) {
    if (Clock::now() - hb_published_ > kStallWindow) {
      if (!stalled) {
        LOG_WARNING << "the worker loop has not run for " << kStallWindow.count()
                    << " s: heartbeats stop until it does";
      }
      stalled = true;
    } else {
      stalled = false;
      proto::Heartbeat hb = hb_snapshot_;
      hb.set_worker_id(options_.worker_id);
      lock.unlock();
      Send(MessageType::kHeartbeat, hb);  // FramedConnection::Send is thread-safe
      lock.lock();
    }
    hb_cv_.wait_for(lock, heartbeat_interval_, [&] { return hb_stop_; });
  }
}

Status ControlLink::Connect(const proto::RegisterWorker& reg, Deadline deadline) {
  Close(Cancelled("reconnecting"));
  protocols::ConnectionOptions copts;
  copts.name = "coordinator";
  // As on the servers' side of every internal port: until the coordinator
  // has proved the cluster key, a frame over kMaxUnauthenticatedPayload closes
  // the connection at its header (whoever answers on that address cannot
  // make a worker buffer 16 MiB), and a started frame must complete in time.
  // `deadline` bounds the handshake itself.
  copts.require_authentication = true;
  copts.auth_timeout = std::chrono::milliseconds(0);
  copts.frame_timeout = std::chrono::milliseconds(10'000);
  // With TLS the handshake (certificates against the cluster CA) runs first;
  // its failure surfaces as the close reason of ClientHandshake's first read.
  copts.tls = options_.tls;
  ASSIGN_OR_RETURN(conn_, protocols::FramedConnection::Connect(*io_, options_.host, options_.port,
                                                               copts, deadline));
  // Connect() has already started reading; a second Start() would run two
  // concurrent reads on one socket and corrupt the frame stream under load.
  // The key hint only where the key is the likely cause: a peer-config
  // mismatch (KV dtype, model) names its field itself.
  if (Status hs = protocols::ClientHandshake(*conn_, options_.cluster_key, options_.worker_id,
                                             options_.peer_config, {}, deadline)
                      .status();
      !hs.ok()) {
    const bool auth = hs.message().rfind("authentication failed", 0) == 0;
    return hs.WithContext(auth ? "joining the cluster (check --cluster-key-file)"
                               : "joining the cluster");
  }
  Send(MessageType::kRegisterWorker, reg);
  ASSIGN_OR_RETURN(protocols::Frame frame, conn_->Receive(deadline));
  proto::RegisterReply reply;
  RETURN_IF_ERROR(protocols::DecodeMessage(frame, MessageType::kRegisterReply, &reply));
  if (!reply.accepted()) {
    return FailedPrecondition("coordinator refused registration: " + reply.reason());
  }
  if (reply.heartbeat_interval_ms() > 0) {
    heartbeat_interval_ = std::chrono::milliseconds(reply.heartbeat_interval_ms());
  }
  // From here the coordinator heartbeats this link every interval: silence
  // for coordinator_timeout() closes it (Serve then re-registers).
  conn_->SetIdleTimeout(coordinator_timeout());
  PublishHeartbeat();
  StartHeartbeats();
  return Status::Ok();
}

std::chrono::milliseconds ControlLink::coordinator_timeout() const {
  if (options_.coordinator_timeout.count() > 0) return options_.coordinator_timeout;
  return std::max<std::chrono::milliseconds>(3 * heartbeat_interval_, kMinCoordinatorTimeout);
}

void ControlLink::Leave(const std::string& worker_id, const std::string& why) {
  StopHeartbeats();
  if (!conn_ || conn_->closed()) return;
  proto::WorkerLeaving m;
  m.set_worker_id(worker_id);
  m.set_reason(why);
  Send(MessageType::kWorkerLeaving, m);
  conn_->CloseAfterFlush(Cancelled(why));
  (void)conn_->WaitClosed(Deadline::AfterMs(1000));
}

void ControlLink::Close(const Status& why) {
  StopHeartbeats();
  if (conn_) conn_->Close(why);
  conn_.reset();
}

Result<protocols::Frame> ControlLink::Receive(Deadline deadline) {
  if (!conn_) return Unavailable("not connected to the coordinator");
  return conn_->Receive(deadline);
}

void ControlLink::SendFinish(engine::RequestId id, proto::Finish::Reason reason,
                             const Status& error, int64_t prompt_tokens, int64_t completion_tokens,
                             uint64_t kv_transfer_id) {
  proto::Finish f;
  f.set_request_id(id);
  f.set_reason(reason);
  if (!error.ok()) {
    f.set_status_code(static_cast<uint32_t>(error.code()));
    f.set_message(error.message());
  }
  f.set_prompt_tokens(static_cast<uint32_t>(prompt_tokens));
  f.set_completion_tokens(static_cast<uint32_t>(completion_tokens));
  f.set_kv_transfer_id(kv_transfer_id);
  Send(MessageType::kFinish, f);
}

void ControlLink::SetHeartbeatSource(std::function<void(proto::Heartbeat*)> source) {
  heartbeat_source_ = std::move(source);
}

void ControlLink::PublishHeartbeat() {
  proto::Heartbeat hb;
  if (heartbeat_source_) heartbeat_source_(&hb);
  std::lock_guard lock(hb_mu_);
  hb_snapshot_ = std::move(hb);
  hb_published_ = Clock::now();
}

void ControlLink::OnKvEvent(const engine::KvEvent& ev) {
  std::string h(ev.hash.begin(), ev.hash.end());
  if (ev.kind == engine::KvEvent::Kind::kStored) {
    cache_events_.add_stored_block_hashes(std::move(h));
  } else {
    cache_events_.add_evicted_block_hashes(std::move(h));
  }
}

void ControlLink::FlushCacheEvents() {
  if (cache_events_.stored_block_hashes_size() == 0 &&
      cache_events_.evicted_block_hashes_size() == 0) {
    return;
  }
  cache_events_.set_worker_id(options_.worker_id);
  Send(MessageType::kPrefixCacheEvent, cache_events_);
  cache_events_.Clear();
}

}  // namespace kvrelay::worker
