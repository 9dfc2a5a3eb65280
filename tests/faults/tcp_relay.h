// A TCP relay the test controls, placed on a KV data path: it listens on one
// address and forwards every connection, both ways, to a target. Cut() drops
// every connection through it at once (and refuses new ones until Restore());
// CorruptNext() flips one byte in the middle of the payload of the next large
// KV data frame going towards the target (the relay follows the framing of
// protocols/frame_codec.h in that direction, so the byte is KV data, not a
// header: what a checksum, not the framing, has to catch).
// Plain sockets and poll(): each connection has a pump thread; Stop() (and
// the destructor) closes everything and joins every thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"

namespace kvrelay::faults {

class TcpRelay {
 public:
  // Listens on listen_host:listen_port (0 = any) and forwards to target.
  static Result<std::unique_ptr<TcpRelay>> Start(const std::string& listen_host,
                                                 uint16_t listen_port,
                                                 const std::string& target_host,
                                                 uint16_t target_port);
  ~TcpRelay() { Stop(); }
  TcpRelay(const TcpRelay&) = delete;
  TcpRelay& operator=(const TcpRelay&) = delete;

  uint16_t port() const { return port_; }
  void Cut();      // close every relayed connection; refuse new ones
  void Restore();  // accept and relay again
  // A cut without a reset (a link that goes quiet, a middlebox that lost the
  // flow): every connection open now stops forwarding in both directions and
  // is never closed (until Stop); connections made later are relayed normally.
  void Blackhole() { epoch_.fetch_add(1); }
  void CorruptNext() { corrupt_.store(true); }
  // Bytes forwarded towards the target so far; connections cut so far.
  uint64_t forwarded() const { return forwarded_.load(); }
  int cuts() const { return cuts_.load(); }
  // True once an armed corruption was applied.
  bool corrupted() const { return corrupted_.load(); }
  void Stop();

 private:
  TcpRelay() = default;
  void AcceptLoop();
  void Pump(int client, int server, uint64_t generation, uint64_t epoch);
  // Follows the frames in `data` (towards the target) and applies an armed
  // corruption inside a large kKvData payload.
  struct FrameCursor {
    unsigned char header[12];
    size_t header_have = 0;
    uint64_t payload_left = 0;
    uint64_t payload_len = 0;
    bool target = false;  // this frame's payload gets the flip
  };
  void Inspect(FrameCursor& cur, char* data, size_t n);

  int listen_fd_ = -1;
  uint16_t port_ = 0;
  std::string target_host_;
  uint16_t target_port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<bool> cut_{false};
  std::atomic<uint64_t> generation_{0};  // bumped by Cut: pumps of older generations end
  std::atomic<uint64_t> epoch_{0};       // bumped by Blackhole: pumps of older epochs go silent
  std::atomic<bool> corrupt_{false};
  std::atomic<bool> corrupted_{false};
  std::atomic<uint64_t> forwarded_{0};
  std::atomic<int> cuts_{0};
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<std::thread> pumps_;  // guarded by mu_
};

}  // namespace kvrelay::faults
