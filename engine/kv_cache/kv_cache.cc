#include "engine/kv_cache/kv_cache.h"

#include <cstring>
#include <limits>
#include <unordered_map>

#include "common/hash.h"
#include "common/logging.h"
#include "engine/kv_cache/kv_codec.h"

namespace kvrelay::engine {

std::string_view KvDtypeName(KvDtype d) {
  switch (d) {
    case KvDtype::kF32:
      return "f32";
    case KvDtype::kF16:
      return "f16";
    case KvDtype::kBF16:
      return "bf16";
    case KvDtype::kInt8:
      return "int8";
    case KvDtype::kKivi4:
      return "kivi4";
    case KvDtype::kKivi2:
      return "kivi2";
  }
  return "unknown";
}

Result<KvDtype> ParseKvDtype(std::string_view name) {
  for (KvDtype d : {KvDtype::kF32, KvDtype::kF16, KvDtype::kBF16, KvDtype::kInt8, KvDtype::kKivi4,
                    KvDtype::kKivi2}) {
    if (name == KvDtypeName(d)) return d;
  }
  return InvalidArgument("unknown KV dtype '" + std::string(name) +
                         "' (expected f32, f16, bf16, int8, kivi4 or kivi2)");
}

int64_t KvLayout::SlabBytes() const { return kvcodec::SlabBytes(dtype, block_tokens, head_dim); }

BlockHash HashBlock(const BlockHash& parent, std::span<const int32_t> tokens,
                    const ModelFingerprint& model, std::string_view tenant_salt) {
  Sha256 h;
  h.Update(parent.data(), parent.size());
  const uint32_t n = static_cast<uint32_t>(tokens.size());
  const uint8_t n_le[4] = {static_cast<uint8_t>(n), static_cast<uint8_t>(n >> 8),
                           static_cast<uint8_t>(n >> 16), static_cast<uint8_t>(n >> 24)};
  h.Update(n_le, 4);
  for (int32_t t : tokens) {
    const uint32_t u = static_cast<uint32_t>(t);
    const uint8_t b[4] = {static_cast<uint8_t>(u), static_cast<uint8_t>(u >> 8),
                          static_cast<uint8_t>(u >> 16), static_cast<uint8_t>(u >> 24)};
    h.Update(b, 4);
  }
  h.Update(model.data(), model.size());
  h.Update(tenant_salt);
  return h.Finish();
}

std::vector<BlockHash> HashPrefixBlocks(std::span<const int32_t> tokens, int block_tokens,
                                        const ModelFingerprint& model,
                                        std::string_view tenant_salt) {
  std::vector<BlockHash> out;
  if (block_tokens <= 0) return out;
  const size_t full = tokens.size() / static_cast<size_t>(block_tokens);
  out.reserve(full);
  BlockHash parent{};
  for (size_t i = 0; i < full; ++i) {
    parent = HashBlock(parent, tokens.subspan(i * block_tokens, block_tokens), model, tenant_salt);
    out.push_back(parent);
  }
  return out;
}

namespace {

struct BlockHashHasher {
  size_t operator()(const BlockHash& h) const {
    size_t v;  // the key is already a uniformly distributed SHA-256 digest
    std::memcpy(&v, h.data(), sizeof(v));
    return v;
  }
};

// Per (block, layer) state of a KIVI pool.
enum class LayerState : uint8_t {
  kFresh,      // nothing written since Allocate
  kStaged,     // values live in an f32 staging slot; the slab bytes are stale
  kQuantized,  // the slab bytes hold the values
};

class KvBlockPoolImpl final : public KvBlockPool {
 public:
  KvBlockPoolImpl(const Options& options, int64_t blocks, int64_t staging_slots)
      : options_(options),
        layout_(options.layout),
        slab_bytes_(layout_.SlabBytes()),
        layer_bytes_(layout_.LayerBytes()),
        block_bytes_(layout_.BlockBytes()),
        kivi_(kvcodec::IsKivi(layout_.dtype)),
        total_(blocks),
        data_(
            std::make_unique_for_overwrite<uint8_t[]>(static_cast<size_t>(blocks * block_bytes_))),
        refcount_(blocks, 0),
        cached_(blocks, 0),
        hash_(blocks),
        lru_prev_(blocks, kNoBlock),
        lru_next_(blocks, kNoBlock) {
    free_.reserve(blocks);
    for (int64_t i = blocks - 1; i >= 0; --i) free_.push_back(static_cast<BlockId>(i));
    if (kivi_) {
      const int64_t cells = blocks * layout_.layers;
      state_.assign(cells, LayerState::kFresh);
      fill_.assign(cells, 0);
      staging_of_.assign(cells, -1);
      staging_floats_ = 2LL * layout_.kv_heads * layout_.block_tokens * layout_.head_dim;
      staging_.resize(static_cast<size_t>(staging_slots * staging_floats_));
      staging_free_.reserve(staging_slots);
      for (int64_t i = staging_slots - 1; i >= 0; --i)
        staging_free_.push_back(static_cast<int32_t>(i));
      scratch_.resize(static_cast<size_t>(staging_floats_));
    }
  }

  const KvLayout& layout() const override { return layout_; }
  int64_t total_blocks() const override { return total_; }
  int64_t free_blocks() const override { return static_cast<int64_t>(free_.size()); }
  int64_t available_blocks() const override { return free_blocks() + lru_size_; }
  int64_t staging_slots_free() const override { return static_cast<int64_t>(staging_free_.size()); }

  Result<BlockId> Allocate() override {
    BlockId id = kNoBlock;
    if (!free_.empty()) {
      id = free_.back();
      free_.pop_back();
    } else if (lru_head_ != kNoBlock) {
      id = lru_head_;
      const BlockHash hash = hash_[id];
      if (spill_hook_) spill_hook_(hash, id);  // the block's bytes are still intact here
      LruRemove(id);
      cached_[id] = 0;
      index_.erase(hash);
      Emit(KvEvent::Kind::kEvicted, hash);
    } else {
      return ResourceExhausted("KV pool exhausted: all " + std::to_string(total_) +
                               " blocks are referenced");
    }
    refcount_[id] = 1;
    if (kivi_) ResetLayers(id);
    return id;
  }

  void Ref(BlockId id) override {
    if (!Valid(id) || (refcount_[id] == 0 && !cached_[id])) {
      LOG_ERROR << "KvBlockPool::Ref on block " << id << " that is not allocated";
      return;
    }
    if (refcount_[id]++ == 0) LruRemove(id);
  }

  void Release(BlockId id) override {
    if (!Valid(id) || refcount_[id] <= 0) {
      LOG_ERROR << "KvBlockPool::Release on block " << id << " with no reference";
      return;
    }
    if (--refcount_[id] > 0) return;
    if (cached_[id]) {
      LruPushBack(id);
    } else {
      if (kivi_) ResetLayers(id);
      free_.push_back(id);
    }
  }

  int refcount(BlockId id) const override { return Valid(id) ? refcount_[id] : 0; }

  void WriteToken(BlockId id, int layer, int offset, const float* k, const float* v) override {
    const int heads = layout_.kv_heads, d = layout_.head_dim, t = layout_.block_tokens;
    uint8_t* base = LayerPtr(id, layer);
    if (!kivi_) {
      for (int h = 0; h < heads; ++h) {
        kvcodec::EncodeRow(layout_.dtype, base + h * slab_bytes_, t, d, offset, k + h * d);
        kvcodec::EncodeRow(layout_.dtype, base + (heads + h) * slab_bytes_, t, d, offset,
                           v + h * d);
      }
      return;
    }
    const int64_t cell = Cell(id, layer);
    float* stage = Stage(id, layer);
    const int64_t slab_floats = static_cast<int64_t>(t) * d;
    const bool staged = stage != nullptr;
    if (!staged) {
      // No staging slot free: re-quantize the slab with the new row (lossier, bounded memory).
      stage = scratch_.data();
      if (state_[cell] == LayerState::kQuantized) {
        DecodeLayer(base, stage);
      } else {
        std::memset(stage, 0, scratch_.size() * sizeof(float));
      }
    }
    for (int h = 0; h < heads; ++h) {
      std::memcpy(stage + h * slab_floats + static_cast<int64_t>(offset) * d, k + h * d,
                  d * sizeof(float));
      std::memcpy(stage + (heads + h) * slab_floats + static_cast<int64_t>(offset) * d, v + h * d,
                  d * sizeof(float));
    }
    fill_[cell] = static_cast<uint16_t>(std::max<int>(fill_[cell], offset + 1));
    if (!staged || offset == t - 1) {
      QuantizeLayer(base, stage, fill_[cell]);
      if (staged) FreeStaging(cell);
      state_[cell] = LayerState::kQuantized;
    }
  }

  void ReadHead(BlockId id, int layer, int head, int n, float* k, float* v) const override {
    const int heads = layout_.kv_heads, d = layout_.head_dim, t = layout_.block_tokens;
    const uint8_t* base = LayerPtr(id, layer);
    if (kivi_) {
      const int64_t cell = Cell(id, layer);
      if (state_[cell] == LayerState::kStaged) {
        const float* stage = staging_.data() + staging_of_[cell] * staging_floats_;
        const int64_t slab_floats = static_cast<int64_t>(t) * d;
        const size_t bytes = static_cast<size_t>(n) * d * sizeof(float);
        std::memcpy(k, stage + head * slab_floats, bytes);
        std::memcpy(v, stage + (heads + head) * slab_floats, bytes);
        return;
      }
    }
    kvcodec::DecodeRows(layout_.dtype, true, base + head * slab_bytes_, t, d, n, k);
    kvcodec::DecodeRows(layout_.dtype, false, base + (heads + head) * slab_bytes_, t, d, n, v);
  }

  const float* HeadSlabF32(BlockId id, int layer, bool value, int head) const override {
    if (layout_.dtype != KvDtype::kF32) return nullptr;
    return reinterpret_cast<const float*>(LayerPtr(id, layer) +
                                          (value ? layout_.kv_heads + head : head) * slab_bytes_);
  }

  std::span<uint8_t> LayerData(BlockId id, int layer) override {
    if (kivi_) Flush(id, layer);
    // The caller may overwrite the bytes (import); from now on they are the
    // truth. fill_ stays what was written here: a sender also comes this way
    // before the rows are computed, and quantizing a partial tail block over
    // all block_tokens rows would mix the slab's stale rows into each K
    // channel's range (the prefill and decode sides then disagreed with the
    // engine's KIVI tokens after a few steps).
    if (kivi_) {
      const int64_t cell = Cell(id, layer);
      if (state_[cell] == LayerState::kFresh) state_[cell] = LayerState::kQuantized;
    }
    return {LayerPtr(id, layer), static_cast<size_t>(layer_bytes_)};
  }

  std::span<const uint8_t> LayerData(BlockId id, int layer) const override {
    if (kivi_) const_cast<KvBlockPoolImpl*>(this)->Flush(id, layer);
    return {LayerPtr(id, layer), static_cast<size_t>(layer_bytes_)};
  }

  void CopyBlock(BlockId src, BlockId dst) override {
    if (src == dst) return;
    std::memcpy(BlockPtr(dst), BlockPtr(src), static_cast<size_t>(block_bytes_));
    if (!kivi_) return;
    for (int l = 0; l < layout_.layers; ++l) {
      const int64_t sc = Cell(src, l), dc = Cell(dst, l);
      FreeStaging(dc);
      state_[dc] = state_[sc];
      fill_[dc] = fill_[sc];
      if (state_[sc] != LayerState::kStaged) continue;
      if (!staging_free_.empty()) {
        const int32_t slot = staging_free_.back();
        staging_free_.pop_back();
        staging_of_[dc] = slot;
        std::memcpy(staging_.data() + slot * staging_floats_,
                    staging_.data() + staging_of_[sc] * staging_floats_,
                    static_cast<size_t>(staging_floats_) * sizeof(float));
      } else {
        QuantizeLayer(LayerPtr(dst, l), staging_.data() + staging_of_[sc] * staging_floats_,
                      fill_[sc]);
        state_[dc] = LayerState::kQuantized;
      }
    }
  }

  void Commit(BlockId id, const BlockHash& hash) override {
    if (!Valid(id) || refcount_[id] <= 0) {
      LOG_ERROR << "KvBlockPool::Commit on block " << id << " with no reference";
      return;
    }
    if (cached_[id] || index_.count(hash) != 0) return;
    if (kivi_) {
      for (int l = 0; l < layout_.layers; ++l) Flush(id, l);
    }
    cached_[id] = 1;
    hash_[id] = hash;
    index_.emplace(hash, id);
    Emit(KvEvent::Kind::kStored, hash);
  }

  std::vector<BlockId> MatchPrefix(std::span<const BlockHash> hashes) override {
    std::vector<BlockId> out;
    for (const BlockHash& h : hashes) {
      auto it = index_.find(h);
      if (it == index_.end()) break;
      Ref(it->second);
      out.push_back(it->second);
    }
    return out;
  }

  bool IsCached(const BlockHash& hash) const override { return index_.count(hash) != 0; }

  void SetSpillHook(std::function<void(const BlockHash&, BlockId)> hook) override {
    spill_hook_ = std::move(hook);
  }
  void SetEventListener(std::function<void(const KvEvent&)> listener) override {
    listener_ = std::move(listener);
  }

 private:
  bool Valid(BlockId id) const { return id >= 0 && id < total_; }
  uint8_t* BlockPtr(BlockId id) const { return data_.get() + id * block_bytes_; }
  uint8_t* LayerPtr(BlockId id, int layer) const { return BlockPtr(id) + layer * layer_bytes_; }
  int64_t Cell(BlockId id, int layer) const {
    return static_cast<int64_t>(id) * layout_.layers + layer;
  }

  void Emit(KvEvent::Kind kind, const BlockHash& hash) {
    if (listener_) listener_(KvEvent{kind, hash});
  }

  // --- LRU of unreferenced cached blocks: head = least recently used ---
  void LruPushBack(BlockId id) {
    lru_prev_[id] = lru_tail_;
    lru_next_[id] = kNoBlock;
    if (lru_tail_ != kNoBlock)
      lru_next_[lru_tail_] = id;
    else
      lru_head_ = id;
    lru_tail_ = id;
    ++lru_size_;
  }
  void LruRemove(BlockId id) {
    const BlockId p = lru_prev_[id], n = lru_next_[id];
    if (p != kNoBlock)
      lru_next_[p] = n;
    else
      lru_head_ = n;
    if (n != kNoBlock)
      lru_prev_[n] = p;
    else
      lru_tail_ = p;
    lru_prev_[id] = lru_next_[id] = kNoBlock;
    --lru_size_;
  }

  // --- KIVI staging ---
  void ResetLayers(BlockId id) {
    for (int l = 0; l < layout_.layers; ++l) {
      const int64_t c = Cell(id, l);
      FreeStaging(c);
      state_[c] = LayerState::kFresh;
      fill_[c] = 0;
    }
  }
  void FreeStaging(int64_t cell) {
    if (staging_of_[cell] >= 0) {
      staging_free_.push_back(staging_of_[cell]);
      staging_of_[cell] = -1;
    }
  }
  // The staging buffer of (id, layer), acquiring one (initialised from the
  // current values) if the layer is not staged; nullptr when none is free.
  float* Stage(BlockId id, int layer) {
    const int64_t cell = Cell(id, layer);
    if (state_[cell] == LayerState::kStaged)
      return staging_.data() + staging_of_[cell] * staging_floats_;
    if (staging_free_.empty()) return nullptr;
    const int32_t slot = staging_free_.back();
    staging_free_.pop_back();
    staging_of_[cell] = slot;
    float* stage = staging_.data() + slot * staging_floats_;
    if (state_[cell] == LayerState::kQuantized) {
      DecodeLayer(LayerPtr(id, layer), stage);
    } else {
      std::memset(stage, 0, static_cast<size_t>(staging_floats_) * sizeof(float));
    }
    state_[cell] = LayerState::kStaged;
    return stage;
  }
  // Quantizes a staged layer's written rows into its slab and frees the slot.
  void Flush(BlockId id, int layer) {
    const int64_t cell = Cell(id, layer);
    if (state_[cell] != LayerState::kStaged) return;
    QuantizeLayer(LayerPtr(id, layer), staging_.data() + staging_of_[cell] * staging_floats_,
                  std::max<int>(fill_[cell], 1));
    FreeStaging(cell);
    state_[cell] = LayerState::kQuantized;
  }
  void DecodeLayer(const uint8_t* base, float* out) const {
    const int heads = layout_.kv_heads, d = layout_.head_dim, t = layout_.block_tokens;
    const int64_t slab_floats = static_cast<int64_t>(t) * d;
    for (int s = 0; s < 2 * heads; ++s) {
      kvcodec::DecodeRows(layout_.dtype, s < heads, base + s * slab_bytes_, t, d, t,
                          out + s * slab_floats);
    }
  }
  void QuantizeLayer(uint8_t* base, const float* src, int n) const {
    const int heads = layout_.kv_heads, d = layout_.head_dim, t = layout_.block_tokens;
    const int64_t slab_floats = static_cast<int64_t>(t) * d;
    for (int s = 0; s < 2 * heads; ++s) {
      kvcodec::QuantizeKivi(layout_.dtype, s < heads, base + s * slab_bytes_, t, d, n,
                            src + s * slab_floats);
    }
  }

  const Options options_;
  const KvLayout layout_;
  const int64_t slab_bytes_, layer_bytes_, block_bytes_;
  const bool kivi_;
  const int64_t total_;
  std::unique_ptr<uint8_t[]> data_;  // total_ * block_bytes_

  std::vector<int32_t> refcount_;
  std::vector<BlockId> free_;    // refcount 0, not cached
  std::vector<uint8_t> cached_;  // block is in index_
  std::vector<BlockHash> hash_;  // valid where cached_
  std::unordered_map<BlockHash, BlockId, BlockHashHasher> index_;
  std::vector<BlockId> lru_prev_, lru_next_;
  BlockId lru_head_ = kNoBlock, lru_tail_ = kNoBlock;
  int64_t lru_size_ = 0;

  // KIVI only, indexed by Cell(id, layer).
  std::vector<LayerState> state_;
  std::vector<uint16_t> fill_;       // rows written: 1 + highest offset written since Allocate
  std::vector<int32_t> staging_of_;  // staging slot or -1
  int64_t staging_floats_ = 0;       // per slot: [2 * kv_heads][block_tokens][head_dim]
  std::vector<float> staging_;
  std::vector<int32_t> staging_free_;
  std::vector<float> scratch_;  // one slot, for writes when no staging slot is free

  std::function<void(const BlockHash&, BlockId)> spill_hook_;
  std::function<void(const KvEvent&)> listener_;
};

}  // namespace

Result<std::unique_ptr<KvBlockPool>> KvBlockPool::Create(const Options& options) {
  const KvLayout& l = options.layout;
  if (l.layers <= 0 || l.kv_heads <= 0 || l.head_dim <= 0) {
    return InvalidArgument("KV layout needs layers, kv_heads and head_dim > 0 (got " +
                           std::to_string(l.layers) + ", " + std::to_string(l.kv_heads) + ", " +
                           std::to_string(l.head_dim) + ")");
  }
  if (l.block_tokens <= 0 || l.block_tokens > 4096) {
    return InvalidArgument("KV layout block_tokens must be in [1, 4096], got " +
                           std::to_string(l.block_tokens));
  }
  const int bits = kvcodec::KiviBits(l.dtype);
  if (bits != 0 && (static_cast<int64_t>(l.head_dim) * bits) % 8 != 0) {
    return InvalidArgument("KV dtype " + std::string(KvDtypeName(l.dtype)) +
                           " needs head_dim * bits to be a multiple of 8, head_dim is " +
                           std::to_string(l.head_dim));
  }
  if (static_cast<uint8_t>(l.dtype) > static_cast<uint8_t>(KvDtype::kKivi2)) {
    return InvalidArgument("unknown KV dtype " + std::to_string(static_cast<int>(l.dtype)));
  }
  if (options.capacity_bytes <= 0) return InvalidArgument("KV capacity_bytes must be > 0");
  int64_t staging_slots = 0;
  int64_t budget = options.capacity_bytes;
  if (bits != 0) {
    const int64_t slot_bytes = 2LL * l.kv_heads * l.block_tokens * l.head_dim * 4;
    const int64_t staging_bytes =
        options.staging_bytes >= 0 ? options.staging_bytes : options.capacity_bytes / 8;
    staging_slots =
        std::min<int64_t>(staging_bytes / slot_bytes, std::numeric_limits<int32_t>::max());
    budget -= staging_slots * slot_bytes;
  }
  const int64_t block_bytes = l.BlockBytes();
  const int64_t blocks = budget > 0 ? budget / block_bytes : 0;
  if (blocks <= 0) {
    return ResourceExhausted("KV capacity of " + std::to_string(options.capacity_bytes) +
                             " bytes holds no block of " + std::to_string(block_bytes) + " bytes");
  }
  if (blocks > std::numeric_limits<BlockId>::max()) {
    return InvalidArgument("KV capacity holds more than 2^31 blocks; raise block_tokens");
  }
  return std::unique_ptr<KvBlockPool>(new KvBlockPoolImpl(options, blocks, staging_slots));
}

}  // namespace kvrelay::engine
