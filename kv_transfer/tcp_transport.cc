#include "kv_transfer/tcp_transport.h"

#include <pthread.h>

#include <cstring>

#include "common/logging.h"

namespace kvrelay::kv_transfer {
namespace {

using protocols::Frame;
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

// Hello payload: the connecting endpoint's rank and world size.
struct HelloPayload {
  uint32_t rank;
  uint32_t world_size;
};

std::string MakeFrame(MessageType type, const ChunkHeader& h, size_t data_bytes) {
  std::string frame(kFrameHeaderBytes + kChunkHeaderBytes + data_bytes, '\0');
  protocols::EncodeFrameHeader(static_cast<uint16_t>(type),
                               static_cast<uint32_t>(kChunkHeaderBytes + data_bytes),
                               reinterpret_cast<uint8_t*>(frame.data()));
  std::memcpy(frame.data() + kFrameHeaderBytes, &h, sizeof(h));
  return frame;
}

}  // namespace

Result<std::unique_ptr<TcpTransport>> TcpTransport::Create(Options options) {
  if (options.rank < 0 || options.rank >= options.world_size) {
    return InvalidArgument("tcp transport: rank " + std::to_string(options.rank) +
                           " outside [0, world_size " + std::to_string(options.world_size) + ")");
  }
  if (options.chunk_bytes == 0 || options.chunk_bytes > (64u << 20)) {
    return InvalidArgument("tcp transport: chunk_bytes must be in (0, 64 MiB]");
  }
  auto t = std::unique_ptr<TcpTransport>(new TcpTransport(options));
  protocols::ConnectionOptions copts;
  copts.name = "kv-data-in@" + std::to_string(options.rank);
  copts.max_payload_bytes = static_cast<uint32_t>(options.chunk_bytes + kChunkHeaderBytes);
  copts.read_chunk_bytes = 256 << 10;
  TcpTransport* raw = t.get();
  auto server = protocols::FramedServer::Listen(
      t->io_, options.listen_host, options.listen_port, copts,
      [raw](std::shared_ptr<FramedConnection> conn) { raw->OnAccept(std::move(conn)); });
  if (!server.ok()) return server.status().WithContext("tcp transport");
  t->server_ = std::move(server).value();
  t->port_ = t->server_->port();
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
      io_("kv-tcp-io") {}

TcpTransport::~TcpTransport() { Shutdown(); }

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
  if (sender_.joinable()) sender_.join();
  for (auto& [peer, c] : conns) c->Close(Cancelled("tcp transport shut down"));
  if (server_) server_->Stop();
  io_.Stop();
}

void TcpTransport::OnAccept(std::shared_ptr<FramedConnection> conn) {
  // Rank of the peer on this connection, learned from its hello (io thread only).
  auto peer = std::make_shared<int>(-1);
  std::weak_ptr<FramedConnection> weak = conn;
  conn->Start(
      [this, peer, weak](Frame frame) {
        auto fail = [&](const std::string& why) {
          if (auto c = weak.lock()) c->Close(InvalidArgument(why));
        };
        if (*peer < 0) {
          HelloPayload hello{};
          if (frame.type != static_cast<uint16_t>(MessageType::kHello) ||
              frame.payload.size() != sizeof(hello)) {
            return fail("kv data connection: first frame is not a hello");
          }
          std::memcpy(&hello, frame.payload.data(), sizeof(hello));
          if (hello.world_size != static_cast<uint32_t>(options_.world_size) ||
              hello.rank >= hello.world_size || hello.rank == static_cast<uint32_t>(rank())) {
            return fail("kv data connection: hello from rank " + std::to_string(hello.rank) +
                        " of world " + std::to_string(hello.world_size) + " does not fit world " +
                        std::to_string(options_.world_size));
          }
          *peer = static_cast<int>(hello.rank);
          std::lock_guard lock(domain_->mu);
          PeerBackLocked(*peer);
          return;
        }
        ChunkHeader h{};
        if (frame.payload.size() < kChunkHeaderBytes) {
          return fail("kv data frame shorter than its chunk header");
        }
        std::memcpy(&h, frame.payload.data(), sizeof(h));
        const size_t len = frame.payload.size() - kChunkHeaderBytes;
        TransferKey key{*peer, h.request_id, h.tag};
        std::lock_guard lock(domain_->mu);
        if (frame.type == static_cast<uint16_t>(MessageType::kKvAbort)) {
          AbortLocked(key, Cancelled(KeyString(key) + ": the sender cancelled"));
          return;
        }
        if (frame.type != static_cast<uint16_t>(MessageType::kKvData) || h.offset > h.total ||
            len > h.total - h.offset) {
          return fail("kv data frame with type " + std::to_string(frame.type) + " offset " +
                      std::to_string(h.offset) + " len " + std::to_string(len) + " total " +
                      std::to_string(h.total));
        }
        DeliverLocked(key, h.offset, h.total,
                      reinterpret_cast<const uint8_t*>(frame.payload.data()) + kChunkHeaderBytes,
                      len);
      },
      [this, peer](const Status& why) {
        if (*peer < 0) return;
        std::lock_guard lock(domain_->mu);
        if (stopping_) return;
        PeerLostLocked(*peer, Unavailable("data connection from peer " + std::to_string(*peer) +
                                          " closed: " + why.ToString()));
      });
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
  ASSIGN_OR_RETURN(auto conn, FramedConnection::Connect(io_, host, port, copts, deadline));
  HelloPayload hello{static_cast<uint32_t>(rank()), static_cast<uint32_t>(world_size())};
  RETURN_IF_ERROR(conn->Send(
      MessageType::kHello, std::string_view(reinterpret_cast<const char*>(&hello), sizeof(hello))));
  std::weak_ptr<FramedConnection> weak = conn;
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

void TcpTransport::CancelLocked(const OpPtr& op, std::unique_lock<std::mutex>& lock) {
  if (!op->is_send) {
    TransportBase::CancelLocked(op, lock);
    return;
  }
  // Queued: drop it. Being sent: the sender thread sees cancel_requested at
  // its next chunk (it only touches the buffers under the lock) and sends an abort.
  std::erase(send_queue_, op);
}

void TcpTransport::SenderLoop() {
  std::unique_lock lock(domain_->mu);
  for (;;) {
    domain_->cv.wait(lock, [&] { return stopping_ || !send_queue_.empty(); });
    if (stopping_) return;
    OpPtr op = send_queue_.front();
    send_queue_.pop_front();
    auto conn_it = out_conns_.find(op->key.peer);
    if (conn_it == out_conns_.end()) {
      CompleteLocked(op, Unavailable("no data connection to peer " + std::to_string(op->key.peer)));
      continue;
    }
    std::shared_ptr<FramedConnection> conn = conn_it->second;
    ChunkHeader h{op->key.request_id, op->key.tag, 0, 0, op->total};
    RegionCursor cursor;
    size_t offset = 0;
    while (true) {
      if (op->cancel_requested || op->done || stopping_) {
        if (offset > 0) {
          lock.unlock();
          (void)conn->SendEncoded(MakeFrame(MessageType::kKvAbort, h, 0));
          lock.lock();
        }
        break;
      }
      const size_t n = std::min(options_.chunk_bytes, op->total - offset);
      h.offset = offset;
      std::string frame = MakeFrame(MessageType::kKvData, h, n);
      GatherFrom(op->regions, &cursor,
                 reinterpret_cast<uint8_t*>(frame.data()) + kFrameHeaderBytes + kChunkHeaderBytes,
                 n);
      offset += n;
      const bool last = offset == op->total;
      // Every byte is copied out: the caller's buffers are free.
      if (last) CompleteLocked(op, Status::Ok());
      lock.unlock();
      Status st = conn->SendEncodedWait(std::move(frame), Deadline::After(options_.stall_timeout));
      lock.lock();
      if (!st.ok()) {
        CompleteLocked(op, st.WithContext("tcp send " + KeyString(op->key)));
        break;
      }
      if (last) break;
    }
  }
}

}  // namespace kvrelay::kv_transfer
