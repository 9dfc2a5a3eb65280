// Role: what a worker process does with its engine — the seam between the
// process shell (worker.h: model, transport, control link, run loop) and the
// prefill role (prefill_worker/), the decode role and its TP group
// (decode_worker/). A role owns its engine and the KvConnector it installs on
// it; the shell calls the hooks below, all on its run thread.
#pragma once

#include <memory>
#include <optional>
#include <span>

#include "common/status.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/model.h"
#include "kv_transfer/transport.h"
#include "protocols/control.pb.h"
#include "protocols/frame_codec.h"
#include "protocols/handshake.h"
#include "worker/control_link.h"
#include "worker/request_table.h"
#include "worker/worker_options.h"

namespace kvrelay::worker {

// Cumulative figures a role adds to; the heartbeat reports them.
struct WorkerCounters {
  int64_t transfer_bytes = 0;      // KV bytes sent or received
  double transfer_seconds = 0;     // spent waiting for KV transfers
  int64_t quarantined_blocks = 0;  // KV blocks kept forever (a dead peer's transfer holds them)
};

// What the shell gives a role. Everything outlives the role.
struct WorkerContext {
  const WorkerOptions* options = nullptr;
  std::shared_ptr<const engine::Model> model;   // this process's model (its shard under TP)
  engine::KvLayout layout;                      // of this process's pool
  protocols::PeerConfig peer_config;            // what peers must match
  kv_transfer::Transport* transport = nullptr;  // the KV data plane
  ControlLink* control = nullptr;               // null on a TP follower
  // Every request this process holds, one record each (request_table.h).
  // The role adds a record before it submits the request to its engine and
  // installs the table's Release for the work it keeps in records.
  RequestTable* requests = nullptr;
  WorkerCounters* counters = nullptr;
};

class Role {
 public:
  virtual ~Role() = default;

  // Creates the engine and whatever else the role needs (TP group, tiers).
  virtual Status Init(WorkerContext& ctx) = 0;
  virtual engine::Engine* engine() = 0;
  // Registration details beyond the shell's (TP ranks and their KV addresses).
  virtual void DescribeRegistration(proto::RegisterWorker* /*reg*/) const {}
  // A control frame from the coordinator (work, cancel).
  virtual Status OnControlFrame(const protocols::Frame& frame) = 0;
  // The coordinator dropped the worker owning data-plane peers `ranks`; the
  // shell has already abandoned them on the transport (AbandonPeer). Let go
  // of what is bound for them (quarantining what the transport still owns).
  virtual void OnPeersLost(std::span<const int> /*ranks*/) {}
  // Work outside engine steps (followers' acknowledgements); every loop turn.
  virtual void Progress() {}
  // The coordinator accepted this worker's (re)registration.
  virtual void OnRegistered() {}
  // The link to the coordinator was lost and every request dropped; the
  // worker registers again next. The coordinator announces this worker's
  // data-plane ranks lost to its peers (PeerLost), which then close their
  // connections to them, possibly only after the new registration got its
  // first streams on those same connections: a role receiving KV closes its
  // own first, so that the next registration's streams use new ones.
  virtual void OnRegistrationEnded() {}
  // A pool event; true when the role forwards it itself (its prefix store).
  virtual bool OnPoolEvent(const engine::KvEvent& /*ev*/) { return false; }
  // True while Progress or the connector has something to poll soon: the
  // loop then wakes every millisecond instead of sleeping to the heartbeat.
  virtual bool polling() const { return false; }
  // Not OK: this worker must leave the cluster (a broken TP group).
  virtual Status health() const { return Status::Ok(); }
  // Non-empty while the role cannot reach a data-plane peer it needs: why
  // (heartbeats carry it to the coordinator's /health).
  virtual std::string data_plane_error() const { return {}; }
  // What the role's own internal port (a TP group's link) refused so far;
  // heartbeats carry it to the coordinator's /metrics. Zeros without one.
  virtual protocols::PortSecurityCounters tp_security_counters() const { return {}; }
  // What the KV data ports of the worker's other processes (a TP group's
  // followers) refused so far; heartbeats add it to this process's KV port's.
  virtual protocols::PortSecurityCounters follower_kv_port_counters() const { return {}; }
  // KV streams refused by an integrity check (checksum, manifest,
  // fingerprint) since the worker started; the decode role counts them.
  virtual uint64_t kv_integrity_failures() const { return 0; }
  // The role's prefix store's counts, for heartbeats (the coordinator's
  // kvrelay_worker_kvstore_*); false when it has none.
  virtual bool FillPrefixStore(proto::PrefixStoreCounters* /*out*/) const { return false; }
  // The worker is stopping: let go of every request (before the engine
  // goes), the table's records' work included, and uninstall the table's
  // Release. Called again by the destructor: must be idempotent.
  virtual void Shutdown() {}
};

}  // namespace kvrelay::worker
