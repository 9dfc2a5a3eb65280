// In-process backend: endpoints of one LocalFabric exchange KV by memcpy.
// Used by tests, the single-process cluster and as the reference backend.
//
// A send whose receive is not yet posted waits (rendezvous, no copy): the
// bytes move when the receive is posted, straight from the sender's buffers,
// so the sender's lifetime rule (buffers valid until finished) matters here too.
// All endpoints of a fabric share one mutex; copies happen under it.
#pragma once

#include <memory>
#include <unordered_map>
#include <vector>

#include "kv_transfer/transport_base.h"

namespace kvrelay::kv_transfer {

class LocalTransport;

class LocalFabric : public std::enable_shared_from_this<LocalFabric> {
 public:
  struct Options {
    int world_size = 2;
    int max_inflight = 4096;
    int64_t max_unexpected_bytes = 1ll << 30;  // unused: sends rendezvous, nothing is staged
  };
  static std::shared_ptr<LocalFabric> Create(Options options);

  // The endpoint of `rank`; each rank may be created once. The fabric must
  // outlive its endpoints' transfers; endpoints keep the fabric alive.
  Result<std::unique_ptr<LocalTransport>> CreateEndpoint(int rank);
  // Simulates the death of `rank`: every peer's unfinished transfers with it fail.
  void Disconnect(int rank);

 private:
  friend class LocalTransport;
  explicit LocalFabric(Options options);
  Options options_;
  std::shared_ptr<SyncDomain> domain_;
  std::vector<LocalTransport*> endpoints_;  // guarded by domain_->mu
};

class LocalTransport final : public TransportBase {
 public:
  ~LocalTransport() override;
  std::string_view name() const override { return "local"; }
  bool SupportsDeviceMemory() const override { return false; }
  int rank() const override { return rank_; }
  int world_size() const override { return fabric_->options_.world_size; }

 private:
  friend class LocalFabric;
  LocalTransport(std::shared_ptr<LocalFabric> fabric, int rank);
  Status StartSendLocked(const OpPtr& op, std::unique_lock<std::mutex>& lock) override;
  void RecvPostedLocked(const OpPtr& op, std::unique_lock<std::mutex>& lock) override;
  void CancelLocked(const OpPtr& op, std::unique_lock<std::mutex>& lock) override;
  void MatchLocked(const OpPtr& send, const OpPtr& recv);

  std::shared_ptr<LocalFabric> fabric_;
  const int rank_;
  // Sends from other endpoints waiting for this endpoint's receive; keyed by
  // (source rank, request, tag). Guarded by the fabric's mutex.
  std::unordered_map<TransferKey, OpPtr, TransferKeyHash> waiting_sends_;
};

}  // namespace kvrelay::kv_transfer
