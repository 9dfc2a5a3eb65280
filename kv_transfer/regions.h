// Flattening of a TransferDesc into the contiguous memory regions that make
// up its wire bytes, in wire order (adjacent regions merged).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "kv_transfer/transport.h"

namespace kvrelay::kv_transfer {

struct Region {
  uint8_t* data = nullptr;
  size_t bytes = 0;
};

// Checks every field of `desc` (names the bad one) against `world_size`.
Status ValidateDesc(const TransferDesc& desc, int world_size);
// The wire-order regions of a valid desc.
std::vector<Region> ResolveRegions(const TransferDesc& desc);
size_t TotalBytes(std::span<const Region> regions);

// Copies `len` bytes from src into the regions starting at wire offset
// `offset` (cursor: region index + offset within it, advanced in place).
struct RegionCursor {
  size_t region = 0;
  size_t within = 0;
};
void ScatterInto(std::span<const Region> regions, RegionCursor* cursor, const uint8_t* src,
                 size_t len);
void GatherFrom(std::span<const Region> regions, RegionCursor* cursor, uint8_t* dst, size_t len);
// The pieces of the regions covering the next `len` wire bytes at `cursor`
// (advanced past them), appended to `out`: for scatter/gather I/O straight
// into or out of caller memory, without a copy.
void TakePieces(std::span<const Region> regions, RegionCursor* cursor, size_t len,
                std::vector<Region>* out);
// Region-to-region copy of equal totals.
void CopyRegions(std::span<const Region> src, std::span<const Region> dst);

}  // namespace kvrelay::kv_transfer
