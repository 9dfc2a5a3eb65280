#include "tests/faults/tcp_relay.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
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
    std::lock_guard lock(mu_);
    pumps_.emplace_back([this, client, server, generation] { Pump(client, server, generation); });
  }
}

void TcpRelay::Pump(int client, int server, uint64_t generation) {
  std::vector<char> buf(256 << 10);
  pollfd fds[2] = {{client, POLLIN, 0}, {server, POLLIN, 0}};
  while (!stop_.load() && generation_.load() == generation) {
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
        // Towards the target: a large read is inside a KV chunk's payload.
        bool expected = true;
        if (n >= 4096 && corrupt_.compare_exchange_strong(expected, false)) {
          buf[static_cast<size_t>(n) / 2] ^= 0x5a;
          corrupted_.store(true);
        }
        forwarded_.fetch_add(static_cast<uint64_t>(n));
      }
      if (!WriteAll(fds[1 - i].fd, buf.data(), static_cast<size_t>(n))) closed = true;
    }
    if (closed) break;
  }
  Abort(client);
  Abort(server);
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
