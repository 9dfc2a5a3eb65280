#include "kv_transfer/head_sharding.h"

#include <algorithm>
#include <string>

namespace kvrelay::kv_transfer {

Result<HeadRange> ShardHeads(int kv_heads, int tp_size, int tp_rank) {
  if (tp_size < 1 || tp_size > kv_heads) {
    return InvalidArgument("head sharding: tp_size " + std::to_string(tp_size) +
                           " must be in [1, kv_heads " + std::to_string(kv_heads) + "]");
  }
  if (tp_rank < 0 || tp_rank >= tp_size) {
    return InvalidArgument("head sharding: tp_rank " + std::to_string(tp_rank) + " outside [0, " +
                           std::to_string(tp_size) + ")");
  }
  const int base = kv_heads / tp_size;
  const int extra = kv_heads % tp_size;
  HeadRange r;
  r.begin = tp_rank * base + std::min(tp_rank, extra);
  r.end = r.begin + base + (tp_rank < extra ? 1 : 0);
  return r;
}

Result<std::vector<HeadRoute>> PlanHeadRoutes(int kv_heads, int src_tp, int dst_tp) {
  std::vector<HeadRoute> routes;
  for (int d = 0; d < dst_tp; ++d) {
    ASSIGN_OR_RETURN(HeadRange dr, ShardHeads(kv_heads, dst_tp, d));
    for (int s = 0; s < src_tp; ++s) {
      ASSIGN_OR_RETURN(HeadRange sr, ShardHeads(kv_heads, src_tp, s));
      HeadRange g{std::max(dr.begin, sr.begin), std::min(dr.end, sr.end)};
      if (g.size() <= 0) continue;
      routes.push_back({s,
                        d,
                        g,
                        {g.begin - sr.begin, g.end - sr.begin},
                        {g.begin - dr.begin, g.end - dr.begin}});
    }
  }
  return routes;
}

}  // namespace kvrelay::kv_transfer
