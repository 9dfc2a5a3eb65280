// The cluster backend: the coordinator's side of the control plane.
//
// Workers (prefill, decode, colocated) connect to the control port, pass the
// configuration handshake (model fingerprint, KV dtype, block size, head
// layout must equal the coordinator's), register, and heartbeat. A request
// then goes:
//   1. coordinator -> decode D:  DecodeAdmission (first_token = -1): reserve
//      blocks for the prompt and post KV receives from the prefill rank;
//      D -> coordinator:         BlockReservationReply (block ids or refusal).
//   2. coordinator -> prefill P: PrefillTask with DecodeTarget (D's rank, data
//      address, block ids). P prefills, streaming each layer's KV to D as soon
//      as it is computed; P -> coordinator: PrefillDone (first token).
//   3. coordinator -> D:         DecodeAdmission (first_token set). D admits the
//      sequence once every layer arrived and verified, decodes, and streams
//      TokenChunks, then a Finish.
// A colocated worker takes a PrefillTask without a DecodeTarget and does both.
//
// Failure: a worker whose connection closes, or that misses
// `missed_heartbeats` heartbeat intervals, is dropped; each of its requests
// ends with an error event (UNAVAILABLE) and its peer worker is told to
// cancel, which releases the blocks there.
//
// Threading: all control traffic runs on one IoThread; sinks are called there.
// Submit/Cancel/Health/Workers are thread-safe.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "coordinator/backend.h"
#include "coordinator/router.h"
#include "protocols/framed_connection.h"
#include "protocols/handshake.h"
#include "protocols/io_thread.h"

namespace kvrelay::coordinator {

struct ClusterBackendOptions {
  std::string host = "127.0.0.1";
  uint16_t control_port = 0;  // 0 = ephemeral, see control_port()
  std::chrono::milliseconds heartbeat_interval{500};
  int missed_heartbeats = 3;  // a silent worker is dropped after this many intervals
  RouterOptions router;
  // What every worker must agree with (handshake); tp fields are ignored.
  protocols::PeerConfig config;
};

class ClusterBackend final : public Backend {
 public:
  static Result<std::unique_ptr<ClusterBackend>> Create(ClusterBackendOptions options);
  ~ClusterBackend() override;

  uint16_t control_port() const { return port_; }

  Status Submit(GenerationRequest request, TokenSink sink) override;
  void Cancel(uint64_t id) override;
  Status Health() override;
  std::vector<WorkerInfo> Workers() override;

  // Stops serving: fails live requests, closes worker connections, joins the io thread.
  void Shutdown();

  struct State;  // shared with io-thread handlers

 private:
  explicit ClusterBackend(ClusterBackendOptions options);

  ClusterBackendOptions options_;
  std::shared_ptr<State> state_;
  std::unique_ptr<protocols::IoThread> io_;
  std::unique_ptr<protocols::FramedServer> server_;
  uint16_t port_ = 0;
  std::shared_ptr<std::function<void()>> tick_;  // heartbeat watchdog, runs on io_
};

}  // namespace kvrelay::coordinator
