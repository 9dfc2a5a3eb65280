// The agreement metric of `kvrelay_gpu_check agree` (docs/gpu-numerics.md):
// top-1 agreement of a backend's logits with the CPU engine's, required at
// every position whose CPU top-2 gap exceeds the gap tolerance 2 * eps (eps:
// the bound on any one logit's |CPU - GPU|). Closer positions are near-ties
// that rounding alone may flip, so they are counted but not required.
// Header-only so the host tests can check it without a GPU.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace kvrelay::gpucheck {

struct Agreement {
  double eps = 0;  // per-logit bound; the gap tolerance is 2 * eps
  int64_t positions = 0, agree = 0;
  int64_t decisive = 0, decisive_agree = 0;  // CPU top-2 gap > 2 * eps
  double max_dlogit = 0;

  // Adds one position; returns whether its top-1 agrees.
  bool Add(const float* cpu, const float* gpu, int vocab) {
    int top = 0, gtop = 0;
    for (int i = 1; i < vocab; ++i) {
      if (cpu[i] > cpu[top]) top = i;
      if (gpu[i] > gpu[gtop]) gtop = i;
    }
    double second = -INFINITY;
    for (int i = 0; i < vocab; ++i) {
      if (i != top) second = std::max(second, static_cast<double>(cpu[i]));
      max_dlogit = std::max(max_dlogit,
                            std::fabs(static_cast<double>(cpu[i]) - static_cast<double>(gpu[i])));
    }
    const bool ok = top == gtop;
    ++positions;
    agree += ok;
    if (static_cast<double>(cpu[top]) - second > 2 * eps) {
      ++decisive;
      decisive_agree += ok;
    }
    return ok;
  }
  // Every decisive position agrees and no logit is off by more than eps.
  bool Pass() const { return decisive_agree == decisive && max_dlogit <= eps; }
};

}  // namespace kvrelay::gpucheck
