#include "kv_transfer/transport_base.h"

#include <string>

#include "common/logging.h"

namespace kvrelay::kv_transfer {

std::string KeyString(const TransferKey& key) {
  return "request " + std::to_string(key.request_id) + " tag " + std::to_string(key.tag) +
         " peer " + std::to_string(key.peer);
}

TransportBase::TransportBase(std::shared_ptr<SyncDomain> domain, int max_inflight,
                             int64_t max_unexpected_bytes)
    : domain_(std::move(domain)),
      max_inflight_(max_inflight),
      max_unexpected_bytes_(max_unexpected_bytes) {}

Result<TransferHandle> TransportBase::PostSend(const TransferDesc& desc) {
  return Post(desc, /*is_send=*/true);
}
Result<TransferHandle> TransportBase::PostRecv(const TransferDesc& desc) {
  return Post(desc, /*is_send=*/false);
}

Result<TransferHandle> TransportBase::Post(const TransferDesc& desc, bool is_send) {
  RETURN_IF_ERROR(ValidateDesc(desc, world_size()));
  if (desc.layout.memory == MemoryKind::kDevice && !SupportsDeviceMemory()) {
    return Unimplemented(std::string("transport '") + std::string(name()) +
                         "' cannot move device memory");
  }
  auto op = std::make_shared<Op>();
  op->is_send = is_send;
  op->key = {desc.peer, desc.request_id, desc.tag};
  op->regions = ResolveRegions(desc);
  op->total = TotalBytes(op->regions);

  std::unique_lock lock(domain_->mu);
  // Only unfinished transfers count: a caller that reaps its handles late
  // (a prefill worker polls a request's sends only once the request has
  // finished computing) must not make every other stream fail.
  if (unfinished_ >= max_inflight_) {
    return ResourceExhausted(std::string(name()) + " transport: " + std::to_string(unfinished_) +
                             " transfers in flight (max_inflight)");
  }
  if (lost_peers_.count(desc.peer)) {
    return Unavailable("peer " + std::to_string(desc.peer) +
                       " is gone: " + lost_reason_[desc.peer].ToString());
  }
  if (!is_send && posted_recvs_.count(op->key)) {
    return AlreadyExists("a receive for " + KeyString(op->key) + " is already posted");
  }
  op->handle = next_handle_++;
  ops_[op->handle] = op;
  op->counted_by = this;
  ++unfinished_;
  if (is_send) {
    Status st = StartSendLocked(op, lock);
    if (!st.ok()) {
      if (op->counted_by != nullptr) {
        op->counted_by = nullptr;
        --unfinished_;
      }
      ops_.erase(op->handle);
      return st;
    }
    return op->handle;
  }
  dropping_.erase(op->key);
  ExpireStagedLocked();
  auto staged = staged_.find(op->key);
  if (staged != staged_.end()) {
    Staged s = std::move(staged->second);
    staged_bytes_ -= s.charged;
    staged_.erase(staged);
    if (!s.error.ok()) {
      CompleteLocked(op, s.error);
    } else if (s.total != op->total) {
      CompleteLocked(op, DataLoss(KeyString(op->key) + ": sender sent " + std::to_string(s.total) +
                                  " bytes, receive expects " + std::to_string(op->total)));
    } else {
      ScatterInto(op->regions, &op->cursor, s.bytes.data(), s.bytes.size());
      op->received = s.bytes.size();
      if (op->received == op->total) {
        CompleteLocked(op, Status::Ok());
      } else {
        posted_recvs_[op->key] = op;
      }
    }
    return op->handle;
  }
  posted_recvs_[op->key] = op;
  RecvPostedLocked(op, lock);
  return op->handle;
}

void TransportBase::CompleteLocked(const OpPtr& op, Status status) {
  if (op->done) return;
  op->done = true;
  if (op->counted_by != nullptr) {
    --op->counted_by->unfinished_;
    op->counted_by = nullptr;
  }
  op->status = std::move(status);
  if (!op->is_send) {
    auto it = posted_recvs_.find(op->key);
    if (it != posted_recvs_.end() && it->second == op) posted_recvs_.erase(it);
  }
  domain_->cv.notify_all();
}

TransportBase::OpPtr TransportBase::TakePostedRecvLocked(const TransferKey& key) {
  auto it = posted_recvs_.find(key);
  if (it == posted_recvs_.end() || it->second->received != 0) return nullptr;
  OpPtr op = it->second;
  posted_recvs_.erase(it);
  return op;
}

void TransportBase::FailAllLocked(const Status& why) {
  for (auto& [handle, op] : ops_) {
    if (op->done) continue;
    op->backend_state = 0;
    CompleteLocked(op, why);
  }
}

TransportBase::OpPtr TransportBase::PostedRecvLocked(const TransferKey& key) const {
  if (dropping_.count(key)) return nullptr;
  auto it = posted_recvs_.find(key);
  return it == posted_recvs_.end() ? nullptr : it->second;
}

void TransportBase::DeliverLocked(const TransferKey& key, size_t offset, size_t total,
                                  const uint8_t* data, size_t len) {
  const bool last = offset + len >= total;
  if (dropping_.count(key)) {
    if (last) dropping_.erase(key);
    return;
  }
  auto it = posted_recvs_.find(key);
  if (it != posted_recvs_.end()) {
    OpPtr op = it->second;
    Status bad;
    if (total != op->total) {
      bad = DataLoss(KeyString(key) + ": sender sent " + std::to_string(total) +
                     " bytes, receive expects " + std::to_string(op->total));
    } else if (offset != op->received) {
      bad = DataLoss(KeyString(key) + ": bytes at offset " + std::to_string(offset) +
                     " arrived, expected offset " + std::to_string(op->received));
    }
    if (!bad.ok()) {
      CompleteLocked(op, bad);
      if (!last) dropping_.emplace(key, Clock::now());
      return;
    }
    ScatterInto(op->regions, &op->cursor, data, len);
    op->received += len;
    if (op->received == op->total) CompleteLocked(op, Status::Ok());
    return;
  }
  // Unexpected: stage it until the receive is posted.
  if (!staged_.count(key)) ExpireStagedLocked();  // before the insert: it must not see itself
  auto [sit, inserted] = staged_.try_emplace(key);
  Staged& s = sit->second;
  if (inserted) {
    s.total = total;
    s.since = Clock::now();
    // The budget is checked against the announced total before anything is
    // charged or allocated; unsigned arithmetic, so a hostile total (2^64 -
    // 2^40) cannot wrap the count negative and switch the limit off.
    const uint64_t left =
        static_cast<uint64_t>(std::max<int64_t>(0, max_unexpected_bytes_ - staged_bytes_));
    if (static_cast<uint64_t>(total) > left) {
      s.error = ResourceExhausted(KeyString(key) + ": " + std::to_string(total) +
                                  " unexpected bytes dropped (staging budget " +
                                  std::to_string(max_unexpected_bytes_) + " bytes, " +
                                  std::to_string(left) + " left)");
      LOG_WARNING << s.error.ToString();
    } else {
      s.charged = static_cast<int64_t>(total);
      staged_bytes_ += s.charged;
      // No reserve(total): memory follows the bytes that actually arrive.
    }
  }
  if (!s.error.ok()) return;
  if (offset != s.bytes.size() || total != s.total) {
    s.error = DataLoss(KeyString(key) + ": out-of-order or resized data while staged");
    return;
  }
  s.bytes.insert(s.bytes.end(), data, data + len);
}

void TransportBase::AbortLocked(const TransferKey& key, const Status& why) {
  if (dropping_.erase(key) > 0) return;  // its receive is gone: nobody to tell
  auto it = posted_recvs_.find(key);
  if (it != posted_recvs_.end()) {
    CompleteLocked(it->second, why);
    return;
  }
  auto [sit, inserted] = staged_.try_emplace(key);
  if (inserted) sit->second.since = Clock::now();
  sit->second.error = why;
  sit->second.bytes.clear();
  sit->second.bytes.shrink_to_fit();
  staged_bytes_ -= sit->second.charged;
  sit->second.charged = 0;
}

void TransportBase::EraseStagedLocked(
    std::unordered_map<TransferKey, Staged, TransferKeyHash>::iterator it) {
  staged_bytes_ -= it->second.charged;
  staged_.erase(it);
}

void TransportBase::ExpireStagedLocked() {
  if (staged_.empty() && dropping_.empty()) return;
  const TimePoint now = Clock::now();
  std::erase_if(dropping_, [&](const auto& d) { return now - d.second > max_unexpected_age_; });
  for (auto it = staged_.begin(); it != staged_.end();) {
    auto next = std::next(it);
    if (now - it->second.since > max_unexpected_age_) {
      LOG_WARNING
          << KeyString(it->first) << ": " << it->second.bytes.size()
          << " staged bytes unclaimed for "
          << std::chrono::duration_cast<std::chrono::milliseconds>(max_unexpected_age_).count()
          << " ms, dropped";
      EraseStagedLocked(it);
    }
    it = next;
  }
}

int64_t TransportBase::staged_bytes() const {
  std::lock_guard lock(domain_->mu);
  return staged_bytes_;
}

void TransportBase::AbandonPeer(int peer, const Status& why) {
  std::unique_lock lock(domain_->mu);
  AbandonPeerLocked(peer, why, lock);
  int quarantined = 0;
  for (auto& [handle, op] : ops_) {
    if (op->key.peer != peer || op->done || op->backend_state == 0) continue;
    QuarantineLocked(op, why.message());
    ++quarantined;
  }
  if (quarantined > 0) {
    LOG_WARNING << name() << " transport: peer " << peer << " abandoned with " << quarantined
                << " transfers still owned by the backend; their buffers are quarantined";
  }
  PeerLostLocked(peer, why);
}

void TransportBase::QuarantineLocked(const OpPtr& op, const std::string& why) {
  if (op->done) return;
  op->quarantined = true;
  quarantined_bytes_ += static_cast<int64_t>(op->total);
  CompleteLocked(op, Aborted(KeyString(op->key) + ": " + why + "; the " + std::string(name()) +
                             " transport still owns its buffers (quarantined)"));
}

bool TransportBase::AnyBoundLocked(int peer) const {
  for (const auto& [handle, op] : ops_) {
    if (op->key.peer == peer && !op->done && op->backend_state != 0) return true;
  }
  return false;
}

int64_t TransportBase::quarantined_bytes() const {
  std::lock_guard lock(domain_->mu);
  return quarantined_bytes_;
}

void TransportBase::PeerLostLocked(int peer, const Status& why) {
  // Staged data from the peer that never completed can never complete now
  // (a reconnected sender starts over): free it.
  for (auto it = staged_.begin(); it != staged_.end();) {
    auto next = std::next(it);
    if (it->first.peer == peer && it->second.bytes.size() < it->second.total) EraseStagedLocked(it);
    it = next;
  }
  if (!lost_peers_.insert(peer).second) return;
  lost_reason_[peer] = why;
  LOG_WARNING << name() << " transport: peer " << peer << " lost: " << why.ToString();
  for (auto& [handle, op] : ops_) {
    if (op->key.peer == peer && !op->done && op->backend_state == 0) CompleteLocked(op, why);
  }
}

void TransportBase::CancelLocked(const OpPtr& op, std::unique_lock<std::mutex>& lock) {
  if (op->is_send) return;
  auto it = posted_recvs_.find(op->key);
  if (it != posted_recvs_.end() && it->second == op) {
    posted_recvs_.erase(it);
    // Whatever of it is still coming, all of it when nothing came yet (the
    // sender may not have started: a request cancelled before its KV left).
    dropping_.emplace(op->key, Clock::now());
  }
}

void TransportBase::ReleaseLocked(const OpPtr& op) { ops_.erase(op->handle); }

Result<bool> TransportBase::Poll(TransferHandle handle) {
  std::unique_lock lock(domain_->mu);
  auto it = ops_.find(handle);
  if (it == ops_.end()) return NotFound("unknown transfer handle " + std::to_string(handle));
  OpPtr op = it->second;
  if (!op->done) return false;
  ReleaseLocked(op);
  if (!op->status.ok()) return op->status;
  return true;
}

Status TransportBase::Wait(TransferHandle handle, Deadline deadline) {
  std::unique_lock lock(domain_->mu);
  auto it = ops_.find(handle);
  if (it == ops_.end()) return NotFound("unknown transfer handle " + std::to_string(handle));
  OpPtr op = it->second;
  domain_->cv.wait_until(lock, deadline.at, [&] { return op->done; });
  if (!op->done) {
    op->cancel_requested = true;
    CancelLocked(op, lock);
    if (!op->done) CompleteLocked(op, Cancelled("deadline"));
    ReleaseLocked(op);
    if (op->quarantined) return op->status;
    return DeadlineExceeded(std::string(op->is_send ? "send " : "receive ") + KeyString(op->key) +
                            " not finished before the deadline (" + std::to_string(op->received) +
                            " of " + std::to_string(op->total) + " bytes)");
  }
  ReleaseLocked(op);
  return op->status;
}

Status TransportBase::Cancel(TransferHandle handle) {
  std::unique_lock lock(domain_->mu);
  auto it = ops_.find(handle);
  if (it == ops_.end()) return NotFound("unknown transfer handle " + std::to_string(handle));
  OpPtr op = it->second;
  if (!op->done) {
    op->cancel_requested = true;
    CancelLocked(op, lock);
    if (!op->done) CompleteLocked(op, Cancelled("cancelled by caller"));
  }
  ReleaseLocked(op);
  if (op->quarantined) return op->status;
  return Status::Ok();
}

int TransportBase::inflight() const {
  std::lock_guard lock(domain_->mu);
  return static_cast<int>(ops_.size());
}

}  // namespace kvrelay::kv_transfer
