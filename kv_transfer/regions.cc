#include "kv_transfer/regions.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace kvrelay::kv_transfer {

Status ValidateDesc(const TransferDesc& desc, int world_size) {
  auto bad = [&](const std::string& what) {
    return InvalidArgument("transfer request " + std::to_string(desc.request_id) + " tag " +
                           std::to_string(desc.tag) + ": " + what);
  };
  if (desc.peer < 0 || desc.peer >= world_size) {
    return bad("peer " + std::to_string(desc.peer) + " outside [0, " + std::to_string(world_size) +
               ")");
  }
  if (desc.layout.kv_heads <= 0) return bad("layout.kv_heads must be > 0");
  if (desc.layout.slab_bytes <= 0) return bad("layout.slab_bytes must be > 0");
  if (desc.slices.empty()) return bad("no slices");
  const int64_t layer_bytes = 2 * desc.layout.kv_heads * desc.layout.slab_bytes;
  for (size_t i = 0; i < desc.slices.size(); ++i) {
    const KvSlice& s = desc.slices[i];
    std::string where = "slice " + std::to_string(i) + " (block " + std::to_string(s.block) + ")";
    if (s.layer_data == nullptr) return bad(where + ": layer_data is null");
    if (s.layer_begin < 0 || s.layer_end <= s.layer_begin) {
      return bad(where + ": layer range [" + std::to_string(s.layer_begin) + ", " +
                 std::to_string(s.layer_end) + ") is empty or negative");
    }
    if (s.head_begin < 0 || s.head_end <= s.head_begin || s.head_end > desc.layout.kv_heads) {
      return bad(where + ": head range [" + std::to_string(s.head_begin) + ", " +
                 std::to_string(s.head_end) + ") outside [0, " +
                 std::to_string(desc.layout.kv_heads) + ")");
    }
    if (s.layer_stride != 0 && s.layer_stride < layer_bytes) {
      return bad(where + ": layer_stride " + std::to_string(s.layer_stride) +
                 " smaller than one layer (" + std::to_string(layer_bytes) + " bytes)");
    }
  }
  return Status::Ok();
}

std::vector<Region> ResolveRegions(const TransferDesc& desc) {
  std::vector<Region> out;
  const int64_t slab = desc.layout.slab_bytes;
  const int64_t heads = desc.layout.kv_heads;
  auto add = [&](uint8_t* p, size_t n) {
    if (!out.empty() && out.back().data + out.back().bytes == p) {
      out.back().bytes += n;
    } else {
      out.push_back({p, n});
    }
  };
  for (const KvSlice& s : desc.slices) {
    const int64_t stride = s.layer_stride != 0 ? s.layer_stride : 2 * heads * slab;
    const size_t piece = static_cast<size_t>((s.head_end - s.head_begin) * slab);
    for (int l = s.layer_begin; l < s.layer_end; ++l) {
      uint8_t* layer = s.layer_data + (l - s.layer_begin) * stride;
      add(layer + s.head_begin * slab, piece);            // K slabs of the head range
      add(layer + (heads + s.head_begin) * slab, piece);  // V slabs of the head range
    }
  }
  return out;
}

size_t TotalBytes(std::span<const Region> regions) {
  size_t n = 0;
  for (const auto& r : regions) n += r.bytes;
  return n;
}

void ScatterInto(std::span<const Region> regions, RegionCursor* c, const uint8_t* src, size_t len) {
  while (len > 0 && c->region < regions.size()) {
    const Region& r = regions[c->region];
    size_t take = std::min(len, r.bytes - c->within);
    std::memcpy(r.data + c->within, src, take);
    src += take;
    len -= take;
    c->within += take;
    if (c->within == r.bytes) {
      ++c->region;
      c->within = 0;
    }
  }
}

void GatherFrom(std::span<const Region> regions, RegionCursor* c, uint8_t* dst, size_t len) {
  while (len > 0 && c->region < regions.size()) {
    const Region& r = regions[c->region];
    size_t take = std::min(len, r.bytes - c->within);
    std::memcpy(dst, r.data + c->within, take);
    dst += take;
    len -= take;
    c->within += take;
    if (c->within == r.bytes) {
      ++c->region;
      c->within = 0;
    }
  }
}

void TakePieces(std::span<const Region> regions, RegionCursor* c, size_t len,
                std::vector<Region>* out) {
  while (len > 0 && c->region < regions.size()) {
    const Region& r = regions[c->region];
    size_t take = std::min(len, r.bytes - c->within);
    out->push_back({r.data + c->within, take});
    len -= take;
    c->within += take;
    if (c->within == r.bytes) {
      ++c->region;
      c->within = 0;
    }
  }
}

void CopyRegions(std::span<const Region> src, std::span<const Region> dst) {
  RegionCursor cursor;
  for (const Region& r : src) ScatterInto(dst, &cursor, r.data, r.bytes);
}

}  // namespace kvrelay::kv_transfer
