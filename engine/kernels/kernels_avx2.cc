// AVX2 + FMA + F16C kernels. Every function here is compiled for that target
// with a pragma placed after the includes, so nothing shared with other
// translation units (inline functions, templates from headers) is built with
// AVX2 and the binary still runs on older CPUs. matmul.cc only reaches this
// table after checking CPUID.
//
// Integer block dots use maddubs (u8 x s8 -> s16 pairs) and madd (-> s32).
// maddubs saturates at 32767: Q4 nibbles give at most 2 * 15 * 127 = 3810 and
// |Q8| * |Q8| pairs at most 2 * 127 * 127 = 32258 (activations never hold -128),
// so no product saturates.
#include <immintrin.h>

#include <cstring>

#include "engine/kernels/kernel_table.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace kvrelay::engine::kernels {
namespace {

// Decode reads every weight once from DRAM (the default model is 96 MB, the
// L3 32 MB). Measured on the default model (tg, 1 thread, alternating builds):
// one row at a time with a software prefetch 512 bytes ahead beat 4 interleaved
// rows without prefetch by ~30% (4 interleaved row streams defeat the hardware
// prefetcher), so single-token products use 1-row tiles and every tile prefetches.
constexpr int kPrefetchBytes = 512;
constexpr int64_t kRowsPerTileSingleToken = 1;

inline float Hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float LoadHalf(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

void Quantize(const float* x, int64_t cols, int64_t t0, int64_t t1, const QuantizedActs& a) {
  const int64_t nb = cols / kBlock;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + t * cols + b * kBlock;
      __m256 v0 = _mm256_loadu_ps(xb);
      __m256 v1 = _mm256_loadu_ps(xb + 8);
      __m256 v2 = _mm256_loadu_ps(xb + 16);
      __m256 v3 = _mm256_loadu_ps(xb + 24);
      __m256 m =
          _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                        _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float amax = _mm_cvtss_f32(m4);
      // As ggml's quantize_row_q8_0/q8_1: multiplier 127 / amax, d and the
      // block sum stored as fp16 (quant_blocks.h).
      const float d = amax / 127.0f;
      const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
      const __m256 mul = _mm256_set1_ps(id);
      constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
      __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, mul), kRound));
      __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, mul), kRound));
      __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, mul), kRound));
      __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, mul), kRound));
      // Block sum of the integers (exact in int32).
      __m256i s16 = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s16), _mm256_extracti128_si256(s16, 1));
      s4 = _mm_hadd_epi32(s4, s4);
      s4 = _mm_hadd_epi32(s4, s4);
      const int sum = _mm_cvtsi128_si32(s4);
      i0 = _mm256_packs_epi32(i0, i1);
      i2 = _mm256_packs_epi32(i2, i3);
      i0 = _mm256_packs_epi16(i0, i2);
      i0 = _mm256_permutevar8x32_epi32(i0, perm);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q + (t * nb + b) * kBlock), i0);
      a.d[t * nb + b] = _cvtsh_ss(_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT));
      a.s[t * nb + b] =
          _cvtsh_ss(_cvtss_sh(d * static_cast<float>(sum), _MM_FROUND_TO_NEAREST_INT));
      if (a.dt != nullptr) {  // token-major copies (quant_blocks.h)
        a.dt[b * a.ldt + t] = a.d[t * nb + b];
        a.st[b * a.ldt + t] = a.s[t * nb + b];
      }
    }
  }
}

// Blocks per pass of the batched tiles' scale table ([block][row][4 tokens]
// of d_w * d_x on the stack, 4 KiB at 4 rows).
constexpr int64_t kScaleChunk = 64;

// The scale table of rows[0..R) x tokens [t0, t0 + 4) for blocks [b0, b1):
// one 4-token vector multiply per row and block (the products are the ones
// the tiles used to form per (row, token, block): fp32(d_w * d_x)). Reads
// 4 tokens of dt whatever T is (padding tokens are zero).
template <int R, int64_t kBytes>
inline void ScaleTable(const uint8_t* const* rows, const QuantizedActs& a, int64_t t0, int64_t b0,
                       int64_t b1, float* table) {
  for (int64_t b = b0; b < b1; ++b) {
    const __m128 dx = _mm_loadu_ps(a.dt + b * a.ldt + t0);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      _mm_store_ps(table + ((b - b0) * R + r) * 4,
                   _mm_mul_ps(_mm_set1_ps(LoadHalf(rows[r] + b * kBytes)), dx));
    }
  }
}

// 32 nibbles -> 32 bytes in element order (low nibbles are elements 0..15).
inline __m256i UnpackNibbles(const uint8_t* qs) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
  return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

// Register-blocked R rows x T tokens micro-kernel for Q4_0 / Q4_1 weights.
template <int R, int T, bool kHasMin>
void TileQ4(const uint8_t* w, int64_t row_bytes, int64_t r0, const QuantizedActs& a, int64_t t0,
            float* y, int64_t ldy) {
  constexpr int64_t kBytes = kHasMin ? sizeof(BlockQ4_1) : sizeof(BlockQ4_0);
  constexpr int kQsOff = kHasMin ? 4 : 2;
  const int64_t nb = a.nb;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][T];
  float ms[R][T];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) {
      acc[r][t] = _mm256_setzero_ps();
      ms[r][t] = 0.0f;
    }
  }
  const uint8_t* rows[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) rows[r] = w + (r0 + r) * row_bytes;
  if (T > 1 && a.dt != nullptr) {
    // Batched: the scale of (row, token, block) is one broadcast load from a
    // table built 4 tokens per multiply, instead of a multiply per output.
    alignas(16) float table[kScaleChunk * R * 4];
    for (int64_t b0 = 0; b0 < nb; b0 += kScaleChunk) {
      const int64_t b1 = nb - b0 < kScaleChunk ? nb : b0 + kScaleChunk;
      ScaleTable<R, kBytes>(rows, a, t0, b0, b1, table);
      for (int64_t b = b0; b < b1; ++b) {
        __m256i wv[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const uint8_t* blk = rows[r] + b * kBytes;
          _mm_prefetch(reinterpret_cast<const char*>(blk) + kPrefetchBytes, _MM_HINT_T0);
          wv[r] = UnpackNibbles(blk + kQsOff);
        }
        const float* sc = table + (b - b0) * R * 4;
#pragma GCC unroll 4
        for (int t = 0; t < T; ++t) {
          const int64_t ab = (t0 + t) * nb + b;
          const __m256i xv =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + ab * kBlock));
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wv[r], xv), ones);
            acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(sc + r * 4 + t),
                                        acc[r][t]);
          }
        }
      }
    }
  } else {
    for (int64_t b = 0; b < nb; ++b) {
      __m256i wv[R];
      __m256 dw[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const uint8_t* blk = rows[r] + b * kBytes;
        _mm_prefetch(reinterpret_cast<const char*>(blk) + kPrefetchBytes, _MM_HINT_T0);
        wv[r] = UnpackNibbles(blk + kQsOff);
        dw[r] = _mm256_set1_ps(LoadHalf(blk));
      }
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        const int64_t ab = (t0 + t) * nb + b;
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + ab * kBlock));
        const __m256 dx = _mm256_set1_ps(a.d[ab]);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wv[r], xv), ones);
          acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw[r], dx), acc[r][t]);
        }
      }
    }
  }
  // The min term: sum_b m[r][b] * s[t][b] (for Q4_0, m = -8 d).
  for (int64_t b = 0; b < nb; ++b) {
    float m[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = rows[r] + b * kBytes;
      m[r] = kHasMin ? LoadHalf(blk + 2) : -8.0f * LoadHalf(blk);
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) {
      const float s = a.s[(t0 + t) * nb + b];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) ms[r][t] += m[r] * s;
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) y[(t0 + t) * ldy + r0 + r] = Hsum(acc[r][t]) + ms[r][t];
  }
}

template <int R, int T>
void TileQ8(const uint8_t* w, int64_t row_bytes, int64_t r0, const QuantizedActs& a, int64_t t0,
            float* y, int64_t ldy) {
  const int64_t nb = a.nb;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][T];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  }
  const uint8_t* rows[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) rows[r] = w + (r0 + r) * row_bytes;
  const bool table_scales = T > 1 && a.dt != nullptr;  // as TileQ4
  alignas(16) float table[kScaleChunk * R * 4];
  for (int64_t b0 = 0; b0 < nb; b0 += kScaleChunk) {
    const int64_t b1 = nb - b0 < kScaleChunk ? nb : b0 + kScaleChunk;
    if (table_scales) ScaleTable<R, sizeof(BlockQ8_0)>(rows, a, t0, b0, b1, table);
    for (int64_t b = b0; b < b1; ++b) {
      __m256i wv[R], wa[R];
      __m256 dw[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const uint8_t* blk = rows[r] + b * sizeof(BlockQ8_0);
        _mm_prefetch(reinterpret_cast<const char*>(blk) + kPrefetchBytes, _MM_HINT_T0);
        wv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
        wa[r] = _mm256_sign_epi8(wv[r], wv[r]);
        if (!table_scales) dw[r] = _mm256_set1_ps(LoadHalf(blk));
      }
      const float* sc = table + (b - b0) * R * 4;
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        const int64_t ab = (t0 + t) * nb + b;
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + ab * kBlock));
        const __m256 dx = table_scales ? _mm256_setzero_ps() : _mm256_set1_ps(a.d[ab]);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m256i p =
              _mm256_madd_epi16(_mm256_maddubs_epi16(wa[r], _mm256_sign_epi8(xv, wv[r])), ones);
          const __m256 scale =
              table_scales ? _mm256_broadcast_ss(sc + r * 4 + t) : _mm256_mul_ps(dw[r], dx);
          acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[r][t]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) y[(t0 + t) * ldy + r0 + r] = Hsum(acc[r][t]);
  }
}

using TileFn = void (*)(const uint8_t*, int64_t, int64_t, const QuantizedActs&, int64_t, float*,
                        int64_t);

// Walks [r0, r1) x [t0, t1) with the widest tiles that fit: 1 row x 1 token
// for single tokens (one sequential weight stream, see kPrefetchBytes), 2 rows
// x 4 tokens otherwise (each unpacked weight block is reused by 4 tokens).
template <template <int, int> class K>
void Drive(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const QuantizedActs& a,
           int64_t t0, int64_t t1, float* y, int64_t ldy) {
  static constexpr TileFn kTiles[4][4] = {
      {K<1, 1>::Run, K<1, 2>::Run, K<1, 3>::Run, K<1, 4>::Run},
      {K<2, 1>::Run, K<2, 2>::Run, K<2, 3>::Run, K<2, 4>::Run},
      {K<3, 1>::Run, K<3, 2>::Run, K<3, 3>::Run, K<3, 4>::Run},
      {K<4, 1>::Run, K<4, 2>::Run, K<4, 3>::Run, K<4, 4>::Run},
  };
  const int64_t nt = t1 - t0;
  const int64_t rstep = nt == 1 ? kRowsPerTileSingleToken : 2;
  for (int64_t r = r0; r < r1; r += rstep) {
    const int64_t nr = r1 - r < rstep ? r1 - r : rstep;
    for (int64_t t = t0; t < t1; t += 4) {
      const int64_t ntt = t1 - t < 4 ? t1 - t : 4;
      kTiles[nr - 1][ntt - 1](w, row_bytes, r, a, t, y, ldy);
    }
  }
}

template <int R, int T>
struct Q4_0Tile {
  static void Run(const uint8_t* w, int64_t rb, int64_t r0, const QuantizedActs& a, int64_t t0,
                  float* y, int64_t ldy) {
    TileQ4<R, T, false>(w, rb, r0, a, t0, y, ldy);
  }
};
template <int R, int T>
struct Q4_1Tile {
  static void Run(const uint8_t* w, int64_t rb, int64_t r0, const QuantizedActs& a, int64_t t0,
                  float* y, int64_t ldy) {
    TileQ4<R, T, true>(w, rb, r0, a, t0, y, ldy);
  }
};
template <int R, int T>
struct Q8_0Tile {
  static void Run(const uint8_t* w, int64_t rb, int64_t r0, const QuantizedActs& a, int64_t t0,
                  float* y, int64_t ldy) {
    TileQ8<R, T>(w, rb, r0, a, t0, y, ldy);
  }
};

void GemmQ4_0(const uint8_t* w, int64_t rb, int64_t r0, int64_t r1, const QuantizedActs& a,
              int64_t t0, int64_t t1, float* y, int64_t ldy) {
  Drive<Q4_0Tile>(w, rb, r0, r1, a, t0, t1, y, ldy);
}
void GemmQ4_1(const uint8_t* w, int64_t rb, int64_t r0, int64_t r1, const QuantizedActs& a,
              int64_t t0, int64_t t1, float* y, int64_t ldy) {
  Drive<Q4_1Tile>(w, rb, r0, r1, a, t0, t1, y, ldy);
}
void GemmQ8_0(const uint8_t* w, int64_t rb, int64_t r0, int64_t r1, const QuantizedActs& a,
              int64_t t0, int64_t t1, float* y, int64_t ldy) {
  Drive<Q8_0Tile>(w, rb, r0, r1, a, t0, t1, y, ldy);
}

// Float weights: 1 row x up to 4 tokens per pass, 8 lanes; scalar tail for
// cols % 8 (float rows need not be a multiple of 32).
template <typename LoadW>
void GemmFloat(LoadW load, int64_t nr, const float* x, int64_t cols, int64_t nt, float* y,
               int64_t ldy) {
  const int64_t c8 = cols & ~int64_t{7};
  for (int64_t r = 0; r < nr; ++r) {
    for (int64_t t = 0; t < nt; t += 4) {
      const int64_t n = nt - t < 4 ? nt - t : 4;
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                       _mm256_setzero_ps()};
      for (int64_t c = 0; c < c8; c += 8) {
        const __m256 wv = load.Vec(r, c);
        for (int64_t k = 0; k < n; ++k) {
          acc[k] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (t + k) * cols + c), acc[k]);
        }
      }
      for (int64_t k = 0; k < n; ++k) {
        float s = Hsum(acc[k]);
        for (int64_t c = c8; c < cols; ++c) s += load.One(r, c) * x[(t + k) * cols + c];
        y[(t + k) * ldy + r] = s;
      }
    }
  }
}

struct LoadF32 {
  const float* w;
  int64_t ldw;
  __m256 Vec(int64_t r, int64_t c) const { return _mm256_loadu_ps(w + r * ldw + c); }
  float One(int64_t r, int64_t c) const { return w[r * ldw + c]; }
};
struct LoadF16 {
  const uint16_t* w;
  int64_t ldw;
  __m256 Vec(int64_t r, int64_t c) const {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * ldw + c)));
  }
  float One(int64_t r, int64_t c) const { return _cvtsh_ss(w[r * ldw + c]); }
};

void GemmF32(const float* w, int64_t ldw, int64_t nr, const float* x, int64_t cols, int64_t nt,
             float* y, int64_t ldy) {
  GemmFloat(LoadF32{w, ldw}, nr, x, cols, nt, y, ldy);
}
void GemmF16(const uint16_t* w, int64_t ldw, int64_t nr, const float* x, int64_t cols, int64_t nt,
             float* y, int64_t ldy) {
  GemmFloat(LoadF16{w, ldw}, nr, x, cols, nt, y, ldy);
}

}  // namespace

const KernelTable& Avx2Kernels() {
  static const KernelTable table = {"avx2",    Isa::kAvx2, &Quantize,
                                    &GemmQ4_0, &GemmQ4_1,  &GemmQ8_0,
                                    &GemmF32,  &GemmF16,   /*token_major_scales=*/true};
  return table;
}

}  // namespace kvrelay::engine::kernels

#pragma GCC pop_options
