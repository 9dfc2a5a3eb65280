// Admission to an internal port's pre-authentication slots (control, KV data,
// TP link), shared by their accept loops.
//
// Each port bounds the connections that have not proved the cluster key yet
// (memory and file descriptors a stranger can hold). Refusing the newest
// connection when the slots are full let any local process stop a port for
// good: it keeps the slots full with silent connections, reopened as the
// auth deadline closes them, and the real peer's connection, always the
// newest, is the one refused (issue #46). So a full port evicts its OLDEST
// unauthenticated connection instead, and admits the new one:
//   - a real peer proves the key within one round trip (ms), so an idle
//     holder's connections are always older than it and are evicted first;
//   - to push a real peer out, an attacker must open `limit` new connections
//     within that peer's handshake, and the peer's retry (every internal
//     client reconnects with backoff until its deadline) starts the race
//     again; memory stays bounded by `limit` either way;
//   - an authenticated connection never occupies a slot and is never evicted.
// A per-source-address cap would not help here: on one host every peer and
// the attacker share 127.0.0.1.
#pragma once

#include <cstddef>
#include <vector>

namespace kvrelay::protocols {

// Which of `conns` (in accept order, oldest first) to evict so that one more
// unauthenticated connection fits in `limit` slots: the indices of the oldest
// entries for which `unauthenticated(entry)` holds, as many as needed (none
// while there is room). A `limit` of 0 counts as 1.
template <typename Container, typename Pred>
std::vector<size_t> OldestUnauthenticated(const Container& conns, size_t limit,
                                          Pred unauthenticated) {
  if (limit == 0) limit = 1;
  std::vector<size_t> strangers;
  size_t i = 0;
  for (const auto& c : conns) {
    if (unauthenticated(c)) strangers.push_back(i);
    ++i;
  }
  if (strangers.size() < limit) return {};
  strangers.resize(strangers.size() - limit + 1);  // the oldest ones
  return strangers;
}

}  // namespace kvrelay::protocols
