#include "kv_transfer/head_sharding.h"

#include <algorithm>
#include <string>

namespace kvrelay::kv_transfer {

Result<HeadRange> ShardHeads(int kv_heads, int tp_size, int tp_rank) {
  if (tp_size < 1 || kv_heads < 1 || (tp_size > kv_heads && tp_size % kv_heads != 0)) {
    return InvalidArgument("head sharding: tp_size " + std::to_string(tp_size) +
                           " must be in [1, kv_heads " + std::to_string(kv_heads) +
                           "] or a multiple of kv_heads (replicated heads)");
  }
  if (tp_rank < 0 || tp_rank >= tp_size) {
    return InvalidArgument("head sharding: tp_rank " + std::to_string(tp_rank) + " outside [0, " +
                           std::to_string(tp_size) + ")");
  }
  HeadRange r;
  if (tp_size > kv_heads) {
    r.begin = tp_rank / (tp_size / kv_heads);
    r.end = r.begin + 1;
    return r;
  }
  const int base = kv_heads / tp_size;
  const int extra = kv_heads % tp_size;
  r.begin = tp_rank * base + std::min(tp_rank, extra);
  r.end = r.begin + base + (tp_rank < extra ? 1 : 0);
  return r;
}

Result<std::vector<HeadRoute>> PlanHeadRoutes(int kv_heads, int src_tp, int dst_tp) {
  std::vector<HeadRange> src(static_cast<size_t>(std::max(src_tp, 0)));
  for (int s = 0; s < src_tp; ++s) {
    ASSIGN_OR_RETURN(src[static_cast<size_t>(s)], ShardHeads(kv_heads, src_tp, s));
  }
  std::vector<HeadRoute> routes;
  for (int d = 0; d < dst_tp; ++d) {
    ASSIGN_OR_RETURN(HeadRange dr, ShardHeads(kv_heads, dst_tp, d));
    // Head by head from the first src rank holding it; runs from one src
    // rank become one route.
    for (int h = dr.begin; h < dr.end;) {
      int s = 0;
      while (s < src_tp && !(src[s].begin <= h && h < src[s].end)) ++s;
      if (s == src_tp)
        return Internal("head sharding: no src rank holds head " + std::to_string(h));
      const HeadRange g{h, std::min(dr.end, src[s].end)};
      routes.push_back({s,
                        d,
                        g,
                        {g.begin - src[s].begin, g.end - src[s].begin},
                        {g.begin - dr.begin, g.end - dr.begin}});
      h = g.end;
    }
  }
  return routes;
}

}  // namespace kvrelay::kv_transfer
