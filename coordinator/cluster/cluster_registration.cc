#include <boost/asio/steady_timer.hpp>

#include "common/logging.h"
#include "coordinator/cluster/cluster_backend_state.h"

// A worker's way into the cluster: the authenticated handshake on its
// control connection, then its registration.
namespace kvrelay::coordinator {

void ClusterBackend::State::OnHandshakeFrame(const std::shared_ptr<FramedConnection>& conn,
                                             const protocols::Frame& frame) {
  auto [it, inserted] = peers.try_emplace(conn.get(), options.cluster_key);
  PeerAuth& peer = it->second;
  if (peer.refused) return;  // frames that arrived with the refused one
  const auto type = static_cast<MessageType>(frame.type);
  auto refuse = [&](const Status& why) {
    peer.refused = true;
    ++counters.auth_failures;
    LOG_WARNING << "refusing control connection " << conn->name() << ": " << why.message();
    // Only the refusal: nothing about this cluster is said to an unauthenticated peer.
    SendTo(conn, MessageType::kAuthProof, [] {
      proto::AuthProof p;
      p.set_error("authentication failed");
      return p;
    }());
    conn->CloseAfterFlush(why);
  };
  if (!peer.auth.authenticated()) {
    if (type == MessageType::kAuthHello) {
      auto challenge = peer.auth.OnHello(frame);
      if (!challenge.ok()) return refuse(challenge.status());
      Status s = conn->Send(MessageType::kAuthChallenge, *challenge);
      if (!s.ok()) conn->Close(s);
      return;
    }
    if (type == MessageType::kAuthProof) {
      auto mine = peer.auth.OnProof(frame);
      if (!mine.ok()) return refuse(mine.status());
      Status s = conn->Send(MessageType::kAuthProof, *mine);
      if (!s.ok()) return conn->Close(s);
      conn->MarkAuthenticated();
      return;
    }
    return refuse(FailedPrecondition(
        "authentication failed: frame type " + std::to_string(frame.type) +
        " before the cluster-key challenge-response (a worker without --cluster-key-file?)"));
  }
  if (type != MessageType::kHello) {
    conn->Close(
        InvalidArgument("first control frame after authentication must be Hello, got type " +
                        std::to_string(frame.type)));
    return;
  }
  OnHello(conn, frame);
}

bool ClusterBackend::State::IsForeign(const std::string& worker_id, uint64_t request_id,
                                      const char* what) {
  auto it = requests.find(request_id);
  if (it == requests.end()) return false;  // finished or cancelled meanwhile: stale, not foreign
  const RequestEntry& r = it->second;
  if (r.prefill_id == worker_id || r.decode_id == worker_id) return false;
  const uint64_t n = ++counters.foreign_frames;
  if (n <= 10 || n % 1000 == 0) {
    LOG_WARNING << "dropping " << what << " from worker " << worker_id << " for request "
                << request_id << ", which is assigned to " << r.prefill_id << " / " << r.decode_id
                << " (" << n << " foreign frames so far)";
  }
  return true;
}

void ClusterBackend::State::OnHello(const std::shared_ptr<FramedConnection>& conn,
                                    const protocols::Frame& frame) {
  proto::Hello hello;
  proto::HelloReply reply;
  Status s = protocols::DecodeMessage(frame, MessageType::kHello, &hello);
  if (s.ok()) {
    auto peer = protocols::FromProto(hello.config());
    if (!peer.ok()) {
      s = peer.status();
    } else {
      protocols::PeerConfig local = options.config;
      local.tp_size = peer->tp_size;  // TP layouts may differ between coordinator and workers
      local.tp_rank = peer->tp_rank;
      s = protocols::CheckPeerCompatible(local, *peer);
    }
  }
  reply.set_accepted(s.ok());
  reply.set_reason(s.ok() ? "" : s.message());
  protocols::ToProto(options.config, reply.mutable_config());
  SendTo(conn, MessageType::kHelloReply, reply);
  if (s.ok()) {
    peers.at(conn.get()).configured = true;
  } else {
    LOG_WARNING << "refusing peer " << hello.peer_name() << ": " << s.ToString();
    conn->CloseAfterFlush(s);
  }
}

void ClusterBackend::State::OnRegister(const std::shared_ptr<FramedConnection>& conn,
                                       const protocols::Frame& frame, PendingEvents& out) {
  proto::RegisterWorker reg;
  proto::RegisterReply reply;
  Status s = protocols::DecodeMessage(frame, MessageType::kRegisterWorker, &reg);
  if (s.ok() && reg.worker_id().empty()) s = InvalidArgument("RegisterWorker.worker_id is empty");
  if (s.ok() && reg.worker_id() != peers.at(conn.get()).auth.peer_name()) {
    // A worker acts under the name it proved, never another's.
    s = FailedPrecondition("RegisterWorker.worker_id '" + reg.worker_id() +
                           "' differs from the authenticated name '" +
                           peers.at(conn.get()).auth.peer_name() + "'");
  }
  if (s.ok() && workers.count(reg.worker_id())) {
    // The same worker came back (it reconnects after losing its link, e.g.
    // after a stall) before its old connection was noticed dead: the new
    // registration replaces the old one, whose requests are re-run or failed.
    DropWorker(reg.worker_id(), Unavailable("replaced by a new registration of the same worker"),
               out);
  }
  if (s.ok() && reg.tp_size() > 1 &&
      (reg.tp_ranks_size() != static_cast<int>(reg.tp_size()) ||
       reg.tp_kv_addresses_size() != static_cast<int>(reg.tp_size()))) {
    s = InvalidArgument("RegisterWorker: TP size " + std::to_string(reg.tp_size()) + " with " +
                        std::to_string(reg.tp_ranks_size()) + " ranks and " +
                        std::to_string(reg.tp_kv_addresses_size()) + " KV addresses");
  }
  reply.set_accepted(s.ok());
  reply.set_reason(s.ok() ? "" : s.message());
  reply.set_heartbeat_interval_ms(static_cast<uint32_t>(options.heartbeat_interval.count()));
  SendTo(conn, MessageType::kRegisterReply, reply);
  if (!s.ok()) {
    conn->CloseAfterFlush(s);
    return;
  }
  WorkerEntry w;
  w.info.id = reg.worker_id();
  w.info.role = FromProto(reg.role());
  w.info.total_kv_blocks = static_cast<int64_t>(reg.capacity_blocks());
  w.info.free_kv_blocks = static_cast<int64_t>(reg.capacity_blocks());
  w.info.block_tokens = options.config.block_tokens;
  w.conn = conn;
  w.rank = reg.rank();
  w.kv_address = reg.kv_address();
  if (reg.tp_size() > 1) {
    w.tp_ranks.assign(reg.tp_ranks().begin(), reg.tp_ranks().end());
    w.tp_kv_addresses.assign(reg.tp_kv_addresses().begin(), reg.tp_kv_addresses().end());
  }
  w.last_seen = Clock::now();
  LOG_INFO << "registered worker " << w.info.id << " rank " << w.rank << " kv " << w.kv_address;
  conn_worker[conn.get()] = w.info.id;
  workers[w.info.id] = std::move(w);
  // Requests that found no worker (a stall, a restart, the replacement just
  // above) start now.
  AdmitWaiting(out);
}

}  // namespace kvrelay::coordinator
