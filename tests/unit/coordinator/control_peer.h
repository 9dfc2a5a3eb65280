// Test-only: the coordinator's cluster backend fixture, with the worker
// peers and event sinks of tests/testing/control_peer.h.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <memory>

#include "coordinator/cluster/cluster_backend.h"
#include "tests/testing/control_peer.h"

namespace kvrelay::coordinator::testing {

// Base fixture of the cluster backend's lifecycle tests: a ClusterBackend on
// 127.0.0.1 with long heartbeats (no worker is dropped for silence during a
// test), the rest of its options set by the test.
class ClusterBackendTest : public ::testing::Test {
 protected:
  void StartBackend(const std::function<void(ClusterBackendOptions&)>& configure) {
    ClusterBackendOptions o;
    o.config = ControlTestConfig();
    o.cluster_key = key_;
    o.heartbeat_interval = std::chrono::milliseconds(5000);
    configure(o);
    auto b = ClusterBackend::Create(o);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    backend_ = std::move(*b);
  }
  void TearDown() override {
    if (backend_) backend_->Shutdown();
  }
  uint16_t port() const { return backend_->control_port(); }

  protocols::ClusterKey key_ = std::move(protocols::ClusterKey::Generate()).value();
  std::unique_ptr<ClusterBackend> backend_;
};

}  // namespace kvrelay::coordinator::testing
