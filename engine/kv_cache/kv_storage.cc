#include "engine/kv_cache/kv_storage.h"

#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <new>
#include <system_error>
#include <thread>
#include <vector>

#include "engine/kv_cache/kv_codec.h"

namespace kvrelay::engine {
namespace {

// The bytes of a host pool: an anonymous mapping, 2 MiB-aligned and advised
// as transparent huge pages, whose pages a background thread faults in
// (MADV_POPULATE_WRITE, one huge page at a time) from the moment it exists.
// Left to first touch, the faults land on the request path: a restore of a
// 3,000-token prefix of the default model (131 MiB into never-used blocks)
// spent 190-600 ms copying into the pool, against 33 ms pre-faulted, more
// than reading, unsealing and verifying its blocks took. The pool is the KV
// capacity the operator configured; like llama.cpp, which clears its KV
// buffer at start, the worker holds it resident. POPULATE_WRITE never
// changes a byte, so the engine may use blocks while it runs; a kernel
// without it (before 5.14) leaves the pages to first touch, as before.
class Slab {
 public:
  explicit Slab(size_t bytes) : bytes_(std::max<size_t>(bytes, 1)) {
    // Over-map by one huge page and trim, so the slab starts 2 MiB-aligned.
    const size_t mapped = bytes_ + kHuge;
    void* raw = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) throw std::bad_alloc();
    auto* base = static_cast<uint8_t*>(raw);
    const size_t head = (kHuge - reinterpret_cast<uintptr_t>(base) % kHuge) % kHuge;
    const size_t tail = mapped - head - bytes_;
    if (head > 0) munmap(base, head);
    if (tail > 0) munmap(base + head + bytes_, tail);
    data_ = base + head;
#ifdef MADV_HUGEPAGE
    madvise(data_, bytes_, MADV_HUGEPAGE);  // advice only: 4 KiB pages where refused
#endif
#ifdef MADV_POPULATE_WRITE
    try {
      populate_ = std::thread([this] {
        pthread_setname_np(pthread_self(), "kv-populate");
        for (size_t at = 0; at < bytes_ && !stop_.load(std::memory_order_relaxed); at += kHuge) {
          if (madvise(data_ + at, std::min(kHuge, bytes_ - at), MADV_POPULATE_WRITE) != 0) break;
        }
      });
    } catch (const std::system_error&) {
      // No thread to be had: the pages come on first touch.
    }
#endif
  }
  ~Slab() {
    stop_.store(true, std::memory_order_relaxed);
    if (populate_.joinable()) populate_.join();
    munmap(data_, bytes_);
  }
  Slab(const Slab&) = delete;
  Slab& operator=(const Slab&) = delete;
  uint8_t* get() const { return data_; }

 private:
  static constexpr size_t kHuge = size_t{2} << 20;
  size_t bytes_;
  uint8_t* data_ = nullptr;
  std::atomic<bool> stop_{false};
  std::thread populate_;  // last: started once the mapping is whole
};

// Per (block, layer) state of a KIVI storage.
enum class LayerState : uint8_t {
  kFresh,      // nothing written since the block was last forgotten
  kStaged,     // values live in an f32 staging slot; the slab bytes are stale
  kQuantized,  // the slab bytes hold the values
};

class HostKvStorage final : public KvStorage {
 public:
  HostKvStorage(const KvLayout& layout, int64_t blocks, int64_t staging_slots)
      : layout_(layout),
        slab_bytes_(layout_.SlabBytes()),
        layer_bytes_(layout_.LayerBytes()),
        block_bytes_(layout_.BlockBytes()),
        kivi_(kvcodec::IsKivi(layout_.dtype)),
        data_(static_cast<size_t>(blocks * block_bytes_)) {
    if (kivi_) {
      const int64_t cells = blocks * layout_.layers;
      state_.assign(static_cast<size_t>(cells), LayerState::kFresh);
      fill_.assign(static_cast<size_t>(cells), 0);
      staging_of_.assign(static_cast<size_t>(cells), -1);
      staging_floats_ = 2LL * layout_.kv_heads * layout_.block_tokens * layout_.head_dim;
      staging_.resize(static_cast<size_t>(staging_slots * staging_floats_));
      staging_free_.reserve(static_cast<size_t>(staging_slots));
      for (int64_t i = staging_slots - 1; i >= 0; --i) {
        staging_free_.push_back(static_cast<int32_t>(i));
      }
      scratch_.resize(static_cast<size_t>(staging_floats_));
    }
  }

  const KvLayout& layout() const override { return layout_; }
  int64_t staging_slots_free() const override { return static_cast<int64_t>(staging_free_.size()); }

  void Forget(BlockId id) override {
    if (!kivi_) return;
    for (int l = 0; l < layout_.layers; ++l) {
      const int64_t c = Cell(id, l);
      FreeStaging(c);
      state_[static_cast<size_t>(c)] = LayerState::kFresh;
      fill_[static_cast<size_t>(c)] = 0;
    }
  }

  void Seal(BlockId id) override {
    if (!kivi_) return;
    for (int l = 0; l < layout_.layers; ++l) Flush(id, l);
  }

  void WriteToken(BlockId id, int layer, int offset, const float* k, const float* v) override {
    const int heads = layout_.kv_heads, d = layout_.head_dim, t = layout_.block_tokens;
    uint8_t* base = LayerPtr(id, layer);
    if (!kivi_) {
      for (int h = 0; h < heads; ++h) {
        const int64_t row = static_cast<int64_t>(h) * d;
        kvcodec::EncodeRow(layout_.dtype, base + h * slab_bytes_, t, d, offset, k + row);
        kvcodec::EncodeRow(layout_.dtype, base + (heads + h) * slab_bytes_, t, d, offset, v + row);
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
      const int64_t row = static_cast<int64_t>(h) * d;
      std::memcpy(stage + h * slab_floats + static_cast<int64_t>(offset) * d, k + row,
                  d * sizeof(float));
      std::memcpy(stage + (heads + h) * slab_floats + static_cast<int64_t>(offset) * d, v + row,
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
    if (kivi_) const_cast<HostKvStorage*>(this)->Flush(id, layer);
    return {LayerPtr(id, layer), static_cast<size_t>(layer_bytes_)};
  }

  const uint8_t* LayerAddress(BlockId id, int layer) const override { return LayerPtr(id, layer); }

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

 private:
  uint8_t* BlockPtr(BlockId id) const { return data_.get() + id * block_bytes_; }
  uint8_t* LayerPtr(BlockId id, int layer) const { return BlockPtr(id) + layer * layer_bytes_; }
  int64_t Cell(BlockId id, int layer) const {
    return static_cast<int64_t>(id) * layout_.layers + layer;
  }

  // --- KIVI staging ---
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

  const KvLayout layout_;
  const int64_t slab_bytes_, layer_bytes_, block_bytes_;
  const bool kivi_;
  Slab data_;  // blocks * block_bytes_

  // KIVI only, indexed by Cell(id, layer).
  std::vector<LayerState> state_;
  std::vector<uint16_t> fill_;       // rows written: 1 + highest offset written since Forget
  std::vector<int32_t> staging_of_;  // staging slot or -1
  int64_t staging_floats_ = 0;       // per slot: [2 * kv_heads][block_tokens][head_dim]
  std::vector<float> staging_;
  std::vector<int32_t> staging_free_;
  std::vector<float> scratch_;  // one slot, for writes when no staging slot is free
};

}  // namespace

std::unique_ptr<KvStorage> KvStorage::CreateHost(const KvLayout& layout, int64_t blocks,
                                                 int64_t staging_slots) {
  return std::make_unique<HostKvStorage>(layout, blocks, staging_slots);
}

}  // namespace kvrelay::engine
