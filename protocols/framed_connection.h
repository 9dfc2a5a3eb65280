// Framed TCP connections over Boost.Asio: the transport of the control plane
// (and of the TCP KV data plane's frames).
//
// FramedConnection reads frames with the safe incremental FrameDecoder and
// writes frames from a bounded send queue. Any bad frame (too large, bad
// magic, truncated at EOF), an idle timeout or a socket error closes the
// connection with a logged reason; the process goes on.
//
// Thread-safety: Send, Close, Receive and the accessors are thread-safe. The
// frame and close handlers run on the IoThread; they must not block. All
// objects here must be destroyed (or at least closed) before their IoThread.
#pragma once

#include <boost/asio/buffer.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "protocols/frame_codec.h"
#include "protocols/io_thread.h"
#include "protocols/tls.h"

namespace kvrelay::protocols {

struct ConnectionOptions {
  std::string name = "conn";  // appears in log lines
  uint32_t max_payload_bytes = kDefaultMaxFramePayload;
  // Frames queued for sending beyond this count make Send fail with
  // ResourceExhausted (back-pressure instead of unbounded memory).
  size_t max_send_queue_frames = 1024;
  // Frames received and not yet taken by Receive() (when no frame handler is
  // installed); overflow closes the connection.
  size_t max_inbox_frames = 1024;
  // No byte received for this long closes the connection; 0 disables.
  std::chrono::milliseconds idle_timeout{0};
  // A frame whose first byte arrived must be complete within this, or the
  // connection is closed and its partial frame freed (a sender cannot park
  // memory here by never finishing a frame); 0 disables.
  std::chrono::milliseconds frame_timeout{0};
  // Until MarkAuthenticated(): frames are limited to kMaxUnauthenticatedPayload
  // bytes (protocols/cluster_auth.h), and the connection is closed when
  // auth_timeout passes first. Servers of internal ports set this.
  bool require_authentication = false;
  std::chrono::milliseconds auth_timeout{5000};
  size_t read_chunk_bytes = 256 << 10;
  // Mutual TLS 1.3 (protocols/tls.h) before the first frame when set: an
  // accepted connection (Adopt, FramedServer) is the TLS server, Connect's the
  // client. Frames queued meanwhile are sent once the handshake succeeded; a
  // failed handshake closes the connection with a status IsTlsHandshakeFailure
  // recognises. The auth timeout (require_authentication) bounds it on servers.
  std::shared_ptr<TlsContext> tls;
};

// Whether `close_reason` is a failed TLS handshake (a plaintext peer on a TLS
// port, a certificate the CA did not sign, no certificate at all).
bool IsTlsHandshakeFailure(const Status& close_reason);

// Limits of a FramedServer: connections over max_connections are closed at accept.
struct ServerLimits {
  size_t max_connections = 1024;  // open connections accepted by this server
  // Open connections that have not authenticated yet (with
  // require_authentication); when full, the oldest of them is evicted to
  // admit the new one (preauth_slots.h).
  size_t max_unauthenticated = 64;
};

// Backoff between connect attempts: initial, doubling up to max.
struct ReconnectOptions {
  std::chrono::milliseconds initial_backoff{20};
  std::chrono::milliseconds max_backoff{1000};
};

class FramedConnection : public std::enable_shared_from_this<FramedConnection> {
 public:
  using FrameHandler = std::function<void(Frame)>;
  using CloseHandler = std::function<void(const Status&)>;

  // Takes ownership of a connected socket. Call Start() to begin reading.
  static std::shared_ptr<FramedConnection> Adopt(IoThread& io, boost::asio::ip::tcp::socket socket,
                                                 ConnectionOptions options);

  // Connects to host:port, retrying with exponential backoff (initial_backoff,
  // doubling up to max_backoff) until `deadline`. Must not be called on the
  // IoThread. The connection is started in inbox mode (use Receive or SetFrameHandler).
  static Result<std::shared_ptr<FramedConnection>> Connect(
      IoThread& io, const std::string& host, uint16_t port, ConnectionOptions options,
      Deadline deadline, ReconnectOptions retry = ReconnectOptions());

  ~FramedConnection();

  // Begins reading. With a null frame handler, frames go to the inbox for
  // Receive(). The close handler (may be null) runs once, with the reason.
  void Start(FrameHandler on_frame = nullptr, CloseHandler on_close = nullptr);

  // Queues one frame. Unavailable when closed, ResourceExhausted when the
  // queue is full, InvalidArgument when the payload is too large.
  Status Send(uint16_t type, std::string_view payload);
  Status Send(MessageType type, std::string_view payload) {
    return Send(static_cast<uint16_t>(type), payload);
  }
  // Sends header + caller bytes assembled in one buffer (no second copy).
  Status SendEncoded(std::string frame_bytes);

  // Like SendEncoded, but waits (until `deadline`) for room in the send queue
  // instead of failing with ResourceExhausted: back-pressure for bulk senders.
  Status SendEncodedWait(std::string frame_bytes, Deadline deadline);

  // Zero-copy send of one frame whose bytes are `head` (frame header and any
  // payload prefix, encoded by the caller) followed by `body`, caller memory
  // written straight to the socket (gather write, no copy). Waits until
  // `deadline` for room in the send queue like SendEncodedWait.
  // On OK, `on_done` runs exactly once on the io thread: with OK when every
  // byte was handed to the kernel, or with the close reason when the
  // connection closed first. Either way the connection never touches `body`
  // after that, so `body` must stay valid until then. On error `on_done` is
  // never called. `on_done` must not block and must not call this connection.
  using WriteDone = std::function<void(const Status&)>;
  Status SendGatherWait(std::string head, std::vector<boost::asio::const_buffer> body,
                        WriteDone on_done, Deadline deadline);
  // Sets SO_SNDBUF and SO_RCVBUF (0 leaves the kernel's autotuning). Any thread.
  void SetSocketBuffers(int bytes);

  // The peer proved the cluster key: lifts the pre-authentication frame limit
  // (to max_payload_bytes) and stops the auth timer. Any thread; takes effect
  // before any frame sent after this call is answered (it is ordered on the
  // io thread before later sends).
  void MarkAuthenticated();
  bool authenticated() const;
  // Replaces ConnectionOptions::idle_timeout from now on (0 turns it off):
  // no byte received for `timeout` from this call or the last byte closes the
  // connection. Any thread (applied on the io thread). For a link whose
  // peer's keep-alive interval is learnt after connecting.
  void SetIdleTimeout(std::chrono::milliseconds timeout);

  // Next inbox frame, waiting until `deadline`. DeadlineExceeded on timeout;
  // the close reason (or Unavailable) once closed and drained.
  Result<Frame> Receive(Deadline deadline);

  // Closes now (pending sends are dropped); logs `reason` once. Idempotent.
  void Close(const Status& reason);
  // Closes once every queued frame has been written.
  void CloseAfterFlush(const Status& reason);
  // Blocks until closed or deadline; returns the close reason (DeadlineExceeded if still open).
  Status WaitClosed(Deadline deadline);

  bool closed() const;
  Status close_reason() const;
  const std::string& name() const { return options_.name; }
  size_t queued_frames() const;

 private:
  FramedConnection(IoThread& io, boost::asio::ip::tcp::socket socket, ConnectionOptions options);
  void DoRead();
  void DoWrite();                        // io thread
  void ArmIdleTimer();                   // io thread
  void ArmAuthTimer();                   // io thread
  void UpdateFrameTimer();               // io thread: armed while a frame is partial
  void CloseOnIo(const Status& reason);  // io thread
  void Deliver(Frame frame);             // io thread
  void StartTls();                       // io thread: the handshake, then DoRead

  struct Tls;  // the TLS stream over socket_ (framed_connection.cc); io thread only

  IoThread& io_;
  ConnectionOptions options_;
  boost::asio::ip::tcp::socket socket_;    // touched on the io thread only
  std::unique_ptr<Tls> tls_;               // null without TLS; io thread only after Start
  bool tls_client_ = false;                // set by Connect before Start
  bool tls_ready_ = false;                 // io thread only: the handshake succeeded
  boost::asio::steady_timer idle_timer_;   // io thread only
  boost::asio::steady_timer auth_timer_;   // io thread only
  boost::asio::steady_timer frame_timer_;  // io thread only
  uint64_t frame_timer_gen_ = 0;           // io thread only: bumped when disarmed
  bool frame_timer_armed_ = false;         // io thread only
  FrameDecoder decoder_;                   // io thread only
  std::vector<char> read_buffer_;          // io thread only
  FrameHandler on_frame_;                  // set before Start
  CloseHandler on_close_;

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  struct Outgoing {
    std::string bytes;                            // owned: header (+ payload)
    std::vector<boost::asio::const_buffer> body;  // caller memory (SendGatherWait)
    WriteDone on_done;                            // may be null
  };
  Status Enqueue(Outgoing out);
  std::deque<Outgoing> send_queue_;                       // guarded by mutex_
  std::vector<boost::asio::const_buffer> write_buffers_;  // io thread only: the write in flight
  bool writing_ = false;                                  // guarded by mutex_
  bool closed_ = false;                                   // guarded by mutex_
  bool close_after_flush_ = false;                        // guarded by mutex_
  bool authenticated_ = false;                            // guarded by mutex_
  Status flush_reason_;                                   // guarded by mutex_
  Status close_reason_;                                   // guarded by mutex_
  std::deque<Frame> inbox_;                               // guarded by mutex_
};

// Accepts connections on host:port (port 0 = ephemeral) and hands each, not
// yet started, to the accept handler on the IoThread.
class FramedServer {
 public:
  using AcceptHandler = std::function<void(std::shared_ptr<FramedConnection>)>;
  static Result<std::unique_ptr<FramedServer>> Listen(IoThread& io, const std::string& host,
                                                      uint16_t port, ConnectionOptions options,
                                                      AcceptHandler on_accept,
                                                      ServerLimits limits = ServerLimits());
  ~FramedServer();
  uint16_t port() const { return port_; }
  // Stops accepting and closes every connection it accepted. Thread-safe, idempotent.
  void Stop();
  // Connections refused at accept because a ServerLimits bound was reached,
  // or evicted from a full set of pre-authentication slots.
  uint64_t refused_connections() const;

  struct State;  // implementation detail, shared with the io thread

 private:
  FramedServer(IoThread& io, std::shared_ptr<State> state, uint16_t port)
      : io_(io), state_(std::move(state)), port_(port) {}
  IoThread& io_;
  std::shared_ptr<State> state_;
  uint16_t port_;
};

}  // namespace kvrelay::protocols
