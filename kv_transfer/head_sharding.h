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
// kv_heads % tp_size ranks get one extra head. InvalidArgument when
// tp_size < 1, tp_size > kv_heads or rank outside [0, tp_size).
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

// Every (src, dst) overlap of the two shardings, ordered by dst_rank then
// head; together they cover each head exactly once.
Result<std::vector<HeadRoute>> PlanHeadRoutes(int kv_heads, int src_tp, int dst_tp);

}  // namespace kvrelay::kv_transfer
