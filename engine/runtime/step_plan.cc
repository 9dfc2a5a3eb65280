#include "engine/runtime/step_plan.h"

#include <algorithm>
#include <string>

namespace kvrelay::engine {

Result<StepShape> CheckStep(std::span<const SeqStep> seqs, int block_tokens, int64_t total_blocks,
                            int vocab) {
  const int B = block_tokens;
  StepShape shape;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const SeqStep& q = seqs[s];
    if (q.tokens.empty())
      return InvalidArgument("sequence " + std::to_string(s) + " has no tokens");
    if (q.cache_len < 0) return InvalidArgument("negative cache length");
    // Compared without forming cache_len + tokens first: a cache length near
    // the int64 limit (a TP plan off the wire) must not wrap to a small end.
    const int64_t room = static_cast<int64_t>(q.blocks.size()) * B;
    const auto n_new = static_cast<int64_t>(q.tokens.size());
    if (q.cache_len > room || n_new > room - q.cache_len) {
      return InvalidArgument("sequence " + std::to_string(s) + ": block table of " +
                             std::to_string(q.blocks.size()) + " blocks cannot hold " +
                             std::to_string(q.cache_len) + " cached + " + std::to_string(n_new) +
                             " new positions");
    }
    const int64_t len = q.end();
    for (int64_t b = 0; b < (len + B - 1) / B; ++b) {
      if (q.blocks[b] < 0 || q.blocks[b] >= total_blocks) {
        return InvalidArgument("sequence " + std::to_string(s) + ": bad block id " +
                               std::to_string(q.blocks[b]));
      }
    }
    for (int32_t t : q.tokens) {
      if (t < 0 || t >= vocab) {
        return InvalidArgument("token id " + std::to_string(t) + " is outside the vocabulary [0, " +
                               std::to_string(vocab) + ")");
      }
    }
    shape.tokens += static_cast<int64_t>(q.tokens.size());
    shape.max_len = std::max(shape.max_len, len);
  }
  return shape;
}

}  // namespace kvrelay::engine
