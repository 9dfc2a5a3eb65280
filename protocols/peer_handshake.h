// The handshakes over a FramedConnection (inbox mode).
//
// Authentication first (protocols/cluster_auth.h): the mutual challenge-
// response over the cluster key; nothing else is said before it succeeds, and
// on success the connection's pre-authentication limits are lifted.
// Then the configuration handshake. Client: sends Hello{config}, waits for
// HelloReply, and checks the server's config itself too. Server: reads the
// Hello, checks it, replies accepted or rejected with the reason, and on
// rejection closes after the reply is sent. Both sides refuse on any
// mismatch; the reason names the field.
// Blocking; call from a worker thread, never from the IoThread.
#pragma once

#include <string>
#include <string_view>

#include "common/clock.h"
#include "protocols/cluster_auth.h"
#include "protocols/framed_connection.h"
#include "protocols/handshake.h"

namespace kvrelay::protocols {

// Proves `key` to the server as `name` and checks the server's proof. On
// failure the connection is closed and the error (FailedPrecondition
// "authentication failed: ...") says what went wrong.
Status ClientAuthenticate(FramedConnection& conn, const ClusterKey& key, std::string_view channel,
                          const std::string& name, Deadline deadline);
// Checks the client's proof and proves `key` back. Returns the name the
// client authenticated as. On failure a refusal is sent and the connection closed.
Result<std::string> ServerAuthenticate(FramedConnection& conn, const ClusterKey& key,
                                       std::string_view channel, Deadline deadline);

// Authentication (control channel) and then the configuration handshake.
Result<PeerConfig> ClientHandshake(FramedConnection& conn, const ClusterKey& key,
                                   const std::string& name, const PeerConfig& local,
                                   const CompatibilityOptions& options, Deadline deadline);

Result<PeerConfig> ServerHandshake(FramedConnection& conn, const ClusterKey& key,
                                   const PeerConfig& local, const CompatibilityOptions& options,
                                   Deadline deadline);

}  // namespace kvrelay::protocols
