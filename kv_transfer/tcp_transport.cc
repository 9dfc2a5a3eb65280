#include "kv_transfer/tcp_transport.h"

#include <pthread.h>

#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <charconv>
#include <cstring>
#include <future>

#include "common/logging.h"
#include "protocols/peer_handshake.h"
#include "protocols/preauth_slots.h"

namespace kvrelay::kv_transfer {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using protocols::FramedConnection;
using protocols::kFrameHeaderBytes;
using protocols::MessageType;

// Payload header of kKvData / kKvAbort frames.
struct ChunkHeader {
  uint64_t request_id;
  uint32_t tag;
  uint32_t reserved;
  uint64_t offset;
  uint64_t total;
};
static_assert(sizeof(ChunkHeader) == 32);
constexpr size_t kChunkHeaderBytes = sizeof(ChunkHeader);

// Hello payload: the connecting endpoint's rank and world size. Sent after
// authentication; the rank must be the one authenticated (KvAuthName).
struct HelloPayload {
  uint32_t rank;
  uint32_t world_size;
};

std::string KvAuthName(uint32_t rank) { return "kv-rank-" + std::to_string(rank); }

}  // namespace

std::string TcpTransport::AuthName(int rank) { return KvAuthName(static_cast<uint32_t>(rank)); }

namespace {

// Op::backend_state of a receive: a chunk read into its regions is in
// flight. Of a send: the number of its frames queued and not yet written.
constexpr int kBound = 1;
// Largest chunk any endpoint may send (Create's bound on chunk_bytes), so
// endpoints with different chunk_bytes interoperate.
constexpr size_t kMaxChunkBytes = size_t{64} << 20;
// Frames that no posted receive is waiting for are read in pieces of this size.
constexpr size_t kScratchBytes = 256 << 10;

// Frame header + chunk header of a kKvData / kKvAbort frame carrying `data_bytes`.
std::string EncodeHead(MessageType type, const ChunkHeader& h, size_t data_bytes) {
  std::string head(kFrameHeaderBytes + kChunkHeaderBytes, '\0');
  protocols::EncodeFrameHeader(static_cast<uint16_t>(type),
                               static_cast<uint32_t>(kChunkHeaderBytes + data_bytes),
                               reinterpret_cast<uint8_t*>(head.data()));
  std::memcpy(head.data() + kFrameHeaderBytes, &h, sizeof(h));
  return head;
}

}  // namespace

// One accepted data connection. Its socket and read state are touched on the
// io thread only; the transport state under the transport's mutex.
class TcpTransport::Inbound : public std::enable_shared_from_this<Inbound> {
 public:
  Inbound(TcpTransport* t, tcp::socket socket, bool foreign)
      : t_(t),
        foreign_(foreign),
        socket_(std::move(socket)),
        auth_(t->options_.cluster_key, protocols::kAuthChannelKv),
        auth_timer_(socket_.get_executor()) {}

  void Start() {
    if (t_->options_.auth_timeout.count() > 0) {
      auth_timer_.expires_after(t_->options_.auth_timeout);
      auth_timer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
        if (ec || self->peer_ >= 0) return;
        self->Fail(DeadlineExceeded("kv data connection did not authenticate within " +
                                    std::to_string(self->t_->options_.auth_timeout.count()) +
                                    " ms"));
      });
    }
    ReadHeader();
  }
  // Io thread.
  bool closed() const { return closed_; }
  bool identified() const { return peer_ >= 0; }
  // From a process of another local user (protocols/preauth_slots.h).
  bool foreign() const { return foreign_; }
  // Any thread: closes the connection on the io thread (a read in flight is aborted).
  void Close(const Status& why) {
    asio::post(socket_.get_executor(), [self = shared_from_this(), why] { self->Fail(why); });
  }
  // Io thread.
  void Fail(const Status& why) {
    if (closed_) return;
    closed_ = true;
    boost::system::error_code ignored;
    auth_timer_.cancel();
    socket_.shutdown(tcp::socket::shutdown_both, ignored);
    socket_.close(ignored);
    std::vector<uint8_t>().swap(scratch_);
    std::lock_guard lock(t_->domain_->mu);
    // Only an identified peer's current connection speaks for that peer: an
    // unauthenticated connection, or one a reconnect replaced, closing says
    // nothing about the peer.
    if (t_->stopping_ || peer_ < 0) return;
    auto cur = t_->inbound_by_peer_.find(peer_);
    if (cur == t_->inbound_by_peer_.end() || cur->second.lock().get() != this) return;
    t_->inbound_by_peer_.erase(cur);
    t_->PeerLostLocked(peer_, Unavailable("data connection from peer " + std::to_string(peer_) +
                                          " closed: " + why.ToString()));
  }

 private:
  void OnReadError(const boost::system::error_code& ec) {
    if (closed_) return;
    Fail(ec == asio::error::eof ? Unavailable("peer closed the connection")
                                : Unavailable("read: " + ec.message()));
  }

  // Before the hello only a frame header; after it, frame + chunk header at once.
  void ReadHeader() {
    if (closed_) return;
    const size_t n = peer_ < 0 ? kFrameHeaderBytes : kFrameHeaderBytes + kChunkHeaderBytes;
    asio::async_read(socket_, asio::buffer(head_, n),
                     [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                       if (ec) return self->OnReadError(ec);
                       self->OnHeader();
                     });
  }

  // Authentication frames: read whole (they are small), answered in turn.
  void OnAuthHeader(const protocols::FrameHeader& fh) {
    const auto type = static_cast<MessageType>(fh.type);
    if (type != MessageType::kAuthHello && type != MessageType::kAuthProof) {
      return Refuse(FailedPrecondition(
          "authentication failed: kv data connection sent frame type " + std::to_string(fh.type) +
          " before the cluster-key challenge-response"));
    }
    auth_frame_.type = fh.type;
    auth_frame_.payload.assign(fh.length, '\0');
    asio::async_read(socket_, asio::buffer(auth_frame_.payload),
                     [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                       if (ec) return self->OnReadError(ec);
                       self->OnAuthFrame();
                     });
  }

  void OnAuthFrame() {
    const bool hello = auth_frame_.type == static_cast<uint16_t>(MessageType::kAuthHello);
    auto reply = hello ? auth_.OnHello(auth_frame_) : auth_.OnProof(auth_frame_);
    auth_frame_ = protocols::Frame{};
    if (!reply.ok()) return Refuse(reply.status());
    WriteFrame(hello ? MessageType::kAuthChallenge : MessageType::kAuthProof, *reply,
               [self = shared_from_this()] { self->ReadHeader(); });
  }

  void CountOversized() {
    std::lock_guard lock(t_->domain_->mu);
    ++t_->oversized_frames_;
  }

  // Sends the refusal, then closes.
  void Refuse(const Status& why) {
    {
      std::lock_guard lock(t_->domain_->mu);
      ++t_->auth_failures_;
    }
    LOG_WARNING << "tcp transport: refusing a data connection: " << why.message();
    WriteFrame(MessageType::kAuthProof,
               protocols::AuthResponder::RefusalPayload("authentication failed"),
               [self = shared_from_this(), why] { self->Fail(why); });
  }

  template <typename Then>
  void WriteFrame(MessageType type, const std::string& payload, Then then) {
    out_.assign(kFrameHeaderBytes + payload.size(), '\0');
    protocols::EncodeFrameHeader(static_cast<uint16_t>(type), static_cast<uint32_t>(payload.size()),
                                 reinterpret_cast<uint8_t*>(out_.data()));
    std::memcpy(out_.data() + kFrameHeaderBytes, payload.data(), payload.size());
    asio::async_write(
        socket_, asio::buffer(out_),
        [self = shared_from_this(), then](const boost::system::error_code& ec, size_t) {
          if (ec) return self->OnReadError(ec);
          then();
        });
  }

  void OnHeader() {
    if (closed_) return;
    // Before authentication only tiny frames are accepted, so a stranger can
    // make this connection hold at most kMaxUnauthenticatedPayload bytes.
    const size_t max_payload = auth_.authenticated() ? kChunkHeaderBytes + kMaxChunkBytes
                                                     : protocols::kMaxUnauthenticatedPayload;
    auto fh = protocols::ParseFrameHeader(
        std::span<const uint8_t, kFrameHeaderBytes>(head_, kFrameHeaderBytes),
        static_cast<uint32_t>(max_payload));
    if (!fh.ok()) {
      if (fh.status().code() == StatusCode::kResourceExhausted) CountOversized();
      if (!auth_.authenticated()) return Refuse(fh.status().WithContext("unauthenticated frame"));
      return Fail(fh.status().WithContext("bad kv data frame"));
    }
    if (!auth_.authenticated()) return OnAuthHeader(*fh);
    if (peer_ < 0) {
      if (fh->type != static_cast<uint16_t>(MessageType::kHello) ||
          fh->length != sizeof(HelloPayload)) {
        return Fail(InvalidArgument("kv data connection: first frame is not a hello"));
      }
      asio::async_read(socket_, asio::buffer(&hello_, sizeof(hello_)),
                       [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                         if (ec) return self->OnReadError(ec);
                         self->OnHello();
                       });
      return;
    }
    if (fh->length < kChunkHeaderBytes) {
      return Fail(InvalidArgument("kv data frame shorter than its chunk header"));
    }
    ChunkHeader h{};
    std::memcpy(&h, head_ + kFrameHeaderBytes, sizeof(h));
    const size_t len = fh->length - kChunkHeaderBytes;
    key_ = TransferKey{peer_, h.request_id, h.tag};
    if (fh->type == static_cast<uint16_t>(MessageType::kKvAbort) && len == 0) {
      {
        std::lock_guard lock(t_->domain_->mu);
        t_->AbortLocked(key_, Cancelled(KeyString(key_) + ": the sender cancelled"));
      }
      return ReadHeader();
    }
    if (h.total > t_->options_.max_transfer_bytes) CountOversized();
    if (fh->type != static_cast<uint16_t>(MessageType::kKvData) || h.offset > h.total ||
        len > h.total - h.offset || h.total > t_->options_.max_transfer_bytes) {
      return Fail(InvalidArgument("kv data frame with type " + std::to_string(fh->type) +
                                  " offset " + std::to_string(h.offset) + " len " +
                                  std::to_string(len) + " total " + std::to_string(h.total) +
                                  " (max transfer " +
                                  std::to_string(t_->options_.max_transfer_bytes) + ")"));
    }
    offset_ = h.offset;
    total_ = h.total;
    remaining_ = len;
    {
      std::lock_guard lock(t_->domain_->mu);
      OpPtr op = t_->PostedRecvLocked(key_);
      if (op && len > 0 && !op->done && !op->cancel_requested && op->backend_state == 0 &&
          op->total == h.total && op->received == h.offset) {
        // The next piece of a posted receive: read it straight into its regions.
        op->backend_state = kBound;
        pieces_.clear();
        TakePieces(op->regions, &op->cursor, len, &pieces_);
        t_->reading_[op->handle] = weak_from_this();
        bound_ = op;
      }
    }
    if (!bound_) return ReadScratch();
    read_buffers_.clear();
    for (const Region& r : pieces_) read_buffers_.push_back(asio::buffer(r.data, r.bytes));
    asio::async_read(socket_, read_buffers_,
                     [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                       self->OnDirectRead(ec);
                     });
  }

  void OnHello() {
    if (closed_) return;
    if (auth_.peer_name() != KvAuthName(hello_.rank)) {
      {
        std::lock_guard lock(t_->domain_->mu);
        ++t_->foreign_frames_;
      }
      return Fail(FailedPrecondition("kv data connection authenticated as '" +
                                     auth_.peer_name().substr(0, 64) + "' but says it is rank " +
                                     std::to_string(hello_.rank)));
    }
    if (hello_.world_size != static_cast<uint32_t>(t_->options_.world_size) ||
        hello_.rank >= hello_.world_size || hello_.rank == static_cast<uint32_t>(t_->rank())) {
      return Fail(InvalidArgument("kv data connection: hello from rank " +
                                  std::to_string(hello_.rank) + " of world " +
                                  std::to_string(hello_.world_size) + " does not fit world " +
                                  std::to_string(t_->options_.world_size)));
    }
    peer_ = static_cast<int>(hello_.rank);
    auth_timer_.cancel();
    std::shared_ptr<Inbound> replaced;
    {
      std::lock_guard lock(t_->domain_->mu);
      auto& cur = t_->inbound_by_peer_[peer_];
      replaced = cur.lock();
      cur = weak_from_this();
      t_->PeerBackLocked(peer_);
    }
    if (replaced && replaced.get() != this) {
      // The peer reconnected (restarted, or its old connection is half-dead):
      // the new connection is the peer now.
      LOG_INFO << "tcp transport: peer " << peer_ << " reconnected; closing its old connection";
      replaced->Fail(Unavailable("replaced by a new connection from the same peer"));
    }
    ReadHeader();
  }

  void OnDirectRead(const boost::system::error_code& ec) {
    OpPtr op = std::move(bound_);
    bound_.reset();
    {
      std::lock_guard lock(t_->domain_->mu);
      op->backend_state = 0;
      t_->reading_.erase(op->handle);
      if (ec) {
        t_->CompleteLocked(
            op, Unavailable("data connection from peer " + std::to_string(peer_) +
                            " broke inside a chunk of " + KeyString(key_) + ": " + ec.message()));
      } else {
        op->received += remaining_;
        if (op->received == op->total) t_->CompleteLocked(op, Status::Ok());
      }
      t_->domain_->cv.notify_all();  // a Cancel may wait for the unbinding
    }
    if (ec) return OnReadError(ec);
    ReadHeader();
  }

  void ReadScratch() {
    if (closed_) return;
    const size_t n = std::min(remaining_, kScratchBytes);
    scratch_.resize(n);
    asio::async_read(socket_, asio::buffer(scratch_.data(), n),
                     [self = shared_from_this()](const boost::system::error_code& ec, size_t got) {
                       if (ec) return self->OnReadError(ec);
                       self->OnScratch(got);
                     });
  }

  void OnScratch(size_t n) {
    // A read that completed just before a Fail (queued behind it on this
    // thread) finds scratch_ released: the connection is gone, drop the bytes.
    if (closed_) return;
    bool clash = false;
    {
      std::lock_guard lock(t_->domain_->mu);
      OpPtr op = t_->PostedRecvLocked(key_);
      // Another connection of the same peer is writing this receive.
      clash = op && op->backend_state == kBound;
      if (!clash) t_->DeliverLocked(key_, offset_, total_, scratch_.data(), n);
    }
    if (clash) return Fail(DataLoss(KeyString(key_) + " arrived on two data connections at once"));
    offset_ += n;
    remaining_ -= n;
    if (remaining_ > 0) return ReadScratch();
    ReadHeader();
  }

  TcpTransport* const t_;
  const bool foreign_;
  tcp::socket socket_;
  bool closed_ = false;
  int peer_ = -1;  // learned from the hello
  uint8_t head_[kFrameHeaderBytes + kChunkHeaderBytes] = {};
  HelloPayload hello_{};
  protocols::AuthResponder auth_;
  asio::steady_timer auth_timer_;
  protocols::Frame auth_frame_;  // the authentication frame being read
  std::string out_;              // the authentication frame being written
  // The frame being read.
  TransferKey key_;
  size_t offset_ = 0, total_ = 0, remaining_ = 0;
  OpPtr bound_;  // receive whose regions the read in flight writes
  std::vector<Region> pieces_;
  std::vector<asio::mutable_buffer> read_buffers_;
  std::vector<uint8_t> scratch_;
};

Result<std::unique_ptr<TcpTransport>> TcpTransport::Create(Options options) {
  if (options.rank < 0 || options.rank >= options.world_size) {
    return InvalidArgument("tcp transport: rank " + std::to_string(options.rank) +
                           " outside [0, world_size " + std::to_string(options.world_size) + ")");
  }
  if (options.chunk_bytes == 0 || options.chunk_bytes > kMaxChunkBytes) {
    return InvalidArgument("tcp transport: chunk_bytes must be in (0, 64 MiB]");
  }
  if (options.cluster_key.empty()) {
    return InvalidArgument(
        "tcp transport: cluster_key is required (every data connection proves it)");
  }
  auto t = std::unique_ptr<TcpTransport>(new TcpTransport(options));
  boost::system::error_code ec;
  auto address = asio::ip::make_address(options.listen_host, ec);
  if (ec) {
    return InvalidArgument("tcp transport: listen address '" + options.listen_host +
                           "' is not an IP address");
  }
  if (address.is_unspecified() && options.advertise_host.empty()) {
    return InvalidArgument("tcp transport: listening on the wildcard address '" +
                           options.listen_host +
                           "' needs an advertise host (the address peers dial)");
  }
  tcp::endpoint endpoint(address, options.listen_port);
  t->acceptor_ = std::make_unique<tcp::acceptor>(t->io_.context());
  t->acceptor_->open(endpoint.protocol(), ec);
  if (!ec) t->acceptor_->set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) t->acceptor_->bind(endpoint, ec);
  if (!ec) t->acceptor_->listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return Unavailable("tcp transport: listening on " + options.listen_host + ":" +
                       std::to_string(options.listen_port) + ": " + ec.message());
  }
  t->port_ = t->acceptor_->local_endpoint(ec).port();
  TcpTransport* raw = t.get();
  asio::post(t->io_.context(), [raw] { raw->AcceptLoop(); });
  t->sender_ = std::thread([raw] {
    pthread_setname_np(pthread_self(), "kv-tcp-send");
    raw->SenderLoop();
  });
  return t;
}

TcpTransport::TcpTransport(Options options)
    : TransportBase(std::make_shared<SyncDomain>(), options.max_inflight,
                    options.max_unexpected_bytes),
      options_(std::move(options)),
      io_("kv-tcp-io") {
  set_max_unexpected_age(options_.max_unexpected_age);
}

uint64_t TcpTransport::refused_connections() const {
  std::lock_guard lock(domain_->mu);
  return refused_connections_;
}

uint64_t TcpTransport::auth_failures() const {
  std::lock_guard lock(domain_->mu);
  return auth_failures_;
}

protocols::PortSecurityCounters TcpTransport::security_counters() const {
  std::lock_guard lock(domain_->mu);
  return {auth_failures_, refused_connections_, oversized_frames_, foreign_frames_};
}

TcpTransport::~TcpTransport() { Shutdown(); }

void TcpTransport::AcceptLoop() {
  acceptor_->async_accept([this](const boost::system::error_code& ec, tcp::socket socket) {
    if (ec) {
      if (ec != asio::error::operation_aborted) {
        LOG_WARNING << "tcp transport: accept: " << ec.message();
        AcceptLoop();
      }
      return;
    }
    boost::system::error_code ignored;
    socket.set_option(tcp::no_delay(true), ignored);
    if (options_.socket_buffer_bytes > 0) {
      socket.set_option(asio::socket_base::receive_buffer_size(options_.socket_buffer_bytes),
                        ignored);
    }
    // Asked before the lock: one netlink round trip to the local kernel.
    const bool foreign = protocols::FromOtherLocalUser(socket.native_handle());
    std::vector<std::shared_ptr<Inbound>> evicted;
    {
      std::lock_guard lock(domain_->mu);
      if (stopping_) return;  // the socket closes on destruction
      // Io thread: Inbound::closed()/identified() are safe to read here.
      std::erase_if(inbound_, [](const auto& w) {
        auto in = w.lock();
        return !in || in->closed();
      });
      if (inbound_.size() >= options_.max_connections) {
        const uint64_t n = ++refused_connections_;
        if (n <= 10 || n % 1000 == 0) {
          LOG_WARNING << "tcp transport: refusing a data connection (" << inbound_.size()
                      << " open; " << n << " refused)";
        }
        socket.close(ignored);
        AcceptLoop();
        return;
      }
      // Pre-auth slots full: the oldest stranger makes room, another local
      // user's only among its own kind (protocols/preauth_slots.h), so silent
      // connections cannot lock a peer out.
      const protocols::PreAuthAdmission admission = protocols::AdmitStranger(
          inbound_, options_.max_unauthenticated, foreign,
          [](const std::weak_ptr<Inbound>& w) {
            auto in = w.lock();
            return in && !in->identified();
          },
          [](const std::weak_ptr<Inbound>& w) {
            auto in = w.lock();
            return in && in->foreign();
          });
      for (size_t i : admission.evict) {
        if (auto in = inbound_[i].lock()) evicted.push_back(std::move(in));
      }
      const uint64_t n = refused_connections_ += evicted.size() + (admission.admit ? 0 : 1);
      if (n > 0 && (n <= 10 || n % 1000 < evicted.size() + 1) &&
          (!evicted.empty() || !admission.admit)) {
        LOG_WARNING << "tcp transport: " << options_.max_unauthenticated
                    << " unauthenticated data connections: "
                    << (admission.admit ? "evicting the oldest" : "refusing another local user's")
                    << " (" << n << " refused)";
      }
      if (!admission.admit) {
        socket.close(ignored);
        AcceptLoop();
        return;
      }
    }
    for (auto& in : evicted) {
      in->Fail(ResourceExhausted("evicted: the data port's pre-authentication slots are full"));
    }
    auto in = std::make_shared<Inbound>(this, std::move(socket), foreign);
    {
      std::lock_guard lock(domain_->mu);
      inbound_.push_back(in);
    }
    in->Start();
    AcceptLoop();
  });
}

void TcpTransport::Shutdown() {
  std::unordered_map<int, std::shared_ptr<FramedConnection>> conns;
  {
    std::lock_guard lock(domain_->mu);
    if (stopping_) return;
    stopping_ = true;
    conns.swap(out_conns_);
    for (auto& op : send_queue_) CompleteLocked(op, Cancelled("tcp transport shut down"));
    send_queue_.clear();
    domain_->cv.notify_all();
  }
  // Closing wakes a sender thread waiting for send-queue room.
  for (auto& [peer, c] : conns) c->Close(Cancelled("tcp transport shut down"));
  if (sender_.joinable()) sender_.join();
  std::vector<std::weak_ptr<Inbound>> inbound;
  {
    std::lock_guard lock(domain_->mu);
    inbound.swap(inbound_);
  }
  if (acceptor_ && !io_.context().stopped()) {
    std::promise<void> closed;
    auto done = closed.get_future();
    asio::post(io_.context(), [&] {
      boost::system::error_code ignored;
      acceptor_->close(ignored);
      for (auto& w : inbound) {
        if (auto in = w.lock()) in->Fail(Cancelled("tcp transport shut down"));
      }
      closed.set_value();
    });
    done.wait_for(std::chrono::seconds(5));
  }
  io_.Stop();
  // No thread can touch caller memory any more: fail what is left.
  std::lock_guard lock(domain_->mu);
  reading_.clear();
  FailAllLocked(Cancelled("tcp transport shut down"));
}

Status TcpTransport::ConnectPeer(int peer, const std::string& host, uint16_t port,
                                 Deadline deadline) {
  if (peer < 0 || peer >= options_.world_size || peer == rank()) {
    return InvalidArgument("tcp transport: cannot connect to peer " + std::to_string(peer));
  }
  protocols::ConnectionOptions copts;
  copts.name = "kv-data-out@" + std::to_string(rank()) + "->" + std::to_string(peer);
  copts.max_send_queue_frames = options_.send_queue_frames;
  copts.max_payload_bytes = static_cast<uint32_t>(options_.chunk_bytes + kChunkHeaderBytes);
  copts.require_authentication = true;  // a stranger on that port cannot make us buffer
  copts.auth_timeout = std::chrono::milliseconds(0);  // `deadline` bounds the handshake
  ASSIGN_OR_RETURN(auto conn, FramedConnection::Connect(io_, host, port, copts, deadline));
  RETURN_IF_ERROR(protocols::ClientAuthenticate(*conn, options_.cluster_key,
                                                protocols::kAuthChannelKv,
                                                KvAuthName(static_cast<uint32_t>(rank())), deadline)
                      .WithContext("kv data connection to peer " + std::to_string(peer)));
  conn->SetSocketBuffers(options_.socket_buffer_bytes);
  HelloPayload hello{static_cast<uint32_t>(rank()), static_cast<uint32_t>(world_size())};
  RETURN_IF_ERROR(conn->Send(
      MessageType::kHello, std::string_view(reinterpret_cast<const char*>(&hello), sizeof(hello))));
  std::lock_guard lock(domain_->mu);
  if (stopping_) {
    conn->Close(Cancelled("tcp transport shut down"));
    return Cancelled("tcp transport shut down");
  }
  if (auto old = out_conns_[peer]) old->Close(Cancelled("replaced by a new connection"));
  out_conns_[peer] = conn;
  PeerBackLocked(peer);
  return Status::Ok();
}

std::string TcpTransport::conn_info() const {
  const std::string& host =
      options_.advertise_host.empty() ? options_.listen_host : options_.advertise_host;
  return host + ":" + std::to_string(port_);
}

Status TcpTransport::ConnectPeer(int peer, std::string_view conn_info, Deadline deadline) {
  const size_t colon = conn_info.rfind(':');
  uint32_t port = 0;
  const char* end = conn_info.data() + conn_info.size();
  if (colon == std::string_view::npos || colon == 0 ||
      std::from_chars(conn_info.data() + colon + 1, end, port).ptr != end || port == 0 ||
      port > 65535) {
    return InvalidArgument("tcp transport: peer " + std::to_string(peer) + " connection info '" +
                           std::string(conn_info) + "' is not host:port");
  }
  {
    std::lock_guard lock(domain_->mu);
    auto it = out_conns_.find(peer);
    if (it != out_conns_.end() && !it->second->closed() && out_info_[peer] == conn_info) {
      return Status::Ok();
    }
  }
  RETURN_IF_ERROR(ConnectPeer(peer, std::string(conn_info.substr(0, colon)),
                              static_cast<uint16_t>(port), deadline));
  std::lock_guard lock(domain_->mu);
  out_info_[peer] = std::string(conn_info);
  return Status::Ok();
}

Status TcpTransport::StartSendLocked(const OpPtr& op, std::unique_lock<std::mutex>&) {
  if (stopping_) return Cancelled("tcp transport shut down");
  auto it = out_conns_.find(op->key.peer);
  if (it == out_conns_.end()) {
    return FailedPrecondition("tcp transport: no data connection to peer " +
                              std::to_string(op->key.peer) + " (call ConnectPeer first)");
  }
  if (it->second->closed()) {
    return Unavailable("tcp transport: data connection to peer " + std::to_string(op->key.peer) +
                       " is closed: " + it->second->close_reason().ToString());
  }
  send_queue_.push_back(op);
  domain_->cv.notify_all();
  return Status::Ok();
}

void TcpTransport::DrainBoundLocked(const OpPtr& op, std::unique_lock<std::mutex>& lock) {
  auto unbound = [&] { return op->backend_state == 0; };
  if (unbound()) return;
  if (domain_->cv.wait_for(lock, options_.cancel_drain_timeout, unbound)) return;
  // The peer is not reading (send) or not writing (receive): close the
  // connection, which aborts the socket operation touching the buffers.
  const Status why =
      Cancelled(KeyString(op->key) + ": a chunk did not drain within " +
                std::to_string(options_.cancel_drain_timeout.count()) + " ms of a cancel");
  LOG_WARNING << "tcp transport: " << why.ToString() << "; closing its connection";
  if (op->is_send) {
    auto it = out_conns_.find(op->key.peer);
    if (it != out_conns_.end()) it->second->Close(why);
  } else {
    auto it = reading_.find(op->handle);
    if (it != reading_.end()) {
      if (auto in = it->second.lock()) in->Close(why);
    }
  }
  if (!domain_->cv.wait_for(lock, std::chrono::seconds(10), unbound)) {
    LOG_ERROR << "tcp transport: " << KeyString(op->key)
              << " still bound to a socket operation after its connection was closed";
  }
}

void TcpTransport::CancelLocked(const OpPtr& op, std::unique_lock<std::mutex>& lock) {
  if (op->is_send && std::erase(send_queue_, op) > 0) return;  // never started
  // A chunk being read into / written from the buffers finishes (or its
  // connection is closed) before the buffers are released. A send being
  // queued stops at its next chunk (cancel_requested) and emits an abort.
  DrainBoundLocked(op, lock);
  if (!op->is_send) TransportBase::CancelLocked(op, lock);
}

void TcpTransport::AbandonPeerLocked(int peer, const Status& why,
                                     std::unique_lock<std::mutex>& lock) {
  std::erase_if(send_queue_, [&](const OpPtr& op) {
    if (op->key.peer != peer) return false;
    CompleteLocked(op, why);
    return true;
  });
  if (auto it = out_conns_.find(peer); it != out_conns_.end()) {
    it->second->Close(why);
    out_conns_.erase(it);
  }
  out_info_.erase(peer);
  if (auto it = inbound_by_peer_.find(peer); it != inbound_by_peer_.end()) {
    if (auto in = it->second.lock()) in->Close(why);
  }
  (void)domain_->cv.wait_for(lock, options_.cancel_drain_timeout,
                             [&] { return !AnyBoundLocked(peer); });
}

void TcpTransport::SenderLoop() {
  std::unique_lock lock(domain_->mu);
  for (;;) {
    domain_->cv.wait(lock, [&] { return stopping_ || !send_queue_.empty(); });
    if (stopping_) return;
    OpPtr op = send_queue_.front();
    send_queue_.pop_front();
    if (!op->done) SendOneLocked(op, lock);
  }
}

void TcpTransport::SendOneLocked(const OpPtr& op, std::unique_lock<std::mutex>& lock) {
  auto conn_it = out_conns_.find(op->key.peer);
  if (conn_it == out_conns_.end()) {
    CompleteLocked(op, Unavailable("no data connection to peer " + std::to_string(op->key.peer)));
    return;
  }
  std::shared_ptr<FramedConnection> conn = conn_it->second;
  ChunkHeader h{op->key.request_id, op->key.tag, 0, 0, op->total};
  RegionCursor cursor;
  size_t offset = 0;
  std::vector<Region> pieces;
  // Runs on the io thread when one frame was written (or dropped by a close).
  auto written = [this, op](bool last, const Status& s) {
    std::lock_guard l(domain_->mu);
    --op->backend_state;
    if (!s.ok() && op->backend_error.ok()) {
      op->backend_error = s.WithContext("tcp send " + KeyString(op->key));
    }
    if (op->backend_state == 0) {
      if (!op->backend_error.ok()) {
        CompleteLocked(op, op->backend_error);
      } else if (last) {
        CompleteLocked(op, Status::Ok());
      }
    }
    domain_->cv.notify_all();
  };
  while (offset < op->total) {
    if (op->cancel_requested || op->done || stopping_ || !op->backend_error.ok()) {
      if (op->cancel_requested && offset > 0) {
        h.offset = offset;
        lock.unlock();
        (void)conn->SendEncodedWait(EncodeHead(MessageType::kKvAbort, h, 0),
                                    Deadline::After(options_.stall_timeout));
        lock.lock();
      }
      if (op->backend_state == 0 && !op->backend_error.ok()) CompleteLocked(op, op->backend_error);
      return;
    }
    const size_t n = std::min(options_.chunk_bytes, op->total - offset);
    h.offset = offset;
    pieces.clear();
    TakePieces(op->regions, &cursor, n, &pieces);
    std::vector<asio::const_buffer> body;
    body.reserve(pieces.size());
    for (const Region& r : pieces) body.push_back(asio::buffer(r.data, r.bytes));
    offset += n;
    const bool last = offset == op->total;
    ++op->backend_state;
    lock.unlock();
    Status st = conn->SendGatherWait(
        EncodeHead(MessageType::kKvData, h, n), std::move(body),
        [written, last](const Status& s) { written(last, s); },
        Deadline::After(options_.stall_timeout));
    lock.lock();
    if (!st.ok()) {
      --op->backend_state;
      if (op->backend_error.ok())
        op->backend_error = st.WithContext("tcp send " + KeyString(op->key));
      if (op->backend_state == 0) CompleteLocked(op, op->backend_error);
      domain_->cv.notify_all();
      return;
    }
  }
}

}  // namespace kvrelay::kv_transfer
