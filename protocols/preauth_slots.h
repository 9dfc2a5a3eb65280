// Admission to an internal port's pre-authentication slots (control, KV data,
// TP link), shared by their accept loops.
//
// Each port bounds the connections that have not proved the cluster key yet
// (memory and file descriptors a stranger can hold). Refusing the newest
// connection when the slots were full let any local process stop a port for
// good: it kept the slots full with silent connections, reopened as the auth
// deadline closed them, and the real peer's connection, always the newest,
// was the one refused (issue #46). Now:
//   - A full port evicts its OLDEST unauthenticated connection to admit the
//     new one. A real peer proves the key within a round trip, so an idle
//     holder's connections are always older than it and go first.
//   - That alone loses to a churning attacker (redialling as fast as the
//     port accepts pushes a real peer out mid-handshake). So a loopback
//     connection whose other end belongs to ANOTHER local user (the kernel
//     says who owns it: sock_diag, no privilege needed) is "foreign": foreign
//     connections share at most half the slots, evict only each other, and
//     are evicted first by anyone else. Peers of the cluster's own uid, and
//     peers on other hosts, can then always get in.
//   - An authenticated connection never occupies a slot and is never evicted.
// A per-source-address cap would not help: on one host every peer and the
// attacker share 127.0.0.1. A process of the cluster's own uid can signal the
// cluster's processes anyway and is out of scope.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace kvrelay::protocols {

// Whether the connected IPv4 TCP socket `fd` comes from a process of another
// user on this host (a loopback peer whose socket another uid owns). False
// for remote peers and when the kernel does not say. One netlink round trip.
bool FromOtherLocalUser(int fd);

struct PreAuthAdmission {
  bool admit = true;          // false: close the newcomer instead
  std::vector<size_t> evict;  // indices into the container, ascending
};

// Whether one more unauthenticated connection (foreign when
// `newcomer_foreign`, see above) may take one of `limit` slots, and which of
// `conns` (in accept order, oldest first) to evict for it.
// `unauthenticated(entry)` and `foreign(entry)` classify the entries. A
// `limit` of 0 counts as 1.
template <typename Container, typename Unauth, typename Foreign>
PreAuthAdmission AdmitStranger(const Container& conns, size_t limit, bool newcomer_foreign,
                               Unauth unauthenticated, Foreign foreign) {
  if (limit == 0) limit = 1;
  const size_t foreign_cap = limit / 2 > 0 ? limit / 2 : 1;
  std::vector<size_t> theirs, ours;  // strangers, oldest first
  size_t i = 0;
  for (const auto& c : conns) {
    if (unauthenticated(c)) (foreign(c) ? theirs : ours).push_back(i);
    ++i;
  }
  PreAuthAdmission a;
  size_t t = 0, o = 0;  // evicted so far from theirs / ours
  if (newcomer_foreign) {
    while (theirs.size() - t >= foreign_cap) a.evict.push_back(theirs[t++]);
    while (theirs.size() - t + ours.size() >= limit && t < theirs.size()) {
      a.evict.push_back(theirs[t++]);
    }
    if (theirs.size() - t + ours.size() >= limit) return {false, {}};  // only ours left
  } else {
    while (theirs.size() - t + ours.size() - o >= limit) {
      a.evict.push_back(t < theirs.size() ? theirs[t++] : ours[o++]);
    }
  }
  std::sort(a.evict.begin(), a.evict.end());
  return a;
}

}  // namespace kvrelay::protocols
