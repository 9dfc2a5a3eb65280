#include "tests/faults/tcp_relay.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

namespace kvrelay::faults {
namespace {

// Closes with RST (SO_LINGER 0), as a link that fails does, not a clean FIN.
void Abort(int fd) {
  if (fd < 0) return;
  linger l{1, 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
  close(fd);
}

bool WriteAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

}  // namespace

Result<std::unique_ptr<TcpRelay>> TcpRelay::Start(const std::string& listen_host,
                                                  uint16_t listen_port,
                                                  const std::string& target_host,
                                                  uint16_t target_port) {
  std::unique_ptr<TcpRelay> r(new TcpRelay());
  r->target_host_ = target_host;
  r->target_port_ = target_port;
  r->listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (r->listen_fd_ < 0) return Unavailable("relay: socket failed");
  int one = 1;
  setsockopt(r->listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(listen_port);
  if (inet_pton(AF_INET, listen_host.c_str(), &addr.sin_addr) != 1) {
    return InvalidArgument("relay: bad listen host " + listen_host);
  }
  socklen_t len = sizeof addr;
  if (bind(r->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      listen(r->listen_fd_, 16) != 0 ||
      getsockname(r->listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    return Unavailable(std::string("relay: cannot listen on ") + listen_host + ": " +
                       std::strerror(errno));
  }
  r->port_ = ntohs(addr.sin_port);
  r->acceptor_ = std::thread([p = r.get()] { p->AcceptLoop(); });
  return r;
}

void TcpRelay::AcceptLoop() {
  while (!stop_.load()) {
    pollfd pfd{listen_fd_, POLLIN, 0};
    if (poll(&pfd, 1, 50) <= 0) continue;
    int client = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    if (cut_.load()) {
      Abort(client);
      continue;
    }
    int server = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(target_port_);
    inet_pton(AF_INET, target_host_.c_str(), &to.sin_addr);
    if (server < 0 || connect(server, reinterpret_cast<sockaddr*>(&to), sizeof to) != 0) {
      Abort(server);
      Abort(client);
      continue;
    }
    const uint64_t generation = generation_.load();
    const uint64_t epoch = epoch_.load();
    std::lock_guard lock(mu_);
    pumps_.emplace_back(
        [this, client, server, generation, epoch] { Pump(client, server, generation, epoch); });
  }
}

void TcpRelay::Pump(int client, int server, uint64_t generation, uint64_t epoch) {
  std::vector<char> buf(256 << 10);
  FrameCursor cursor;
  pollfd fds[2] = {{client, POLLIN, 0}, {server, POLLIN, 0}};
  while (!stop_.load() && generation_.load() == generation) {
    if (epoch_.load() != epoch) {
      // Black-holed: read nothing, write nothing, close nothing.
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    if (poll(fds, 2, 50) <= 0) continue;
    bool closed = false;
    for (int i = 0; i < 2 && !closed; ++i) {
      if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      ssize_t n = recv(fds[i].fd, buf.data(), buf.size(), 0);
      if (n <= 0) {
        closed = true;
        break;
      }
      if (i == 0) {
        Inspect(cursor, buf.data(), static_cast<size_t>(n));
        forwarded_.fetch_add(static_cast<uint64_t>(n));
      }
      if (!WriteAll(fds[1 - i].fd, buf.data(), static_cast<size_t>(n))) closed = true;
    }
    if (closed) break;
  }
  Abort(client);
  Abort(server);
}

void TcpRelay::Inspect(FrameCursor& cur, char* data, size_t n) {
  constexpr uint16_t kKvData = 100;  // protocols::MessageType::kKvData
  size_t at = 0;
  while (at < n) {
    if (cur.payload_left == 0) {
      // In a header: [magic u32][version u16][type u16][length u32], little endian.
      const size_t take = std::min(n - at, sizeof cur.header - cur.header_have);
      std::memcpy(cur.header + cur.header_have, data + at, take);
      cur.header_have += take;
      at += take;
      if (cur.header_have < sizeof cur.header) return;
      cur.header_have = 0;
      const uint16_t type = static_cast<uint16_t>(cur.header[6] | (cur.header[7] << 8));
      const uint32_t length = static_cast<uint32_t>(cur.header[8]) | (cur.header[9] << 8) |
                              (cur.header[10] << 16) |
                              (static_cast<uint32_t>(cur.header[11]) << 24);
      cur.payload_len = cur.payload_left = length;
      bool armed = true;
      cur.target =
          type == kKvData && length >= 4096 && corrupt_.compare_exchange_strong(armed, false);
      continue;
    }
    const size_t take = static_cast<size_t>(std::min<uint64_t>(n - at, cur.payload_left));
    if (cur.target) {
      // The payload offset of this piece's first byte, and the flip's.
      const uint64_t offset = cur.payload_len - cur.payload_left;
      const uint64_t flip = cur.payload_len / 2;
      if (flip >= offset && flip < offset + take) {
        data[at + (flip - offset)] ^= 0x5a;
        cur.target = false;
        corrupted_.store(true);
      }
    }
    cur.payload_left -= take;
    at += take;
  }
}

void TcpRelay::Cut() {
  cut_.store(true);
  generation_.fetch_add(1);
  cuts_.fetch_add(1);
}

void TcpRelay::Restore() { cut_.store(false); }

void TcpRelay::Stop() {
  if (stop_.exchange(true)) return;
  if (acceptor_.joinable()) acceptor_.join();
  std::vector<std::thread> pumps;
  {
    std::lock_guard lock(mu_);
    pumps.swap(pumps_);
  }
  for (auto& t : pumps) t.join();
  if (listen_fd_ >= 0) close(listen_fd_);
  listen_fd_ = -1;
}

}  // namespace kvrelay::faults
