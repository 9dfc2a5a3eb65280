// Reference quantizers for tests: encode float rows into ggml block formats so
// tests can build synthetic quantized weights. Straightforward round-to-nearest
// per block as ggml's reference quantizers do; not tuned for speed or error.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/gguf/ggml_type.h"

namespace kvrelay::engine {

// True for the types QuantizeRowForTest can encode: F32, F16, BF16, Q4_0, Q4_1,
// Q5_0, Q5_1, Q8_0, Q8_1.
bool CanQuantizeForTest(GgmlType type);

// Encodes n floats (n a multiple of BlockElems(type)) into RowBytes(type, n)
// bytes. Returns an empty vector for an unsupported type or a bad n.
// Scales are stored as fp16 and the quants are computed against the stored
// (rounded) scale, so DequantizeRow(QuantizeRowForTest(x)) is within half a
// quantization step of x (Q4_0/Q5_0: one step at the positive end, as in ggml).
std::vector<uint8_t> QuantizeRowForTest(GgmlType type, const float* x, int64_t n);

}  // namespace kvrelay::engine
