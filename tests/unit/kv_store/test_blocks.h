// Deterministic synthetic KV blocks for kv_store tests.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kv_store/block_codec.h"
#include "kv_store/tiered_cache.h"

namespace kvrelay::kv_store::testing {

inline engine::KvLayout SmallLayout() {
  engine::KvLayout l;
  l.layers = 3;
  l.kv_heads = 2;
  l.head_dim = 8;
  l.block_tokens = 4;
  l.dtype = engine::KvDtype::kF32;
  return l;
}

inline engine::ModelFingerprint Fingerprint(uint8_t seed) {
  engine::ModelFingerprint f{};
  for (size_t i = 0; i < f.size(); ++i) f[i] = static_cast<uint8_t>(seed * 31 + i);
  return f;
}

// A block's meta and per-layer bytes, all derived from `id`.
struct TestBlock {
  BlockMeta meta;
  std::vector<std::vector<uint8_t>> layers;

  std::vector<std::span<const uint8_t>> Spans() const {
    return std::vector<std::span<const uint8_t>>(layers.begin(), layers.end());
  }
  std::vector<uint8_t> Payload() const {
    std::vector<uint8_t> out;
    for (const auto& l : layers) out.insert(out.end(), l.begin(), l.end());
    return out;
  }
  std::string Encoded() const {
    auto spans = Spans();
    Result<std::string> r = EncodeBlock(meta, spans);
    return r.ok() ? *r : std::string();
  }
};

inline TestBlock MakeBlock(uint64_t id, const engine::KvLayout& layout = SmallLayout(),
                           std::string_view salt = "tenant-a", uint8_t model_seed = 1) {
  TestBlock b;
  b.meta.model = Fingerprint(model_seed);
  b.meta.layout = layout;
  b.meta.tenant_salt_hash = TenantSaltHash(salt);
  std::mt19937_64 rng(id * 0x9E3779B97F4A7C15ull + 7);
  for (int i = 0; i < layout.block_tokens; ++i) {
    b.meta.tokens.push_back(static_cast<int32_t>(rng() % 49152));
  }
  BlockHash parent{};
  parent[0] = static_cast<uint8_t>(id);
  parent[1] = static_cast<uint8_t>(id >> 8);
  parent[2] = static_cast<uint8_t>(id >> 16);
  parent[3] = static_cast<uint8_t>(id >> 24);
  b.meta.hash = engine::HashBlock(parent, b.meta.tokens, b.meta.model, salt);
  for (int l = 0; l < layout.layers; ++l) {
    std::vector<uint8_t> bytes(static_cast<size_t>(layout.LayerBytes()));
    for (auto& x : bytes) x = static_cast<uint8_t>(rng());
    b.layers.push_back(std::move(bytes));
  }
  return b;
}

// Attaches a pool to a cache for the rest of the scope. Declared after the
// pool, it detaches before the pool dies, also when an ASSERT returns early
// (the cache outlives the pools its tests attach: TieredCache::Attach's
// contract).
class AttachScope {
 public:
  AttachScope(TieredCache& cache, engine::KvBlockPool* pool,
              TieredCache::EventListener listener = nullptr)
      : cache_(cache) {
    cache_.Attach(pool, std::move(listener));
  }
  ~AttachScope() { cache_.Detach(); }
  AttachScope(const AttachScope&) = delete;
  AttachScope& operator=(const AttachScope&) = delete;

 private:
  TieredCache& cache_;
};

}  // namespace kvrelay::kv_store::testing
