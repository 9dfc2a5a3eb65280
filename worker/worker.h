// The worker process shell every role shares.
//
// A Worker loads the model, creates the KV data plane by name
// (kv_transfer/transport_factory.h), connects to the coordinator
// (ControlLink: handshake, registration, heartbeats, cache events) and runs
// the loop that feeds control frames to its Role, steps the role's engine
// and reports the engine's events (EventReporter). What a worker DOES is its
// role: prefill_worker/ (prefill, and colocated = prefill to completion),
// decode_worker/ (decode, and the TP group: rank 0 is a decode role, ranks
// 1.. run a TpFollower with its own loop and no coordinator link).
//
// Threading: everything runs on the thread that calls Run(); the loop sleeps
// in the control connection's Receive when there is nothing to compute, so an
// idle worker uses no CPU.
#pragma once

#include <atomic>
#include <functional>
#include <memory>

#include "common/status.h"
#include "kv_transfer/transport.h"
#include "worker/event_reporter.h"
#include "worker/request_table.h"
#include "worker/role.h"
#include "worker/worker_options.h"

namespace kvrelay::worker {

// What every process of a cluster needs before its role starts: the model
// (this rank's shard under TP), the layout of its pool, the handshake config
// and the KV transport.
struct ProcessBase {
  std::shared_ptr<const engine::Model> model;
  engine::KvLayout layout;
  protocols::PeerConfig peer_config;
  std::unique_ptr<kv_transfer::Transport> transport;
};
Result<ProcessBase> LoadProcessBase(const WorkerOptions& options);

class Worker {
 public:
  static Result<std::unique_ptr<Worker>> Create(WorkerOptions options, std::unique_ptr<Role> role);
  ~Worker();

  // Connects, registers and serves until `stop` becomes true. A lost
  // coordinator link (a coordinator restart, a stall past the heartbeat
  // deadline) drops the requests it carried and reconnects with backoff,
  // keeping the engine and its prefix cache; a refused registration or a
  // broken TP group ends Run with that error. Every request still held is
  // released before it returns.
  Status Run(const std::atomic<bool>& stop);

 private:
  Worker(WorkerOptions options, std::unique_ptr<Role> role);
  Status Init();
  proto::RegisterWorker Registration() const;
  Status Register(const std::atomic<bool>& stop, bool first);
  // The inner loop: until `stop` (OK), a lost link (*link_lost) or a fatal error.
  Status Serve(const std::atomic<bool>& stop, bool* link_lost);
  // Sends WorkerLeaving with `why`, once per registration.
  void LeaveOnce(const Status& why);
  void DropRequests();
  // kPeerLost: abandons the dead peers on the transport, then tells the role.
  Status OnPeerLost(const protocols::Frame& frame);
  void FillHeartbeat(proto::Heartbeat* hb) const;
  // The loop sleeps until this: at once with compute, ~1 ms while polling,
  // else until the next heartbeat; at most 100 ms (to notice `stop`).
  std::chrono::nanoseconds Idle() const;

  WorkerOptions options_;
  ProcessBase base_;
  WorkerCounters counters_;
  std::unique_ptr<ControlLink> control_;
  bool left_ = false;  // WorkerLeaving sent on this registration
  // Before role_: the role's work in records is released (Role::Shutdown)
  // before the role goes.
  RequestTable requests_;
  std::unique_ptr<EventReporter> events_;
  WorkerContext ctx_;
  std::unique_ptr<Role> role_;  // destroyed first: it holds the engine and uses the rest
};

// A process that runs `role` (the mains of kvrelay-prefill / -decode / -worker):
// parses flags, installs SIGINT/SIGTERM handlers. `make_role` picks the role
// from the parsed options; it returns null for a TP follower, which runs
// `run_follower` instead (a loop of its own, no coordinator link).
using RoleFactory = std::function<std::unique_ptr<Role>(const WorkerOptions&)>;
using FollowerMain = std::function<Status(const WorkerOptions&, const std::atomic<bool>& stop)>;
int WorkerMain(RoleKind kind, const RoleFactory& make_role, const FollowerMain& run_follower,
               int argc, char** argv);

}  // namespace kvrelay::worker
