// TCP backend over Boost.Asio. Each endpoint listens on its own data port
// (never the control plane's) and opens one outgoing data connection per
// peer it sends to. A connection first passes the cluster-key challenge-
// response (protocols/cluster_auth.h, channel "kv", the sender authenticating
// as "kv-rank-<rank>"); only then does its hello name the sender's rank, which
// must be the rank it authenticated as. An unauthenticated connection never
// takes a peer slot, can buffer at most kMaxUnauthenticatedPayload bytes and
// is closed after auth_timeout; a peer's new authenticated connection replaces
// its old one, and only the current connection's close counts as that peer
// being lost. When the unauthenticated slots are full the oldest stranger is
// evicted for the new connection (protocols/preauth_slots.h). Chunk headers
// are bounded before anything is allocated (a total above max_transfer_bytes
// closes the connection).
//
// A send is cut into kKvData frames (frame header + chunk header: request,
// tag, offset, total) of at most chunk_bytes. No user-space copy on either
// side: the sender thread ("kv-tcp-send") queues each frame as a gather write
// (a small owned header followed by the caller's regions, written with one
// sendmsg over an iovec), with back-pressure (send_queue_frames per
// connection). The caller's send buffers are therefore read by the kernel
// until the last frame is written; the send completes (and the buffers are
// released) when every frame has been handed to the kernel. A cancelled send
// waits for its frames already queued (or closes the connection when they do
// not drain within cancel_drain_timeout) and emits kKvAbort.
//
// The receiving side reads each frame's headers, and when the frame is the
// next piece of a posted receive, reads its payload straight into the
// receive's regions (scatter read; the regions are "bound" meanwhile and
// Cancel waits for that one chunk read, closing the connection if it does
// not finish within cancel_drain_timeout). Frames without a matching posted
// receive go through a bounded scratch buffer into the shared staging of
// transport_base.h. A closed incoming connection fails every unfinished
// receive from that peer at once (peer death never hangs).
//
// Threads: one io thread ("kv-tcp-io") and one sender thread
// ("kv-tcp-send"), both joined by Shutdown()/destructor.
#pragma once

#include <memory>
#include <string>
#include <thread>
#include <unordered_map>

#include "kv_transfer/transport_base.h"
#include "protocols/cluster_auth.h"
#include "protocols/framed_connection.h"
#include "protocols/io_thread.h"

namespace kvrelay::kv_transfer {

class TcpTransport final : public TransportBase {
 public:
  struct Options {
    int rank = 0;
    int world_size = 2;
    std::string listen_host = "127.0.0.1";
    uint16_t listen_port = 0;  // 0: ephemeral, see port()
    // The host peers dial (conn_info()); empty = listen_host, which must then
    // not be a wildcard (0.0.0.0 / ::) — peers on other hosts would dial themselves.
    std::string advertise_host;
    size_t chunk_bytes = 1 << 20;
    // Per connection: frames queued for writing (they reference caller memory).
    size_t send_queue_frames = 8;
    // SO_SNDBUF / SO_RCVBUF of the data sockets (the kernel caps it at
    // net.core.wmem_max / rmem_max); 0 keeps the kernel's autotuning. 4 MiB
    // measured ~1.4x the autotuned bandwidth on loopback (docs/BENCHMARKS.md).
    int socket_buffer_bytes = 4 << 20;
    // How long Cancel / a Wait deadline waits for a chunk already being read
    // into or written from caller memory before closing that connection.
    std::chrono::milliseconds cancel_drain_timeout{2000};
    int max_inflight = 4096;
    int64_t max_unexpected_bytes = 1ll << 30;
    // A send that cannot queue a chunk for this long fails (peer not reading).
    std::chrono::milliseconds stall_timeout{30000};
    // The cluster secret every data connection proves (required).
    protocols::ClusterKey cluster_key;
    // An accepted connection that has not authenticated by then is closed.
    std::chrono::milliseconds auth_timeout{5000};
    // Accepted connections open at once (more are closed at accept), and of
    // those unauthenticated ones: when these are full, the oldest is evicted
    // to admit the new one (protocols/preauth_slots.h), so a local process
    // holding them with silent connections cannot lock a peer out.
    size_t max_connections = 256;
    size_t max_unauthenticated = 32;
    // Largest transfer a chunk header may announce.
    uint64_t max_transfer_bytes = uint64_t{4} << 30;
    // Staged (unexpected) data nobody posted a receive for is dropped after this.
    std::chrono::milliseconds max_unexpected_age{60000};
  };
  static Result<std::unique_ptr<TcpTransport>> Create(Options options);
  ~TcpTransport() override;

  uint16_t port() const { return port_; }
  // The name rank `rank` authenticates as on the data plane ("kv-rank-<rank>").
  static std::string AuthName(int rank);
  // Opens the data connection for sends to `peer`, listening at host:port,
  // retrying with backoff until `deadline`.
  Status ConnectPeer(int peer, const std::string& host, uint16_t port, Deadline deadline);
  // "advertise_host:port".
  std::string conn_info() const override;
  // conn_info is "host:port"; see Transport::ConnectPeer.
  Status ConnectPeer(int peer, std::string_view conn_info, Deadline deadline) override;
  // Closes every connection and joins the threads; unfinished transfers fail.
  // Idempotent. Called by the destructor.
  void Shutdown();

  std::string_view name() const override { return "tcp"; }
  bool SupportsDeviceMemory() const override { return false; }
  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }

 private:
  explicit TcpTransport(Options options);
  Status StartSendLocked(const OpPtr& op, std::unique_lock<std::mutex>& lock) override;
  void CancelLocked(const OpPtr& op, std::unique_lock<std::mutex>& lock) override;
  // Fails queued sends to `peer`, closes both directions of its connections
  // (a restarted or stalled peer reconnects through ConnectPeer) and waits up
  // to cancel_drain_timeout for chunks in flight to unbind.
  void AbandonPeerLocked(int peer, const Status& why, std::unique_lock<std::mutex>& lock) override;
  void SenderLoop();
  void SendOneLocked(const OpPtr& op, std::unique_lock<std::mutex>& lock);
  class Inbound;  // one accepted data connection (tcp_transport.cc)
  void AcceptLoop();
  // Waits (lock held via `lock`) until `op` is no longer bound to a chunk
  // read/write; closes the connection carrying it if that takes longer than
  // cancel_drain_timeout.
  void DrainBoundLocked(const OpPtr& op, std::unique_lock<std::mutex>& lock);

  Options options_;
  protocols::IoThread io_;
  std::unique_ptr<boost::asio::ip::tcp::acceptor> acceptor_;  // io thread after Create
  uint16_t port_ = 0;
  std::thread sender_;
  // Guarded by domain_->mu.
  bool stopping_ = false;
  std::unordered_map<int, std::shared_ptr<protocols::FramedConnection>> out_conns_;
  std::unordered_map<int, std::string> out_info_;  // conn_info each out_conns_ entry was made from
  std::deque<OpPtr> send_queue_;
  std::vector<std::weak_ptr<Inbound>> inbound_;
  // Receive handle -> the connection whose read is writing into it (bound ops only).
  std::unordered_map<TransferHandle, std::weak_ptr<Inbound>> reading_;
  // Peer -> its current authenticated incoming connection.
  std::unordered_map<int, std::weak_ptr<Inbound>> inbound_by_peer_;
  uint64_t refused_connections_ = 0;
  uint64_t auth_failures_ = 0;
  uint64_t oversized_frames_ = 0;
  uint64_t foreign_frames_ = 0;

 public:
  // Connections closed at accept (limits) or evicted from a full set of
  // pre-auth slots, and that failed authentication.
  uint64_t refused_connections() const;
  uint64_t auth_failures() const;
  // Those, plus connections closed at a frame or chunk header over its limit
  // and hellos naming another rank than the one authenticated.
  protocols::PortSecurityCounters security_counters() const override;
};

}  // namespace kvrelay::kv_transfer
