// Matrix products against GGUF weight tensors, the hot path of the engine.
//
// CONTRACT shared by engine/forward and the kernel work: keep the signatures.
//   W is a 2-D GGUF tensor with dims {cols, rows} (ggml order), any type for
//   which CanDequantize() is true. X is [n_tokens][cols] row-major floats,
//   Y is [n_tokens][rows]. Y[t][r] = sum_c W[r][c] * X[t][c].
#pragma once

#include <cstdint>

#include "common/thread_pool.h"
#include "engine/gguf/gguf.h"

namespace kvrelay::engine {

// Fast path: chosen at run time (AVX2 / scalar). `pool` may be null (one thread).
void MatMul(const GgufTensor& w, const float* x, int64_t n_tokens, float* y, ThreadPool* pool);

// Reference: dequantize each row to fp32 and accumulate in double. Slow; the
// yardstick every fast kernel is tested against.
void MatMulReference(const GgufTensor& w, const float* x, int64_t n_tokens, float* y);

// Copies row `row` of an embedding-style tensor (dims {cols, rows}) to dst as floats.
void GetRow(const GgufTensor& w, int64_t row, float* dst);

}  // namespace kvrelay::engine
