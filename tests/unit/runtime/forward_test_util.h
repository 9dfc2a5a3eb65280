// Helpers shared by the runtime tests: run a model's forward pass over one
// sequence in a given chunking and collect the logits of every position.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/status.h"
#include "common/thread_pool.h"
#include "engine/kv_cache/kv_cache.h"
#include "engine/runtime/forward.h"
#include "engine/runtime/model.h"

namespace kvrelay::engine::testutil {

inline std::unique_ptr<KvBlockPool> MakePool(const Model& m, int64_t blocks, int block_tokens = 16,
                                             KvDtype dtype = KvDtype::kF32) {
  KvBlockPool::Options o;
  o.layout = m.MakeKvLayout(dtype, block_tokens);
  o.capacity_bytes = blocks * o.layout.BlockBytes();
  auto pool = KvBlockPool::Create(o);
  return pool.ok() ? std::move(pool).value() : nullptr;
}

// Feeds `tokens` as a first chunk of `first` tokens and then chunks of `step`
// tokens, asking for the logits of every position. Returns [n][vocab].
// The blocks are released before returning. tiled_attention: ForwardPass's
// set_tiled_attention.
inline Result<std::vector<float>> ChunkedLogits(const Model& m, KvBlockPool* pool,
                                                ThreadPool* threads,
                                                const std::vector<int32_t>& tokens, int64_t first,
                                                int64_t step, bool tiled_attention = true) {
  const int B = pool->layout().block_tokens;
  const int64_t n = static_cast<int64_t>(tokens.size());
  std::vector<BlockId> blocks;
  for (int64_t i = 0; i < (n + B - 1) / B; ++i) {
    auto b = pool->Allocate();
    if (!b.ok()) {
      for (BlockId x : blocks) pool->Release(x);
      return b.status();
    }
    blocks.push_back(*b);
  }
  ForwardPass fwd(m, pool, threads);
  fwd.set_tiled_attention(tiled_attention);
  std::vector<float> all;
  int64_t done = 0;
  Status st;
  while (done < n && st.ok()) {
    const int64_t len = std::min(n - done, done == 0 ? first : step);
    SeqStep s;
    s.blocks.assign(blocks.begin(), blocks.end());
    s.cache_len = done;
    s.tokens.assign(tokens.data() + done, tokens.data() + done + len);
    s.logits = LogitRows::kAll;
    ForwardOutput out;
    st = fwd.Run(std::span<const SeqStep>(&s, 1), &out);
    all.insert(all.end(), out.logits.begin(), out.logits.end());
    done += len;
  }
  for (BlockId x : blocks) pool->Release(x);
  if (!st.ok()) return st;
  return all;
}

inline int32_t ArgMax(const float* v, int n) {
  return static_cast<int32_t>(std::max_element(v, v + n) - v);
}

}  // namespace kvrelay::engine::testutil
