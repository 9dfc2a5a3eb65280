// AVX2 K-quant kernels (kquant.h). Compiled for avx2/fma/f16c by the pragma
// after the includes (as kernels_avx2.cc); matmul.cc reaches this table only
// after checking CPUID.
//
// maddubs saturation: Q4_K nibbles give pairs of at most 2 * 15 * 127 = 3810,
// Q6_K values (0..63) at most 2 * 63 * 127 = 16002, |Q5_0| (<= 16) at most
// 2 * 16 * 127 = 4064 (activations never hold -128), so nothing saturates.
// Per 256-block integer sums are bounded by 256 * 63 * 15 * 127 (Q4_K) and
// 256 * 127 * 63 * 127 (Q6_K) < 2^31.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "engine/kernels/kquant.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace kvrelay::engine::kernels {
namespace {

constexpr int64_t kQ4KBytes = 4 + 12 + 128;
constexpr int64_t kQ6KBytes = 128 + 64 + 16 + 2;
constexpr int64_t kQ5_0Bytes = 2 + 4 + 16;
constexpr int kTokTile = 4;

inline int HsumI32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// The fixed reduction the scalar path reproduces: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)).
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

// quantize_row_q8_K with the scalar path's bits: the same max (the first
// element of largest magnitude, NaN ignored as fabs(NaN) > amax is false),
// iscale and d in scalar float, and cvtps (round half to even, the default
// MXCSR mode that nearbyint uses too) for the 256 products iscale * x.
void QuantizeQ8K(const float* x, int64_t cols, int64_t t0, int64_t t1, const Q8KActs& a) {
  const int64_t nb = cols / kBlockK;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + t * cols + b * kBlockK;
      int8_t* q = a.q + (t * nb + b) * kBlockK;
      int16_t* bs = a.bsums + (t * nb + b) * (kBlockK / 16);
      __m256 vmax = _mm256_setzero_ps();
      for (int j = 0; j < kBlockK; j += 8) {
        // max_ps returns its second operand when either is NaN: NaN ignored.
        vmax = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xb + j)), vmax);
      }
      alignas(32) float m8[8];
      _mm256_store_ps(m8, vmax);
      float amax = m8[0];
      for (int i = 1; i < 8; ++i) amax = m8[i] > amax ? m8[i] : amax;
      if (amax == 0.0f) {
        a.d[t * nb + b] = 0.0f;
        std::memset(q, 0, kBlockK);
        std::memset(bs, 0, sizeof(int16_t) * (kBlockK / 16));
        continue;
      }
      int first = 0;
      while (std::fabs(xb[first]) != amax) ++first;
      const float iscale = -127.0f / xb[first];
      const __m256 vs = _mm256_set1_ps(iscale);
      const __m256i m127 = _mm256_set1_epi32(127);
      for (int j = 0; j < kBlockK; j += 32) {
        __m256i i4[4];
        for (int k = 0; k < 4; ++k) {
          i4[k] = _mm256_min_epi32(
              _mm256_cvtps_epi32(_mm256_mul_ps(vs, _mm256_loadu_ps(xb + j + 8 * k))), m127);
        }
        // Sums of the two 16-element groups: lane-wise adds, then hadds.
        const __m256i g0 = _mm256_add_epi32(i4[0], i4[1]), g1 = _mm256_add_epi32(i4[2], i4[3]);
        const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(g0, g1), _mm256_setzero_si256());
        const __m128i hs = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        bs[j / 16] = static_cast<int16_t>(_mm_cvtsi128_si32(hs));
        bs[j / 16 + 1] = static_cast<int16_t>(_mm_extract_epi32(hs, 1));
        // |values| <= 127: the saturating packs are exact.
        const __m256i p =
            _mm256_packs_epi16(_mm256_packs_epi32(i4[0], i4[1]), _mm256_packs_epi32(i4[2], i4[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + j),
                            _mm256_permutevar8x32_epi32(p, perm));
      }
      a.d[t * nb + b] = 1.0f / iscale;
    }
  }
}

// ---- Q4_K / Q6_K batches: 8 rows per tile, one row per 32-bit lane ----
//
// As kquant_avx512.cc's 16-row tiles (see there), with maddubs + madd for the
// 4-byte group products: the weights of 8 rows' block are unpacked and
// transposed once (wt[g], lane i = row i, elements 4g..4g+3), and per token
// each group's 4 activation bytes are broadcast, so the exact integer
// sub-block sums of 8 rows come out side by side and the float steps run in
// kquant.h's order on 8 rows at once. int16 partial sums stay exact: at most
// 8 Q4_K pairs (8 * 3810) or 2 Q6_K pairs (2 * 16002) are added before madd.

// 8x8 transpose of 32-bit elements: out[k] lane i = in[i] lane k.
inline void Transpose8(__m256i* r) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i + 0] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    r[m] = _mm256_permute2x128_si256(u[m], u[4 + m], 0x20);
    r[4 + m] = _mm256_permute2x128_si256(u[m], u[4 + m], 0x31);
  }
}

inline int32_t LoadI32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// One Q6_K block's 256 6-bit values as 8 vectors of 32 bytes (0..63):
// out[stride * v] holds elements 32 v .. 32 v + 31 (ql low / high nibbles
// with their two qh bits, as ggml's dequantize_row_q6_K orders them).
__attribute__((always_inline)) inline void UnpackQ6K(const uint8_t* blk, __m256i m4, __m256i m30,
                                                     __m256i* out, int stride) {
  for (int n = 0; n < 2; ++n) {
    const uint8_t* ql = blk + 64 * n;
    const uint8_t* qh = blk + 128 + 32 * n;
    const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
    const __m256i qb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
    out[stride * (4 * n + 0)] =
        _mm256_or_si256(_mm256_and_si256(qa, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30));
    out[stride * (4 * n + 1)] =
        _mm256_or_si256(_mm256_and_si256(qb, m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m30));
    out[stride * (4 * n + 2)] =
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), m4), _mm256_and_si256(h, m30));
    out[stride * (4 * n + 3)] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qb, 4), m4),
                                                _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
  }
}

// Tokens per pass over an 8-row group: its accumulators stay in L1.
constexpr int64_t kRowGroupTokens = 64;

// Rows [r, r + 8), tokens [t0, t1) (at most kRowGroupTokens).
template <bool kQ6>
void RowGroup8(const uint8_t* w, int64_t row_bytes, int64_t r, const Q8KActs& a, int64_t t0,
               int64_t t1, float* y, int64_t ldy) {
  constexpr int64_t kBytes = kQ6 ? kQ6KBytes : kQ4KBytes;
  const int64_t nb = a.nb;
  const int nt = static_cast<int>(t1 - t0);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i m30 = _mm256_set1_epi8(0x30);
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) float acc[kRowGroupTokens][8];
  alignas(32) float acc_min[kRowGroupTokens][8];
  for (int k = 0; k < nt; ++k) {
    _mm256_store_ps(acc[k], _mm256_setzero_ps());
    _mm256_store_ps(acc_min[k], _mm256_setzero_ps());
  }
  for (int64_t b = 0; b < nb; ++b) {
    // wt[8 c + k]: elements 32 c + 4 k .. + 3 of the 8 rows.
    __m256i wt[64];
    alignas(32) int32_t sc[16][8];  // Q4_K: [0..7] scales, [8..11] min pairs; Q6_K: [0..15]
    alignas(32) int32_t scp[8][8];  // Q6_K: scale pairs (int16 x 2) for the bsum term
    alignas(32) float dw[8], dmw[8];
    for (int i = 0; i < 8; ++i) {
      const uint8_t* blk = w + (r + i) * row_bytes + b * kBytes;
      _mm_prefetch(reinterpret_cast<const char*>(blk + kBytes), _MM_HINT_T0);
      if constexpr (kQ6) {
        UnpackQ6K(blk, m4, m30, wt + i, 8);
        const int8_t* s8 = reinterpret_cast<const int8_t*>(blk + 192);
        for (int s = 0; s < 16; ++s) sc[s][i] = s8[s];
        for (int s = 0; s < 8; ++s) {
          scp[s][i] = static_cast<int32_t>(
              static_cast<uint32_t>(static_cast<uint16_t>(static_cast<int16_t>(s8[2 * s]))) |
              (static_cast<uint32_t>(static_cast<uint16_t>(static_cast<int16_t>(s8[2 * s + 1])))
               << 16));
        }
        dw[i] = LoadHalfAt(blk + 208);
      } else {
        for (int j = 0; j < 4; ++j) {
          const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * j));
          wt[8 * (2 * j) + i] = _mm256_and_si256(q, m4);
          wt[8 * (2 * j + 1) + i] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        }
        uint8_t s6[8], m6[8];
        UnpackQ4KScales(blk + 4, s6, m6);
        for (int s = 0; s < 8; ++s) sc[s][i] = s6[s];
        for (int j = 0; j < 4; ++j) sc[8 + j][i] = m6[2 * j] | (m6[2 * j + 1] << 16);
        dw[i] = LoadHalfAt(blk);
        dmw[i] = LoadHalfAt(blk + 2);
      }
    }
    for (int c = 0; c < 8; ++c) Transpose8(wt + 8 * c);
    const __m256 dv = _mm256_load_ps(dw);
    if constexpr (kQ6) {
      for (int k = 0; k < nt; ++k) {
        const int64_t tb = (t0 + k) * nb + b;
        const int8_t* xq = a.q + tb * kBlockK;
        const int16_t* bs = a.bsums + tb * (kBlockK / 16);
        __m256i sumi = _mm256_setzero_si256(), sbs = _mm256_setzero_si256();
        for (int s = 0; s < 16; ++s) {
          const __m256i p0 = _mm256_add_epi16(
              _mm256_maddubs_epi16(wt[4 * s], _mm256_set1_epi32(LoadI32(xq + 16 * s))),
              _mm256_maddubs_epi16(wt[4 * s + 1], _mm256_set1_epi32(LoadI32(xq + 16 * s + 4))));
          const __m256i p1 = _mm256_add_epi16(
              _mm256_maddubs_epi16(wt[4 * s + 2], _mm256_set1_epi32(LoadI32(xq + 16 * s + 8))),
              _mm256_maddubs_epi16(wt[4 * s + 3], _mm256_set1_epi32(LoadI32(xq + 16 * s + 12))));
          const __m256i dot =
              _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones));
          sumi = _mm256_add_epi32(
              sumi,
              _mm256_mullo_epi32(dot, _mm256_load_si256(reinterpret_cast<const __m256i*>(sc[s]))));
        }
        for (int s = 0; s < 8; ++s) {
          sbs = _mm256_add_epi32(
              sbs, _mm256_madd_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(scp[s])),
                                     _mm256_set1_epi32(LoadI32(bs + 2 * s))));
        }
        sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(sbs, 5));
        const __m256 v = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(sumi));
        _mm256_store_ps(acc[k],
                        _mm256_fmadd_ps(v, _mm256_set1_ps(a.d[tb]), _mm256_load_ps(acc[k])));
      }
    } else {
      const __m256 dmv = _mm256_load_ps(dmw);
      for (int k = 0; k < nt; ++k) {
        const int64_t tb = (t0 + k) * nb + b;
        const int8_t* xq = a.q + tb * kBlockK;
        const int16_t* bs = a.bsums + tb * (kBlockK / 16);
        const __m256 dx = _mm256_set1_ps(a.d[tb]);
        const __m256 dd = _mm256_mul_ps(dv, dx), dm = _mm256_mul_ps(dmv, dx);
        __m256 ac = _mm256_load_ps(acc[k]), am = _mm256_load_ps(acc_min[k]);
        for (int j = 0; j < 4; ++j) {
          __m256i dots[2];
          for (int h = 0; h < 2; ++h) {
            const int c = 2 * j + h;
            __m256i s16 = _mm256_setzero_si256();
            for (int g = 0; g < 8; ++g) {
              s16 = _mm256_add_epi16(
                  s16, _mm256_maddubs_epi16(wt[8 * c + g],
                                            _mm256_set1_epi32(LoadI32(xq + 32 * c + 4 * g))));
            }
            dots[h] = _mm256_madd_epi16(s16, ones);
          }
          const __m256i sumi = _mm256_add_epi32(
              _mm256_mullo_epi32(dots[0],
                                 _mm256_load_si256(reinterpret_cast<const __m256i*>(sc[2 * j]))),
              _mm256_mullo_epi32(
                  dots[1], _mm256_load_si256(reinterpret_cast<const __m256i*>(sc[2 * j + 1]))));
          const int32_t pa = bs[4 * j] + bs[4 * j + 1], pb = bs[4 * j + 2] + bs[4 * j + 3];
          const int32_t pair = static_cast<int32_t>(
              static_cast<uint32_t>(static_cast<uint16_t>(pa)) | (static_cast<uint32_t>(pb) << 16));
          const __m256i summ =
              _mm256_madd_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(sc[8 + j])),
                                _mm256_set1_epi32(pair));
          ac = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), dd, ac);
          am = _mm256_fmadd_ps(_mm256_cvtepi32_ps(summ), dm, am);
        }
        _mm256_store_ps(acc[k], ac);
        _mm256_store_ps(acc_min[k], am);
      }
    }
  }
  for (int k = 0; k < nt; ++k) {
    const __m256 v = kQ6 ? _mm256_load_ps(acc[k])
                         : _mm256_sub_ps(_mm256_load_ps(acc[k]), _mm256_load_ps(acc_min[k]));
    _mm256_storeu_ps(y + (t0 + k) * ldy + r, v);
  }
}

// Batches of 4+ tokens: full 8-row groups on RowGroup8; returns the first row
// it did not do (r0 when the call is not a batch).
template <bool kQ6>
int64_t RowGroups8(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const Q8KActs& a,
                   int64_t t0, int64_t t1, float* y, int64_t ldy) {
  if (t1 - t0 < 4) return r0;
  int64_t r = r0;
  for (; r + 8 <= r1; r += 8) {
    for (int64_t t = t0; t < t1; t += kRowGroupTokens) {
      RowGroup8<kQ6>(w, row_bytes, r, a, t, std::min(t1, t + kRowGroupTokens), y, ldy);
    }
  }
  return r;
}

void GemmQ4K(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const Q8KActs& a,
             int64_t t0, int64_t t1, float* y, int64_t ldy) {
  r0 = RowGroups8<false>(w, row_bytes, r0, r1, a, t0, t1, y, ldy);
  const int64_t nb = a.nb;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    for (int64_t tt = t0; tt < t1; tt += kTokTile) {
      const int nt = static_cast<int>(std::min<int64_t>(kTokTile, t1 - tt));
      float acc[kTokTile] = {0, 0, 0, 0}, acc_min[kTokTile] = {0, 0, 0, 0};
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * kQ4KBytes;
        _mm_prefetch(reinterpret_cast<const char*>(blk + 4 * kQ4KBytes), _MM_HINT_T0);
        uint8_t sc[8], mn[8];
        UnpackQ4KScales(blk + 4, sc, mn);
        const float dw = LoadHalfAt(blk), dmw = LoadHalfAt(blk + 2);
        __m256i wv[8], scv[8];
        for (int j = 0; j < 4; ++j) {
          const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * j));
          wv[2 * j] = _mm256_and_si256(q, m4);
          wv[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
          scv[2 * j] = _mm256_set1_epi16(sc[2 * j]);
          scv[2 * j + 1] = _mm256_set1_epi16(sc[2 * j + 1]);
        }
        // mins per 16-element bsum: lane s holds mn[s / 2].
        alignas(32) int16_t mins16[16];
        for (int s = 0; s < 16; ++s) mins16[s] = mn[s / 2];
        const __m256i minv = _mm256_load_si256(reinterpret_cast<const __m256i*>(mins16));
        for (int k = 0; k < nt; ++k) {
          const int64_t t = tt + k;
          const int8_t* xq = a.q + (t * nb + b) * kBlockK;
          // u[j]: the 8 int32 lanes of sub-blocks 2j and 2j+1 (64 elements).
          __m256i u[4];
          for (int j = 0; j < 4; ++j) {
            const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 64 * j));
            const __m256i x1 =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 64 * j + 32));
            u[j] = _mm256_add_epi32(
                _mm256_madd_epi16(_mm256_maddubs_epi16(wv[2 * j], x0), scv[2 * j]),
                _mm256_madd_epi16(_mm256_maddubs_epi16(wv[2 * j + 1], x1), scv[2 * j + 1]));
          }
          // Four exact sums at once: lane j of sumi = all lanes of u[j].
          const __m256i h =
              _mm256_hadd_epi32(_mm256_hadd_epi32(u[0], u[1]), _mm256_hadd_epi32(u[2], u[3]));
          const __m128i sumi =
              _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
          // Lane s of mb: mn[s] * (bsum of sub-block s); lane j of summ: pair j.
          const __m256i bs = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(a.bsums + (t * nb + b) * (kBlockK / 16)));
          const __m256i mb = _mm256_madd_epi16(bs, minv);
          const __m256i mh = _mm256_hadd_epi32(mb, mb);
          const __m128i summ =
              _mm_unpacklo_epi64(_mm256_castsi256_si128(mh), _mm256_extracti128_si256(mh, 1));
          alignas(16) float fi[4], fm[4];
          _mm_store_ps(fi, _mm_cvtepi32_ps(sumi));
          _mm_store_ps(fm, _mm_cvtepi32_ps(summ));
          const float dx = a.d[t * nb + b];
          const float dd = dw * dx, dm = dmw * dx;
          for (int j = 0; j < 4; ++j) {
            acc[k] = std::fma(fi[j], dd, acc[k]);
            acc_min[k] = std::fma(fm[j], dm, acc_min[k]);
          }
        }
      }
      for (int k = 0; k < nt; ++k) y[(tt + k) * ldy + r] = acc[k] - acc_min[k];
    }
  }
}

void GemmQ6K(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const Q8KActs& a,
             int64_t t0, int64_t t1, float* y, int64_t ldy) {
  r0 = RowGroups8<true>(w, row_bytes, r0, r1, a, t0, t1, y, ldy);
  const int64_t nb = a.nb;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i m30 = _mm256_set1_epi8(0x30);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    for (int64_t tt = t0; tt < t1; tt += kTokTile) {
      const int nt = static_cast<int>(std::min<int64_t>(kTokTile, t1 - tt));
      float acc[kTokTile] = {0, 0, 0, 0};
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * kQ6KBytes;
        _mm_prefetch(reinterpret_cast<const char*>(blk + 4 * kQ6KBytes), _MM_HINT_T0);
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        __m256i wv[8], scv[8];
        UnpackQ6K(blk, m4, m30, wv, 1);
        for (int v = 0; v < 8; ++v) {
          scv[v] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * v + 1]), _mm_set1_epi16(sc[2 * v]));
        }
        const __m256i sc16 =
            _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
        for (int k = 0; k < nt; ++k) {
          const int64_t t = tt + k;
          const int8_t* xq = a.q + (t * nb + b) * kBlockK;
          __m256i sum = _mm256_setzero_si256();
          for (int v = 0; v < 8; ++v) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * v));
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(wv[v], xv), scv[v]));
          }
          const __m256i bs = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(a.bsums + (t * nb + b) * (kBlockK / 16)));
          sum = _mm256_sub_epi32(sum, _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5));
          const int sumi = HsumI32(sum);
          acc[k] =
              std::fma(LoadHalfAt(blk + 208) * static_cast<float>(sumi), a.d[t * nb + b], acc[k]);
        }
      }
      for (int k = 0; k < nt; ++k) y[(tt + k) * ldy + r] = acc[k];
    }
  }
}

// 32 bits -> 32 bytes: 0xFF where bit j of the word is set (byte j).
inline __m256i BytesFromBits32(const uint8_t* p) {
  uint32_t x32;
  std::memcpy(&x32, p, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101,
                                         0x0000000000000000);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x32)), shuf);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

// Q5_0: the float sum runs in 8 lanes (lane m = elements 4m..4m+3 of every
// block) and is reduced at the end as HsumF32; the scalar path reproduces it.
// Q5_0 batches: 2 rows x 4 tokens per tile, each activation block loaded
// once for both rows. The weights are kept biased (v + 16, 0..31, unsigned
// for maddubs: pairs <= 2 * 31 * 127) and 16 * (sum of each lane's 4
// activations) is subtracted: exactly GemmQ5_0's int32 lanes (|v| x sign(x, v)),
// then its float steps.
void TileQ5_0x2x4(const uint8_t* w, int64_t row_bytes, int64_t r, const QuantizedActs& a, int64_t t,
                  float* y, int64_t ldy) {
  const int64_t nb = a.nb;
  const __m128i m4 = _mm_set1_epi8(0x0F);
  const __m256i b16 = _mm256_set1_epi8(16);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[2][4];
  for (int i = 0; i < 2; ++i) {
    for (int k = 0; k < 4; ++k) acc[i][k] = _mm256_setzero_ps();
  }
  const uint8_t* rows[2] = {w + r * row_bytes, w + (r + 1) * row_bytes};
  for (int64_t b = 0; b < nb; ++b) {
    __m256i u[2];
    __m256 dw[2];
    for (int i = 0; i < 2; ++i) {
      const uint8_t* blk = rows[i] + b * kQ5_0Bytes;
      _mm_prefetch(reinterpret_cast<const char*>(blk + 16 * kQ5_0Bytes), _MM_HINT_T0);
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 6));
      const __m256i q4 =
          _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), _mm_and_si128(qs, m4));
      u[i] = _mm256_or_si256(q4, _mm256_and_si256(BytesFromBits32(blk + 2), b16));
      dw[i] = _mm256_set1_ps(LoadHalfAt(blk));
    }
    for (int k = 0; k < 4; ++k) {
      const int64_t tb = (t + k) * nb + b;
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + tb * kBlock));
      const __m256i bias = _mm256_madd_epi16(_mm256_maddubs_epi16(b16, xv), ones);
      const __m256 dx = _mm256_set1_ps(a.d[tb]);
      for (int i = 0; i < 2; ++i) {
        const __m256i p =
            _mm256_sub_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u[i], xv), ones), bias);
        acc[i][k] = _mm256_fmadd_ps(_mm256_mul_ps(dw[i], dx), _mm256_cvtepi32_ps(p), acc[i][k]);
      }
    }
  }
  for (int i = 0; i < 2; ++i) {
    for (int k = 0; k < 4; ++k) y[(t + k) * ldy + r + i] = HsumF32(acc[i][k]);
  }
}

void GemmQ5_0(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const QuantizedActs& a,
              int64_t t0, int64_t t1, float* y, int64_t ldy) {
  if (t1 - t0 >= 4) {
    const int64_t t4 = t0 + (t1 - t0) / 4 * 4;
    int64_t r = r0;
    for (; r + 2 <= r1; r += 2) {
      for (int64_t t = t0; t < t4; t += 4) TileQ5_0x2x4(w, row_bytes, r, a, t, y, ldy);
    }
    // The tiles' rows for the last (t1 - t0) % 4 tokens, then the odd row.
    if (t4 < t1 && r > r0) GemmQ5_0(w, row_bytes, r0, r, a, t4, t1, y, ldy);
    r0 = r;
  }
  const int64_t nb = a.nb;
  const __m128i m4 = _mm_set1_epi8(0x0F);
  const __m256i b16 = _mm256_set1_epi8(16);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    for (int64_t tt = t0; tt < t1; tt += kTokTile) {
      const int nt = static_cast<int>(std::min<int64_t>(kTokTile, t1 - tt));
      __m256 acc[kTokTile] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                              _mm256_setzero_ps()};
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * kQ5_0Bytes;
        _mm_prefetch(reinterpret_cast<const char*>(blk + 16 * kQ5_0Bytes), _MM_HINT_T0);
        const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 6 - 0));
        const __m256i q4 =
            _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), _mm_and_si128(qs, m4));
        const __m256i hb = _mm256_and_si256(BytesFromBits32(blk + 2), b16);
        const __m256i v = _mm256_sub_epi8(_mm256_or_si256(q4, hb), b16);  // -16..15
        const __m256i av = _mm256_sign_epi8(v, v);
        const __m256 dw = _mm256_set1_ps(LoadHalfAt(blk));
        for (int k = 0; k < nt; ++k) {
          const int64_t t = tt + k;
          const __m256i xv =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + (t * nb + b) * kBlock));
          const __m256i p =
              _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(xv, v)), ones);
          const __m256 d = _mm256_mul_ps(dw, _mm256_set1_ps(a.d[t * nb + b]));
          acc[k] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), acc[k]);
        }
      }
      for (int k = 0; k < nt; ++k) y[(tt + k) * ldy + r] = HsumF32(acc[k]);
    }
  }
}

}  // namespace

const KQuantKernels& Avx2KQuantKernels() {
  static const KQuantKernels table = {"avx2", &QuantizeQ8K, &GemmQ4K, &GemmQ6K, &GemmQ5_0};
  return table;
}

}  // namespace kvrelay::engine::kernels

#pragma GCC pop_options
