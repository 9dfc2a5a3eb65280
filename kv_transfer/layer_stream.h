// Layer-wise KV streaming with integrity checks, on top of any Transport.
//
// The prefill side calls SendLayer(l) as soon as layer l of the prompt's KV is
// computed; the decode side has posted receives for every layer up front and
// sees, per layer, when it has arrived AND verified (completion bitmap). A
// layer travels as two transfers of one (request, tag) family: a manifest
// (protocols/kv_manifest.proto: request, layer, block ids, head range, shape,
// dtype, byte count, model fingerprint, xxh3 per block) in a fixed-size slot,
// and the payload. The receiver checks every manifest field against what it
// expects and recomputes each block's checksum over the bytes that landed.
//
// Any mismatch, missing piece, failed transfer or passed deadline marks the
// destination invalid: every outstanding receive is cancelled, the bitmap
// reads all-false and status() says what went wrong. A stream is complete
// only when every layer arrived and verified; partial KV is never complete.
//
// Thread-compatible: one owner thread per sender / receiver object. The
// caller's buffers follow transport.h's lifetime rule until Finish/WaitAll
// returns (or the object is destroyed, which cancels what is outstanding).
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <string_view>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "engine/kv_cache/kv_cache.h"
#include "kv_transfer/head_sharding.h"
#include "kv_transfer/transport.h"

namespace kvrelay::kv_transfer {

// What both ends agree on for one stream (the receiver verifies it).
struct StreamSpec {
  uint64_t request_id = 0;
  // Several streams of one request between the same two ranks (e.g. two head
  // routes) need distinct ids. < 2^15.
  uint32_t stream_id = 0;
  int layers = 0;  // < 2^15
  // The stream's blocks, in order, as both ends name them on the wire (the
  // workers name a block by its position in the prompt, so a sender needs
  // nothing from the receiver: each end maps the names to its own memory).
  std::vector<engine::BlockId> blocks;
  HeadRange global_heads;  // model kv heads carried
  int block_tokens = 0;
  int head_dim = 0;
  engine::KvDtype dtype = engine::KvDtype::kF32;
  engine::ModelFingerprint model_fingerprint{};
};

// Where the stream's bytes live in the caller's memory.
struct StreamBuffers {
  BufferLayout layout;                 // caller's heads and slab size
  HeadRange local_heads;               // heads of this stream in the caller's buffer
  std::vector<uint8_t*> block_layer0;  // per block (same order as blocks): layer 0 address
  int64_t layer_stride = 0;            // 0: contiguous (2 * kv_heads * slab_bytes)
  // Optional, [layer * blocks + block]: where each (block, layer) lives when a
  // block's layers are not a fixed stride apart (an engine with KV cache
  // groups keeps each group's layers in its own pool blocks). Overrides
  // block_layer0 + layer * layer_stride; block_layer0 still has one entry
  // per block.
  std::vector<uint8_t*> layer_data;

  uint8_t* LayerAddress(size_t block, int layer) const {
    if (!layer_data.empty()) {
      return layer_data[static_cast<size_t>(layer) * block_layer0.size() + block];
    }
    const int64_t stride =
        layer_stride != 0 ? layer_stride : 2 * layout.kv_heads * layout.slab_bytes;
    return block_layer0[block] + layer * stride;
  }
};

// xxh3 of one block's layer slice (K piece then V piece of the head range).
uint64_t SliceChecksum(const StreamBuffers& buffers, size_t block, int layer);

class LayerStreamSender {
 public:
  LayerStreamSender(Transport* transport, int peer, StreamSpec spec, StreamBuffers buffers);
  ~LayerStreamSender();  // cancels unfinished sends
  LayerStreamSender(const LayerStreamSender&) = delete;
  LayerStreamSender& operator=(const LayerStreamSender&) = delete;

  // Posts layer `layer` (manifest + payload). Each layer once, any order.
  // Back-pressure: when the transport has max_inflight transfers in flight
  // (ResourceExhausted) the layer's sends are deferred, in order, and posted
  // by later SendLayer / Poll / Finish calls as room frees up; the stream is
  // finished only once they have been posted and have finished. Any other
  // post error fails the whole stream: Poll / Finish return it, so a layer
  // that never left is never reported delivered.
  Status SendLayer(int layer);
  // Waits for every posted and deferred send; cancels the rest at the
  // deadline or first error.
  Status Finish(Deadline deadline);
  // Non-blocking Finish: posts what was deferred while there is room; true
  // once every send finished OK, false while some are in flight or deferred;
  // the first error cancels the rest and is returned.
  Result<bool> Poll();
  // Layers accepted by SendLayer (posted or deferred).
  int layers_sent() const;
  // Sends not yet finished (as of the last Poll), deferred ones included;
  // with a deadline on progress, a number that stops falling means the path
  // is stuck.
  int unfinished() const { return static_cast<int>(handles_.size() + deferred_.size()); }
  // Sends deferred by back-pressure and not posted yet.
  int deferred() const { return static_cast<int>(deferred_.size()); }
  int peer() const { return peer_; }
  // Cancels every unfinished send (also done by the destructor).
  void CancelAll();
  // A send ended kAborted (its peer was abandoned while the transport still
  // owned the buffers): this sender (its manifest slots) and the blocks it
  // reads must be kept for the life of the transport, never reused.
  bool quarantined() const { return quarantined_; }

 private:
  void Note(const Status& s) {
    if (s.code() == StatusCode::kAborted) quarantined_ = true;
  }
  // One half of a layer: its manifest or its payload.
  struct PendingSend {
    int layer = 0;
    bool payload = false;
  };
  // Posts deferred sends in order until the transport is full again; an
  // error other than ResourceExhausted fails the stream (status_).
  Status PostDeferred();
  // Posts one half; ResourceExhausted when the transport is full.
  Status PostOne(const PendingSend& p);
  // Fails the stream: records `why`, cancels every posted send, drops the deferred.
  Status Fail(Status why);
  Transport* transport_;
  int peer_;
  StreamSpec spec_;
  StreamBuffers buffers_;
  std::vector<std::string> manifests_;   // per layer slot; must outlive its send
  std::vector<TransferHandle> handles_;  // unfinished sends
  std::deque<PendingSend> deferred_;     // accepted, not posted yet (back-pressure)
  std::vector<bool> sent_;
  Status status_;
  bool quarantined_ = false;
};

class LayerStreamReceiver {
 public:
  LayerStreamReceiver(Transport* transport, int peer, StreamSpec spec, StreamBuffers buffers);
  ~LayerStreamReceiver();  // cancels what is outstanding
  LayerStreamReceiver(const LayerStreamReceiver&) = delete;
  LayerStreamReceiver& operator=(const LayerStreamReceiver&) = delete;

  // Posts the receives of every layer.
  Status Start();
  // Polls the transport and verifies finished layers; returns status().
  Status Progress();
  // Waits until `layer` is verified (or the stream fails / the deadline passes;
  // a passed deadline invalidates the whole stream).
  Status WaitLayer(int layer, Deadline deadline);
  // OK only when every layer arrived and verified.
  Status WaitAll(Deadline deadline);

  bool LayerComplete(int layer) const { return valid() && verified_[layer]; }
  int layers_complete() const;
  bool complete() const { return valid() && layers_complete() == spec_.layers; }
  bool valid() const { return status_.ok(); }
  const Status& status() const { return status_; }
  // A receive ended kAborted: the transport still owns destination blocks;
  // they (and this receiver's manifest slots) must never be reused.
  bool quarantined() const { return quarantined_; }

 private:
  struct LayerRecv {
    TransferHandle manifest = 0;
    TransferHandle data = 0;
    bool manifest_done = false;
    bool data_done = false;
  };
  Status PollLayer(int layer);
  Status Verify(int layer);
  void Invalidate(Status why);

  Transport* transport_;
  int peer_;
  StreamSpec spec_;
  StreamBuffers buffers_;
  std::vector<std::string> manifests_;
  std::vector<LayerRecv> recvs_;
  std::vector<bool> verified_;
  bool started_ = false;
  Status status_;
  bool quarantined_ = false;
};

// A fixed-size slot for a small message: [u64 xxh3 of the rest][u32 length]
// [payload][zero padding]. A receive posts exactly `slot_bytes`.
Result<std::string> EncodeSlot(std::string_view payload, size_t slot_bytes);
// The payload of a slot whose checksum and length hold; DataLoss otherwise.
// Never reads outside `slot`.
Result<std::string_view> OpenSlot(std::string_view slot);
// A byte buffer as a one-slice transfer of (request_id, tag) with `peer`.
TransferDesc SlotDesc(int peer, uint64_t request_id, uint32_t tag, std::string* slot);

// The manifest slot of one layer (EncodeSlot of a serialized
// KvTransferManifest), sized for `blocks` blocks.
Result<std::string> EncodeManifestSlot(std::string_view manifest, size_t blocks);
// Checks a received slot against what the receiver expects for `layer` and
// the bytes that landed in `buffers` (every manifest field, every block's
// checksum). DataLoss naming the first mismatch. Never reads outside `slot`.
// (The receiver's own check, exposed for the manifest fuzz target.)
Status VerifyLayerManifest(std::string_view slot, const StreamSpec& spec,
                           const StreamBuffers& buffers, int layer);

// Tag of a stream's layer transfer (exposed for tests and fault injection).
uint32_t StreamTag(uint32_t stream_id, int layer, bool payload);

}  // namespace kvrelay::kv_transfer
