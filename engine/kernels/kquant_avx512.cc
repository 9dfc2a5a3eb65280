// AVX-512 VNNI variant of the Q5_0 kernel (kquant.h), 256-bit vectors
// (AVX512VL): vpdpbusd does maddubs + madd in one instruction with the same
// int32 lanes (lane m = elements 4m..4m+3), and the sums cannot saturate
// (|q5| <= 16, |x8| <= 127), so its results are the AVX2 / scalar bits.
// Q4_K and Q6_K batches (4+ tokens) run on register tiles of 16 rows: each
// zmm lane is one row's output (GemmKQuant16 below); single tokens, small
// batches and the last rows % 16 keep the AVX2 kernels. Compiled for the
// target by the pragma after the includes; matmul.cc reaches it only after
// checking CPUID.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "engine/kernels/kquant.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
// GCC 12's AVX-512 headers build casts and inserts from an intentionally
// undefined register, which -Wuninitialized reports (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace kvrelay::engine::kernels {
namespace {

constexpr int64_t kQ5_0Bytes = 2 + 4 + 16;
constexpr int64_t kQ4KBytes = 4 + 12 + 128;
constexpr int64_t kQ6KBytes = 128 + 64 + 16 + 2;
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

// ---- Q4_K / Q6_K: 16 rows per tile, one row per 32-bit lane ----
//
// The weights of 16 rows' block b are unpacked to bytes (0..15 / 0..63) and
// transposed once per tile so that vector g holds elements 4g..4g+3 of each
// row in its lane (wt[g], lane i = row i). Each token then needs no
// horizontal sums: vpdpbusd of wt[g] with the token's 4 activation bytes
// 4g..4g+3 broadcast adds those 4 products into every row's lane, so the
// integer sub-block sums of 16 rows come out side by side, and the float
// steps of kquant.h's order (fma per pair of sub-blocks for Q4_K, per block
// for Q6_K) run on 16 rows at once. The integer sums are exact (no
// saturation: vpdpbusd widens to int32; bounds in kquant_avx2.cc), so each
// lane holds the scalar kernel's integers and, after the same float steps in
// the same order, its bits.

// 16x16 transpose of 32-bit elements: out[k] lane i = in[i] lane k.
inline void Transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int h = 0; h < 2; ++h) {
    for (int m = 0; m < 4; ++m) {
      t[8 * h + m] = _mm512_shuffle_i32x4(u[8 * h + m], u[8 * h + 4 + m], 0x88);
      t[8 * h + 4 + m] = _mm512_shuffle_i32x4(u[8 * h + m], u[8 * h + 4 + m], 0xDD);
    }
  }
  for (int m = 0; m < 8; ++m) {
    r[m] = _mm512_shuffle_i32x4(t[m], t[8 + m], 0x88);
    r[8 + m] = _mm512_shuffle_i32x4(t[m], t[8 + m], 0xDD);
  }
}

inline __m512i Join(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// Row block -> 4 zmm of its 256 values as bytes in element order (64 each).
inline void UnpackQ4KBlock(const uint8_t* blk, __m512i* e) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * j));
    e[j] = Join(_mm256_and_si256(q, m4), _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
  }
}
inline void UnpackQ6KBlock(const uint8_t* blk, __m512i* e) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i m30 = _mm256_set1_epi8(0x30);
  for (int n = 0; n < 2; ++n) {
    const uint8_t* ql = blk + 64 * n;
    const uint8_t* qh = blk + 128 + 32 * n;
    const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
    const __m256i qb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
    e[2 * n] = Join(
        _mm256_or_si256(_mm256_and_si256(qa, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30)),
        _mm256_or_si256(_mm256_and_si256(qb, m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m30)));
    e[2 * n + 1] = Join(
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), m4), _mm256_and_si256(h, m30)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qb, 4), m4),
                        _mm256_and_si256(_mm256_srli_epi16(h, 2), m30)));
  }
}

inline int32_t LoadI32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Tokens per pass over a 16-row group: its accumulators stay in L1.
constexpr int64_t kRowGroupTokens = 64;

// Rows [r, r + 16), tokens [t0, t1) (at most kRowGroupTokens).
template <bool kQ6>
void RowGroup16(const uint8_t* w, int64_t row_bytes, int64_t r, const Q8KActs& a, int64_t t0,
                int64_t t1, float* y, int64_t ldy) {
  constexpr int64_t kBytes = kQ6 ? kQ6KBytes : kQ4KBytes;
  const int64_t nb = a.nb;
  const int nt = static_cast<int>(t1 - t0);
  alignas(64) float acc[kRowGroupTokens][16];
  alignas(64) float acc_min[kRowGroupTokens][16];
  for (int k = 0; k < nt; ++k) {
    _mm512_store_ps(acc[k], _mm512_setzero_ps());
    _mm512_store_ps(acc_min[k], _mm512_setzero_ps());
  }
  for (int64_t b = 0; b < nb; ++b) {
    // wt[16 j + k]: elements 64 j + 4 k .. + 3 of the 16 rows.
    __m512i wt[64];
    alignas(64) int32_t sc[16][16];  // Q4_K: [0..7] scales, [8..11] min pairs; Q6_K: [0..15]
    alignas(64) int32_t scp[8][16];  // Q6_K: scale pairs (int16 x 2) for the bsum term
    alignas(64) float dw[16], dmw[16];
    for (int i = 0; i < 16; ++i) {
      const uint8_t* blk = w + (r + i) * row_bytes + b * kBytes;
      _mm_prefetch(reinterpret_cast<const char*>(blk + kBytes), _MM_HINT_T0);
      __m512i e[4];
      if constexpr (kQ6) {
        UnpackQ6KBlock(blk, e);
        const int8_t* s8 = reinterpret_cast<const int8_t*>(blk + 192);
        for (int s = 0; s < 16; ++s) sc[s][i] = s8[s];
        for (int s = 0; s < 8; ++s) {
          scp[s][i] = static_cast<int32_t>(
              static_cast<uint16_t>(static_cast<int16_t>(s8[2 * s])) |
              (static_cast<uint32_t>(static_cast<uint16_t>(static_cast<int16_t>(s8[2 * s + 1])))
               << 16));
        }
        dw[i] = LoadHalfAt(blk + 208);
      } else {
        UnpackQ4KBlock(blk, e);
        uint8_t s6[8], m6[8];
        UnpackQ4KScales(blk + 4, s6, m6);
        for (int s = 0; s < 8; ++s) sc[s][i] = s6[s];
        for (int j = 0; j < 4; ++j) sc[8 + j][i] = m6[2 * j] | (m6[2 * j + 1] << 16);
        dw[i] = LoadHalfAt(blk);
        dmw[i] = LoadHalfAt(blk + 2);
      }
      for (int j = 0; j < 4; ++j) wt[16 * j + i] = e[j];
    }
    for (int j = 0; j < 4; ++j) Transpose16(wt + 16 * j);
    const __m512 dv = _mm512_load_ps(dw);
    if constexpr (kQ6) {
      __m512i scv[16], scpv[8];
      for (int s = 0; s < 16; ++s) scv[s] = _mm512_load_si512(sc[s]);
      for (int s = 0; s < 8; ++s) scpv[s] = _mm512_load_si512(scp[s]);
      for (int k = 0; k < nt; ++k) {
        const int64_t tb = (t0 + k) * nb + b;
        const int8_t* xq = a.q + tb * kBlockK;
        const int16_t* bs = a.bsums + tb * (kBlockK / 16);
        __m512i sumi = _mm512_setzero_si512();
        for (int s = 0; s < 16; ++s) {
          __m512i dot = _mm512_setzero_si512();
          for (int g = 4 * s; g < 4 * s + 4; ++g) {
            dot = _mm512_dpbusd_epi32(dot, wt[g], _mm512_set1_epi32(LoadI32(xq + 4 * g)));
          }
          sumi = _mm512_add_epi32(sumi, _mm512_mullo_epi32(dot, scv[s]));
        }
        __m512i sbs = _mm512_setzero_si512();
        for (int s = 0; s < 8; ++s) {
          sbs = _mm512_dpwssd_epi32(sbs, scpv[s], _mm512_set1_epi32(LoadI32(bs + 2 * s)));
        }
        sumi = _mm512_sub_epi32(sumi, _mm512_slli_epi32(sbs, 5));
        const __m512 v = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(sumi));
        _mm512_store_ps(acc[k],
                        _mm512_fmadd_ps(v, _mm512_set1_ps(a.d[tb]), _mm512_load_ps(acc[k])));
      }
    } else {
      const __m512 dmv = _mm512_load_ps(dmw);
      __m512i scv[12];
      for (int s = 0; s < 12; ++s) scv[s] = _mm512_load_si512(sc[s]);
      for (int k = 0; k < nt; ++k) {
        const int64_t tb = (t0 + k) * nb + b;
        const int8_t* xq = a.q + tb * kBlockK;
        const int16_t* bs = a.bsums + tb * (kBlockK / 16);
        const __m512 dx = _mm512_set1_ps(a.d[tb]);
        const __m512 dd = _mm512_mul_ps(dv, dx), dm = _mm512_mul_ps(dmv, dx);
        __m512 ac = _mm512_load_ps(acc[k]), am = _mm512_load_ps(acc_min[k]);
        for (int j = 0; j < 4; ++j) {
          __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
          for (int g = 0; g < 8; ++g) {
            lo = _mm512_dpbusd_epi32(lo, wt[16 * j + g],
                                     _mm512_set1_epi32(LoadI32(xq + 64 * j + 4 * g)));
            hi = _mm512_dpbusd_epi32(hi, wt[16 * j + 8 + g],
                                     _mm512_set1_epi32(LoadI32(xq + 64 * j + 32 + 4 * g)));
          }
          const __m512i sumi = _mm512_add_epi32(_mm512_mullo_epi32(lo, scv[2 * j]),
                                                _mm512_mullo_epi32(hi, scv[2 * j + 1]));
          // (bs[4j] + bs[4j+1], bs[4j+2] + bs[4j+3]) as two int16 (|.| <= 4064).
          const int32_t pa = bs[4 * j] + bs[4 * j + 1], pb = bs[4 * j + 2] + bs[4 * j + 3];
          const int32_t pair =
              static_cast<int32_t>(static_cast<uint16_t>(pa) | (static_cast<uint32_t>(pb) << 16));
          const __m512i summ = _mm512_madd_epi16(scv[8 + j], _mm512_set1_epi32(pair));
          ac = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), dd, ac);
          am = _mm512_fmadd_ps(_mm512_cvtepi32_ps(summ), dm, am);
        }
        _mm512_store_ps(acc[k], ac);
        _mm512_store_ps(acc_min[k], am);
      }
    }
  }
  for (int k = 0; k < nt; ++k) {
    const __m512 v = kQ6 ? _mm512_load_ps(acc[k])
                         : _mm512_sub_ps(_mm512_load_ps(acc[k]), _mm512_load_ps(acc_min[k]));
    _mm512_storeu_ps(y + (t0 + k) * ldy + r, v);
  }
}

// Batches of 4+ tokens: 16-row groups here, the rows past the last full group
// (and every smaller call) on the AVX2 kernel, which has the same bits.
template <bool kQ6>
void GemmKQuant16(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const Q8KActs& a,
                  int64_t t0, int64_t t1, float* y, int64_t ldy) {
  const GemmQ8KFn fallback = kQ6 ? Avx2KQuantKernels().gemm_q6_k : Avx2KQuantKernels().gemm_q4_k;
  if (t1 - t0 < 4) return fallback(w, row_bytes, r0, r1, a, t0, t1, y, ldy);
  int64_t r = r0;
  for (; r + 16 <= r1; r += 16) {
    for (int64_t t = t0; t < t1; t += kRowGroupTokens) {
      RowGroup16<kQ6>(w, row_bytes, r, a, t, std::min(t1, t + kRowGroupTokens), y, ldy);
    }
  }
  if (r < r1) fallback(w, row_bytes, r, r1, a, t0, t1, y, ldy);
}

}  // namespace

const KQuantKernels& Avx512KQuantKernels() {
  static const KQuantKernels table = {"avx512vnni", Avx2KQuantKernels().quantize_q8k,
                                      &GemmKQuant16<false>, &GemmKQuant16<true>, &GemmQ5_0};
  return table;
}

}  // namespace kvrelay::engine::kernels

#pragma GCC diagnostic pop
#pragma GCC pop_options
