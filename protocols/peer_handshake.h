// The configuration handshake over a FramedConnection (inbox mode).
// Client: sends Hello{config}, waits for HelloReply, and checks the server's
// config itself too. Server: reads the Hello, checks it, replies accepted or
// rejected with the reason, and on rejection closes after the reply is sent.
// Both sides refuse on any mismatch; the reason names the field.
// Blocking; call from a worker thread, never from the IoThread.
#pragma once

#include <string>

#include "common/clock.h"
#include "protocols/framed_connection.h"
#include "protocols/handshake.h"

namespace kvrelay::protocols {

Result<PeerConfig> ClientHandshake(FramedConnection& conn, const std::string& name,
                                   const PeerConfig& local, const CompatibilityOptions& options,
                                   Deadline deadline);

Result<PeerConfig> ServerHandshake(FramedConnection& conn, const PeerConfig& local,
                                   const CompatibilityOptions& options, Deadline deadline);

}  // namespace kvrelay::protocols
