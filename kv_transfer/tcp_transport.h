// TCP backend over Boost.Asio. Each endpoint listens on its own data port
// (never the control plane's) and opens one outgoing data connection per
// peer it sends to; the first frame on a connection names the sender's rank.
//
// A send is cut into kKvData frames (header: request, tag, offset, total) of
// at most chunk_bytes, copied out of the caller's buffers under the
// transport's mutex by the sender thread and queued with back-pressure
// (send_queue_frames), so the caller's buffers are released as soon as the
// last chunk is copied. A cancelled send emits kKvAbort. Receives scatter
// arriving frames into the caller's buffers under the same mutex, so Cancel
// ends every buffer access. A closed incoming connection fails every
// unfinished receive from that peer at once (peer death never hangs).
//
// Threads: one io thread ("kv-tcp-io") and one sender thread
// ("kv-tcp-send"), both joined by Shutdown()/destructor.
#pragma once

#include <memory>
#include <string>
#include <thread>
#include <unordered_map>

#include "kv_transfer/transport_base.h"
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
    size_t chunk_bytes = 1 << 20;
    size_t send_queue_frames = 8;  // per connection: bounds buffered send memory
    int max_inflight = 4096;
    int64_t max_unexpected_bytes = 1ll << 30;
    // A send that cannot queue a chunk for this long fails (peer not reading).
    std::chrono::milliseconds stall_timeout{30000};
  };
  static Result<std::unique_ptr<TcpTransport>> Create(Options options);
  ~TcpTransport() override;

  uint16_t port() const { return port_; }
  // Opens the data connection for sends to `peer`, listening at host:port,
  // retrying with backoff until `deadline`.
  Status ConnectPeer(int peer, const std::string& host, uint16_t port, Deadline deadline);
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
  void SenderLoop();
  void OnAccept(std::shared_ptr<protocols::FramedConnection> conn);

  Options options_;
  protocols::IoThread io_;
  std::unique_ptr<protocols::FramedServer> server_;
  uint16_t port_ = 0;
  std::thread sender_;
  // Guarded by domain_->mu.
  bool stopping_ = false;
  std::unordered_map<int, std::shared_ptr<protocols::FramedConnection>> out_conns_;
  std::deque<OpPtr> send_queue_;
};

}  // namespace kvrelay::kv_transfer
