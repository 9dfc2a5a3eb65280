#include "engine/kv_cache/kv_groups.h"

#include <algorithm>
#include <numeric>

#include "common/hash.h"

namespace kvrelay::engine {

int KvCacheGroups::sliding_groups() const {
  return static_cast<int>(std::count_if(window.begin(), window.end(), [](int w) { return w > 0; }));
}

KvCacheGroups KvCacheGroups::One(int n_layers) {
  KvCacheGroups g;
  g.layers.resize(1);
  g.window.assign(1, 0);
  for (int l = 0; l < n_layers; ++l) {
    g.layers[0].push_back(l);
    g.group_of.push_back(0);
    g.slot_of.push_back(l);
  }
  return g;
}

KvCacheGroups KvCacheGroups::FromLayerWindows(std::span<const int> windows, bool split) {
  const int n = static_cast<int>(windows.size());
  std::vector<int> full, sliding;
  int window = 0;
  bool one_window = true;
  for (int l = 0; l < n; ++l) {
    const int w = windows[static_cast<size_t>(l)];
    if (w <= 0) {
      full.push_back(l);
      continue;
    }
    sliding.push_back(l);
    if (window == 0) window = w;
    one_window = one_window && w == window;
  }
  if (!split || full.empty() || sliding.empty() || !one_window) return One(n);
  const int per_block = std::gcd(static_cast<int>(full.size()), static_cast<int>(sliding.size()));
  KvCacheGroups g;
  g.group_of.assign(static_cast<size_t>(n), 0);
  g.slot_of.assign(static_cast<size_t>(n), 0);
  for (const auto* list : {&full, &sliding}) {
    for (size_t i = 0; i < list->size(); ++i) {
      if (i % static_cast<size_t>(per_block) == 0) {
        g.layers.emplace_back();
        g.window.push_back(list == &full ? 0 : window);
      }
      const int l = (*list)[i];
      g.group_of[static_cast<size_t>(l)] = g.size() - 1;
      g.slot_of[static_cast<size_t>(l)] = static_cast<int>(g.layers.back().size());
      g.layers.back().push_back(l);
    }
  }
  return g;
}

int64_t KvCacheGroups::DroppableBlocks(int group, int64_t next_pos, int block_tokens) const {
  if (!sliding(group) || block_tokens <= 0) return 0;
  const int64_t first_read =
      std::max<int64_t>(0, next_pos - window[static_cast<size_t>(group)] + 1);
  return first_read / block_tokens;
}

int64_t KvCacheGroups::WindowBlocksBound(int group, int64_t step_tokens, int block_tokens) const {
  // A step at cache_len c with k new tokens reads and writes blocks
  // floor((c - W + 1) / B) .. floor((c + k - 1) / B): at most
  // ceil((W + k) / B) + 1 of them.
  const int64_t span = window[static_cast<size_t>(group)] + step_tokens;
  return (span + block_tokens - 1) / block_tokens + 1;
}

std::string KvCacheGroups::DebugString() const {
  if (size() == 1) return "1 KV cache group";
  return std::to_string(size()) + " KV cache groups of " + std::to_string(layers_per_block()) +
         " layers (" + std::to_string(size() - sliding_groups()) + " full attention, " +
         std::to_string(sliding_groups()) + " sliding window " +
         std::to_string(window[static_cast<size_t>(size() - 1)]) + ")";
}

BlockHash GroupBlockHash(const BlockHash& hash, int group) {
  if (group == 0) return hash;
  Sha256 h;
  h.Update(hash.data(), hash.size());
  h.Update(std::string_view("kv-group"));
  const uint32_t g = static_cast<uint32_t>(group);
  const uint8_t g_le[4] = {static_cast<uint8_t>(g), static_cast<uint8_t>(g >> 8),
                           static_cast<uint8_t>(g >> 16), static_cast<uint8_t>(g >> 24)};
  h.Update(g_le, 4);
  return h.Finish();
}

}  // namespace kvrelay::engine
