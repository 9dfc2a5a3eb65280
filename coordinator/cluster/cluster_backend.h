// The cluster backend: the coordinator's side of the control plane.
//
// Workers (prefill, decode, colocated) connect to the control port, pass the
// configuration handshake (model fingerprint, KV dtype, block size, head
// layout must equal the coordinator's), register, and heartbeat. A request
// then goes, in one hop:
//   1. coordinator -> decode D and prefill P at once: ReserveBlocks (the
//      prompt; D reserves its blocks and posts KV receives from P's rank) and
//      PrefillTask with a DecodeTarget (D's ranks and each rank's Transport
//      conn info). P starts at once, streaming each segment's KV layer by
//      layer to D as chunks complete it; the streams name blocks by their
//      position in the prompt, so P needs nothing back from D.
//   2. P samples the first token: P -> coordinator PrefillDone (TTFT: it
//      reaches the client now), and P -> D the hand-over frame, the last
//      transfer of the KV streams, carrying that token.
//   3. D decodes once every layer verified and the frame arrived, and streams
//      TokenChunks, then a Finish. From its first TokenChunk the request no
//      longer depends on P. D -> coordinator ReserveBlocksReply only refuses.
//      D's reports may overtake P's PrefillDone (another connection): they
//      wait for it. A hand-over D has not reported on within a watchdog tick
//      gets a HandOverDue (P is done: D may time a silent path out).
// Each attempt (a re-run, a migration) streams under its own kv_transfer_id.
// A colocated worker takes a PrefillTask without a DecodeTarget and does both.
//
// Security: the control port (bound to `host`, loopback by default) is an
// internal port. A connection must pass the cluster-key challenge-response
// (protocols/cluster_auth.h) before anything else, including the
// configuration, is said; it registers under the name it authenticated as;
// and every frame after that is checked against what that worker owns: a
// TokenChunk, Finish, PrefillDone or ReserveBlocksReply for a request
// assigned to another worker is dropped and counted (security_counters()).
// Unauthenticated connections are limited in number, in frame size and in
// time (ServerLimits, ConnectionOptions::require_authentication).
//
// Failure: a worker whose connection closes, or that is silent for
// `worker_timeout()` (missed_heartbeats intervals unless heartbeat_timeout
// says otherwise), is dropped. Its requests that have produced no token yet
// are re-run once on the workers left; the others migrate (below) or end
// with an error event (UNAVAILABLE), and the peer worker is told to cancel,
// which releases the blocks there — except requests a lost prefill worker
// had already handed over, which the decode side finishes. A worker that
// registers again under the same name replaces its old entry.
//
// Migration: a request that already streamed tokens and loses its decode
// worker (or, re-prefilling, either worker), or whose worker reports a fault
// of its own or of its KV path (IsWorkerFault: a TP rank gone, a stalled or
// corrupt KV stream), continues on other workers from prompt + those tokens
// (ClusterBackendOptions::migration_limit): a new prefill of them, then
// decode as usual, on the same sink. With no worker of a role it needs, it
// waits as below. Greedy answers
// are unchanged by it. A sampled one continues from the same tokens with a
// seed derived from its own and the number of tokens carried (MigratedSeed):
// repeatable, but not the draws an undisturbed run makes.
//
// Waiting for a worker: a request that finds no healthy worker of a role it
// needs, on Submit or when re-run or migrated after a loss, waits up to
// worker_wait_bound() for one to register and is started when one does; past
// the bound it ends with the Unavailable error it would have got at once.
// Cancel releases it meanwhile.
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
#include "coordinator/cluster/router.h"
#include "protocols/cluster_auth.h"
#include "protocols/framed_connection.h"
#include "protocols/handshake.h"
#include "protocols/io_thread.h"
#include "protocols/tls.h"

namespace kvrelay::coordinator {

struct ClusterBackendOptions {
  // The control plane's listen address (kvrelay-coordinator --control-host),
  // not the HTTP API's: the control port is internal.
  std::string host = "127.0.0.1";
  uint16_t control_port = 0;  // 0 = ephemeral, see control_port()
  // Workers heartbeat every heartbeat_interval; the coordinator sends each
  // registered worker a heartbeat at the same interval (its liveness for the
  // worker, WorkerOptions::coordinator_timeout).
  std::chrono::milliseconds heartbeat_interval{500};
  int missed_heartbeats = 3;
  // A worker silent for this long is dropped (--heartbeat-timeout-ms); 0 =
  // missed_heartbeats intervals. The default (3 intervals, 1.5 s at 500 ms)
  // lets a heartbeat arrive two whole intervals late before a live worker is
  // taken for dead: a false drop fails that worker's streaming requests, and
  // on a loaded 2-core host a heartbeat thread can be scheduled hundreds of
  // ms late. A deployment that wants a silent fault's requests to end within
  // 2 intervals sets ~1.5 intervals (the fault matrix does, at 1 s), which
  // tolerates a heartbeat half an interval late. Checked every tenth of it,
  // so a silent worker is dropped within 1.1 x this after its last frame;
  // time the coordinator itself did not run (stopped, starved) is not held
  // against the workers.
  std::chrono::milliseconds heartbeat_timeout{0};
  std::chrono::milliseconds worker_timeout() const {
    return heartbeat_timeout.count() > 0 ? heartbeat_timeout
                                         : heartbeat_interval * missed_heartbeats;
  }
  // A request that finds no healthy worker (a prefill or a decode one), new
  // or moving on after a loss, waits this long for one to register (--worker-wait-ms)
  // before it fails as it would have at once: workers that dropped their
  // link to a stalled coordinator are mid-reconnect when it resumes and
  // re-register within ms. Negative = one heartbeat interval: a request must
  // still get its final status within 2 intervals of a fault that leaves no
  // worker of a role (the fault matrix's bound); a deployment that wants
  // requests to ride out a worker restart sets more (a worker's reconnect
  // backoff is at most 2 s). 0 = no wait.
  std::chrono::milliseconds worker_wait{-1};
  std::chrono::milliseconds worker_wait_bound() const {
    return worker_wait.count() >= 0 ? worker_wait : heartbeat_interval;
  }
  // Request migration (--migration-limit): a request whose decode worker (or
  // TP group) is lost or fails mid-answer, or whose prefill worker is lost or
  // its KV stream fails before the hand-over, is started again on other
  // workers as a new prefill of its prompt plus the tokens already sent to
  // the client, with max_tokens reduced by those; the client's stream
  // continues where it stopped. With no worker of a role it needs registered
  // (its only decode group restarting) it waits worker_wait for one. Each
  // request moves at most this many times, then fails as with 0 (the error
  // "worker X was lost"). Not moved: requests under a JSON schema (the
  // grammar's state is not rebuilt from tokens) or with presence/frequency
  // penalties (they count generated tokens only, so the re-prefilled tokens
  // would escape them).
  int migration_limit = 3;
  // The model's vocabulary size: a request naming a token id outside
  // [0, vocab_size) (prompt or logit_bias) is refused with InvalidArgument
  // before it reaches a worker. 0 = not checked here.
  int64_t vocab_size = 0;
  RouterOptions router;
  // What every worker must agree with (handshake); tp fields are ignored.
  protocols::PeerConfig config;
  // The cluster secret every worker must prove (required).
  protocols::ClusterKey cluster_key;
  // An unauthenticated connection is closed after this long; a started frame
  // must complete within frame_timeout.
  std::chrono::milliseconds auth_timeout{5000};
  std::chrono::milliseconds frame_timeout{10000};
  protocols::ServerLimits limits;
  // Mutual TLS on the control port (--control-tls-*, protocols/tls.h): every
  // worker must present a certificate the cluster CA signed, then still prove
  // the cluster key inside the TLS session. Null = plaintext.
  std::shared_ptr<protocols::TlsContext> tls;
};

// OK when every token id of `request` (its prompt and its logit_bias) lies in
// [0, vocab_size); otherwise InvalidArgument naming the first id outside (the
// client's error: 400, not a capacity problem). vocab_size <= 0: OK.
Status CheckTokenIds(const GenerationRequest& request, int64_t vocab_size);

// The seed a sampled request continues with after its migration-th move,
// carrying `carried` generated tokens: a mix of all three, so a re-run of the
// same move draws the same tokens and two moves never share a stream.
uint64_t MigratedSeed(uint64_t seed, size_t carried, int migration);

// What the control plane refused, for tests and metrics.
struct ControlSecurityCounters {
  uint64_t auth_failures = 0;           // connections that failed the challenge-response
  uint64_t refused_connections = 0;     // closed at accept (ServerLimits)
  uint64_t foreign_frames = 0;          // frames about a request the sender does not own, dropped
  uint64_t oversized_frames = 0;        // connections closed at a frame header over their limit
  uint64_t tls_handshake_failures = 0;  // TLS port: plaintext peer, no or foreign certificate
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
  ControlSecurityCounters security_counters() const;
  // Requests started again elsewhere after losing a worker mid-answer.
  uint64_t requests_migrated() const;
  // security_counters() as kvrelay_control_*_total, and
  // kvrelay_requests_migrated_total.
  std::vector<BackendMetric> Counters() override;
  // kvrelay_cluster_requests{phase}: the requests in each Phase now.
  std::vector<BackendMetric> Gauges() override;

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
