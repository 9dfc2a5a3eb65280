// Test-only, no test framework: a worker's control connection driven frame
// by frame against a real ClusterBackend over TCP on 127.0.0.1, and a sink
// that collects a request's events. Every wait has a deadline. Used by the
// coordinator's unit tests (tests/unit/coordinator/control_peer.h adds their
// fixture) and the control-frame fuzz target (tests/fuzz/).
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "coordinator/backend.h"
#include "coordinator/cluster/cluster_backend.h"
#include "protocols/control.pb.h"
#include "protocols/framed_connection.h"
#include "protocols/messages.h"
#include "protocols/peer_handshake.h"

namespace kvrelay::coordinator::testing {

inline protocols::PeerConfig ControlTestConfig() {
  protocols::PeerConfig c;
  c.model_fingerprint.fill(3);
  c.kv_dtype = engine::KvDtype::kF32;
  c.block_tokens = 16;
  c.layers = 2;
  c.kv_heads = 2;
  c.head_dim = 8;
  return c;
}

class ControlPeer {
 public:
  ControlPeer(protocols::IoThread& io, uint16_t port) {
    auto c =
        protocols::FramedConnection::Connect(io, "127.0.0.1", port, {}, Deadline::AfterMs(5000));
    if (c.ok()) conn = *c;
  }
  ~ControlPeer() {
    if (conn) conn->Close(Cancelled("test peer done"));
  }
  ControlPeer(const ControlPeer&) = delete;
  ControlPeer& operator=(const ControlPeer&) = delete;

  // Authenticates, says hello and registers as `id` (data-plane rank `rank`).
  Status Join(const protocols::ClusterKey& key, const std::string& id, proto::WorkerRole role,
              uint32_t rank = 0) {
    if (!conn) return Unavailable("not connected");
    RETURN_IF_ERROR(
        protocols::ClientHandshake(*conn, key, id, ControlTestConfig(), {}, Deadline::AfterMs(5000))
            .status());
    proto::RegisterWorker reg;
    reg.set_worker_id(id);
    reg.set_role(role);
    reg.set_rank(rank);
    reg.set_tp_size(1);
    reg.set_capacity_blocks(1000);
    protocols::ToProto(ControlTestConfig(), reg.mutable_config());
    RETURN_IF_ERROR(Send(protocols::MessageType::kRegisterWorker, reg));
    proto::RegisterReply reply;
    RETURN_IF_ERROR(Expect(protocols::MessageType::kRegisterReply, &reply));
    if (!reply.accepted()) return FailedPrecondition(reply.reason());
    return Status::Ok();
  }
  template <typename M>
  Status Send(protocols::MessageType type, const M& m) {
    return conn->Send(type, m.SerializeAsString());
  }
  // The next frame of `type`, skipping others (heartbeats).
  template <typename M>
  Status Expect(protocols::MessageType type, M* out, int64_t timeout_ms = 5000) {
    const Deadline d = Deadline::AfterMs(timeout_ms);
    while (true) {
      ASSIGN_OR_RETURN(protocols::Frame f, conn->Receive(d));
      if (f.type == static_cast<uint16_t>(type)) return protocols::DecodeMessage(f, type, out);
    }
  }
  std::shared_ptr<protocols::FramedConnection> conn;
};

struct CollectedEvents {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<TokenEvent> got;
  TokenSink Sink() {
    return [this](const TokenEvent& e) {
      std::lock_guard lock(mu);
      got.push_back(e);
      cv.notify_all();
    };
  }
  bool WaitFinished(Deadline d) {
    std::unique_lock lock(mu);
    return cv.wait_until(lock, d.at, [&] { return !got.empty() && got.back().finished; });
  }
  // True once `n` token events arrived (or the stream finished first: false).
  bool WaitTokens(size_t n, Deadline d) {
    std::unique_lock lock(mu);
    auto tokens = [&] {
      size_t k = 0;
      for (const auto& e : got) k += e.token >= 0 ? 1 : 0;
      return k;
    };
    cv.wait_until(lock, d.at,
                  [&] { return tokens() >= n || (!got.empty() && got.back().finished); });
    return tokens() >= n;
  }
  bool Finished() {
    std::lock_guard lock(mu);
    return !got.empty() && got.back().finished;
  }
  TokenEvent Last() {
    std::lock_guard lock(mu);
    return got.empty() ? TokenEvent{} : got.back();
  }
  std::vector<int32_t> Tokens() {
    std::lock_guard lock(mu);
    std::vector<int32_t> t;
    for (const auto& e : got) {
      if (e.token >= 0) t.push_back(e.token);
    }
    return t;
  }
};

}  // namespace kvrelay::coordinator::testing
