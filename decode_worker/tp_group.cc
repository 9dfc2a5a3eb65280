#include "decode_worker/tp_group.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "common/logging.h"
#include "protocols/cluster_auth.h"
#include "protocols/preauth_slots.h"

namespace kvrelay::decode_worker {
namespace {

constexpr uint32_t kMagic = 0x5054564B;  // "KVTP" little-endian
constexpr size_t kHeaderBytes = 16;

int PollMs(Deadline deadline) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline.Remaining());
  // Round up so a sub-millisecond remainder still waits instead of spinning.
  return static_cast<int>(std::min<int64_t>(ms.count() + 1, 1000));
}

// Waits until fd is readable/writable or the deadline passes.
Status WaitFd(int fd, short events, Deadline deadline) {
  while (true) {
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, deadline.Expired() ? 0 : PollMs(deadline));
    if (rc > 0) return Status::Ok();
    if (rc < 0 && errno != EINTR) return Unavailable(std::string("poll: ") + std::strerror(errno));
    if (deadline.Expired()) return DeadlineExceeded("TP link: peer did not answer in time");
  }
}

void SetSocketOptions(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
}

Result<sockaddr_in> Resolve(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || res == nullptr) {
    return InvalidArgument("TP group: cannot resolve host '" + host + "'");
  }
  sockaddr_in addr = *reinterpret_cast<sockaddr_in*>(res->ai_addr);
  ::freeaddrinfo(res);
  addr.sin_port = htons(port);
  return addr;
}

}  // namespace

// --- authentication of a TP link (security) ----------------------------------
// The cluster-key challenge-response (protocols/cluster_auth.h, channel "tp")
// runs first on every link: each auth message travels as one kHello
// (follower -> rank 0) or kSetup (rank 0 -> follower) whose payload is a
// protocols frame. A follower authenticates as "tp-rank-<r>" and must then
// say hello as that rank.
namespace {

std::string TpAuthName(int rank) { return "tp-rank-" + std::to_string(rank); }

Status SendAuth(TpLink& link, TpMsg type, protocols::MessageType inner, const std::string& payload,
                Deadline deadline) {
  ASSIGN_OR_RETURN(std::string frame,
                   protocols::EncodeFrame(static_cast<uint16_t>(inner), payload,
                                          protocols::kMaxUnauthenticatedPayload));
  return link.Send(type, frame, deadline);
}

// One auth message (a protocols frame inside a TP message of `type`).
Result<protocols::Frame> ParseAuth(const TpMessage& m, TpMsg type) {
  if (m.type != type || m.payload.size() < protocols::kFrameHeaderBytes) {
    return FailedPrecondition("authentication failed: TP peer sent message type " +
                              std::to_string(static_cast<uint32_t>(m.type)) +
                              " instead of the cluster-key challenge-response");
  }
  ASSIGN_OR_RETURN(
      protocols::FrameHeader h,
      protocols::ParseFrameHeader(
          std::span<const uint8_t, protocols::kFrameHeaderBytes>(
              reinterpret_cast<const uint8_t*>(m.payload.data()), protocols::kFrameHeaderBytes),
          protocols::kMaxUnauthenticatedPayload));
  if (h.length != m.payload.size() - protocols::kFrameHeaderBytes) {
    return FailedPrecondition("authentication failed: TP auth message with a bad length");
  }
  protocols::Frame f;
  f.type = h.type;
  f.payload = m.payload.substr(protocols::kFrameHeaderBytes);
  return f;
}

Result<protocols::Frame> ReceiveAuth(TpLink& link, TpMsg type, Deadline deadline) {
  ASSIGN_OR_RETURN(TpMessage m, link.Receive(deadline));
  return ParseAuth(m, type);
}

Status AuthenticateToLeader(TpLink& link, const protocols::ClusterKey& key, int tp_rank,
                            Deadline deadline) {
  using protocols::MessageType;
  protocols::AuthInitiator auth(key, protocols::kAuthChannelTp, TpAuthName(tp_rank));
  ASSIGN_OR_RETURN(std::string hello, auth.Hello());
  RETURN_IF_ERROR(SendAuth(link, TpMsg::kHello, MessageType::kAuthHello, hello, deadline));
  ASSIGN_OR_RETURN(protocols::Frame challenge, ReceiveAuth(link, TpMsg::kSetup, deadline));
  ASSIGN_OR_RETURN(std::string proof, auth.OnChallenge(challenge));
  RETURN_IF_ERROR(SendAuth(link, TpMsg::kHello, MessageType::kAuthProof, proof, deadline));
  ASSIGN_OR_RETURN(protocols::Frame result, ReceiveAuth(link, TpMsg::kSetup, deadline));
  return auth.OnResult(result);
}

}  // namespace

// --- TpLink ----------------------------------------------------------------

TpLink::TpLink(int fd) : fd_(fd) { SetSocketOptions(fd_); }
TpLink::~TpLink() {
  if (fd_ >= 0) ::close(fd_);
}

Status TpLink::Send(TpMsg type, const void* a, size_t a_len, const void* b, size_t b_len,
                    Deadline deadline) {
  if (!broken_.ok()) return broken_;
  uint8_t header[kHeaderBytes];
  const uint32_t t = static_cast<uint32_t>(type);
  const uint64_t len = a_len + b_len;
  std::memcpy(header, &kMagic, 4);
  std::memcpy(header + 4, &t, 4);
  std::memcpy(header + 8, &len, 8);
  iovec iov[3] = {
      {header, kHeaderBytes}, {const_cast<void*>(a), a_len}, {const_cast<void*>(b), b_len}};
  int first = 0;
  while (first < 3) {
    const ssize_t n = ::writev(fd_, iov + first, 3 - first);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        Status w = WaitFd(fd_, POLLOUT, deadline);
        if (!w.ok()) return broken_ = w.WithContext("TP link send");
        continue;
      }
      return broken_ = Unavailable(std::string("TP link send: ") + std::strerror(errno));
    }
    size_t left = static_cast<size_t>(n);
    while (first < 3 && left >= iov[first].iov_len) {
      left -= iov[first].iov_len;
      ++first;
    }
    if (first < 3) {
      iov[first].iov_base = static_cast<uint8_t*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
  return Status::Ok();
}

bool TpLink::has_buffered_message() const {
  if (rbuf_.size() < kHeaderBytes) return false;
  uint64_t len;
  std::memcpy(&len, rbuf_.data() + 8, 8);
  return rbuf_.size() >= kHeaderBytes + len;
}

Result<TpMessage> TpLink::Receive(Deadline deadline) {
  if (!broken_.ok()) return broken_;
  while (true) {
    if (rbuf_.size() >= kHeaderBytes) {
      uint32_t magic, type;
      uint64_t len;
      std::memcpy(&magic, rbuf_.data(), 4);
      std::memcpy(&type, rbuf_.data() + 4, 4);
      std::memcpy(&len, rbuf_.data() + 8, 8);
      if (magic != kMagic || type < 1 || type > kLastTpMsg) {
        return broken_ = DataLoss("TP link: bad message header (magic " + std::to_string(magic) +
                                  ", type " + std::to_string(type) + ")");
      }
      if (len > max_message_bytes_) {
        oversized_ = true;
        return broken_ =
                   DataLoss("TP link: message of " + std::to_string(len) +
                            " bytes exceeds the limit of " + std::to_string(max_message_bytes_));
      }
      if (rbuf_.size() >= kHeaderBytes + len) {
        TpMessage m;
        m.type = static_cast<TpMsg>(type);
        m.payload.assign(rbuf_, kHeaderBytes, len);
        rbuf_.erase(0, kHeaderBytes + len);
        return m;
      }
    }
    char buf[64 * 1024];
    const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
    if (n > 0) {
      rbuf_.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n == 0) return broken_ = Unavailable("TP link: peer closed the connection");
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      return broken_ = Unavailable(std::string("TP link receive: ") + std::strerror(errno));
    }
    RETURN_IF_ERROR(WaitFd(fd_, POLLIN, deadline));
  }
}

// --- TcpTpGroup -------------------------------------------------------------

TcpTpGroup::~TcpTpGroup() {
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

Result<std::unique_ptr<TcpTpGroup>> TcpTpGroup::Listen(const TpGroupOptions& options) {
  if (options.tp_rank != 0) return InvalidArgument("only TP rank 0 listens");
  if (options.tp_size < 2) return InvalidArgument("a TP group needs tp_size >= 2");
  std::unique_ptr<TcpTpGroup> g(new TcpTpGroup(options));
  ASSIGN_OR_RETURN(sockaddr_in addr, Resolve(options.leader_host, options.leader_port));
  g->listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
  if (g->listen_fd_ < 0) return Unavailable("TP group: socket() failed");
  int one = 1;
  ::setsockopt(g->listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(g->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(g->listen_fd_, SOMAXCONN) != 0) {
    return Unavailable("TP group: cannot listen on " + options.leader_host + ":" +
                       std::to_string(options.leader_port) + ": " + std::strerror(errno));
  }
  socklen_t len = sizeof(addr);
  ::getsockname(g->listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  g->port_ = ntohs(addr.sin_port);
  ::fcntl(g->listen_fd_, F_SETFL, ::fcntl(g->listen_fd_, F_GETFL) | O_NONBLOCK);
  g->links_.resize(options.tp_size);
  return g;
}

namespace {

// A connection rank 0 accepted that has not joined yet: it runs the
// cluster-key challenge-response (kHello, kProof), then must say its TpHello.
// Every pending connection advances as its messages arrive, each stage within
// its own deadline, so a silent one delays nobody else.
struct PendingFollower {
  enum class Stage { kAuthHello, kAuthProof, kTpHello };
  PendingFollower(int fd, const protocols::ClusterKey& key, Deadline d, bool foreign)
      : link(std::make_unique<TpLink>(fd)),
        auth(key, protocols::kAuthChannelTp),
        deadline(d),
        foreign(foreign) {
    // A stranger can make rank 0 buffer no more than an auth message.
    link->set_max_message_bytes(protocols::kFrameHeaderBytes +
                                protocols::kMaxUnauthenticatedPayload);
  }
  bool authenticated() const { return stage == Stage::kTpHello; }
  std::unique_ptr<TpLink> link;
  protocols::AuthResponder auth;
  Stage stage = Stage::kAuthHello;
  Deadline deadline;
  bool foreign = false;  // from another local user (protocols/preauth_slots.h)
};

constexpr auto kTpStageTimeout = std::chrono::seconds(5);  // each of auth, hello

}  // namespace

Result<std::vector<std::string>> TcpTpGroup::Accept(
    Deadline deadline, const std::function<Result<SetupAnswer>(const std::string&)>& setup,
    const std::function<std::string(const Status&)>& refusal) {
  using protocols::MessageType;
  std::vector<std::string> hellos(options_.tp_size);
  std::vector<std::unique_ptr<PendingFollower>> pending;
  int joined = 0;
  auto stage_deadline = [&] {
    return Deadline{std::min(deadline.at, Deadline::After(kTpStageTimeout).at)};
  };
  // A connection that cannot prove the cluster key is dropped, not joined,
  // and does not stop the group from forming.
  auto auth_failed = [&](PendingFollower& p, const Status& why) {
    LOG_WARNING << "TP group: dropping a connection: " << why.message();
    (void)SendAuth(*p.link, TpMsg::kSetup, MessageType::kAuthProof,
                   protocols::AuthResponder::RefusalPayload("authentication failed"),
                   Deadline::After(std::chrono::milliseconds(50)));
    std::lock_guard lock(counters_mu_);
    ++counters_.auth_failures;
    if (p.link->refused_oversized()) ++counters_.oversized_frames;
  };
  // One message of a pending connection; false drops the connection.
  auto on_message = [&](PendingFollower& p, TpMessage m) -> bool {
    switch (p.stage) {
      case PendingFollower::Stage::kAuthHello: {
        auto challenge = [&]() -> Result<std::string> {
          ASSIGN_OR_RETURN(protocols::Frame hello, ParseAuth(m, TpMsg::kHello));
          return p.auth.OnHello(hello);
        }();
        Status sent = challenge.ok() ? SendAuth(*p.link, TpMsg::kSetup, MessageType::kAuthChallenge,
                                                *challenge, p.deadline)
                                     : challenge.status();
        if (!sent.ok()) return auth_failed(p, sent), false;
        p.stage = PendingFollower::Stage::kAuthProof;
        return true;
      }
      case PendingFollower::Stage::kAuthProof: {
        auto mine = [&]() -> Result<std::string> {
          ASSIGN_OR_RETURN(protocols::Frame proof, ParseAuth(m, TpMsg::kHello));
          return p.auth.OnProof(proof);
        }();
        Status sent =
            mine.ok() ? SendAuth(*p.link, TpMsg::kSetup, MessageType::kAuthProof, *mine, p.deadline)
                      : mine.status();
        if (!sent.ok()) return auth_failed(p, sent), false;
        p.link->set_max_message_bytes(kMaxTpMessageBytes);
        p.stage = PendingFollower::Stage::kTpHello;
        p.deadline = stage_deadline();
        return true;
      }
      case PendingFollower::Stage::kTpHello:
        break;
    }
    // From here the peer holds the cluster key, but it may still be a
    // misconfigured or stale member (a second rank 1, a rank of another
    // group): it is refused with the reason and dropped, and the group keeps
    // forming from the connections that fit, until the deadline.
    if (m.type != TpMsg::kHello) {
      LOG_WARNING << "TP group: dropping a follower that did not say hello: another message "
                     "came first";
      return false;
    }
    auto answer = setup(m.payload);
    if (answer.ok() && p.auth.peer_name() != TpAuthName(answer->rank)) {
      {
        std::lock_guard lock(counters_mu_);
        ++counters_.foreign_frames;
      }
      answer = FailedPrecondition("TP follower authenticated as '" + p.auth.peer_name() +
                                  "' but says it is rank " + std::to_string(answer->rank));
    }
    if (answer.ok() &&
        (answer->rank < 1 || answer->rank >= options_.tp_size || links_[answer->rank] != nullptr)) {
      answer =
          InvalidArgument("TP follower rank " + std::to_string(answer->rank) + " is outside [1, " +
                          std::to_string(options_.tp_size) + ") or already joined");
    }
    if (!answer.ok()) {
      LOG_WARNING << "TP group: refusing a follower: " << answer.status().message();
      (void)p.link->Send(TpMsg::kSetup, refusal(answer.status()), p.deadline);
      return false;
    }
    const int r = answer->rank;
    if (Status sent = p.link->Send(TpMsg::kSetup, answer->payload, p.deadline); !sent.ok()) {
      LOG_WARNING << "TP group: follower rank " << r << " left during setup: " << sent.message();
      return false;
    }
    hellos[r] = std::move(m.payload);
    links_[r] = std::move(p.link);
    ++joined;
    return false;  // joined: no longer pending
  };

  while (joined < options_.tp_size - 1) {
    if (deadline.Expired()) {
      return DeadlineExceeded("waiting for " + std::to_string(options_.tp_size - 1 - joined) +
                              " TP follower(s) to connect: TP link: peer did not answer in time");
    }
    // Stages past their deadline end first.
    for (auto it = pending.begin(); it != pending.end();) {
      PendingFollower& p = **it;
      if (!p.deadline.Expired()) {
        ++it;
        continue;
      }
      if (p.authenticated()) {
        LOG_WARNING << "TP group: dropping a follower that did not say hello: TP link: peer did "
                       "not answer in time";
      } else {
        auth_failed(p, DeadlineExceeded("TP link: peer did not answer in time"));
      }
      it = pending.erase(it);
    }
    Deadline wake = deadline;
    for (const auto& p : pending) wake.at = std::min(wake.at, p->deadline.at);
    std::vector<pollfd> fds;
    fds.push_back({listen_fd_, POLLIN, 0});
    for (const auto& p : pending) fds.push_back({p->link->fd(), POLLIN, 0});
    const int rc = ::poll(fds.data(), fds.size(), wake.Expired() ? 0 : PollMs(wake));
    if (rc < 0 && errno != EINTR) return Unavailable(std::string("poll: ") + std::strerror(errno));
    if (rc <= 0) continue;
    // Messages of the pending connections, each as far as it has arrived.
    std::vector<bool> keep(pending.size(), true);
    for (size_t i = 0; i < pending.size(); ++i) {
      if (fds[i + 1].revents == 0) continue;
      PendingFollower& p = *pending[i];
      while (keep[i]) {
        auto m = p.link->Receive(Deadline::After(std::chrono::milliseconds(0)));
        if (!m.ok()) {
          if (m.status().code() == StatusCode::kDeadlineExceeded) break;  // the rest not here yet
          if (p.authenticated()) {
            LOG_WARNING << "TP group: dropping a follower that did not say hello: "
                        << m.status().message();
          } else {
            auth_failed(p, m.status());
          }
          keep[i] = false;
          break;
        }
        keep[i] = on_message(p, std::move(*m));
      }
    }
    for (size_t i = pending.size(); i-- > 0;) {
      if (!keep[i]) pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
    }
    // New connections: each starts its own authentication, up to
    // max_unauthenticated at once; beyond that the oldest unauthenticated
    // one is dropped for the new one (protocols/preauth_slots.h) and
    // counted: a local process opening silent connections cannot grow rank
    // 0's memory, and its connections, always older than a real follower's,
    // go first, so it cannot keep the followers out.
    if ((fds[0].revents & POLLIN) != 0 && joined < options_.tp_size - 1) {
      for (;;) {
        const int fd = ::accept(listen_fd_, nullptr, nullptr);
        if (fd < 0) break;  // EAGAIN: none left
        const bool foreign = protocols::FromOtherLocalUser(fd);
        const protocols::PreAuthAdmission admission = protocols::AdmitStranger(
            pending, options_.max_unauthenticated, foreign,
            [](const std::unique_ptr<PendingFollower>& p) { return !p->authenticated(); },
            [](const std::unique_ptr<PendingFollower>& p) { return p->foreign; });
        const size_t refused = admission.evict.size() + (admission.admit ? 0 : 1);
        if (refused > 0) {
          uint64_t n;
          {
            std::lock_guard lock(counters_mu_);
            n = counters_.refused_connections += refused;
          }
          if (n <= 10 || n % 1000 < refused) {
            LOG_WARNING << "TP group: " << options_.max_unauthenticated
                        << " unauthenticated connections: "
                        << (admission.admit ? "dropping the oldest"
                                            : "refusing another local user's")
                        << " (" << n << " refused so far)";
          }
          for (size_t i = admission.evict.size(); i-- > 0;) {
            pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(admission.evict[i]));
          }
        }
        if (!admission.admit) {
          ::close(fd);
          continue;
        }
        pending.push_back(
            std::make_unique<PendingFollower>(fd, options_.cluster_key, stage_deadline(), foreign));
      }
    }
  }
  ::close(listen_fd_);
  listen_fd_ = -1;
  return hellos;
}

Result<std::unique_ptr<TcpTpGroup>> TcpTpGroup::Connect(const TpGroupOptions& options,
                                                        const std::string& hello,
                                                        Deadline deadline) {
  if (options.tp_rank < 1 || options.tp_rank >= options.tp_size) {
    return InvalidArgument("TP follower rank " + std::to_string(options.tp_rank) + " outside [1, " +
                           std::to_string(options.tp_size) + ")");
  }
  ASSIGN_OR_RETURN(sockaddr_in addr, Resolve(options.leader_host, options.leader_port));
  std::unique_ptr<TcpTpGroup> g(new TcpTpGroup(options));
  auto backoff = std::chrono::milliseconds(20);
  while (true) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return Unavailable("TP group: socket() failed");
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      g->links_.push_back(std::make_unique<TpLink>(fd));
      break;
    }
    ::close(fd);
    if (deadline.Expired()) {
      return DeadlineExceeded("TP group: rank 0 at " + options.leader_host + ":" +
                              std::to_string(options.leader_port) + " did not accept in time");
    }
    // Rank 0 may still be loading the model: retry with capped backoff.
    std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(backoff, deadline.Remaining()));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }
  RETURN_IF_ERROR(
      AuthenticateToLeader(*g->links_[0], options.cluster_key, options.tp_rank, deadline)
          .WithContext("joining TP rank 0 (check --cluster-key-file)"));
  RETURN_IF_ERROR(g->links_[0]->Send(TpMsg::kHello, hello, deadline));
  return g;
}

protocols::PortSecurityCounters TcpTpGroup::security_counters() const {
  std::lock_guard lock(counters_mu_);
  return counters_;
}

Status TcpTpGroup::status() const {
  if (!broken_.ok()) return broken_;
  for (const auto& l : links_) {
    if (l != nullptr && !l->status().ok()) return l->status();
  }
  return Status::Ok();
}

Status TcpTpGroup::Broadcast(TpMsg type, const std::string& payload) {
  return Broadcast(type, payload, Deadline::After(options_.timeout));
}

Status TcpTpGroup::Broadcast(TpMsg type, const std::string& payload, Deadline d) {
  for (int r = 1; r < options_.tp_size; ++r) {
    RETURN_IF_ERROR(
        links_[r]->Send(type, payload, d).WithContext("to TP rank " + std::to_string(r)));
  }
  return Status::Ok();
}

Result<std::optional<std::pair<int, TpMessage>>> TcpTpGroup::PollFollowers(Deadline deadline) {
  if (!inbox_.empty()) {
    auto m = std::move(inbox_.front());
    inbox_.pop_front();
    return std::optional<std::pair<int, TpMessage>>(std::move(m));
  }
  while (true) {
    std::vector<pollfd> fds;
    for (int r = 1; r < options_.tp_size; ++r) {
      if (links_[r]->has_buffered_message()) {
        ASSIGN_OR_RETURN(TpMessage m, links_[r]->Receive(Deadline::After({})));
        return std::optional<std::pair<int, TpMessage>>(std::pair{r, std::move(m)});
      }
      fds.push_back({links_[r]->fd(), POLLIN, 0});
    }
    const int rc = ::poll(fds.data(), fds.size(), deadline.Expired() ? 0 : PollMs(deadline));
    if (rc < 0 && errno != EINTR) return Unavailable("TP group: poll failed");
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      const int r = static_cast<int>(i) + 1;
      auto m = links_[r]->Receive(Deadline::After(std::chrono::milliseconds(0)));
      if (m.ok()) return std::optional<std::pair<int, TpMessage>>(std::pair{r, std::move(*m)});
      if (m.status().code() != StatusCode::kDeadlineExceeded) {
        return m.status().WithContext("TP rank " + std::to_string(r));
      }
    }
    if (deadline.Expired()) return std::optional<std::pair<int, TpMessage>>();
  }
}

std::string EncodePong(const std::string& ping, const protocols::PortSecurityCounters& kv_port) {
  const uint64_t counts[4] = {kv_port.auth_failures, kv_port.refused_connections,
                              kv_port.oversized_frames, kv_port.foreign_frames};
  std::string out = ping;
  out.append(reinterpret_cast<const char*>(counts), sizeof(counts));
  return out;
}

bool DecodePong(const std::string& payload, uint64_t* seq,
                protocols::PortSecurityCounters* kv_port) {
  uint64_t v[5];
  if (payload.size() != sizeof(v)) return false;
  std::memcpy(v, payload.data(), sizeof(v));
  *seq = v[0];
  *kv_port = {v[1], v[2], v[3], v[4]};
  return true;
}

std::string TcpTpGroup::Pong(const std::string& ping) const {
  return EncodePong(ping,
                    kv_port_counters_ ? kv_port_counters_() : protocols::PortSecurityCounters{});
}

Status TcpTpGroup::SendToLeader(TpMsg type, const std::string& payload) {
  return links_[0]->Send(type, payload, Deadline::After(options_.timeout));
}

Result<TpMessage> TcpTpGroup::ReceiveFromLeader(Deadline deadline) {
  return links_[0]->Receive(deadline);
}

Result<std::string> TcpTpGroup::ReceiveData(int r, Deadline deadline) {
  while (true) {
    auto m = links_[r]->Receive(deadline);
    if (!m.ok()) return m.status().WithContext("collective with TP rank " + std::to_string(r));
    if (m->type == TpMsg::kData) return std::move(m->payload);
    inbox_.emplace_back(r, std::move(*m));
  }
}

Status TcpTpGroup::Collective(const float* in, int64_t n_in, float* out, int64_t n_out,
                              bool reduce) {
  if (!broken_.ok()) return broken_;
  Status st = CollectiveOnce(in, n_in, out, n_out, reduce);
  // A collective that failed (a rank missed the step deadline, sent garbage
  // or left) leaves the ranks at different points of the step: the group
  // cannot step again, and says so at once (status()).
  if (!st.ok()) broken_ = st;
  return st;
}

Status TcpTpGroup::CollectiveOnce(const float* in, int64_t n_in, float* out, int64_t n_out,
                                  bool reduce) {
  const Deadline deadline = Deadline::After(options_.timeout);
  const size_t in_bytes = static_cast<size_t>(n_in) * sizeof(float);
  const size_t out_bytes = static_cast<size_t>(n_out) * sizeof(float);
  if (options_.tp_rank != 0) {
    RETURN_IF_ERROR(links_[0]->Send(TpMsg::kData, in, in_bytes, nullptr, 0, deadline));
    while (true) {
      ASSIGN_OR_RETURN(TpMessage m, links_[0]->Receive(deadline));
      if (m.type == TpMsg::kShutdown) return Cancelled("TP rank 0 is shutting down");
      if (m.type == TpMsg::kPing) {  // (pings come between steps; answered wherever seen)
        RETURN_IF_ERROR(links_[0]->Send(TpMsg::kPong, Pong(m.payload), deadline));
        continue;
      }
      if (m.type != TpMsg::kData) {
        return DataLoss("TP collective: expected data from rank 0, got message type " +
                        std::to_string(static_cast<uint32_t>(m.type)));
      }
      if (m.payload.size() != out_bytes) {
        return DataLoss("TP collective: rank 0 sent " + std::to_string(m.payload.size()) +
                        " bytes, expected " + std::to_string(out_bytes));
      }
      std::memcpy(out, m.payload.data(), out_bytes);
      return Status::Ok();
    }
  }
  // Rank 0: collect in rank order, combine, answer everyone.
  scratch_.assign(in, in + n_in);
  for (int r = 1; r < options_.tp_size; ++r) {
    ASSIGN_OR_RETURN(std::string data, ReceiveData(r, deadline));
    if (data.size() % sizeof(float) != 0) return DataLoss("TP collective: ragged payload");
    const int64_t n = static_cast<int64_t>(data.size() / sizeof(float));
    const float* p = reinterpret_cast<const float*>(data.data());
    if (reduce) {
      if (n != n_in) {
        return DataLoss("TP all-reduce: rank " + std::to_string(r) + " sent " + std::to_string(n) +
                        " floats, expected " + std::to_string(n_in));
      }
      for (int64_t i = 0; i < n; ++i) scratch_[i] += p[i];
    } else {
      scratch_.insert(scratch_.end(), p, p + n);
    }
  }
  if (static_cast<int64_t>(scratch_.size()) != n_out) {
    return DataLoss("TP all-gather: ranks sent " + std::to_string(scratch_.size()) +
                    " floats in all, expected " + std::to_string(n_out));
  }
  for (int r = 1; r < options_.tp_size; ++r) {
    RETURN_IF_ERROR(
        links_[r]->Send(TpMsg::kData, scratch_.data(), out_bytes, nullptr, 0, deadline));
  }
  std::memcpy(out, scratch_.data(), out_bytes);
  return Status::Ok();
}

Status TcpTpGroup::AllReduceSum(float* data, int64_t n) {
  return Collective(data, n, data, n, /*reduce=*/true);
}

Status TcpTpGroup::AllGather(const float* local, int64_t n_local, float* out, int64_t n_out) {
  return Collective(local, n_local, out, n_out, /*reduce=*/false);
}

}  // namespace kvrelay::decode_worker
