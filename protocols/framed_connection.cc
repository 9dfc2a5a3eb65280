#include "protocols/framed_connection.h"

#include <atomic>
#include <boost/asio/connect.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/ssl/error.hpp>
#include <boost/asio/ssl/stream.hpp>
#include <boost/asio/write.hpp>
#include <cstring>
#include <future>
#include <thread>

#include "common/logging.h"
#include "protocols/cluster_auth.h"
#include "protocols/preauth_slots.h"

namespace kvrelay::protocols {
namespace {
// The close reason of an orderly EOF at a frame boundary.
constexpr const char* kPeerClosedMessage = "peer closed the connection";
constexpr std::string_view kTlsFailedMessage = "TLS handshake failed";
}  // namespace

bool IsTlsHandshakeFailure(const Status& close_reason) {
  return close_reason.code() == StatusCode::kFailedPrecondition &&
         close_reason.message().rfind(kTlsFailedMessage, 0) == 0;
}

struct FramedConnection::Tls {
  Tls(boost::asio::ip::tcp::socket& socket, TlsContext& context)
      : stream(socket, context.context()) {}
  // Over the connection's socket (a reference): closing socket_ aborts the
  // stream's operations, and socket options still apply to socket_.
  boost::asio::ssl::stream<boost::asio::ip::tcp::socket&> stream;
};

namespace asio = boost::asio;
using asio::ip::tcp;

namespace {

Status FromAsio(const boost::system::error_code& ec, const std::string& what) {
  return Unavailable(what + ": " + ec.message());
}

}  // namespace

std::shared_ptr<FramedConnection> FramedConnection::Adopt(IoThread& io, tcp::socket socket,
                                                          ConnectionOptions options) {
  return std::shared_ptr<FramedConnection>(
      new FramedConnection(io, std::move(socket), std::move(options)));
}

FramedConnection::FramedConnection(IoThread& io, tcp::socket socket, ConnectionOptions options)
    : io_(io),
      options_(std::move(options)),
      socket_(std::move(socket)),
      idle_timer_(io.context()),
      auth_timer_(io.context()),
      frame_timer_(io.context()),
      decoder_(FrameDecoder::Options{
          options_.require_authentication
              ? std::min(options_.max_payload_bytes, kMaxUnauthenticatedPayload)
              : options_.max_payload_bytes}),
      authenticated_(!options_.require_authentication) {
  boost::system::error_code ignored;
  socket_.set_option(tcp::no_delay(true), ignored);
  if (options_.tls) tls_ = std::make_unique<Tls>(socket_, *options_.tls);
}

FramedConnection::~FramedConnection() = default;

Result<std::shared_ptr<FramedConnection>> FramedConnection::Connect(
    IoThread& io, const std::string& host, uint16_t port, ConnectionOptions options,
    Deadline deadline, ReconnectOptions retry) {
  if (io.InThisThread()) return Internal("FramedConnection::Connect called on its IoThread");
  boost::system::error_code ec;
  auto address = asio::ip::make_address(host, ec);
  if (ec) {
    tcp::resolver resolver(io.context());
    auto results = resolver.resolve(host, std::to_string(port), ec);
    if (ec || results.empty()) return FromAsio(ec, "resolving " + host);
    address = results.begin()->endpoint().address();
  }
  tcp::endpoint endpoint(address, port);
  auto backoff = retry.initial_backoff;
  Status last = DeadlineExceeded("connecting to " + host + ":" + std::to_string(port) +
                                 ": deadline passed before the first attempt");
  for (int attempt = 1; !deadline.Expired(); ++attempt) {
    // State shared by the two handlers of one attempt (both run on the io thread).
    struct Attempt {
      explicit Attempt(asio::io_context& ctx) : socket(ctx), timer(ctx) {}
      tcp::socket socket;
      asio::steady_timer timer;
      bool done = false;  // io thread only until `result` is set
      std::promise<boost::system::error_code> result;
    };
    auto a = std::make_shared<Attempt>(io.context());
    auto future = a->result.get_future();
    auto remaining = deadline.Remaining();
    asio::post(io.context(), [a, remaining, endpoint] {
      a->timer.expires_after(remaining);
      a->timer.async_wait([a](const boost::system::error_code& tec) {
        if (!tec && !a->done) {
          boost::system::error_code ignored;
          a->socket.close(ignored);  // aborts the pending connect
        }
      });
      a->socket.async_connect(endpoint, [a](const boost::system::error_code& cec) {
        a->done = true;
        a->timer.cancel();
        a->result.set_value(cec);
      });
    });
    // The connect handler always runs: on success, refusal, or the timer's close.
    if (future.wait_until(deadline.at + std::chrono::seconds(1)) != std::future_status::ready) {
      return Internal("connect to " + host + ": io thread " + io.name() + " is not running");
    }
    auto cec = future.get();
    if (!cec) {
      auto conn = Adopt(io, std::move(a->socket), std::move(options));
      conn->tls_client_ = true;
      conn->Start();
      LOG_DEBUG << "connected " << conn->name() << " to " << host << ":" << port << " (attempt "
                << attempt << ")";
      return conn;
    }
    last = FromAsio(cec, "connecting to " + host + ":" + std::to_string(port) + " (attempt " +
                             std::to_string(attempt) + ")");
    auto sleep = std::min<std::chrono::nanoseconds>(backoff, deadline.Remaining());
    std::this_thread::sleep_for(sleep);
    backoff = std::min(backoff * 2, retry.max_backoff);
  }
  return last;
}

void FramedConnection::Start(FrameHandler on_frame, CloseHandler on_close) {
  on_frame_ = std::move(on_frame);
  on_close_ = std::move(on_close);
  auto self = shared_from_this();
  asio::post(io_.context(), [self] {
    self->ArmIdleTimer();
    self->ArmAuthTimer();
    if (self->tls_) {
      self->StartTls();
    } else {
      self->DoRead();
    }
  });
}

void FramedConnection::StartTls() {
  if (closed()) return;
  const auto role = tls_client_ ? asio::ssl::stream_base::client : asio::ssl::stream_base::server;
  tls_->stream.async_handshake(
      role, [self = shared_from_this()](const boost::system::error_code& ec) {
        if (ec) {
          if (ec == asio::error::operation_aborted) return;  // closed meanwhile
          // For OpenSSL errors the message is its reason: "certificate verify
          // failed", "wrong version number" (a plaintext peer), ...
          self->CloseOnIo(FailedPrecondition(std::string(kTlsFailedMessage) + ": " + ec.message()));
          return;
        }
        self->tls_ready_ = true;
        bool kick = false;
        {
          std::lock_guard lock(self->mutex_);
          if (!self->closed_ && !self->writing_ &&
              (!self->send_queue_.empty() || self->close_after_flush_)) {
            self->writing_ = true;
            kick = true;
          }
        }
        if (kick) self->DoWrite();
        self->DoRead();
      });
}

void FramedConnection::ArmAuthTimer() {
  if (authenticated() || options_.auth_timeout.count() <= 0) return;
  auth_timer_.expires_after(options_.auth_timeout);
  auth_timer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    if (ec || self->authenticated()) return;
    self->CloseOnIo(DeadlineExceeded("peer did not authenticate within " +
                                     std::to_string(self->options_.auth_timeout.count()) + " ms"));
  });
}

void FramedConnection::MarkAuthenticated() {
  {
    std::lock_guard lock(mutex_);
    if (authenticated_) return;
    authenticated_ = true;
  }
  auto apply = [self = shared_from_this()] {
    self->decoder_.set_max_payload_bytes(self->options_.max_payload_bytes);
    self->auth_timer_.cancel();
  };
  if (io_.InThisThread()) {
    apply();
  } else {
    asio::post(io_.context(), std::move(apply));
  }
}

bool FramedConnection::authenticated() const {
  std::lock_guard lock(mutex_);
  return authenticated_;
}

void FramedConnection::UpdateFrameTimer() {
  if (options_.frame_timeout.count() <= 0) return;
  const bool partial = decoder_.buffered_bytes() > 0;
  if (!partial) {
    if (frame_timer_armed_) {
      frame_timer_armed_ = false;
      ++frame_timer_gen_;
      frame_timer_.cancel();
    }
    return;
  }
  if (frame_timer_armed_) return;  // the deadline runs from the frame's first byte
  frame_timer_armed_ = true;
  frame_timer_.expires_after(options_.frame_timeout);
  frame_timer_.async_wait([self = shared_from_this(),
                           gen = frame_timer_gen_](const boost::system::error_code& ec) {
    if (ec || gen != self->frame_timer_gen_) return;
    self->CloseOnIo(DeadlineExceeded(
        "a frame stayed incomplete for " + std::to_string(self->options_.frame_timeout.count()) +
        " ms (" + std::to_string(self->decoder_.buffered_bytes()) + " bytes buffered)"));
  });
}

void FramedConnection::SetIdleTimeout(std::chrono::milliseconds timeout) {
  auto apply = [self = shared_from_this(), timeout] {
    if (self->closed()) return;
    self->options_.idle_timeout = timeout;
    if (timeout.count() > 0) {
      self->ArmIdleTimer();
    } else {
      self->idle_timer_.cancel();
    }
  };
  if (io_.InThisThread()) {
    apply();
  } else {
    asio::post(io_.context(), std::move(apply));
  }
}

void FramedConnection::ArmIdleTimer() {
  if (options_.idle_timeout.count() <= 0) return;
  idle_timer_.expires_after(options_.idle_timeout);
  idle_timer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    if (ec) return;  // re-armed or cancelled
    self->CloseOnIo(DeadlineExceeded("no data for " +
                                     std::to_string(self->options_.idle_timeout.count()) + " ms"));
  });
}

void FramedConnection::DoRead() {
  if (closed()) return;
  // Small reads until the peer authenticated: an unauthenticated connection
  // costs a few KiB, not read_chunk_bytes. No read is in flight here.
  const size_t chunk = authenticated() ? options_.read_chunk_bytes
                                       : std::min<size_t>(options_.read_chunk_bytes, 4096);
  if (read_buffer_.size() != chunk) read_buffer_.assign(chunk, 0);
  auto on_read = [self = shared_from_this()](const boost::system::error_code& ec, size_t n) {
    if (ec) {
      // A TLS peer that closes without close_notify reads as stream_truncated.
      if (ec == asio::error::eof || ec == asio::ssl::error::stream_truncated) {
        Status truncated = self->decoder_.Finish();
        self->CloseOnIo(truncated.ok() ? Unavailable(kPeerClosedMessage)
                                       : truncated.WithContext(kPeerClosedMessage));
      } else if (ec != asio::error::operation_aborted) {
        self->CloseOnIo(FromAsio(ec, "read"));
      }
      return;
    }
    if (self->closed()) return;  // closed while this read completed: deliver nothing
    Status st = self->decoder_.Feed(self->read_buffer_.data(), n);
    // Frames decoded before a bad one are still delivered.
    while (auto frame = self->decoder_.Next()) {
      self->Deliver(std::move(*frame));
      if (self->closed()) return;
    }
    if (!st.ok()) {
      self->CloseOnIo(st.WithContext("bad frame"));
      return;
    }
    self->UpdateFrameTimer();
    self->ArmIdleTimer();
    self->DoRead();
  };
  if (tls_) {
    tls_->stream.async_read_some(asio::buffer(read_buffer_), std::move(on_read));
  } else {
    socket_.async_read_some(asio::buffer(read_buffer_), std::move(on_read));
  }
}

void FramedConnection::Deliver(Frame frame) {
  if (on_frame_) {
    on_frame_(std::move(frame));
    return;
  }
  {
    std::lock_guard lock(mutex_);
    if (inbox_.size() < options_.max_inbox_frames) {
      inbox_.push_back(std::move(frame));
      cv_.notify_all();
      return;
    }
  }
  CloseOnIo(ResourceExhausted("receive inbox full (" + std::to_string(options_.max_inbox_frames) +
                              " frames unread)"));
}

Status FramedConnection::Send(uint16_t type, std::string_view payload) {
  if (payload.size() > options_.max_payload_bytes) {
    return InvalidArgument("frame payload of " + std::to_string(payload.size()) +
                           " bytes exceeds the maximum of " +
                           std::to_string(options_.max_payload_bytes));
  }
  std::string bytes(kFrameHeaderBytes + payload.size(), '\0');
  EncodeFrameHeader(type, static_cast<uint32_t>(payload.size()),
                    reinterpret_cast<uint8_t*>(bytes.data()));
  if (!payload.empty())
    std::memcpy(bytes.data() + kFrameHeaderBytes, payload.data(), payload.size());
  return SendEncoded(std::move(bytes));
}

Status FramedConnection::SendEncoded(std::string frame_bytes) {
  return Enqueue(Outgoing{std::move(frame_bytes), {}, nullptr});
}

Status FramedConnection::Enqueue(Outgoing out) {
  bool start = false;
  {
    std::lock_guard lock(mutex_);
    if (closed_ || close_after_flush_) {
      return Unavailable("connection " + options_.name + " is closed" +
                         (close_reason_.ok() ? "" : ": " + close_reason_.ToString()));
    }
    if (send_queue_.size() >= options_.max_send_queue_frames) {
      return ResourceExhausted("send queue of " + options_.name + " is full (" +
                               std::to_string(send_queue_.size()) + " frames)");
    }
    send_queue_.push_back(std::move(out));
    if (!writing_) {
      writing_ = true;
      start = true;
    }
  }
  if (start) asio::post(io_.context(), [self = shared_from_this()] { self->DoWrite(); });
  return Status::Ok();
}

Status FramedConnection::SendEncodedWait(std::string frame_bytes, Deadline deadline) {
  {
    std::unique_lock lock(mutex_);
    bool room = cv_.wait_until(lock, deadline.at, [&] {
      return closed_ || close_after_flush_ || send_queue_.size() < options_.max_send_queue_frames;
    });
    if (!room) {
      return DeadlineExceeded("send queue of " + options_.name + " stayed full until the deadline");
    }
  }
  return SendEncoded(std::move(frame_bytes));
}

Status FramedConnection::SendGatherWait(std::string head, std::vector<asio::const_buffer> body,
                                        WriteDone on_done, Deadline deadline) {
  size_t payload = head.size() < kFrameHeaderBytes ? 0 : head.size() - kFrameHeaderBytes;
  for (const auto& b : body) payload += b.size();
  if (head.size() < kFrameHeaderBytes || payload > options_.max_payload_bytes) {
    return InvalidArgument("gather frame of " + std::to_string(payload) + " payload bytes (head " +
                           std::to_string(head.size()) + ") does not fit the maximum of " +
                           std::to_string(options_.max_payload_bytes));
  }
  {
    std::unique_lock lock(mutex_);
    bool room = cv_.wait_until(lock, deadline.at, [&] {
      return closed_ || close_after_flush_ || send_queue_.size() < options_.max_send_queue_frames;
    });
    if (!room) {
      return DeadlineExceeded("send queue of " + options_.name + " stayed full until the deadline");
    }
  }
  return Enqueue(Outgoing{std::move(head), std::move(body), std::move(on_done)});
}

void FramedConnection::SetSocketBuffers(int bytes) {
  if (bytes <= 0) return;
  asio::post(io_.context(), [self = shared_from_this(), bytes] {
    boost::system::error_code ignored;
    self->socket_.set_option(asio::socket_base::send_buffer_size(bytes), ignored);
    self->socket_.set_option(asio::socket_base::receive_buffer_size(bytes), ignored);
  });
}

void FramedConnection::DoWrite() {
  Status flush_close;
  bool close_now = false;
  write_buffers_.clear();
  {
    std::lock_guard lock(mutex_);
    if (closed_ || (tls_ && !tls_ready_)) {
      writing_ = false;  // StartTls kicks the queue once the handshake succeeded
      return;
    }
    if (send_queue_.empty()) {
      writing_ = false;
      if (close_after_flush_) {
        close_now = true;
        flush_close = flush_reason_;
      }
    } else {
      // deque keeps element addresses stable on push_back
      const Outgoing& front = send_queue_.front();
      write_buffers_.push_back(asio::buffer(front.bytes));
      write_buffers_.insert(write_buffers_.end(), front.body.begin(), front.body.end());
    }
  }
  if (close_now) {
    CloseOnIo(flush_close);
    return;
  }
  if (write_buffers_.empty()) return;
  auto on_written = [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
    if (ec) {
      if (ec != asio::error::operation_aborted) {
        self->CloseOnIo(FromAsio(ec, "write"));
      }
      return;
    }
    WriteDone done;
    {
      std::lock_guard lock(self->mutex_);
      if (!self->send_queue_.empty()) {
        done = std::move(self->send_queue_.front().on_done);
        self->send_queue_.pop_front();
      }
      self->cv_.notify_all();  // room for SendEncodedWait
    }
    if (done) done(Status::Ok());
    self->DoWrite();
  };
  if (tls_) {
    asio::async_write(tls_->stream, write_buffers_, std::move(on_written));
  } else {
    asio::async_write(socket_, write_buffers_, std::move(on_written));
  }
}

Result<Frame> FramedConnection::Receive(Deadline deadline) {
  std::unique_lock lock(mutex_);
  cv_.wait_until(lock, deadline.at, [&] { return !inbox_.empty() || closed_; });
  if (!inbox_.empty()) {
    Frame f = std::move(inbox_.front());
    inbox_.pop_front();
    return f;
  }
  if (closed_) {
    return close_reason_.ok() ? Unavailable("connection " + options_.name + " closed")
                              : close_reason_;
  }
  return DeadlineExceeded("no frame on " + options_.name + " before the deadline");
}

void FramedConnection::Close(const Status& reason) {
  {
    std::lock_guard lock(mutex_);
    if (closed_) return;
  }
  asio::post(io_.context(), [self = shared_from_this(), reason] { self->CloseOnIo(reason); });
  // Mark closed now so that Send fails immediately; CloseOnIo does the rest.
  std::lock_guard lock(mutex_);
  if (!closed_ && !close_after_flush_) {
    close_after_flush_ = true;  // refuses new sends until the io thread closes
    flush_reason_ = reason;
  }
}

void FramedConnection::CloseAfterFlush(const Status& reason) {
  bool start = false;
  {
    std::lock_guard lock(mutex_);
    if (closed_ || close_after_flush_) return;
    close_after_flush_ = true;
    flush_reason_ = reason;
    if (!writing_) {
      writing_ = true;
      start = true;
    }
  }
  if (start) asio::post(io_.context(), [self = shared_from_this()] { self->DoWrite(); });
}

void FramedConnection::CloseOnIo(const Status& reason) {
  std::deque<Outgoing> dropped;
  {
    std::lock_guard lock(mutex_);
    if (closed_) return;
    closed_ = true;
    close_reason_ = reason;
    dropped.swap(send_queue_);
    cv_.notify_all();
  }
  boost::system::error_code ignored;
  idle_timer_.cancel();
  auth_timer_.cancel();
  ++frame_timer_gen_;
  frame_timer_.cancel();
  socket_.shutdown(tcp::socket::shutdown_both, ignored);
  socket_.close(ignored);
  // A closed connection may outlive its close (handlers, maps holding it):
  // its buffers must not.
  decoder_.Release();
  // The socket is closed: no write touches the dropped frames' memory any more.
  const Status dropped_why =
      reason.ok() ? Unavailable("connection " + options_.name + " closed") : reason;
  for (Outgoing& out : dropped) {
    if (out.on_done) out.on_done(dropped_why);
  }
  if (reason.ok()) {
    LOG_DEBUG << "connection " << options_.name << " closed";
  } else if (reason.code() == StatusCode::kCancelled ||
             (reason.code() == StatusCode::kUnavailable &&
              reason.message() == kPeerClosedMessage)) {
    // Closed on purpose by this side, or an orderly close by the peer at a
    // frame boundary: whether that is a problem is the owner's to say.
    LOG_INFO << "closing connection " << options_.name << ": " << reason.ToString();
  } else {
    LOG_WARNING << "closing connection " << options_.name << ": " << reason.ToString();
  }
  if (on_close_) on_close_(reason);
}

Status FramedConnection::WaitClosed(Deadline deadline) {
  std::unique_lock lock(mutex_);
  if (!cv_.wait_until(lock, deadline.at, [&] { return closed_; })) {
    return DeadlineExceeded("connection " + options_.name + " still open at the deadline");
  }
  return close_reason_;
}

bool FramedConnection::closed() const {
  std::lock_guard lock(mutex_);
  return closed_;
}

Status FramedConnection::close_reason() const {
  std::lock_guard lock(mutex_);
  return close_reason_;
}

size_t FramedConnection::queued_frames() const {
  std::lock_guard lock(mutex_);
  return send_queue_.size();
}

// ---------------------------------------------------------------------------

struct FramedServer::State {
  explicit State(IoThread& io) : io(io), acceptor(io.context()) {}
  IoThread& io;
  tcp::acceptor acceptor;  // io thread after Listen returns
  ConnectionOptions options;
  ServerLimits limits;
  AcceptHandler on_accept;
  std::atomic<uint64_t> refused{0};
  std::mutex mutex;
  bool stopped = false;  // guarded by mutex
  struct Accepted {
    std::weak_ptr<FramedConnection> conn;
    bool foreign = false;  // from another local user (preauth_slots.h)
  };
  std::vector<Accepted> accepted;  // guarded by mutex; in accept order
  int next_id = 0;                 // io thread only
};

namespace {

void AcceptLoop(const std::shared_ptr<FramedServer::State>& state);

}  // namespace

Result<std::unique_ptr<FramedServer>> FramedServer::Listen(IoThread& io, const std::string& host,
                                                           uint16_t port, ConnectionOptions options,
                                                           AcceptHandler on_accept,
                                                           ServerLimits limits) {
  boost::system::error_code ec;
  auto address = asio::ip::make_address(host, ec);
  if (ec) return InvalidArgument("listen address '" + host + "' is not an IP address");
  auto state = std::make_shared<State>(io);
  state->options = std::move(options);
  state->on_accept = std::move(on_accept);
  state->limits = limits;
  tcp::endpoint endpoint(address, port);
  state->acceptor.open(endpoint.protocol(), ec);
  if (!ec) state->acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) state->acceptor.bind(endpoint, ec);
  if (!ec) state->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return FromAsio(ec, "listening on " + host + ":" + std::to_string(port));
  uint16_t bound = state->acceptor.local_endpoint(ec).port();
  asio::post(io.context(), [state] { AcceptLoop(state); });
  return std::unique_ptr<FramedServer>(new FramedServer(io, state, bound));
}

namespace {

void AcceptLoop(const std::shared_ptr<FramedServer::State>& state) {
  state->acceptor.async_accept([state](const boost::system::error_code& ec, tcp::socket socket) {
    if (ec) {
      if (ec != asio::error::operation_aborted) {
        LOG_WARNING << "accept on " << state->options.name << ": " << ec.message();
        AcceptLoop(state);
      }
      return;
    }
    ConnectionOptions options = state->options;
    options.name += "#" + std::to_string(state->next_id++);
    // Asked before the lock: one netlink round trip to the local kernel.
    const bool foreign =
        options.require_authentication && FromOtherLocalUser(socket.native_handle());
    std::vector<std::shared_ptr<FramedConnection>> evicted;
    {
      std::lock_guard lock(state->mutex);
      if (state->stopped) return;  // the socket closes on destruction
      std::erase_if(state->accepted, [](const auto& a) {
        auto c = a.conn.lock();
        return !c || c->closed();
      });
      if (state->accepted.size() >= state->limits.max_connections) {
        // Refused before anything is allocated for it; the peer sees a close.
        const uint64_t n = ++state->refused;
        if (n <= 10 || n % 1000 == 0) {
          LOG_WARNING << "refusing connection " << options.name << ": " << state->accepted.size()
                      << " open connections (" << n << " refused so far)";
        }
        boost::system::error_code ignored;
        socket.close(ignored);
        AcceptLoop(state);
        return;
      }
      // Pre-auth slots full: the oldest unauthenticated connection makes
      // room, another local user's only among its own kind (preauth_slots.h),
      // so silent connections cannot lock peers out.
      if (options.require_authentication) {
        const PreAuthAdmission admission = AdmitStranger(
            state->accepted, state->limits.max_unauthenticated, foreign,
            [](const FramedServer::State::Accepted& a) {
              auto c = a.conn.lock();
              return c && !c->authenticated();
            },
            [](const FramedServer::State::Accepted& a) { return a.foreign; });
        for (size_t i : admission.evict) {
          if (auto c = state->accepted[i].conn.lock()) evicted.push_back(std::move(c));
        }
        const size_t refused = evicted.size() + (admission.admit ? 0 : 1);
        const uint64_t n = state->refused += refused;
        if (refused > 0 && (n <= 10 || n % 1000 < refused)) {
          LOG_WARNING << "accepting " << options.name << ": " << state->limits.max_unauthenticated
                      << " unauthenticated connections, "
                      << (admission.admit ? "evicting the oldest" : "refusing another local user's")
                      << " (" << n << " refused so far)";
        }
        if (!admission.admit) {
          boost::system::error_code ignored;
          socket.close(ignored);
          AcceptLoop(state);
          return;
        }
      }
    }
    for (auto& c : evicted) {
      c->Close(ResourceExhausted("evicted: the port's pre-authentication slots are full"));
    }
    auto conn = FramedConnection::Adopt(state->io, std::move(socket), options);
    {
      std::lock_guard lock(state->mutex);
      state->accepted.push_back({conn, foreign});
    }
    state->on_accept(conn);
    AcceptLoop(state);
  });
}

}  // namespace

FramedServer::~FramedServer() { Stop(); }

uint64_t FramedServer::refused_connections() const { return state_->refused.load(); }

void FramedServer::Stop() {
  std::vector<State::Accepted> accepted;
  {
    std::lock_guard lock(state_->mutex);
    if (state_->stopped) return;
    state_->stopped = true;
    accepted.swap(state_->accepted);
  }
  auto closed = std::make_shared<std::promise<void>>();
  auto future = closed->get_future();
  asio::post(io_.context(), [state = state_, closed] {
    boost::system::error_code ignored;
    state->acceptor.close(ignored);
    closed->set_value();
  });
  if (!io_.InThisThread() && !io_.context().stopped()) future.wait_for(std::chrono::seconds(5));
  for (auto& a : accepted) {
    if (auto c = a.conn.lock()) c->Close(Cancelled("server stopped"));
  }
}

}  // namespace kvrelay::protocols
