// Element-wise CPU ops of the transformer, vectorised (AVX2 chosen at run time
// like MatMul, scalar otherwise). The runtime decides whether to call them;
// each is single-threaded, reentrant, and allows y == x unless noted.
#pragma once

#include <cstdint>
#include <span>

#include "common/thread_pool.h"
#include "engine/gguf/gguf.h"

namespace kvrelay::engine {

// y = x / sqrt(mean(x^2) + eps) * w over n floats (sum of squares in double
// on the scalar path, float lanes then double on AVX2).
void RmsNormFast(const float* x, const float* w, int64_t n, float eps, float* y);

// out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + exp(-g)). out may alias gate or up.
void SiluMul(const float* gate, const float* up, int64_t n, float* out);

// y[i] += x[i] (residual add).
void AddInPlace(float* y, const float* x, int64_t n);

// Several products that read the SAME input x (Q/K/V, or gate/up): x is
// quantized once and all of them run in a single parallel section, which saves
// thread wake-ups in decode. ys[i] is [n_tokens][ws[i]->Rows()]. All ws must
// have the same Cols(). Equivalent to calling MatMul for each.
void MatMulShared(std::span<const GgufTensor* const> ws, const float* x, int64_t n_tokens,
                  std::span<float* const> ys, ThreadPool* pool);

}  // namespace kvrelay::engine
