// ControlLink: a worker's connection to the coordinator — handshake,
// registration, heartbeats, prefix-cache events, and the protobuf messages
// the roles send. It never carries KV (that is the Transport's job), so the
// death of either side is a closed connection or a missed heartbeat here.
//
// Threading: owned by the worker shell and used on its run thread (roles
// call it from their hooks, which run there too), except the heartbeats: the
// link's own thread ("worker-hb") sends one every interval while connected,
// carrying the latest snapshot the run thread published, so a long step (a
// big prefill chunk on a quarter of a core) never looks like a dead worker.
// A run thread that has not published for kStallWindow (stuck, e.g. waiting
// on KV sends to a peer that died) stops the heartbeats, so the coordinator
// drops this worker and re-runs its requests elsewhere instead of routing
// more to it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/clock.h"
#include "common/logging.h"
#include "common/status.h"
#include "engine/kv_cache/kv_cache.h"
#include "engine/runtime/engine.h"
#include "protocols/control.pb.h"
#include "protocols/framed_connection.h"
#include "protocols/handshake.h"
#include "protocols/io_thread.h"
#include "protocols/messages.h"
#include "protocols/peer_handshake.h"

namespace kvrelay::worker {

class ControlLink {
 public:
  struct Options {
    std::string worker_id;
    std::string host = "127.0.0.1";
    uint16_t port = 9000;
    protocols::PeerConfig peer_config;
    protocols::ClusterKey cluster_key;  // proved before anything else is said
    // Mutual TLS under the handshake (protocols/tls.h); null = plaintext.
    std::shared_ptr<protocols::TlsContext> tls;
    std::chrono::milliseconds connect_timeout{30000};
    // Nothing heard from the coordinator for this long (it sends a heartbeat
    // every interval it announced at registration) closes the link, and the
    // worker re-registers with backoff: how a stopped or cut-off coordinator
    // is noticed, as a closed connection is not. 0 = 3 announced intervals,
    // at least kMinCoordinatorTimeout.
    std::chrono::milliseconds coordinator_timeout{0};
  };
  explicit ControlLink(Options options);
  ~ControlLink();

  // Connects (retrying until `deadline`), handshakes and sends `reg`; OK once
  // the coordinator accepted it. Replaces a previous connection.
  Status Connect(const proto::RegisterWorker& reg, Deadline deadline);
  bool connected() const { return conn_ != nullptr && !conn_->closed(); }
  // The coordinator-liveness deadline in force (after Connect).
  std::chrono::milliseconds coordinator_timeout() const;
  void Close(const Status& why);

  template <typename Message>
  void Send(protocols::MessageType type, const Message& m) {
    std::string payload;
    m.SerializeToString(&payload);
    Status s = conn_ ? conn_->Send(type, payload) : Unavailable("not connected");
    if (!s.ok()) LOG_WARNING << "control send failed: " << s.ToString();
  }
  // The request ended here (or failed): one Finish frame.
  // Tells the coordinator this worker stops on purpose, waits (bounded) for
  // the frame to be written, and closes the link.
  void Leave(const std::string& worker_id, const std::string& why);
  void SendFinish(engine::RequestId id, proto::Finish::Reason reason, const Status& error,
                  int64_t prompt_tokens = 0, int64_t completion_tokens = 0,
                  uint64_t kv_transfer_id = 0);
  Result<protocols::Frame> Receive(Deadline deadline);

  // Heartbeats carry what `source` fills in (called on the run thread).
  void SetHeartbeatSource(std::function<void(proto::Heartbeat*)> source);
  // Refreshes the snapshot the heartbeat thread sends (run thread; cheap,
  // called every loop turn and from inside long steps).
  void PublishHeartbeat();

  // Prefix-cache events of the pool, batched until FlushCacheEvents.
  void OnKvEvent(const engine::KvEvent& ev);
  void FlushCacheEvents();

 private:
  Options options_;
  std::unique_ptr<protocols::IoThread> io_;
  std::shared_ptr<protocols::FramedConnection> conn_;
  static constexpr std::chrono::seconds kStallWindow{10};
  // The default coordinator deadline's floor: nothing is gained by noticing a
  // silent coordinator fast (no request reaches this worker or its clients
  // meanwhile, and the coordinator itself ends the requests it holds), while
  // a false positive costs this worker's streaming requests; 2 s rides out
  // a coordinator scheduled late on a loaded host at short intervals.
  static constexpr std::chrono::milliseconds kMinCoordinatorTimeout{2000};

  void StartHeartbeats();
  void StopHeartbeats();
  void HeartbeatLoop();

  std::function<void(proto::Heartbeat*)> heartbeat_source_;
  std::chrono::milliseconds heartbeat_interval_{500};
  std::mutex hb_mu_;
  std::condition_variable hb_cv_;
  proto::Heartbeat hb_snapshot_;  // guarded by hb_mu_
  bool hb_stop_ = false;          // guarded by hb_mu_
  TimePoint hb_published_;        // guarded by hb_mu_: the run thread's last PublishHeartbeat
  std::thread hb_thread_;
  proto::PrefixCacheEvent cache_events_;
};

// engine::FinishReason as the protocol names it.
proto::Finish::Reason ToProto(engine::FinishReason r);
// The protocol's sampling parameters as the engine's (unset = the engine's default).

}  // namespace kvrelay::worker
