// Tanh-approximate GELU as llama.cpp's CPU backend computes it (Gemma's FFN).
#pragma once

#include <cstdint>
#include <span>

#include "engine/kernels/matmul.h"

namespace kvrelay::engine {

// out[i] = gelu(gate[i]) * up[i] with ggml's GGML_GELU_FP16 arithmetic: for
// -10 < g < 10 the GELU comes from a table indexed by fp16(g) whose entries
// are fp16(0.5 g (1 + tanhf(sqrt(2/pi) g (1 + 0.044715 g^2)))) in float;
// g <= -10 gives 0 and g >= 10 gives g. The fp16 roundings (relative error
// <= 2^-11 each) are llama.cpp's, kept so the FFN matches it rather than the
// exact function. out may alias gate or up. Thread-safe (the table is built
// once).
void GeluTanhMulGgml(const float* gate, const float* up, int64_t n, float* out);

// The same on an explicit instruction-set path (tests; the result is the same
// bits on every path).
void GeluTanhMulGgmlWithPath(const float* gate, const float* up, int64_t n, float* out,
                             KernelPath path);

// The same GELU without the table, in float: 0.5 g (1 + tanhf(...)).
float GeluTanhF32(float g);

// The table itself: 65536 fp16 bit patterns, entry i = fp16(GeluTanhF32(
// float(fp16 i))) (the CUDA backend uploads it so its GeGLU has these bits).
std::span<const uint16_t> GeluTableGgml();

}  // namespace kvrelay::engine
