#include "tests/testing/fault_injecting_transport.h"

#include "kv_transfer/regions.h"

namespace kvrelay::kv_transfer {

Result<TransferHandle> FaultInjectingTransport::PostSend(const TransferDesc& desc) {
  Fault fault = rule_ ? rule_(desc) : Fault::kNone;
  if (fault == Fault::kNone) return inner_->PostSend(desc);
  RETURN_IF_ERROR(ValidateDesc(desc, world_size()));
  if (fault == Fault::kDrop) {
    std::lock_guard lock(mutex_);
    ++dropped_;
    return kDroppedBit | next_dropped_++;
  }
  // kCorrupt: stage a copy, flip a byte in the middle, send the copy.
  auto regions = ResolveRegions(desc);
  std::string staging(TotalBytes(regions), '\0');
  RegionCursor cursor;
  GatherFrom(regions, &cursor, reinterpret_cast<uint8_t*>(staging.data()), staging.size());
  staging[staging.size() / 2] ^= 0x5A;
  TransferDesc copy;
  copy.peer = desc.peer;
  copy.request_id = desc.request_id;
  copy.tag = desc.tag;
  copy.layout.kv_heads = 1;
  copy.layout.slab_bytes = static_cast<int64_t>(staging.size() / 2);  // wire bytes are even
  KvSlice s;
  s.layer_end = 1;
  s.head_end = 1;
  s.layer_data = reinterpret_cast<uint8_t*>(staging.data());
  copy.slices.push_back(s);
  std::lock_guard lock(mutex_);  // held across the post so Poll cannot release first
  ASSIGN_OR_RETURN(TransferHandle h, inner_->PostSend(copy));
  staging_[h] = std::move(staging);  // std::string move keeps the heap buffer (large sizes)
  ++corrupted_;
  return h;
}

void FaultInjectingTransport::Release(TransferHandle handle) {
  std::lock_guard lock(mutex_);
  staging_.erase(handle);
}

Result<bool> FaultInjectingTransport::Poll(TransferHandle handle) {
  if (handle & kDroppedBit) return true;
  auto r = inner_->Poll(handle);
  if (!r.ok() || *r) Release(handle);
  return r;
}

Status FaultInjectingTransport::Wait(TransferHandle handle, Deadline deadline) {
  if (handle & kDroppedBit) return Status::Ok();
  Status st = inner_->Wait(handle, deadline);
  Release(handle);
  return st;
}

Status FaultInjectingTransport::Cancel(TransferHandle handle) {
  if (handle & kDroppedBit) return Status::Ok();
  Status st = inner_->Cancel(handle);
  Release(handle);
  return st;
}

int FaultInjectingTransport::corrupted() const {
  std::lock_guard lock(mutex_);
  return corrupted_;
}
int FaultInjectingTransport::dropped() const {
  std::lock_guard lock(mutex_);
  return dropped_;
}

}  // namespace kvrelay::kv_transfer
