// Test helper: two connected endpoints (rank 0 and 1) of a named backend.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kv_transfer/local_transport.h"
#include "kv_transfer/tcp_transport.h"
#include "protocols/peer_handshake.h"

namespace kvrelay::kv_transfer::testing {

struct TransportPair {
  std::shared_ptr<LocalFabric> fabric;  // local only
  std::unique_ptr<Transport> a;         // rank 0
  std::unique_ptr<Transport> b;         // rank 1
};

// One key for every endpoint a test process creates.
inline const protocols::ClusterKey& TestKey() {
  static const protocols::ClusterKey key = std::move(protocols::ClusterKey::Generate()).value();
  return key;
}

// A raw frame connection to a TcpTransport's data port that authenticated as
// `rank` (and sent nothing else yet): for tests that play a hostile or
// crashing sender.
inline Result<std::shared_ptr<protocols::FramedConnection>> DialAuthenticated(
    protocols::IoThread& io, uint16_t port, int rank, const protocols::ClusterKey& key) {
  ASSIGN_OR_RETURN(auto conn, protocols::FramedConnection::Connect(io, "127.0.0.1", port, {},
                                                                   Deadline::AfterMs(5000)));
  RETURN_IF_ERROR(protocols::ClientAuthenticate(*conn, key, protocols::kAuthChannelKv,
                                                TcpTransport::AuthName(rank),
                                                Deadline::AfterMs(5000)));
  return conn;
}

inline TransportPair MakePair(const std::string& backend) {
  TransportPair p;
  if (backend == "local") {
    p.fabric = LocalFabric::Create({.world_size = 2});
    p.a = std::move(p.fabric->CreateEndpoint(0)).value();
    p.b = std::move(p.fabric->CreateEndpoint(1)).value();
  } else {
    TcpTransport::Options o;
    o.cluster_key = TestKey();
    o.rank = 0;
    o.chunk_bytes = 64 << 10;  // small chunks: many frames per transfer
    auto a = std::move(TcpTransport::Create(o)).value();
    o.rank = 1;
    auto b = std::move(TcpTransport::Create(o)).value();
    EXPECT_TRUE(a->ConnectPeer(1, "127.0.0.1", b->port(), Deadline::AfterMs(5000)).ok());
    EXPECT_TRUE(b->ConnectPeer(0, "127.0.0.1", a->port(), Deadline::AfterMs(5000)).ok());
    p.a = std::move(a);
    p.b = std::move(b);
  }
  return p;
}

inline std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937 rng(seed);
  for (auto& x : v) x = static_cast<uint8_t>(rng());
  return v;
}

}  // namespace kvrelay::kv_transfer::testing
