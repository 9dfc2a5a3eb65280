// AVX-512 VNNI variant of the Q5_0 kernel (kquant.h), 256-bit vectors
// (AVX512VL): vpdpbusd does maddubs + madd in one instruction with the same
// int32 lanes (lane m = elements 4m..4m+3), and the sums cannot saturate
// (|q5| <= 16, |x8| <= 127), so its results are the AVX2 / scalar bits.
// Q4_K and Q6_K keep the AVX2 kernels. Compiled for the target by the pragma
// after the includes; matmul.cc reaches it only after checking CPUID.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "engine/kernels/kquant.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")

namespace kvrelay::engine::kernels {
namespace {

constexpr int64_t kQ5_0Bytes = 2 + 4 + 16;
constexpr int kTokTile = 4;

inline float HsumF32(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float LoadHalfAt(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

void GemmQ5_0(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const QuantizedActs& a,
              int64_t t0, int64_t t1, float* y, int64_t ldy) {
  // Batches: register tiles of 4 rows x 8 tokens on the pair layout.
  if (GemmQ5_0Pairs(w, row_bytes, r0, r1, a, t0, t1, y, ldy)) return;
  const int64_t nb = a.nb;
  const __m128i m4 = _mm_set1_epi8(0x0F);
  const __m256i b16 = _mm256_set1_epi8(16);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    for (int64_t tt = t0; tt < t1; tt += kTokTile) {
      const int nt = static_cast<int>(std::min<int64_t>(kTokTile, t1 - tt));
      __m256 acc[kTokTile] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                              _mm256_setzero_ps()};
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * kQ5_0Bytes;
        _mm_prefetch(reinterpret_cast<const char*>(blk + 16 * kQ5_0Bytes), _MM_HINT_T0);
        const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 6));
        const __m256i q4 =
            _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), _mm_and_si128(qs, m4));
        uint32_t qh;
        std::memcpy(&qh, blk + 2, 4);
        // bit j of qh -> byte j: a mask register selects 16 into those bytes.
        const __m256i hb = _mm256_maskz_mov_epi8(static_cast<__mmask32>(qh), b16);
        const __m256i v = _mm256_sub_epi8(_mm256_or_si256(q4, hb), b16);  // -16..15
        const __m256i av = _mm256_abs_epi8(v);
        const __m256 dw = _mm256_set1_ps(LoadHalfAt(blk));
        for (int k = 0; k < nt; ++k) {
          const int64_t t = tt + k;
          const __m256i xv =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + (t * nb + b) * kBlock));
          const __m256i p =
              _mm256_dpbusd_epi32(_mm256_setzero_si256(), av, _mm256_sign_epi8(xv, v));
          const __m256 d = _mm256_mul_ps(dw, _mm256_set1_ps(a.d[t * nb + b]));
          acc[k] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), acc[k]);
        }
      }
      for (int k = 0; k < nt; ++k) y[(tt + k) * ldy + r] = HsumF32(acc[k]);
    }
  }
}

}  // namespace

const KQuantKernels& Avx512KQuantKernels() {
  static const KQuantKernels table = {"avx512vnni", Avx2KQuantKernels().quantize_q8k,
                                      Avx2KQuantKernels().gemm_q4_k, Avx2KQuantKernels().gemm_q6_k,
                                      &GemmQ5_0};
  return table;
}

}  // namespace kvrelay::engine::kernels

#pragma GCC pop_options
