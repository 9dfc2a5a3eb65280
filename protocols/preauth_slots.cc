#include "protocols/preauth_slots.h"

#include <arpa/inet.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstring>

namespace kvrelay::protocols {
namespace {

// The uid owning the TCP socket whose local end is `owner_local` and whose
// remote end is `owner_remote` (an exact sock_diag lookup; unprivileged).
// -1 when the kernel does not say.
int64_t TcpSocketUid(const sockaddr_in& owner_local, const sockaddr_in& owner_remote) {
  const int nl = ::socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
  if (nl < 0) return -1;
  timeval tv{0, 100'000};  // a local kernel answer: never near this
  (void)::setsockopt(nl, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  struct {
    nlmsghdr nlh;
    inet_diag_req_v2 req;
  } msg{};
  msg.nlh.nlmsg_len = sizeof(msg);
  msg.nlh.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  msg.nlh.nlmsg_flags = NLM_F_REQUEST;
  msg.req.sdiag_family = AF_INET;
  msg.req.sdiag_protocol = IPPROTO_TCP;
  msg.req.idiag_states = ~0u;
  msg.req.id.idiag_sport = owner_local.sin_port;
  msg.req.id.idiag_dport = owner_remote.sin_port;
  msg.req.id.idiag_src[0] = owner_local.sin_addr.s_addr;
  msg.req.id.idiag_dst[0] = owner_remote.sin_addr.s_addr;
  msg.req.id.idiag_cookie[0] = INET_DIAG_NOCOOKIE;
  msg.req.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  int64_t uid = -1;
  if (::sendto(nl, &msg, sizeof(msg), 0, reinterpret_cast<sockaddr*>(&kernel), sizeof(kernel)) ==
      static_cast<ssize_t>(sizeof(msg))) {
    alignas(nlmsghdr) char buf[4096];
    const ssize_t n = ::recv(nl, buf, sizeof(buf), 0);
    if (n > 0) {
      auto* h = reinterpret_cast<nlmsghdr*>(buf);
      if (NLMSG_OK(h, static_cast<unsigned>(n)) && h->nlmsg_type == SOCK_DIAG_BY_FAMILY &&
          h->nlmsg_len >= NLMSG_LENGTH(sizeof(inet_diag_msg))) {
        uid = static_cast<const inet_diag_msg*>(NLMSG_DATA(h))->idiag_uid;
      }
    }
  }
  ::close(nl);
  return uid;
}

}  // namespace

bool FromOtherLocalUser(int fd) {
  sockaddr_in local{}, peer{};
  socklen_t ll = sizeof(local), pl = sizeof(peer);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &ll) != 0 ||
      ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &pl) != 0 ||
      local.sin_family != AF_INET || peer.sin_family != AF_INET) {
    return false;  // not IPv4: not classified
  }
  // Only a connection from this host has its other end in this kernel.
  if ((ntohl(peer.sin_addr.s_addr) >> 24) != 127) return false;
  // The other end is the socket bound to `peer` and connected to `local`.
  const int64_t uid = TcpSocketUid(peer, local);
  return uid >= 0 && static_cast<uid_t>(uid) != ::geteuid();
}

}  // namespace kvrelay::protocols
