#include "kv_transfer/layer_stream.h"

#include <chrono>
#include <cstring>
#include <thread>

#include "common/hash.h"
#include "protocols/kv_manifest.pb.h"

namespace kvrelay::kv_transfer {
namespace {

// Manifest slot: [u64 xxh3 of the rest][u32 length][serialized KvTransferManifest][zero padding].
constexpr size_t kSlotHeader = 12;
size_t ManifestSlotBytes(size_t blocks) {
  size_t n = 256 + 32 * blocks;
  return n + (n & 1);
}

TransferDesc LayerDesc(int peer, const StreamSpec& spec, const StreamBuffers& b, int layer) {
  TransferDesc d;
  d.peer = peer;
  d.request_id = spec.request_id;
  d.tag = StreamTag(spec.stream_id, layer, /*payload=*/true);
  d.layout = b.layout;
  const int64_t stride =
      b.layer_stride != 0 ? b.layer_stride : 2 * b.layout.kv_heads * b.layout.slab_bytes;
  for (size_t i = 0; i < b.block_layer0.size(); ++i) {
    KvSlice s;
    s.block = spec.blocks[i];
    s.layer_begin = layer;
    s.layer_end = layer + 1;
    s.head_begin = b.local_heads.begin;
    s.head_end = b.local_heads.end;
    s.layer_data = b.LayerAddress(i, layer);
    s.layer_stride = stride;  // one layer per slice: never stepped over
    d.slices.push_back(s);
  }
  return d;
}

uint64_t ExpectedBytes(const StreamBuffers& b) {
  return 2ull * static_cast<uint64_t>(b.local_heads.size()) *
         static_cast<uint64_t>(b.layout.slab_bytes) * b.block_layer0.size();
}

Status CheckSpec(const StreamSpec& spec, const StreamBuffers& b) {
  if (spec.layers <= 0 || spec.layers >= (1 << 15)) {
    return InvalidArgument("layer stream: layers " + std::to_string(spec.layers) +
                           " outside [1, 32767]");
  }
  if (spec.stream_id >= (1u << 15)) return InvalidArgument("layer stream: stream_id >= 2^15");
  if (spec.blocks.empty()) return InvalidArgument("layer stream: no blocks");
  if (spec.blocks.size() != b.block_layer0.size()) {
    return InvalidArgument("layer stream: " + std::to_string(spec.blocks.size()) + " blocks but " +
                           std::to_string(b.block_layer0.size()) + " block buffers");
  }
  if (!b.layer_data.empty() &&
      b.layer_data.size() != static_cast<size_t>(spec.layers) * b.block_layer0.size()) {
    return InvalidArgument("layer stream: " + std::to_string(b.layer_data.size()) +
                           " layer addresses for " + std::to_string(spec.layers) + " layers of " +
                           std::to_string(b.block_layer0.size()) + " blocks");
  }
  if (b.local_heads.size() != spec.global_heads.size() || b.local_heads.size() <= 0) {
    return InvalidArgument("layer stream: local head range size " +
                           std::to_string(b.local_heads.size()) + " != global head range size " +
                           std::to_string(spec.global_heads.size()));
  }
  return Status::Ok();
}

}  // namespace

uint32_t StreamTag(uint32_t stream_id, int layer, bool payload) {
  return (stream_id << 16) | (static_cast<uint32_t>(layer) << 1) | (payload ? 1u : 0u);
}

uint64_t SliceChecksum(const StreamBuffers& b, size_t block, int layer) {
  const int64_t slab = b.layout.slab_bytes;
  const uint8_t* base = b.LayerAddress(block, layer);
  const size_t n = static_cast<size_t>(b.local_heads.size() * slab);
  uint64_t k = Xxh3_64(base + b.local_heads.begin * slab, n, 0);
  return Xxh3_64(base + (b.layout.kv_heads + b.local_heads.begin) * slab, n, k);
}

// --- sender ----------------------------------------------------------------

LayerStreamSender::LayerStreamSender(Transport* transport, int peer, StreamSpec spec,
                                     StreamBuffers buffers)
    : transport_(transport),
      peer_(peer),
      spec_(std::move(spec)),
      buffers_(std::move(buffers)),
      manifests_(static_cast<size_t>(std::max(spec_.layers, 0))),
      sent_(static_cast<size_t>(std::max(spec_.layers, 0)), false) {
  status_ = CheckSpec(spec_, buffers_);
}

LayerStreamSender::~LayerStreamSender() { CancelAll(); }

void LayerStreamSender::CancelAll() {
  for (TransferHandle h : handles_) Note(transport_->Cancel(h));
  handles_.clear();
  deferred_.clear();
}

int LayerStreamSender::layers_sent() const {
  int n = 0;
  for (bool s : sent_) n += s ? 1 : 0;
  return n;
}

Status LayerStreamSender::Fail(Status why) {
  Note(why);
  status_ = std::move(why);
  CancelAll();
  return status_;
}

Status LayerStreamSender::PostOne(const PendingSend& p) {
  const TransferDesc desc =
      p.payload ? LayerDesc(peer_, spec_, buffers_, p.layer)
                : SlotDesc(peer_, spec_.request_id, StreamTag(spec_.stream_id, p.layer, false),
                           &manifests_[p.layer]);
  ASSIGN_OR_RETURN(TransferHandle h, transport_->PostSend(desc));
  handles_.push_back(h);
  return Status::Ok();
}

Status LayerStreamSender::PostDeferred() {
  while (!deferred_.empty()) {
    Status st = PostOne(deferred_.front());
    if (st.code() == StatusCode::kResourceExhausted) return Status::Ok();  // still full
    if (!st.ok()) {
      return Fail(
          st.WithContext("layer stream: posting layer " + std::to_string(deferred_.front().layer)));
    }
    deferred_.pop_front();
  }
  return Status::Ok();
}

Status LayerStreamSender::SendLayer(int layer) {
  RETURN_IF_ERROR(status_);
  if (layer < 0 || layer >= spec_.layers) {
    return InvalidArgument("layer stream: layer " + std::to_string(layer) + " outside [0, " +
                           std::to_string(spec_.layers) + ")");
  }
  if (sent_[layer])
    return AlreadyExists("layer stream: layer " + std::to_string(layer) + " sent twice");
  proto::KvTransferManifest m;
  m.set_request_id(spec_.request_id);
  m.set_layer_begin(static_cast<uint32_t>(layer));
  m.set_layer_end(static_cast<uint32_t>(layer + 1));
  for (auto b : spec_.blocks) m.add_block_ids(b);
  m.mutable_heads()->set_begin(static_cast<uint32_t>(spec_.global_heads.begin));
  m.mutable_heads()->set_end(static_cast<uint32_t>(spec_.global_heads.end));
  m.set_block_tokens(static_cast<uint32_t>(spec_.block_tokens));
  m.set_head_dim(static_cast<uint32_t>(spec_.head_dim));
  m.set_dtype(static_cast<proto::KvDtype>(static_cast<int>(spec_.dtype) + 1));
  m.set_byte_count(ExpectedBytes(buffers_));
  m.set_model_fingerprint(spec_.model_fingerprint.data(), spec_.model_fingerprint.size());
  for (size_t i = 0; i < spec_.blocks.size(); ++i) {
    auto* c = m.add_checksums();
    c->set_block_id(spec_.blocks[i]);
    c->set_layer(static_cast<uint32_t>(layer));
    c->set_xxh3(SliceChecksum(buffers_, i, layer));
  }
  auto slot = EncodeManifestSlot(m.SerializeAsString(), spec_.blocks.size());
  if (!slot.ok()) return Fail(slot.status());
  manifests_[layer] = std::move(*slot);
  sent_[layer] = true;
  // Behind whatever is already deferred: the receiver takes a layer's
  // halves in any order, but the oldest layers should leave first.
  deferred_.push_back({layer, /*payload=*/false});
  deferred_.push_back({layer, /*payload=*/true});
  return PostDeferred();
}

Status LayerStreamSender::Finish(Deadline deadline) {
  RETURN_IF_ERROR(status_);
  for (;;) {
    ASSIGN_OR_RETURN(bool done, Poll());
    if (done) return Status::Ok();
    if (handles_.empty()) {
      // Only deferred sends left, and the transport is full with other
      // streams' transfers: wait for room, bounded by the deadline.
      if (deadline.Expired()) {
        return Fail(DeadlineExceeded("layer stream: " + std::to_string(deferred_.size()) +
                                     " sends still waiting for transport room at the deadline"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    TransferHandle h = handles_.front();
    handles_.erase(handles_.begin());
    Status st = transport_->Wait(h, deadline);
    if (!st.ok()) return Fail(st);
  }
}

Result<bool> LayerStreamSender::Poll() {
  RETURN_IF_ERROR(status_);
  for (auto it = handles_.begin(); it != handles_.end();) {
    Result<bool> done = transport_->Poll(*it);
    if (!done.ok()) {
      handles_.erase(it);
      return Fail(done.status());
    }
    it = *done ? handles_.erase(it) : std::next(it);
  }
  RETURN_IF_ERROR(PostDeferred());
  return handles_.empty() && deferred_.empty();
}

// --- receiver --------------------------------------------------------------

LayerStreamReceiver::LayerStreamReceiver(Transport* transport, int peer, StreamSpec spec,
                                         StreamBuffers buffers)
    : transport_(transport),
      peer_(peer),
      spec_(std::move(spec)),
      buffers_(std::move(buffers)),
      manifests_(static_cast<size_t>(std::max(spec_.layers, 0))),
      recvs_(static_cast<size_t>(std::max(spec_.layers, 0))),
      verified_(static_cast<size_t>(std::max(spec_.layers, 0)), false) {
  status_ = CheckSpec(spec_, buffers_);
}

LayerStreamReceiver::~LayerStreamReceiver() { Invalidate(Cancelled("receiver destroyed")); }

int LayerStreamReceiver::layers_complete() const {
  int n = 0;
  for (bool v : verified_) n += v ? 1 : 0;
  return n;
}

void LayerStreamReceiver::Invalidate(Status why) {
  for (auto& r : recvs_) {
    for (auto [h, done] :
         {std::pair{r.manifest, r.manifest_done}, std::pair{r.data, r.data_done}}) {
      if (h != 0 && !done && transport_->Cancel(h).code() == StatusCode::kAborted) {
        quarantined_ = true;
      }
    }
    r.manifest_done = r.data_done = true;
  }
  if (status_.ok()) status_ = std::move(why);
}

Status LayerStreamReceiver::Start() {
  RETURN_IF_ERROR(status_);
  if (started_) return FailedPrecondition("layer stream: Start called twice");
  started_ = true;
  for (int l = 0; l < spec_.layers; ++l) {
    manifests_[l].assign(ManifestSlotBytes(spec_.blocks.size()), '\0');
    auto mh = transport_->PostRecv(
        SlotDesc(peer_, spec_.request_id, StreamTag(spec_.stream_id, l, false), &manifests_[l]));
    if (!mh.ok()) {
      Invalidate(mh.status());
      return status_;
    }
    recvs_[l].manifest = *mh;
    auto dh = transport_->PostRecv(LayerDesc(peer_, spec_, buffers_, l));
    if (!dh.ok()) {
      recvs_[l].data_done = true;
      Invalidate(dh.status());
      return status_;
    }
    recvs_[l].data = *dh;
  }
  return Status::Ok();
}

Status LayerStreamReceiver::PollLayer(int l) {
  LayerRecv& r = recvs_[l];
  auto poll = [&](TransferHandle h, bool* done) -> Status {
    if (*done) return Status::Ok();
    auto p = transport_->Poll(h);
    if (!p.ok()) {
      if (p.status().code() == StatusCode::kAborted) quarantined_ = true;
      *done = true;
      return p.status();
    }
    *done = *p;
    return Status::Ok();
  };
  Status st = poll(r.manifest, &r.manifest_done);
  if (st.ok()) st = poll(r.data, &r.data_done);
  if (!st.ok()) return st.WithContext("layer " + std::to_string(l));
  if (r.manifest_done && r.data_done && !verified_[l]) {
    RETURN_IF_ERROR(Verify(l));
    verified_[l] = true;
  }
  return Status::Ok();
}

Status LayerStreamReceiver::Progress() {
  if (!status_.ok()) return status_;
  if (!started_) return FailedPrecondition("layer stream: Progress before Start");
  for (int l = 0; l < spec_.layers; ++l) {
    Status st = PollLayer(l);
    if (!st.ok()) {
      Invalidate(st);
      return status_;
    }
  }
  return status_;
}

Status LayerStreamReceiver::Verify(int l) {
  return VerifyLayerManifest(manifests_[l], spec_, buffers_, l);
}

TransferDesc SlotDesc(int peer, uint64_t request_id, uint32_t tag, std::string* slot) {
  TransferDesc d;
  d.peer = peer;
  d.request_id = request_id;
  d.tag = tag;
  d.layout.kv_heads = 1;  // a byte buffer is a one-head, one-layer slice: K half then V half
  d.layout.slab_bytes = static_cast<int64_t>(slot->size() / 2);
  KvSlice s;
  s.layer_begin = 0;
  s.layer_end = 1;
  s.head_begin = 0;
  s.head_end = 1;
  s.layer_data = reinterpret_cast<uint8_t*>(slot->data());
  d.slices.push_back(s);
  return d;
}

Result<std::string> EncodeSlot(std::string_view payload, size_t slot_bytes) {
  std::string slot(slot_bytes, '\0');
  if (slot_bytes % 2 != 0 || payload.size() + kSlotHeader > slot.size()) {
    return Internal("slot: " + std::to_string(payload.size()) + " bytes do not fit a slot of " +
                    std::to_string(slot_bytes));
  }
  const uint32_t len32 = static_cast<uint32_t>(payload.size());
  std::memcpy(slot.data() + 8, &len32, 4);
  if (!payload.empty()) std::memcpy(slot.data() + kSlotHeader, payload.data(), payload.size());
  const uint64_t sum = Xxh3_64(slot.data() + 8, slot.size() - 8);
  std::memcpy(slot.data(), &sum, 8);
  return slot;
}

Result<std::string_view> OpenSlot(std::string_view slot) {
  if (slot.size() < kSlotHeader) return DataLoss("shorter than its header");
  uint64_t sum = 0;
  std::memcpy(&sum, slot.data(), 8);
  if (sum != Xxh3_64(slot.data() + 8, slot.size() - 8)) return DataLoss("checksum mismatch");
  uint32_t len = 0;
  std::memcpy(&len, slot.data() + 8, 4);
  if (len > slot.size() - kSlotHeader) return DataLoss("length beyond its slot");
  return slot.substr(kSlotHeader, len);
}

Result<std::string> EncodeManifestSlot(std::string_view manifest, size_t blocks) {
  auto slot = EncodeSlot(manifest, ManifestSlotBytes(blocks));
  if (!slot.ok()) return Internal("layer stream: manifest larger than its slot");
  return slot;
}

Status VerifyLayerManifest(std::string_view slot, const StreamSpec& spec,
                           const StreamBuffers& buffers, int l) {
  if (l < 0 || l >= spec.layers) {
    return InvalidArgument("layer stream: layer " + std::to_string(l) + " outside the stream");
  }
  if (slot.size() != ManifestSlotBytes(spec.blocks.size())) {
    return DataLoss("layer stream: manifest slot of " + std::to_string(slot.size()) +
                    " bytes, expected " + std::to_string(ManifestSlotBytes(spec.blocks.size())));
  }
  const std::string where =
      "request " + std::to_string(spec.request_id) + " layer " + std::to_string(l) + ": ";
  auto body = OpenSlot(slot);
  if (!body.ok()) return DataLoss(where + "manifest " + body.status().message());
  proto::KvTransferManifest m;
  if (!m.ParseFromArray(body->data(), static_cast<int>(body->size()))) {
    return DataLoss(where + "unparseable manifest");
  }
  auto field = [&](const char* name, uint64_t got, uint64_t want) -> Status {
    if (got == want) return Status::Ok();
    return DataLoss(where + "manifest " + name + " is " + std::to_string(got) + ", expected " +
                    std::to_string(want));
  };
  RETURN_IF_ERROR(field("request_id", m.request_id(), spec.request_id));
  RETURN_IF_ERROR(field("layer_begin", m.layer_begin(), static_cast<uint64_t>(l)));
  RETURN_IF_ERROR(field("layer_end", m.layer_end(), static_cast<uint64_t>(l + 1)));
  RETURN_IF_ERROR(field("heads.begin", m.heads().begin(), spec.global_heads.begin));
  RETURN_IF_ERROR(field("heads.end", m.heads().end(), spec.global_heads.end));
  RETURN_IF_ERROR(field("block_tokens", m.block_tokens(), spec.block_tokens));
  RETURN_IF_ERROR(field("head_dim", m.head_dim(), spec.head_dim));
  RETURN_IF_ERROR(field("dtype", m.dtype(), static_cast<uint64_t>(spec.dtype) + 1));
  RETURN_IF_ERROR(field("byte_count", m.byte_count(), ExpectedBytes(buffers)));
  if (m.model_fingerprint().size() != spec.model_fingerprint.size() ||
      std::memcmp(m.model_fingerprint().data(), spec.model_fingerprint.data(),
                  spec.model_fingerprint.size()) != 0) {
    return DataLoss(where + "manifest model_fingerprint differs from this worker's model");
  }
  RETURN_IF_ERROR(
      field("block count", static_cast<uint64_t>(m.block_ids_size()), spec.blocks.size()));
  RETURN_IF_ERROR(
      field("checksum count", static_cast<uint64_t>(m.checksums_size()), spec.blocks.size()));
  for (size_t i = 0; i < spec.blocks.size(); ++i) {
    const int idx = static_cast<int>(i);
    if (m.block_ids(idx) != spec.blocks[i] || m.checksums(idx).block_id() != spec.blocks[i] ||
        m.checksums(idx).layer() != static_cast<uint32_t>(l)) {
      return DataLoss(where + "manifest entry " + std::to_string(i) + " names block " +
                      std::to_string(m.block_ids(idx)) + ", expected block " +
                      std::to_string(spec.blocks[i]));
    }
    uint64_t got = SliceChecksum(buffers, i, l);
    if (got != m.checksums(idx).xxh3()) {
      char buf[160];
      std::snprintf(buf, sizeof(buf),
                    "checksum mismatch in block %d: received %016llx, sent %016llx", spec.blocks[i],
                    static_cast<unsigned long long>(got),
                    static_cast<unsigned long long>(m.checksums(idx).xxh3()));
      return DataLoss(where + buf);
    }
  }
  return Status::Ok();
}

Status LayerStreamReceiver::WaitLayer(int layer, Deadline deadline) {
  if (layer < 0 || layer >= spec_.layers) {
    return InvalidArgument("layer stream: layer " + std::to_string(layer) + " out of range");
  }
  if (!status_.ok()) return status_;
  if (!started_) return FailedPrecondition("layer stream: WaitLayer before Start");
  LayerRecv& r = recvs_[layer];
  auto wait = [&](TransferHandle h, bool* done) -> Status {
    if (*done) return Status::Ok();
    Status st = transport_->Wait(h, deadline);
    if (st.code() == StatusCode::kAborted) quarantined_ = true;
    *done = true;
    return st;
  };
  Status st = wait(r.manifest, &r.manifest_done);
  if (st.ok()) st = wait(r.data, &r.data_done);
  if (st.ok() && !verified_[layer]) {
    st = Verify(layer);
    if (st.ok()) verified_[layer] = true;
  }
  if (!st.ok()) {
    Invalidate(st.WithContext("layer " + std::to_string(layer)));
    return status_;
  }
  return Status::Ok();
}

Status LayerStreamReceiver::WaitAll(Deadline deadline) {
  for (int l = 0; l < spec_.layers; ++l) RETURN_IF_ERROR(WaitLayer(l, deadline));
  return Status::Ok();
}

}  // namespace kvrelay::kv_transfer
