// AVX-512 (F, BW, VL, DQ) + VNNI kernels for the quantized products. Like
// kernels_avx2.cc, the target is selected with a pragma after the includes, so
// nothing from shared headers is built for AVX-512 and the binary still runs
// on CPUs without it; matmul.cc only reaches this table after checking CPUID
// and that the OS saves the zmm state (XGETBV).
//
// Bit-identical to the AVX2 path (and so to llama.cpp's AVX2 arithmetic,
// docs/ENGINE_NUMERICS.md): every output keeps ggml's 8-lane float
// accumulator, updated block by block in order with fma(int dot, d_w * d_x).
// In batched products a 512-bit register holds two such accumulators (two
// tokens of one row): interleaved lane by lane on the pair layout that
// matmul.cc asks this table's quantize for (TilePairs), side by side
// otherwise (TileTokens); single-token products use 256-bit VNNI.
// The per-lane integer values are the same as the AVX2 path's: vpdpbusd sums
// four adjacent u8 x s8 products into a lane, exactly what maddubs + madd
// (pairs, then pairs of pairs) give when maddubs does not saturate (see the
// bound in kernels_avx2.cc).
#include <immintrin.h>

#include <cstring>

#include "engine/kernels/kernel_table.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
// GCC 12's AVX-512 headers build casts and inserts from an intentionally
// undefined register, which -Wuninitialized reports (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace kvrelay::engine::kernels {
namespace {

constexpr int kPrefetchBytes = 512;

// ggml's 8-lane horizontal sum, as kernels_avx2.cc's Hsum (same order).
inline float Hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float HsumLo(__m512 v) { return Hsum(_mm512_castps512_ps256(v)); }
inline float HsumHi(__m512 v) {
  return Hsum(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

inline float LoadHalf(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m512i Join(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
inline __m512 Join(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(
      _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}
inline __m256i Load256(const int8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// 32 nibbles -> 32 bytes in element order (low nibbles are elements 0..15).
inline __m256i UnpackNibbles(const uint8_t* qs) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
  return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

// The int32 lanes of one block dot (4 adjacent byte products per lane) for
// u8 weights (Q4) x s8 activations.
inline __m512i DotU8S8(__m512i w, __m512i x) {
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x);
}
// Same for s8 x s8 (Q8_0): |w| x (x with w's sign), as the AVX2 sign trick.
inline __m512i DotS8S8(__m512i w, __m512i x) {
  const __mmask64 neg = _mm512_movepi8_mask(w);
  const __m512i xs = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(w), xs);
}

// kQ5_0 only has the pair tiles (GemmQ5_0Pairs); its other shapes are the
// kquant_avx512.cc kernels.
enum class Kind { kQ4_0, kQ4_1, kQ8_0, kQ5_0 };

template <Kind K>
struct Fmt {
  static constexpr int64_t kBytes = K == Kind::kQ4_0   ? sizeof(BlockQ4_0)
                                    : K == Kind::kQ4_1 ? sizeof(BlockQ4_1)
                                    : K == Kind::kQ5_0 ? 2 + 4 + 16
                                                       : sizeof(BlockQ8_0);
  static constexpr bool kHasMinTerm = K == Kind::kQ4_0 || K == Kind::kQ4_1;
  // Q5_0's result is the 8-lane sum alone (kquant_avx2.cc): adding a zero
  // min term would turn a -0.0f into +0.0f.
  static constexpr bool kAddsMinTerm = K != Kind::kQ5_0;
  static __m256i Weights(const uint8_t* blk) {
    if constexpr (K == Kind::kQ8_0) {
      return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    } else {
      return UnpackNibbles(blk + (K == Kind::kQ4_1 ? 4 : 2));
    }
  }
  static __m512i Dot(__m512i w, __m512i x) {
    if constexpr (K == Kind::kQ8_0) {
      return DotS8S8(w, x);
    } else {
      return DotU8S8(w, x);
    }
  }
  // The Q4 min term per block (Q4_0: -8 d).
  static float Min(const uint8_t* blk) {
    if constexpr (K == Kind::kQ4_1) {
      return LoadHalf(blk + 2);
    } else {
      return -8.0f * LoadHalf(blk);
    }
  }
};

// 32 nibbles -> [elements 0..31 | the same again] (two copies for two tokens):
// each 128-bit lane of the broadcast 16 bytes is shifted by 0 or 4 bits.
inline __m512i UnpackNibblesTwice(const uint8_t* qs) {
  const __m512i b = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  const __m512i shifts = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0);  // per 16-bit lane via epi16
  const __m512i sh16 = _mm512_or_si512(shifts, _mm512_slli_epi64(shifts, 16));
  const __m512i sh = _mm512_or_si512(sh16, _mm512_slli_epi64(sh16, 32));
  return _mm512_and_si512(_mm512_srlv_epi16(b, sh), _mm512_set1_epi8(0x0F));
}

// R rows x T tokens (T <= 8), tokens paired in 512-bit registers. The min
// term of output (r, t) is fma(m_rb, s_tb, ms) over blocks b in order, as
// the AVX2 tile's scalar loop compiles; here lane t of one 8-lane register
// per row holds it (the 8 tokens' s values gathered once per block).
template <Kind K, int R, int T>
void TileTokens(const uint8_t* w, int64_t row_bytes, int64_t r0, const QuantizedActs& a, int64_t t0,
                float* y, int64_t ldy) {
  using F = Fmt<K>;
  constexpr int P = (T + 1) / 2;
  const int64_t nb = a.nb;
  __m512 acc[R][P];
  __m256 ms[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
    ms[r] = _mm256_setzero_ps();
  }
  const uint8_t* rows[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) rows[r] = w + (r0 + r) * row_bytes;
  // Token t's s at block b is a.s[(t0 + t) * nb + b]; lanes past T repeat token 0.
  alignas(32) int32_t sidx[8];
  for (int t = 0; t < 8; ++t) sidx[t] = static_cast<int32_t>(t < T ? t * nb : 0);
  const __m256i vsidx = _mm256_load_si256(reinterpret_cast<const __m256i*>(sidx));
  const float* s_base = a.s + t0 * nb;
  for (int64_t b = 0; b < nb; ++b) {
    __m512i wv[R];
    __m512 dw[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const uint8_t* blk = rows[r] + b * F::kBytes;
      _mm_prefetch(reinterpret_cast<const char*>(blk) + kPrefetchBytes, _MM_HINT_T0);
      if constexpr (K == Kind::kQ8_0) {
        const __m256i v = F::Weights(blk);
        wv[r] = Join(v, v);
      } else {
        wv[r] = UnpackNibblesTwice(blk + (K == Kind::kQ4_1 ? 4 : 2));
      }
      dw[r] = _mm512_set1_ps(LoadHalf(blk));
    }
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      const int64_t lo = (t0 + 2 * p) * nb + b;
      const int64_t hi = 2 * p + 1 < T ? lo + nb : lo;
      const __m512i xv = Join(Load256(a.q + lo * kBlock), Load256(a.q + hi * kBlock));
      const __m512 dx = Join(_mm256_set1_ps(a.d[lo]), _mm256_set1_ps(a.d[hi]));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512i d = F::Dot(wv[r], xv);
        acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(dw[r], dx), acc[r][p]);
      }
    }
    if constexpr (F::kHasMinTerm) {
      const __m256 sv = _mm256_i32gather_ps(s_base + b, vsidx, 4);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        ms[r] = _mm256_fmadd_ps(_mm256_set1_ps(F::Min(rows[r] + b * F::kBytes)), sv, ms[r]);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    alignas(32) float m8[8];
    _mm256_store_ps(m8, ms[r]);
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const __m512 v = acc[r][t / 2];
      y[(t0 + t) * ldy + r0 + r] = ((t & 1) == 0 ? HsumLo(v) : HsumHi(v)) + m8[t];
    }
  }
}

// One block's integer dot on 256-bit VNNI (dpbusd takes unsigned x signed):
// signed Q8_0 weights go through the sign trick |w| * (x * sign(w)); the
// other formats' weights are unpacked unsigned (F::Weights).
template <Kind K>
__attribute__((always_inline)) inline __m256i BlockDot256(__m256i wv, __m256i xv) {
  if constexpr (K == Kind::kQ8_0) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(wv, wv),
                               _mm256_sign_epi8(xv, wv));
  } else {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), wv, xv);
  }
}

// One token, one row: a single sequential weight stream with a software
// prefetch (as the AVX2 path; interleaved row streams defeat the hardware
// prefetcher in decode), 256-bit VNNI for the block dots.
template <Kind K>
void TileRow(const uint8_t* w, int64_t row_bytes, int64_t r0, const QuantizedActs& a, int64_t t0,
             float* y, int64_t ldy) {
  using F = Fmt<K>;
  const int64_t nb = a.nb;
  __m256 acc = _mm256_setzero_ps();
  float ms = 0.0f;
  const uint8_t* row = w + r0 * row_bytes;
  const int8_t* xq = a.q + t0 * nb * kBlock;
  const float* xd = a.d + t0 * nb;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * F::kBytes;
    _mm_prefetch(reinterpret_cast<const char*>(blk) + kPrefetchBytes, _MM_HINT_T0);
    const __m256i wv = F::Weights(blk);
    const __m256i xv = Load256(xq + b * kBlock);
    const __m256i d = BlockDot256<K>(wv, xv);
    const __m256 dwx = _mm256_mul_ps(_mm256_set1_ps(LoadHalf(blk)), _mm256_set1_ps(xd[b]));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), dwx, acc);
  }
  if constexpr (F::kHasMinTerm) {
    const float* xs = a.s + t0 * nb;
    for (int64_t b = 0; b < nb; ++b) {
      const float m = F::Min(row + b * F::kBytes);
      ms += m * xs[b];
    }
  }
  y[t0 * ldy + r0] = Hsum(acc) + ms;
}

// Two or three tokens, one row (small decode batches): TileRow's weight
// stream and, per token, TileRow's arithmetic exactly, the unpacked block
// shared by the tokens. The pair tiles' per-pass scale tables cost more than
// they save at this size: a decode step of 2 sequences took 1.9x the step of
// one (bench engine --batches 1,2), this path about 1.2x.
template <Kind K, int N>
void TileRowTokens(const uint8_t* w, int64_t row_bytes, int64_t r0, const QuantizedActs& a,
                   int64_t t0, float* y, int64_t ldy) {
  using F = Fmt<K>;
  const int64_t nb = a.nb;
  __m256 acc[N];
  float ms[N];
  for (int t = 0; t < N; ++t) {
    acc[t] = _mm256_setzero_ps();
    ms[t] = 0.0f;
  }
  const uint8_t* row = w + r0 * row_bytes;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * F::kBytes;
    _mm_prefetch(reinterpret_cast<const char*>(blk) + kPrefetchBytes, _MM_HINT_T0);
    const __m256i wv = F::Weights(blk);
    const __m256 dw = _mm256_set1_ps(LoadHalf(blk));
    for (int t = 0; t < N; ++t) {
      const int64_t tok = t0 + t;
      const __m256i xv = Load256(a.q + (tok * nb + b) * kBlock);
      const __m256i d = BlockDot256<K>(wv, xv);
      const __m256 dwx = _mm256_mul_ps(dw, _mm256_set1_ps(a.d[tok * nb + b]));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), dwx, acc[t]);
    }
  }
  for (int t = 0; t < N; ++t) {
    if constexpr (F::kHasMinTerm) {
      const float* xs = a.s + (t0 + t) * nb;
      for (int64_t b = 0; b < nb; ++b) {
        const float m = F::Min(row + b * F::kBytes);
        ms[t] += m * xs[b];
      }
    }
    y[(t0 + t) * ldy + r0] = Hsum(acc[t]) + ms[t];
  }
}

using TileFn = void (*)(const uint8_t*, int64_t, int64_t, const QuantizedActs&, int64_t, float*,
                        int64_t);

// ---- Batched tiles on the pair layout (QuantizedActs::qp / dt / st) ----
//
// Same per-output arithmetic as TileTokens (and so as AVX2 and llama.cpp):
// lane i of output (r, t) is fma(float(int lane i of block b), fp32(d_w * d_x),
// acc) for b in order, then ggml's 8-lane sum plus the min term
// fma(m_rb, s_tb, ms) in block order. What changes is only where values sit:
// one zmm holds two tokens' 8 lanes interleaved (lane 2i: token 2p, lane
// 2i + 1: token 2p + 1), so
//   - the 8-lane scale of a (row, token pair) is one 64-bit broadcast of the
//     two products d_w * d_x, loaded from a per-tile table computed 8 tokens
//     per vector multiply (instead of two broadcasts, an insert and a
//     multiply per pair per row), and
//   - the activations of a pair are one aligned 64-byte load.
// Per (row, token pair, block) the loop body is vpdpbusd, vcvtdq2ps, a
// broadcast load and one FMA.

// 32 nibbles of a Q4 block -> the 32 elements' bytes with each 4-byte group
// duplicated (zmm byte 8i + k and 8i + 4 + k = element 4i + k): the weight
// operand that meets a pair block of qp. Lanes 2 and 3 (elements 16..31)
// take the high nibbles: a per-lane 16-bit shift by 4 before the mask.
inline __m512i UnpackQ4Pairs(const uint8_t* qs) {
  const __m512i b = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  const __m512i sh = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0x0004000400040004,
                                      0x0004000400040004, 0, 0, 0, 0);
  const __m512i nib = _mm512_and_si512(_mm512_srlv_epi16(b, sh), _mm512_set1_epi8(0x0F));
  // Byte j of 128-bit lane L <- byte (8L + 4 (j / 8) + j % 4) % 16.
  const __m512i idx =
      _mm512_set_epi8(15, 14, 13, 12, 15, 14, 13, 12, 11, 10, 9, 8, 11, 10, 9, 8,  //
                      7, 6, 5, 4, 7, 6, 5, 4, 3, 2, 1, 0, 3, 2, 1, 0,              //
                      15, 14, 13, 12, 15, 14, 13, 12, 11, 10, 9, 8, 11, 10, 9, 8,  //
                      7, 6, 5, 4, 7, 6, 5, 4, 3, 2, 1, 0, 3, 2, 1, 0);
  return _mm512_shuffle_epi8(nib, idx);
}

// 32 int8 of a Q8_0 block -> each 4-byte group duplicated, as UnpackQ4Pairs.
inline __m512i LoadQ8Pairs(const uint8_t* qs) {
  const __m512i idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  return _mm512_permutexvar_epi32(
      idx, _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs))));
}

// A Q5_0 block (fp16 d, 32 high bits, 16 bytes of nibbles) -> its 32 values
// biased by 16 (0..31, unsigned) with each 4-byte group duplicated, as
// UnpackQ4Pairs: bit j of the high word adds 16 to element j.
inline __m512i UnpackQ5Pairs(const uint8_t* blk) {
  uint32_t qh;
  std::memcpy(&qh, blk + 2, 4);
  const __m256i v =
      _mm256_or_si256(UnpackNibbles(blk + 6), _mm256_maskz_mov_epi8(qh, _mm256_set1_epi8(16)));
  const __m512i idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  return _mm512_permutexvar_epi32(idx, _mm512_castsi256_si512(v));
}

// Blocks per pass of TilePairs: its table of d_w * d_x ([block][row][8
// tokens], on the stack) covers this many blocks, 8 KiB at 4 rows.
constexpr int64_t kPairChunk = 64;

// R rows x up to 2P tokens (nt valid, t0 even) on the pair layout.
template <Kind K, int R, int P>
void TilePairs(const uint8_t* w, int64_t row_bytes, int64_t r0, const QuantizedActs& a, int64_t t0,
               int nt, float* y, int64_t ldy) {
  using F = Fmt<K>;
  const int64_t nb = a.nb;
  const uint8_t* rows[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) rows[r] = w + (r0 + r) * row_bytes;
  __m256 ms[R];
  __m512 acc[R][P];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    ms[r] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  }
  const int8_t* xq = a.qp + (t0 / 2) * nb * 64;
  const __m512i bias128 = _mm512_set1_epi8(static_cast<char>(0x80));
  alignas(64) float scales[kPairChunk * R * 8];
  for (int64_t b0 = 0; b0 < nb; b0 += kPairChunk) {
    const int64_t b1 = nb - b0 < kPairChunk ? nb : b0 + kPairChunk;
    // Pass 1: the scale products of every (block, row, token) and the min
    // terms (both one vector op per row and block for 8 tokens).
    for (int64_t b = b0; b < b1; ++b) {
      const __m256 dx = _mm256_loadu_ps(a.dt + b * a.ldt + t0);
      __m256 sx = _mm256_setzero_ps();
      if constexpr (F::kHasMinTerm) sx = _mm256_loadu_ps(a.st + b * a.ldt + t0);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const uint8_t* blk = rows[r] + b * F::kBytes;
        _mm256_store_ps(scales + ((b - b0) * R + r) * 8,
                        _mm256_mul_ps(_mm256_set1_ps(LoadHalf(blk)), dx));
        if constexpr (F::kHasMinTerm) {
          ms[r] = _mm256_fmadd_ps(_mm256_set1_ps(F::Min(blk)), sx, ms[r]);
        }
      }
    }
    // Pass 2: the block dots.
    for (int64_t b = b0; b < b1; ++b) {
      __m512i wv[R];
      __m512i wbias[R];  // Q8_0: -128 * (sum of each lane's 4 weights)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const uint8_t* blk = rows[r] + b * F::kBytes;
        _mm_prefetch(reinterpret_cast<const char*>(blk) + kPrefetchBytes, _MM_HINT_T0);
        if constexpr (K == Kind::kQ5_0) {
          wv[r] = UnpackQ5Pairs(blk);
        } else if constexpr (K == Kind::kQ8_0) {
          wv[r] = LoadQ8Pairs(blk + 2);
          wbias[r] = _mm512_sub_epi32(_mm512_setzero_si512(),
                                      _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias128, wv[r]));
        } else {
          wv[r] = UnpackQ4Pairs(blk + (K == Kind::kQ4_1 ? 4 : 2));
        }
      }
      const float* sc = scales + (b - b0) * R * 8;
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        const __m512i xv = _mm512_load_si512(reinterpret_cast<const void*>(xq + (p * nb + b) * 64));
        // Q5_0: -16 * (sum of each lane's 4 activations), shared by the rows.
        __m512i xbias = _mm512_setzero_si512();
        if constexpr (K == Kind::kQ5_0) {
          xbias = _mm512_sub_epi32(
              _mm512_setzero_si512(),
              _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(16), xv));
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          __m512i d;
          if constexpr (K == Kind::kQ5_0) {
            // (v + 16) x s8 x minus 16 * sum x: the exact int32 lanes of the
            // AVX2 path's |v| x sign(x, v).
            d = _mm512_dpbusd_epi32(xbias, wv[r], xv);
          } else if constexpr (K == Kind::kQ8_0) {
            // u8 (x + 128) x s8 w, minus 128 * sum w: the same int32 lanes as
            // the AVX2 sign trick (both exact).
            d = _mm512_dpbusd_epi32(wbias[r], _mm512_xor_si512(xv, bias128), wv[r]);
          } else {
            d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[r], xv);
          }
          const __m512 lane = _mm512_cvtepi32_ps(d);
          double s2;
          std::memcpy(&s2, sc + r * 8 + 2 * p, sizeof(s2));
          acc[r][p] = _mm512_fmadd_ps(lane, _mm512_castpd_ps(_mm512_set1_pd(s2)), acc[r][p]);
        }
      }
    }
  }
  // Even lanes -> token 2p, odd lanes -> token 2p + 1, then ggml's 8-lane sum.
  const __m512i split = _mm512_set_epi32(15, 13, 11, 9, 7, 5, 3, 1, 14, 12, 10, 8, 6, 4, 2, 0);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    alignas(32) float m8[8];
    _mm256_store_ps(m8, ms[r]);
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      const __m512 v = _mm512_permutexvar_ps(split, acc[r][p]);
      const int t = 2 * p;
      if constexpr (F::kAddsMinTerm) {
        if (t < nt) y[(t0 + t) * ldy + r0 + r] = HsumLo(v) + m8[t];
        if (t + 1 < nt) y[(t0 + t + 1) * ldy + r0 + r] = HsumHi(v) + m8[t + 1];
      } else {
        if (t < nt) y[(t0 + t) * ldy + r0 + r] = HsumLo(v);
        if (t + 1 < nt) y[(t0 + t + 1) * ldy + r0 + r] = HsumHi(v);
      }
    }
  }
}

using PairTileFn = void (*)(const uint8_t*, int64_t, int64_t, const QuantizedActs&, int64_t, int,
                            float*, int64_t);

// Tokens [t0, t1) of the batch -> the pair layout's copy of q (the AVX2
// quantize fills dt / st).
void QuantizePairs(int64_t t0, int64_t t1, const QuantizedActs& a) {
  const int64_t nb = a.nb;
  for (int64_t t = t0; t < t1; ++t) {
    const __mmask16 words = (t & 1) != 0 ? 0xAAAA : 0x5555;
    for (int64_t b = 0; b < nb; ++b) {
      const __m256i v = Load256(a.q + (t * nb + b) * kBlock);
      const __m512i e = _mm512_maskz_expand_epi32(words, _mm512_castsi256_si512(v));
      _mm512_mask_storeu_epi32(a.qp + ((t / 2) * nb + b) * 64, words, e);
    }
  }
}

// Batched products: tiles of up to 4 rows x 8 tokens, so each unpacked weight
// block is reused by 8 tokens and each activation pair by 4 rows (16 of the 32
// zmm registers hold accumulators). Single tokens: one row at a time.
template <Kind K>
void Drive(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const QuantizedActs& a,
           int64_t t0, int64_t t1, float* y, int64_t ldy) {
  static constexpr TileFn kTiles[4][8] = {
      {TileTokens<K, 1, 1>, TileTokens<K, 1, 2>, TileTokens<K, 1, 3>, TileTokens<K, 1, 4>,
       TileTokens<K, 1, 5>, TileTokens<K, 1, 6>, TileTokens<K, 1, 7>, TileTokens<K, 1, 8>},
      {TileTokens<K, 2, 1>, TileTokens<K, 2, 2>, TileTokens<K, 2, 3>, TileTokens<K, 2, 4>,
       TileTokens<K, 2, 5>, TileTokens<K, 2, 6>, TileTokens<K, 2, 7>, TileTokens<K, 2, 8>},
      {TileTokens<K, 3, 1>, TileTokens<K, 3, 2>, TileTokens<K, 3, 3>, TileTokens<K, 3, 4>,
       TileTokens<K, 3, 5>, TileTokens<K, 3, 6>, TileTokens<K, 3, 7>, TileTokens<K, 3, 8>},
      {TileTokens<K, 4, 1>, TileTokens<K, 4, 2>, TileTokens<K, 4, 3>, TileTokens<K, 4, 4>,
       TileTokens<K, 4, 5>, TileTokens<K, 4, 6>, TileTokens<K, 4, 7>, TileTokens<K, 4, 8>},
  };
  static constexpr PairTileFn kPairTiles[4][4] = {
      {TilePairs<K, 1, 1>, TilePairs<K, 1, 2>, TilePairs<K, 1, 3>, TilePairs<K, 1, 4>},
      {TilePairs<K, 2, 1>, TilePairs<K, 2, 2>, TilePairs<K, 2, 3>, TilePairs<K, 2, 4>},
      {TilePairs<K, 3, 1>, TilePairs<K, 3, 2>, TilePairs<K, 3, 3>, TilePairs<K, 3, 4>},
      {TilePairs<K, 4, 1>, TilePairs<K, 4, 2>, TilePairs<K, 4, 3>, TilePairs<K, 4, 4>},
  };
  const int64_t nt = t1 - t0;
  if (nt == 1) {
    for (int64_t r = r0; r < r1; ++r) TileRow<K>(w, row_bytes, r, a, t0, y, ldy);
    return;
  }
  if (nt <= 3) {
    for (int64_t r = r0; r < r1; ++r) {
      if (nt == 2) {
        TileRowTokens<K, 2>(w, row_bytes, r, a, t0, y, ldy);
      } else {
        TileRowTokens<K, 3>(w, row_bytes, r, a, t0, y, ldy);
      }
    }
    return;
  }
  if (a.qp != nullptr && t0 % 2 == 0) {
    for (int64_t r = r0; r < r1; r += 4) {
      const int64_t nr = r1 - r < 4 ? r1 - r : 4;
      for (int64_t t = t0; t < t1; t += 8) {
        const int ntt = static_cast<int>(t1 - t < 8 ? t1 - t : 8);
        kPairTiles[nr - 1][(ntt + 1) / 2 - 1](w, row_bytes, r, a, t, ntt, y, ldy);
      }
    }
    return;
  }
  for (int64_t r = r0; r < r1; r += 4) {
    const int64_t nr = r1 - r < 4 ? r1 - r : 4;
    for (int64_t t = t0; t < t1; t += 8) {
      const int64_t ntt = t1 - t < 8 ? t1 - t : 8;
      kTiles[nr - 1][ntt - 1](w, row_bytes, r, a, t, y, ldy);
    }
  }
}

void GemmQ4_0(const uint8_t* w, int64_t rb, int64_t r0, int64_t r1, const QuantizedActs& a,
              int64_t t0, int64_t t1, float* y, int64_t ldy) {
  Drive<Kind::kQ4_0>(w, rb, r0, r1, a, t0, t1, y, ldy);
}
void GemmQ4_1(const uint8_t* w, int64_t rb, int64_t r0, int64_t r1, const QuantizedActs& a,
              int64_t t0, int64_t t1, float* y, int64_t ldy) {
  Drive<Kind::kQ4_1>(w, rb, r0, r1, a, t0, t1, y, ldy);
}
void GemmQ8_0(const uint8_t* w, int64_t rb, int64_t r0, int64_t r1, const QuantizedActs& a,
              int64_t t0, int64_t t1, float* y, int64_t ldy) {
  Drive<Kind::kQ8_0>(w, rb, r0, r1, a, t0, t1, y, ldy);
}

}  // namespace

bool GemmQ5_0Pairs(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1,
                   const QuantizedActs& a, int64_t t0, int64_t t1, float* y, int64_t ldy) {
  constexpr Kind K = Kind::kQ5_0;
  static constexpr PairTileFn kPairTiles[4][4] = {
      {TilePairs<K, 1, 1>, TilePairs<K, 1, 2>, TilePairs<K, 1, 3>, TilePairs<K, 1, 4>},
      {TilePairs<K, 2, 1>, TilePairs<K, 2, 2>, TilePairs<K, 2, 3>, TilePairs<K, 2, 4>},
      {TilePairs<K, 3, 1>, TilePairs<K, 3, 2>, TilePairs<K, 3, 3>, TilePairs<K, 3, 4>},
      {TilePairs<K, 4, 1>, TilePairs<K, 4, 2>, TilePairs<K, 4, 3>, TilePairs<K, 4, 4>},
  };
  if (a.qp == nullptr || t0 % 2 != 0 || t1 - t0 < 4) return false;
  for (int64_t r = r0; r < r1; r += 4) {
    const int64_t nr = r1 - r < 4 ? r1 - r : 4;
    for (int64_t t = t0; t < t1; t += 8) {
      const int ntt = static_cast<int>(t1 - t < 8 ? t1 - t : 8);
      kPairTiles[nr - 1][(ntt + 1) / 2 - 1](w, row_bytes, r, a, t, ntt, y, ldy);
    }
  }
  return true;
}

namespace {

// The AVX2 quantization (the same bits on both paths, and dt / st), plus the
// pair layout when matmul.cc asks for it.
void Quantize(const float* x, int64_t cols, int64_t t0, int64_t t1, const QuantizedActs& a) {
  Avx2Kernels().quantize(x, cols, t0, t1, a);
  if (a.qp != nullptr) QuantizePairs(t0, t1, a);
}

}  // namespace

const KernelTable& Avx512Kernels() {
  // Activation quantization and the float products are the AVX2 ones: they
  // are not the hot path, and sharing them keeps the quantized activations
  // bit-identical across the two paths.
  static const KernelTable table = [] {
    KernelTable t = Avx2Kernels();
    t.name = "avx512";
    t.isa = Isa::kAvx512;
    t.quantize = &Quantize;
    t.pair_layout = true;
    t.gemm_q4_0 = &GemmQ4_0;
    t.gemm_q4_1 = &GemmQ4_1;
    t.gemm_q8_0 = &GemmQ8_0;
    return t;
  }();
  return table;
}

}  // namespace kvrelay::engine::kernels

#pragma GCC diagnostic pop
#pragma GCC pop_options
