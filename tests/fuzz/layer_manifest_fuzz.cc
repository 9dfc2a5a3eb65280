#include <cstdlib>
#include <cstring>

#include "fuzz_targets.h"
#include "kv_transfer/layer_stream.h"
#include "protocols/kv_manifest.pb.h"

namespace kvrelay::fuzz {
namespace {

using kv_transfer::StreamBuffers;
using kv_transfer::StreamSpec;

constexpr int kLayers = 2;
constexpr int kHeads = 2;
constexpr int kBlockTokens = 4;
constexpr int kHeadDim = 4;
constexpr int64_t kSlab = kBlockTokens * kHeadDim * 4;  // f32
constexpr size_t kBlockBytes = kLayers * 2 * kHeads * kSlab;

const StreamSpec& Spec() {
  static const StreamSpec spec = [] {
    StreamSpec s;
    s.request_id = 7;
    s.layers = kLayers;
    s.blocks = {3, 5};
    s.global_heads = {0, kHeads};
    s.block_tokens = kBlockTokens;
    s.head_dim = kHeadDim;
    s.dtype = engine::KvDtype::kF32;
    s.model_fingerprint.fill(9);
    return s;
  }();
  return spec;
}

// Two blocks' worth of caller memory, filled from `bytes` (cycled).
struct Buffers {
  std::vector<uint8_t> memory;
  StreamBuffers view;
  explicit Buffers(std::string_view bytes) : memory(2 * kBlockBytes, 0) {
    for (size_t i = 0; i < memory.size() && !bytes.empty(); ++i) {
      memory[i] = static_cast<uint8_t>(bytes[i % bytes.size()]);
    }
    view.layout = {kHeads, kSlab, kv_transfer::MemoryKind::kHost};
    view.local_heads = {0, kHeads};
    view.block_layer0 = {memory.data(), memory.data() + kBlockBytes};
  }
};

std::string ValidManifest(const StreamBuffers& b, int layer) {
  const StreamSpec& s = Spec();
  proto::KvTransferManifest m;
  m.set_request_id(s.request_id);
  m.set_layer_begin(static_cast<uint32_t>(layer));
  m.set_layer_end(static_cast<uint32_t>(layer + 1));
  for (auto id : s.blocks) m.add_block_ids(id);
  m.mutable_heads()->set_begin(0);
  m.mutable_heads()->set_end(kHeads);
  m.set_block_tokens(kBlockTokens);
  m.set_head_dim(kHeadDim);
  m.set_dtype(proto::KV_DTYPE_F32);
  m.set_byte_count(2 * 2 * kHeads * kSlab);
  m.set_model_fingerprint(s.model_fingerprint.data(), s.model_fingerprint.size());
  for (size_t i = 0; i < s.blocks.size(); ++i) {
    auto* c = m.add_checksums();
    c->set_block_id(s.blocks[i]);
    c->set_layer(static_cast<uint32_t>(layer));
    c->set_xxh3(kv_transfer::SliceChecksum(b, i, layer));
  }
  return m.SerializeAsString();
}

}  // namespace

// Input: [flags u8][manifest length u16][manifest (or raw slot) bytes][payload bytes].
// flags bit 0: layer; bit 1: the bytes are a raw slot (checksum and length
// fields included), not a manifest to wrap.
int FuzzLayerManifest(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  const int layer = data[0] & 1;
  const bool raw = (data[0] & 2) != 0;
  const size_t len = std::min<size_t>(size - 3, data[1] | (data[2] << 8));
  const std::string_view body(reinterpret_cast<const char*>(data) + 3, len);
  const std::string_view payload(reinterpret_cast<const char*>(data) + 3 + len, size - 3 - len);
  Buffers buffers(payload);
  std::string slot;
  if (raw) {
    slot.assign(body);
  } else {
    auto wrapped = kv_transfer::EncodeManifestSlot(body, Spec().blocks.size());
    if (!wrapped.ok()) return 0;
    slot = std::move(*wrapped);
  }
  Status st = kv_transfer::VerifyLayerManifest(slot, Spec(), buffers.view, layer);
  if (st.ok()) {
    // A verified manifest names this request and layer (checked again here
    // independently of the verifier).
    uint32_t n = 0;
    std::memcpy(&n, slot.data() + 8, 4);
    proto::KvTransferManifest m;
    if (!m.ParseFromArray(slot.data() + 12, static_cast<int>(n)) ||
        m.request_id() != Spec().request_id || m.layer_begin() != static_cast<uint32_t>(layer) ||
        m.checksums_size() != static_cast<int>(Spec().blocks.size())) {
      std::abort();
    }
  }
  return 0;
}

std::vector<std::string> LayerManifestSeeds() {
  std::vector<std::string> seeds;
  const std::string payload = "kvrelay-fuzz-payload-0123456789";
  Buffers buffers(payload);
  for (int layer = 0; layer < kLayers; ++layer) {
    const std::string m = ValidManifest(buffers.view, layer);
    std::string s(1, static_cast<char>(layer));
    s.push_back(static_cast<char>(m.size() & 0xff));
    s.push_back(static_cast<char>(m.size() >> 8));
    seeds.push_back(s + m + payload);
    // The same as a raw slot.
    const std::string slot = *kv_transfer::EncodeManifestSlot(m, Spec().blocks.size());
    std::string r(1, static_cast<char>(layer | 2));
    r.push_back(static_cast<char>(slot.size() & 0xff));
    r.push_back(static_cast<char>(slot.size() >> 8));
    seeds.push_back(r + slot + payload);
  }
  return seeds;
}

}  // namespace kvrelay::fuzz

#ifdef KVRELAY_LIBFUZZER_ENTRY
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return kvrelay::fuzz::FuzzLayerManifest(data, size);
}
#endif
