// Which kv heads live on which TP rank, and how a transfer from a prefill
// group of TP size S to a decode group of TP size D is cut so that each
// decode rank receives exactly its own heads (S and D may differ).
#pragma once

#include <vector>

#include "common/status.h"

namespace kvrelay::kv_transfer {

struct HeadRange {
  int begin = 0;
  int end = 0;  // exclusive
  int size() const { return end - begin; }
  bool operator==(const HeadRange&) const = default;
};

// Contiguous split of `kv_heads` over `tp_size` ranks; the first
// kv_heads % tp_size ranks get one extra head. With more ranks than heads
// (tp_size a multiple of kv_heads) every head is replicated: rank r holds head
// r / (tp_size / kv_heads) alone, the KV head its query heads share
// (engine::ShardAttentionHeads). InvalidArgument when tp_size < 1, tp_size >
// kv_heads and not a multiple of it, or rank outside [0, tp_size).
Result<HeadRange> ShardHeads(int kv_heads, int tp_size, int tp_rank);

// One piece of a re-sharded transfer: heads `global` go from src_rank (where
// they are src_local in its buffer) to dst_rank (dst_local in its buffer).
struct HeadRoute {
  int src_rank = 0;
  int dst_rank = 0;
  HeadRange global;
  HeadRange src_local;
  HeadRange dst_local;
};

// What each dst rank receives from which src rank, ordered by dst_rank then
// head: together the routes give every dst rank each of its heads exactly
// once. A head held by several src ranks (replicated) comes from the first of
// them; a head held by several dst ranks is sent to each.
Result<std::vector<HeadRoute>> PlanHeadRoutes(int kv_heads, int src_tp, int dst_tp);

}  // namespace kvrelay::kv_transfer
