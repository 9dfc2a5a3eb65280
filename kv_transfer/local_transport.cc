#include "kv_transfer/local_transport.h"

namespace kvrelay::kv_transfer {

std::shared_ptr<LocalFabric> LocalFabric::Create(Options options) {
  return std::shared_ptr<LocalFabric>(new LocalFabric(options));
}

LocalFabric::LocalFabric(Options options)
    : options_(options),
      domain_(std::make_shared<SyncDomain>()),
      endpoints_(static_cast<size_t>(std::max(options.world_size, 0)), nullptr) {}

Result<std::unique_ptr<LocalTransport>> LocalFabric::CreateEndpoint(int rank) {
  std::lock_guard lock(domain_->mu);
  if (rank < 0 || rank >= options_.world_size) {
    return InvalidArgument("local fabric: rank " + std::to_string(rank) + " outside [0, " +
                           std::to_string(options_.world_size) + ")");
  }
  if (endpoints_[rank] != nullptr) {
    return AlreadyExists("local fabric: rank " + std::to_string(rank) + " already has an endpoint");
  }
  auto t = std::unique_ptr<LocalTransport>(new LocalTransport(shared_from_this(), rank));
  endpoints_[rank] = t.get();
  return t;
}

void LocalFabric::Disconnect(int rank) {
  std::lock_guard lock(domain_->mu);
  for (LocalTransport* t : endpoints_) {
    if (t == nullptr || t->rank_ == rank) continue;
    // Sends from `rank` waiting at t are the dead sender's; drop them.
    std::erase_if(t->waiting_sends_, [&](const auto& kv) { return kv.first.peer == rank; });
    t->PeerLostLocked(rank, Unavailable("local peer " + std::to_string(rank) + " disconnected"));
  }
  if (endpoints_[rank] != nullptr) endpoints_[rank]->waiting_sends_.clear();
}

LocalTransport::LocalTransport(std::shared_ptr<LocalFabric> fabric, int rank)
    : TransportBase(fabric->domain_, fabric->options_.max_inflight,
                    fabric->options_.max_unexpected_bytes),
      fabric_(std::move(fabric)),
      rank_(rank) {}

LocalTransport::~LocalTransport() {
  std::lock_guard lock(domain_->mu);
  for (LocalTransport* t : fabric_->endpoints_) {
    if (t == nullptr || t == this) continue;
    std::erase_if(t->waiting_sends_, [&](const auto& kv) { return kv.first.peer == rank_; });
  }
  fabric_->endpoints_[rank_] = nullptr;
}

void LocalTransport::MatchLocked(const OpPtr& send, const OpPtr& recv) {
  if (send->total != recv->total) {
    Status bad = DataLoss(KeyString(recv->key) + ": sender sent " + std::to_string(send->total) +
                          " bytes, receive expects " + std::to_string(recv->total));
    CompleteLocked(recv, bad);
    CompleteLocked(send, bad);
    return;
  }
  CopyRegions(send->regions, recv->regions);
  recv->received = recv->total;
  CompleteLocked(recv, Status::Ok());
  CompleteLocked(send, Status::Ok());
}

Status LocalTransport::StartSendLocked(const OpPtr& op, std::unique_lock<std::mutex>&) {
  LocalTransport* dst = fabric_->endpoints_[op->key.peer];
  if (dst == nullptr) {
    return Unavailable("local peer " + std::to_string(op->key.peer) + " has no endpoint");
  }
  TransferKey at_dst{rank_, op->key.request_id, op->key.tag};
  if (OpPtr recv = dst->TakePostedRecvLocked(at_dst)) {
    MatchLocked(op, recv);
    return Status::Ok();
  }
  if (!dst->waiting_sends_.emplace(at_dst, op).second) {
    return AlreadyExists("a send for " + KeyString(op->key) + " is already waiting");
  }
  return Status::Ok();
}

void LocalTransport::RecvPostedLocked(const OpPtr& op, std::unique_lock<std::mutex>&) {
  auto it = waiting_sends_.find(op->key);
  if (it == waiting_sends_.end()) return;
  OpPtr send = it->second;
  waiting_sends_.erase(it);
  TakePostedRecvLocked(op->key);
  MatchLocked(send, op);
}

void LocalTransport::CancelLocked(const OpPtr& op, std::unique_lock<std::mutex>& lock) {
  if (!op->is_send) {
    TransportBase::CancelLocked(op, lock);
    return;
  }
  LocalTransport* dst = fabric_->endpoints_[op->key.peer];
  if (dst == nullptr) return;
  TransferKey at_dst{rank_, op->key.request_id, op->key.tag};
  auto it = dst->waiting_sends_.find(at_dst);
  if (it != dst->waiting_sends_.end() && it->second == op) {
    dst->waiting_sends_.erase(it);
    // The receiver, when it posts, learns that the sender gave up.
    dst->AbortLocked(at_dst, Cancelled(KeyString(at_dst) + ": the sender cancelled"));
  }
}

}  // namespace kvrelay::kv_transfer
