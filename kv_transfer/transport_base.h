// Shared machinery of the backends: handle bookkeeping (Poll/Wait/Cancel),
// receive matching by (peer, request_id, tag), and staging of data that
// arrives before its receive is posted. Staging is bounded before anything
// is allocated: a transfer whose announced total does not fit what is left
// of max_unexpected_bytes is refused whole (never reserved), staged memory
// grows only with bytes that arrived, staged data nobody claims within
// max_unexpected_age is dropped, and a lost peer's incomplete staged data is
// dropped with it.
// Internal to kv_transfer; callers use transport.h.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kv_transfer/regions.h"
#include "kv_transfer/transport.h"

namespace kvrelay::kv_transfer {

struct TransferKey {
  int peer = 0;  // the other side: destination for sends, source for receives
  uint64_t request_id = 0;
  uint32_t tag = 0;
  bool operator==(const TransferKey&) const = default;
};
struct TransferKeyHash {
  size_t operator()(const TransferKey& k) const {
    return std::hash<uint64_t>()(k.request_id * 0x9E3779B97F4A7C15ull ^
                                 (static_cast<uint64_t>(k.tag) << 20) ^
                                 static_cast<uint64_t>(k.peer));
  }
};
std::string KeyString(const TransferKey& key);

// One mutex + condition variable guarding a transport's state (the local
// backend shares one domain between all endpoints of a fabric).
struct SyncDomain {
  std::mutex mu;
  std::condition_variable cv;
};

class TransportBase : public Transport {
 public:
  void PeerRejoined(int peer) override {
    std::lock_guard lock(domain_->mu);
    PeerBackLocked(peer);
  }
  struct Op {
    TransferHandle handle = 0;
    bool is_send = false;
    TransferKey key;
    std::vector<Region> regions;  // caller memory
    size_t total = 0;
    // All below guarded by domain mu.
    bool done = false;
    Status status;
    RegionCursor cursor;  // receive progress
    size_t received = 0;
    bool cancel_requested = false;
    int backend_state = 0;     // backend-specific (e.g. MPI: bound to a direct receive)
    Status backend_error;      // backend-specific: first error seen while backend_state != 0
    bool quarantined = false;  // ended kAborted: the backend keeps the buffers
    // The endpoint whose max_inflight slot this op holds until done (the
    // local backend completes a peer endpoint's ops too); null: none.
    TransportBase* counted_by = nullptr;
  };
  using OpPtr = std::shared_ptr<Op>;

  Result<TransferHandle> PostSend(const TransferDesc& desc) override;
  Result<TransferHandle> PostRecv(const TransferDesc& desc) override;
  Result<bool> Poll(TransferHandle handle) override;
  Status Wait(TransferHandle handle, Deadline deadline) override;
  Status Cancel(TransferHandle handle) override;
  int inflight() const override;
  int max_inflight() const override { return max_inflight_; }
  // The backend takes back what it can (AbandonPeerLocked); transfers still
  // bound to it end kAborted and are quarantined; the rest fail with `why`.
  void AbandonPeer(int peer, const Status& why) override;
  int64_t quarantined_bytes() const override;
  // Bytes of the staging budget held now by data no receive was posted for.
  int64_t staged_bytes() const;

 protected:
  TransportBase(std::shared_ptr<SyncDomain> domain, int max_inflight, int64_t max_unexpected_bytes);

  // --- backend hooks (domain mu held via `lock`) ---
  // Begin moving a registered send. An error fails the post.
  virtual Status StartSendLocked(const OpPtr& op, std::unique_lock<std::mutex>& lock) = 0;
  // A receive was registered and matched nothing staged (local: match a waiting send).
  virtual void RecvPostedLocked(const OpPtr& op, std::unique_lock<std::mutex>& lock) {}
  // Stop touching op's buffers before returning (may release and retake `lock`).
  // The default drops an unbound receive; sends need a backend override.
  virtual void CancelLocked(const OpPtr& op, std::unique_lock<std::mutex>& lock);
  // `peer` is dead: stop touching the buffers of its transfers where the
  // backend can (reset backend_state, may release and retake `lock`, bounded
  // wait). Whatever is still bound afterwards is quarantined by the caller.
  virtual void AbandonPeerLocked(int peer, const Status& why, std::unique_lock<std::mutex>& lock) {}

  // --- for backends delivering bytes (domain mu held) ---
  // In-order bytes [offset, offset+len) of a `total`-byte transfer `key` arrived.
  void DeliverLocked(const TransferKey& key, size_t offset, size_t total, const uint8_t* data,
                     size_t len);
  // The sender abandoned `key`; its receive fails with `why`.
  void AbortLocked(const TransferKey& key, const Status& why);
  // Every unfinished transfer with `peer` fails; later posts to/from it fail fast.
  void PeerLostLocked(int peer, const Status& why);
  void CompleteLocked(const OpPtr& op, Status status);
  // Ends an op the backend cannot take back: kAborted, its buffers counted
  // in quarantined_bytes() and never to be reused by the caller.
  void QuarantineLocked(const OpPtr& op, const std::string& why);
  // Every unfinished transfer fails with `why` (backend_state reset): for a
  // backend that has stopped every thread that could touch the buffers.
  void FailAllLocked(const Status& why);
  // Removes and returns a posted receive for key that has received nothing yet.
  OpPtr TakePostedRecvLocked(const TransferKey& key);
  // The posted, unfinished receive for key, or nullptr when there is none or
  // key's remaining data is being dropped (a backend may then write the
  // receive's regions directly, in order, and advance cursor/received itself).
  OpPtr PostedRecvLocked(const TransferKey& key) const;
  bool HasPostedRecvsLocked() const { return !posted_recvs_.empty(); }
  // An unfinished transfer with `peer` is bound to a backend operation.
  bool AnyBoundLocked(int peer) const;
  // A peer (re)connected: posts to/from it are allowed again.
  void PeerBackLocked(int peer) { lost_peers_.erase(peer); }
  // How long staged (unexpected) data waits for its receive; default 60 s.
  void set_max_unexpected_age(std::chrono::milliseconds age) { max_unexpected_age_ = age; }
  // Bytes staged now (for tests and leak checks).
  int64_t StagedBytesLocked() const { return staged_bytes_; }
  bool PeerLostLocked(int peer) const { return lost_peers_.count(peer) > 0; }

  std::shared_ptr<SyncDomain> domain_;

 private:
  struct Staged {
    std::vector<uint8_t> bytes;
    size_t total = 0;
    int64_t charged = 0;  // bytes of the budget this entry holds (0 when refused)
    TimePoint since;
    Status error;  // set when dropped (over budget) or aborted
  };
  // Drops staged entries older than max_unexpected_age_ (domain mu held).
  void ExpireStagedLocked();
  void EraseStagedLocked(std::unordered_map<TransferKey, Staged, TransferKeyHash>::iterator it);
  Result<TransferHandle> Post(const TransferDesc& desc, bool is_send);
  void ReleaseLocked(const OpPtr& op);

  const int max_inflight_;
  const int64_t max_unexpected_bytes_;
  // Posted transfers not finished yet: what max_inflight bounds. A finished
  // transfer whose handle the caller has not consumed yet (Poll/Wait/Cancel)
  // holds no backend resource and does not count (guarded by domain_->mu).
  int unfinished_ = 0;
  std::chrono::milliseconds max_unexpected_age_{60000};  // guarded by domain_->mu
  // All guarded by domain_->mu.
  TransferHandle next_handle_ = 1;
  std::unordered_map<TransferHandle, OpPtr> ops_;
  std::unordered_map<TransferKey, OpPtr, TransferKeyHash> posted_recvs_;
  std::unordered_map<TransferKey, Staged, TransferKeyHash> staged_;
  // Tombstones of cancelled or failed receives, from when: the sender's bytes
  // for them (still coming, or not started yet) are discarded, not staged;
  // cleared by the last byte, a new receive of the key, or max_unexpected_age_.
  std::unordered_map<TransferKey, TimePoint, TransferKeyHash> dropping_;
  std::unordered_set<int> lost_peers_;
  std::unordered_map<int, Status> lost_reason_;
  int64_t staged_bytes_ = 0;
  int64_t quarantined_bytes_ = 0;
};

}  // namespace kvrelay::kv_transfer
