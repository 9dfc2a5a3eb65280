#include <cstdlib>
#include <cstring>

#include "common/hash.h"
#include "fuzz_targets.h"
#include "kv_store/block_codec.h"

namespace kvrelay::fuzz {
namespace {

using kv_store::BlockMeta;

const BlockMeta& Meta() {
  static const BlockMeta meta = [] {
    BlockMeta m;
    m.model.fill(0x11);
    m.layout.layers = 2;
    m.layout.kv_heads = 1;
    m.layout.head_dim = 4;
    m.layout.block_tokens = 4;
    m.layout.dtype = engine::KvDtype::kF32;
    m.tenant_salt_hash = kv_store::TenantSaltHash("tenant");
    m.hash.fill(0x22);
    m.tokens = {1, 2, 3, 4};
    return m;
  }();
  return meta;
}

// The codec's checksum (block_codec.h): xxh3 of tokens + payload, seeded with
// xxh3 of the header before the checksum field.
void RepairChecksum(std::string* b) {
  constexpr size_t kOffChecksum = kv_store::kFixedHeaderBytes - 8;
  if (b->size() < kv_store::kFixedHeaderBytes) return;
  const uint64_t seed = Xxh3_64(b->data(), kOffChecksum);
  const uint64_t sum = Xxh3_64(b->data() + kv_store::kFixedHeaderBytes,
                               b->size() - kv_store::kFixedHeaderBytes, seed);
  std::memcpy(b->data() + kOffChecksum, &sum, 8);
}

}  // namespace

int FuzzBlockCodec(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::string encoded(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] & 1) RepairChecksum(&encoded);
  const BlockMeta& meta = Meta();
  auto decoded = kv_store::DecodeBlock(encoded, meta);
  if (!decoded.ok()) {
    if (!decoded.payload.empty()) std::abort();  // a miss serves nothing
    return 0;
  }
  const auto* begin = reinterpret_cast<const uint8_t*>(encoded.data());
  if (decoded.payload.data() < begin ||
      decoded.payload.data() + decoded.payload.size() > begin + encoded.size() ||
      static_cast<int64_t>(decoded.payload.size()) != meta.layout.BlockBytes()) {
    std::abort();
  }
  // Served means canonical: encoding what was served gives the same bytes.
  std::vector<std::span<const uint8_t>> layers;
  for (int l = 0; l < meta.layout.layers; ++l) layers.push_back(decoded.Layer(meta.layout, l));
  auto again = kv_store::EncodeBlock(meta, layers);
  if (!again.ok() || *again != encoded) std::abort();
  return 0;
}

std::vector<std::string> BlockCodecSeeds() {
  const BlockMeta& meta = Meta();
  std::vector<uint8_t> payload(static_cast<size_t>(meta.layout.BlockBytes()));
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 13);
  std::vector<std::span<const uint8_t>> layers;
  const size_t lb = static_cast<size_t>(meta.layout.LayerBytes());
  for (int l = 0; l < meta.layout.layers; ++l) layers.emplace_back(payload.data() + l * lb, lb);
  const std::string block = *kv_store::EncodeBlock(meta, layers);
  // 0x01: checksum repaired by the harness; 0x00: as is.
  return {std::string(1, '\1') + block, std::string(1, '\0') + block,
          std::string(1, '\1') + block.substr(0, kv_store::kFixedHeaderBytes)};
}

}  // namespace kvrelay::fuzz

#ifdef KVRELAY_LIBFUZZER_ENTRY
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return kvrelay::fuzz::FuzzBlockCodec(data, size);
}
#endif
