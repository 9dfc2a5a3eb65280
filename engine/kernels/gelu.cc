#include "engine/kernels/gelu.h"

#include <immintrin.h>

#include <cmath>
#include <vector>

#include "engine/gguf/ggml_type.h"
#include "engine/kernels/matmul.h"

namespace kvrelay::engine {
namespace {

constexpr float kGeluCoefA = 0.044715f;
constexpr float kSqrt2OverPi = 0.79788456080286535587989211986876f;

const std::vector<uint16_t>& GeluTable() {
  static const std::vector<uint16_t> table = [] {
    // Two entries of padding: the AVX2 path gathers 32 bits at entry i.
    std::vector<uint16_t> t((1 << 16) + 2, 0);
    for (uint32_t i = 0; i < (1u << 16); ++i) {
      t[i] = Fp32ToFp16(GeluTanhF32(Fp16ToFp32(static_cast<uint16_t>(i))));
    }
    return t;
  }();
  return table;
}

void GeluTanhMulScalar(const uint16_t* table, const float* gate, const float* up, int64_t from,
                       int64_t n, float* out) {
  for (int64_t i = from; i < n; ++i) {
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

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
// 8 elements at a time with the scalar loop's bits: F16C's round-to-nearest-
// even conversion is Fp32ToFp16 for every finite input (NaN payloads differ,
// so a group holding a NaN takes the scalar loop), the table is gathered, the
// product is the same float multiply, and the two ends are blended in.
void GeluTanhMulAvx2(const uint16_t* table, const float* gate, const float* up, int64_t n,
                     float* out) {
  const __m256 lo = _mm256_set1_ps(-10.0f), hi = _mm256_set1_ps(10.0f);
  const __m256i low16 = _mm256_set1_epi32(0xFFFF);
  const int* base = reinterpret_cast<const int*>(table);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 u = _mm256_loadu_ps(up + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(g, g, _CMP_UNORD_Q)) != 0) {
      GeluTanhMulScalar(table, gate, up, i, i + 8, out);
      continue;
    }
    const __m128i h = _mm256_cvtps_ph(g, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i idx = _mm256_cvtepu16_epi32(h);
    const __m256i e = _mm256_and_si256(_mm256_i32gather_epi32(base, idx, 2), low16);
    const __m128i e16 = _mm_packus_epi32(_mm256_castsi256_si128(e), _mm256_extracti128_si256(e, 1));
    __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(e16), u);
    v = _mm256_blendv_ps(v, _mm256_mul_ps(g, u), _mm256_cmp_ps(g, hi, _CMP_GE_OQ));
    v = _mm256_blendv_ps(v, _mm256_setzero_ps(), _mm256_cmp_ps(g, lo, _CMP_LE_OQ));
    _mm256_storeu_ps(out + i, v);
  }
  GeluTanhMulScalar(table, gate, up, i, n, out);
}
#pragma GCC pop_options
#endif

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

std::span<const uint16_t> GeluTableGgml() { return {GeluTable().data(), size_t{1} << 16}; }

void GeluTanhMulGgmlWithPath(const float* gate, const float* up, int64_t n, float* out,
                             KernelPath path) {
  const uint16_t* table = GeluTable().data();
  if (path == KernelPath::kAuto) path = ResolvedKernelPath();
#if defined(__x86_64__)
  if (path != KernelPath::kScalar && KernelPathSupported(KernelPath::kAvx2)) {
    return GeluTanhMulAvx2(table, gate, up, n, out);
  }
#endif
  GeluTanhMulScalar(table, gate, up, 0, n, out);
}

void GeluTanhMulGgml(const float* gate, const float* up, int64_t n, float* out) {
  GeluTanhMulGgmlWithPath(gate, up, n, out, KernelPath::kAuto);
}

}  // namespace kvrelay::engine
