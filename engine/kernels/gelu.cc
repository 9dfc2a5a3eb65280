#include "engine/kernels/gelu.h"

#include <cmath>
#include <vector>

#include "engine/gguf/ggml_type.h"

namespace kvrelay::engine {
namespace {

constexpr float kGeluCoefA = 0.044715f;
constexpr float kSqrt2OverPi = 0.79788456080286535587989211986876f;

const std::vector<uint16_t>& GeluTable() {
  static const std::vector<uint16_t> table = [] {
    std::vector<uint16_t> t(1 << 16);
    for (uint32_t i = 0; i < (1u << 16); ++i) {
      t[i] = Fp32ToFp16(GeluTanhF32(Fp16ToFp32(static_cast<uint16_t>(i))));
    }
    return t;
  }();
  return table;
}

}  // namespace

float GeluTanhF32(float g) {
  // ggml builds its table in ggml-cpu.c, C compiled as gnu11 (GCC then
  // contracts a * b + c into one fma) with -mfma: 1 + (0.044715 g) g is one
  // fused operation there. Unfused, one of the 37376 fp16 inputs in
  // (-10, 10) rounds the other way (g = -1.999, fp16 0xBFFF; gelu_test in
  // tests/unit/kernels/ops_test.cc), which Gemma 3's FFN meets often enough
  // to move llama.cpp-exact logits.
  const float inner = std::fma(kGeluCoefA * g, g, 1.0f);
  return 0.5f * g * (1.0f + std::tanh(kSqrt2OverPi * g * inner));
}

void GeluTanhMulGgml(const float* gate, const float* up, int64_t n, float* out) {
  const std::vector<uint16_t>& table = GeluTable();
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    if (g <= -10.0f) {
      out[i] = 0.0f;
    } else if (g >= 10.0f) {
      out[i] = g * up[i];
    } else {
      out[i] = Fp16ToFp32(table[Fp32ToFp16(g)]) * up[i];
    }
  }
}

}  // namespace kvrelay::engine
