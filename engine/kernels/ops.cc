#include "engine/kernels/ops.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "engine/kernels/matmul.h"

namespace kvrelay::engine {
namespace {

// AttendTileGgml: positions are walked in chunks of kTileChunk (a multiple of
// 16, so AVX-512's score groups and value groups never straddle a chunk); a
// chunk of K (V) is read once from memory for all rows of the tile and reused
// from L1/L2 (hd 64: 32 KiB).
constexpr int64_t kTileChunk = 128;
constexpr int kTileMaxRows = 64;  // rows per pass (the stack holds their maxima)

// The AVX-512 path runs the AVX2 element-wise ops (same bits; matmul.h).
bool UseAvx2(KernelPath path = KernelPath::kAuto) {
  if (path == KernelPath::kAuto) path = ResolvedKernelPath();
  return (path == KernelPath::kAvx2 || path == KernelPath::kAvx512) &&
         KernelPathSupported(KernelPath::kAvx2);
}

inline uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// The exp approximation ggml vectorises (the ARM optimized-routines expf
// algorithm, with ggml's constants): n = round(x / ln2) via the 1.5 * 2^23
// shift, r = x - n ln2 with ln2 split in a high and a low part,
// exp(r) - 1 ~= C0 r + C1 r^2 + C2 r^3 + C3 r^4 + C4 r^5, and
// exp(x) = 2^n (1 + p) with 2^n built in the exponent bits.
constexpr float kShift = 0x1.8p23f;
constexpr float kInvLn2 = 0x1.715476p+0f;
constexpr float kLn2Hi = 0x1.62e4p-1f;
constexpr float kLn2Lo = 0x1.7f7d1cp-20f;
constexpr float kC0 = 0x1.ffffecp-1f;
constexpr float kC1 = 0x1.fffdb6p-2f;
constexpr float kC2 = 0x1.555e66p-3f;
constexpr float kC3 = 0x1.573e2ep-5f;
constexpr float kC4 = 0x1.0e4020p-7f;

// Scalar twin of Exp8Ggml (same operations, std::fma where it fuses).
float ExpGgmlScalar(float x) {
  const float z = std::fma(x, kInvLn2, kShift);
  const float n = z - kShift;
  const float r = std::fma(-n, kLn2Lo, std::fma(-n, kLn2Hi, x));
  const uint32_t e = Bits(z) << 23;
  const float k = FromBits(e + Bits(1.0f));
  const float r2 = r * r;
  const float p = std::fma(std::fma(std::fma(kC4, r, kC3), r2, std::fma(kC2, r, kC1)), r2, kC0 * r);
  if (!(std::fabs(n) > 126.0f)) return std::fma(p, k, k);
  // Large |n|: build 2^n from two factors so it neither overflows nor
  // flushes early; beyond |n| > 192 the result is inf or 0.
  const uint32_t g = n <= 0.0f ? 0x82000000u : 0u;
  const float s1 = FromBits(g + 0x7F000000u);
  const float s2 = FromBits(e - g);
  if (std::fabs(n) > 192.0f) return s1 * s1;
  return std::fma(s2, p, s2) * s1;
}

// ggml_vec_max_f32's MAX(max, x) (inline, unlike std::fmax's libm call). It
// can differ from std::fmax only in the sign of a zero max, which no result
// sees: exp(s - (+0)) and exp(s - (-0)) are the same for every s.
inline float MaxGgml(float mx, float s) { return mx > s ? mx : s; }

// ggml's 8-lane horizontal sum: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)).
inline float Hsum8Scalar(const float* a) {
  const float t0 = a[0] + a[4], t1 = a[1] + a[5], t2 = a[2] + a[6], t3 = a[3] + a[7];
  return (t0 + t2) + (t1 + t3);
}

// ggml's GGML_F32x8_REDUCE of the four 8-lane accumulators of
// ggml_vec_dot_f32: x = (s0 + s2) + (s1 + s3) lane-wise, t_i = x_i + x_{i+4},
// result (t0 + t1) + (t2 + t3).
inline float ReduceVecDot(const float* s0, const float* s1, const float* s2, const float* s3) {
  float x[8];
  for (int l = 0; l < 8; ++l) x[l] = (s0[l] + s2[l]) + (s1[l] + s3[l]);
  const float t0 = x[0] + x[4], t1 = x[1] + x[5], t2 = x[2] + x[6], t3 = x[3] + x[7];
  return (t0 + t1) + (t2 + t3);
}

// Output element e of a single-token V * p product: the 32 partial sums
// acc[(j mod 32) * hd + e] reduced as ggml_vec_dot_f32 reduces them.
inline float ReduceColumn32(const float* acc, int hd, int e) {
  float s[32];
  for (int l = 0; l < 32; ++l) s[l] = acc[l * hd + e];
  return ReduceVecDot(s, s + 8, s + 16, s + 24);
}

// ggml_vec_dot_f32 (AVX2): 4 accumulators of 8 lanes over steps of 32, then
// a fixed reduction; the remainder in double.
float DotVecScalar(const float* a, const float* b, int n) {
  float s[4][8] = {};
  const int np = n & ~31;
  for (int i = 0; i < np; i += 32) {
    for (int j = 0; j < 4; ++j) {
      for (int l = 0; l < 8; ++l) s[j][l] = std::fma(a[i + 8 * j + l], b[i + 8 * j + l], s[j][l]);
    }
  }
  double sum = ReduceVecDot(s[0], s[1], s[2], s[3]);
  for (int i = np; i < n; ++i) sum += static_cast<double>(a[i] * b[i]);
  return static_cast<float>(sum);
}

// The tiled prefill-attention driver shared by AttendTileAvx2 and
// AttendTileScalar: each row's passes as the single-row Attend runs them
// (single == false), over the chunks in position order. Steps supplies the
// Scores / Softmax / Zero / Values / Fold step functions. Always inlined, so
// each caller's copy is compiled under that caller's target (AVX2 or none).
template <typename Steps>
__attribute__((always_inline)) inline void AttendTileDriver(
    const AttendTileRow* rows, int n, const float* const* kb, const float* const* vb, int B, int hd,
    float scale, float* scores, int64_t stride, float* acc, int64_t jlo, int64_t jhi) {
  float mx[kTileMaxRows], inv[kTileMaxRows];
  for (int r = 0; r < n; ++r) mx[r] = -INFINITY;
  for (int64_t c0 = jlo; c0 < jhi; c0 += kTileChunk) {
    const int64_t c1 = c0 + kTileChunk;
    for (int r = 0; r < n; ++r) {
      const AttendTileRow& row = rows[r];
      if (row.j1 <= row.j0 || c0 >= row.j1 || c1 <= row.j0) continue;
      mx[r] = Steps::Scores(row.q, kb, B, hd, row.j0, row.j1, c0, c1, scale, scores + r * stride,
                            mx[r]);
    }
  }
  for (int r = 0; r < n; ++r) {
    const AttendTileRow& row = rows[r];
    if (row.j1 <= row.j0) continue;
    inv[r] = Steps::Softmax(scores + r * stride, row.j0, row.j1, mx[r]);
    float* a = acc + static_cast<int64_t>(r) * 8 * hd;
    Steps::Zero(a, hd);
  }
  for (int64_t c0 = jlo; c0 < jhi; c0 += kTileChunk) {
    const int64_t c1 = c0 + kTileChunk;
    for (int r = 0; r < n; ++r) {
      const AttendTileRow& row = rows[r];
      if (row.j1 <= row.j0 || c0 >= row.j1 || c1 <= row.j0) continue;
      Steps::Values(scores + r * stride, inv[r], vb, B, hd, row.j0, row.j1, c0, c1,
                    acc + static_cast<int64_t>(r) * 8 * hd);
    }
  }
  for (int r = 0; r < n; ++r) {
    if (rows[r].j1 > rows[r].j0) {
      Steps::Fold(acc + static_cast<int64_t>(r) * 8 * hd, hd, rows[r].out);
    }
  }
}

#pragma GCC push_options
#pragma GCC target("avx2,fma")

__m256 Exp8Ggml(__m256 x) {
  const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(kInvLn2), _mm256_set1_ps(kShift));
  const __m256 n = _mm256_sub_ps(z, _mm256_set1_ps(kShift));
  const __m256 r =
      _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x));
  const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
  const __m256 k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_set1_epi32(0x3F800000)));
  const __m256 absn = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), n);
  const __m256 big = _mm256_cmp_ps(absn, _mm256_set1_ps(126.0f), _CMP_GT_OQ);
  const __m256 r2 = _mm256_mul_ps(r, r);
  const __m256 hi = _mm256_fmadd_ps(_mm256_set1_ps(kC4), r, _mm256_set1_ps(kC3));
  const __m256 lo = _mm256_fmadd_ps(_mm256_set1_ps(kC2), r, _mm256_set1_ps(kC1));
  const __m256 p =
      _mm256_fmadd_ps(_mm256_fmadd_ps(hi, r2, lo), r2, _mm256_mul_ps(_mm256_set1_ps(kC0), r));
  const __m256 normal = _mm256_fmadd_ps(p, k, k);
  if (_mm256_movemask_ps(big) == 0) return normal;
  const __m256i g =
      _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ)),
                       _mm256_set1_epi32(static_cast<int>(0x82000000u)));
  const __m256 s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7F000000)));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
  const __m256 huge = _mm256_cmp_ps(absn, _mm256_set1_ps(192.0f), _CMP_GT_OQ);
  const __m256 scaled = _mm256_mul_ps(_mm256_fmadd_ps(s2, p, s2), s1);
  const __m256 r_big = _mm256_blendv_ps(scaled, _mm256_mul_ps(s1, s1), huge);
  return _mm256_blendv_ps(normal, r_big, big);
}

inline float Hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

void SiluMulAvx2(const float* gate, const float* up, int64_t n, float* out) {
  int64_t i = 0;
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = Exp8Ggml(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
  }
  // ggml's tail uses libm expf.
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void ExpAvx2(const float* x, int64_t n, float* y) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, Exp8Ggml(_mm256_loadu_ps(x + i)));
  for (; i < n; ++i) y[i] = ExpGgmlScalar(x[i]);
}

float DotVecAvx2(const float* a, const float* b, int n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  const int np = n & ~31;
  for (int i = 0; i < np; i += 32) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
    s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
  }
  // ggml's GGML_F32x8_REDUCE: (s0 + s2) + (s1 + s3), then the 8 lanes.
  const __m256 x = _mm256_add_ps(_mm256_add_ps(s0, s2), _mm256_add_ps(s1, s3));
  const __m128 t0 = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 t1 = _mm_hadd_ps(t0, t0);
  double sum = _mm_cvtss_f32(_mm_hadd_ps(t1, t1));
  for (int i = np; i < n; ++i) sum += static_cast<double>(a[i] * b[i]);
  return static_cast<float>(sum);
}

// DotVecAvx2 of q with the 8 consecutive rows k, k + hd, ..., k + 7 hd (hd a
// multiple of 32), in key order: per key the same four 8-lane FMA chains and
// x = (s0 + s2) + (s1 + s3); then DotVecAvx2's horizontal sum
// ((x0 + x4) + (x1 + x5)) + ((x2 + x6) + (x3 + x7)) for 8 keys at once: lane
// halves added by pairs of keys, then two hadds pair exactly those terms. (The
// float result of DotVecAvx2 goes through double unchanged when hd % 32 == 0.)
inline __m256 Dot8Avx2(const float* q, const float* k, int hd) {
  __m256 u[4];
  for (int p = 0; p < 4; ++p) {
    __m256 x[2];
    for (int c = 0; c < 2; ++c) {
      const float* b = k + (2 * p + c) * hd;
      __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
      for (int i = 0; i < hd; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 16), _mm256_loadu_ps(b + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 24), _mm256_loadu_ps(b + i + 24), s3);
      }
      x[c] = _mm256_add_ps(_mm256_add_ps(s0, s2), _mm256_add_ps(s1, s3));
    }
    // [x_a.lo + x_a.hi | x_b.lo + x_b.hi]
    u[p] = _mm256_add_ps(_mm256_permute2f128_ps(x[0], x[1], 0x20),
                         _mm256_permute2f128_ps(x[0], x[1], 0x31));
  }
  // Low halves: keys 0, 2, 4, 6; high halves: keys 1, 3, 5, 7.
  const __m256 r = _mm256_hadd_ps(_mm256_hadd_ps(u[0], u[1]), _mm256_hadd_ps(u[2], u[3]));
  return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// AttendAvx2's passes (single == false), also run chunk by chunk by the tile
// path (AttendTileGgml): scores of the positions in [max(j0, c0), min(j1, c1)),
// their running max (MaxGgml in position order) carried in mx.
float Avx2ScoresStep(const float* q, const float* const* kb, int B, int hd, int64_t j0, int64_t j1,
                     int64_t c0, int64_t c1, float scale, float* scores, float mx) {
  const int64_t a = std::max(j0, c0), z = std::min(j1, c1);
  int64_t blk = a / B, in_blk = a % B;  // walk with j: no division per key
  const bool eights = hd % 32 == 0 && B % 8 == 0;
  for (int64_t j = a; j < z;) {
    const float* k = kb[blk] + in_blk * hd;
    if (eights && (j & 7) == 0 && j + 8 <= z) {
      // 8 keys (one block: B % 8 == 0) at once, the same dot products.
      alignas(32) float s8[8];
      _mm256_store_ps(s8, _mm256_mul_ps(Dot8Avx2(q, k, hd), _mm256_set1_ps(scale)));
      for (int l = 0; l < 8; ++l) {
        scores[j + l] = s8[l];
        mx = MaxGgml(mx, s8[l]);
      }
      j += 8;
      if ((in_blk += 8) == B) {
        ++blk;
        in_blk = 0;
      }
      continue;
    }
    if (++in_blk == B) {
      ++blk;
      in_blk = 0;
    }
    const float s = DotVecAvx2(q, k, hd) * scale;
    scores[j] = s;
    mx = MaxGgml(mx, s);
    ++j;
  }
  return mx;
}

// Scores -> exp(s - mx) in place; returns 1 / their sum (the softmax's
// normalisation, applied as scores[j] * inv when the values are summed).
float Avx2SoftmaxExp(float* scores, int64_t j0, int64_t j1, float mx) {
  // exp in groups of 8 aligned at position 0; masked positions are 0.
  double sum = 0;
  const __m256 vmx = _mm256_set1_ps(mx);
  const int64_t g0 = j0 & ~int64_t{7};
  alignas(32) float buf[8];
  for (int64_t g = g0; g < j1; g += 8) {
    if (g >= j0 && g + 8 <= j1) {  // a whole group: no masking
      const __m256 e = Exp8Ggml(_mm256_sub_ps(_mm256_loadu_ps(scores + g), vmx));
      sum += static_cast<double>(Hsum8(e));
      _mm256_storeu_ps(scores + g, e);
      continue;
    }
    for (int l = 0; l < 8; ++l) {
      const int64_t j = g + l;
      buf[l] = j >= j0 && j < j1 ? scores[j] : -INFINITY;
    }
    const __m256 e = Exp8Ggml(_mm256_sub_ps(_mm256_load_ps(buf), vmx));
    _mm256_store_ps(buf, e);
    sum += static_cast<double>(Hsum8(e));
    for (int l = 0; l < 8 && g + l < j1; ++l) {
      if (g + l >= j0) scores[g + l] = buf[l];
    }
  }
  return static_cast<float>(1.0 / sum);
}

// V * p over the positions in [max(j0, c0), min(j1, c1)): lane (j mod 8) of an
// 8-lane FMA accumulator per output element (acc: 8 x hd, lane-major).
void Avx2ValuesStep(const float* scores, float inv, const float* const* vb, int B, int hd,
                    int64_t j0, int64_t j1, int64_t c0, int64_t c1, float* acc) {
  const int64_t first = std::max(j0, c0), z = std::min(j1, c1);
  if (hd % 8 == 0 && B % 8 == 0 && first < z) {
    // 8 output elements at a time with their 8 lane accumulators in registers
    // (the same FMAs, each accumulator's positions in order), in groups of 8
    // positions aligned at 0 (one block each: B % 8 == 0).
    const int64_t g_begin = first & ~int64_t{7};
    for (int e0 = 0; e0 < hd; e0 += 8) {
      __m256 a[8];
      for (int l = 0; l < 8; ++l) a[l] = _mm256_loadu_ps(acc + l * hd + e0);
      int64_t blk = g_begin / B, in_blk = g_begin % B;
      for (int64_t g = g_begin; g < z; g += 8) {
        const float* v = vb[blk] + in_blk * hd + e0;
        if ((in_blk += 8) == B) {
          ++blk;
          in_blk = 0;
        }
        if (g >= first && g + 8 <= z) {
          for (int l = 0; l < 8; ++l) {
            a[l] = _mm256_fmadd_ps(_mm256_loadu_ps(v + l * hd), _mm256_set1_ps(scores[g + l] * inv),
                                   a[l]);
          }
        } else {
          for (int l = 0; l < 8; ++l) {
            if (g + l < first || g + l >= z) continue;
            a[l] = _mm256_fmadd_ps(_mm256_loadu_ps(v + l * hd), _mm256_set1_ps(scores[g + l] * inv),
                                   a[l]);
          }
        }
      }
      for (int l = 0; l < 8; ++l) _mm256_storeu_ps(acc + l * hd + e0, a[l]);
    }
    return;
  }
  int64_t blk = first / B, in_blk = first % B;  // walk with j: no division per position
  for (int64_t j = first; j < z; ++j) {
    const float* v = vb[blk] + in_blk * hd;
    if (++in_blk == B) {
      ++blk;
      in_blk = 0;
    }
    float* a = acc + (j & 7) * hd;
    const __m256 p = _mm256_set1_ps(scores[j] * inv);
    int e = 0;
    for (; e + 8 <= hd; e += 8) {
      _mm256_storeu_ps(a + e, _mm256_fmadd_ps(_mm256_loadu_ps(v + e), p, _mm256_loadu_ps(a + e)));
    }
    for (; e < hd; ++e) a[e] = std::fma(v[e], scores[j] * inv, a[e]);
  }
}

void Avx2ValuesFold(const float* acc, int hd, float* out) {
  int e = 0;
  for (; e + 8 <= hd; e += 8) {
    const __m256 t0 =
        _mm256_add_ps(_mm256_loadu_ps(acc + 0 * hd + e), _mm256_loadu_ps(acc + 4 * hd + e));
    const __m256 t1 =
        _mm256_add_ps(_mm256_loadu_ps(acc + 1 * hd + e), _mm256_loadu_ps(acc + 5 * hd + e));
    const __m256 t2 =
        _mm256_add_ps(_mm256_loadu_ps(acc + 2 * hd + e), _mm256_loadu_ps(acc + 6 * hd + e));
    const __m256 t3 =
        _mm256_add_ps(_mm256_loadu_ps(acc + 3 * hd + e), _mm256_loadu_ps(acc + 7 * hd + e));
    _mm256_storeu_ps(out + e, _mm256_add_ps(_mm256_add_ps(t0, t2), _mm256_add_ps(t1, t3)));
  }
  for (; e < hd; ++e) {
    float l[8];
    for (int k = 0; k < 8; ++k) l[k] = acc[k * hd + e];
    out[e] = Hsum8Scalar(l);
  }
}

void AttendAvx2(const float* q, const float* const* kb, const float* const* vb, int B, int hd,
                int64_t j0, int64_t j1, float scale, bool single, float* scores, float* acc,
                float* out) {
  const float mx = Avx2ScoresStep(q, kb, B, hd, j0, j1, j0, j1, scale, scores, -INFINITY);
  const float inv = Avx2SoftmaxExp(scores, j0, j1, mx);
  if (single) {
    // ggml_vec_dot_f32 over positions: 4 accumulators x 8 lanes, j mod 32.
    for (int i = 0; i < 32 * hd; i += 8) _mm256_storeu_ps(acc + i, _mm256_setzero_ps());
    for (int64_t j = j0; j < j1; ++j) {
      const float* v = vb[j / B] + (j % B) * hd;
      float* a = acc + (j & 31) * hd;
      const __m256 p = _mm256_set1_ps(scores[j] * inv);
      int e = 0;
      for (; e + 8 <= hd; e += 8) {
        _mm256_storeu_ps(a + e, _mm256_fmadd_ps(_mm256_loadu_ps(v + e), p, _mm256_loadu_ps(a + e)));
      }
      for (; e < hd; ++e) a[e] = std::fma(v[e], scores[j] * inv, a[e]);
    }
    for (int e = 0; e < hd; ++e) out[e] = ReduceColumn32(acc, hd, e);
    return;
  }
  // V * p: lane (j mod 8) of an 8-lane FMA accumulator per output element.
  for (int i = 0; i < 8 * hd; i += 8) _mm256_storeu_ps(acc + i, _mm256_setzero_ps());
  Avx2ValuesStep(scores, inv, vb, B, hd, j0, j1, j0, j1, acc);
  Avx2ValuesFold(acc, hd, out);
}

// The step functions AttendTileDriver runs on AVX2 (defined in this target
// region, so the driver inlined into AttendTileAvx2 is compiled for AVX2).
struct Avx2TileSteps {
  static float Scores(const float* q, const float* const* kb, int B, int hd, int64_t j0, int64_t j1,
                      int64_t c0, int64_t c1, float scale, float* scores, float mx) {
    return Avx2ScoresStep(q, kb, B, hd, j0, j1, c0, c1, scale, scores, mx);
  }
  static float Softmax(float* scores, int64_t j0, int64_t j1, float mx) {
    return Avx2SoftmaxExp(scores, j0, j1, mx);
  }
  static void Zero(float* a, int hd) {
    for (int i = 0; i < 8 * hd; i += 8) _mm256_storeu_ps(a + i, _mm256_setzero_ps());
  }
  static void Values(const float* scores, float inv, const float* const* vb, int B, int hd,
                     int64_t j0, int64_t j1, int64_t c0, int64_t c1, float* acc) {
    Avx2ValuesStep(scores, inv, vb, B, hd, j0, j1, c0, c1, acc);
  }
  static void Fold(const float* acc, int hd, float* out) { Avx2ValuesFold(acc, hd, out); }
};

// The tile path on AVX2: AttendTileDriver over the AVX2 steps.
void AttendTileAvx2(const AttendTileRow* rows, int n, const float* const* kb,
                    const float* const* vb, int B, int hd, float scale, float* scores,
                    int64_t stride, float* acc, int64_t jlo, int64_t jhi) {
  AttendTileDriver<Avx2TileSteps>(rows, n, kb, vb, B, hd, scale, scores, stride, acc, jlo, jhi);
}

void RopeRotateAvx2(float* x, int half, bool neox, const float* cos, const float* sin) {
  for (int i = 0; i < half; ++i) {
    const int a = neox ? i : 2 * i;
    const int b = neox ? i + half : 2 * i + 1;
    const float x0 = x[a], x1 = x[b];
    x[a] = std::fma(x0, cos[i], -(x1 * sin[i]));
    x[b] = std::fma(x0, sin[i], x1 * cos[i]);
  }
}

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
// GCC 12's AVX-512 headers trip -Wuninitialized on their casts (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// AttendAvx2's result bits (batched order, single == false), computed
// faster. Preconditions: hd % 32 == 0, B % 16 == 0.
//
// Scores: ggml_vec_dot_f32 keeps four 8-lane accumulators s0..s3 (element
// 32 i + 8 j + l goes to lane l of s_j) and reduces them as
//   x = (s0 + s2) + (s1 + s3);  u_m = x_m + x_{m+4};  (u0 + u1) + (u2 + u3).
// Here one zmm holds [s0 | s1] and another [s2 | s3], so their sum is
// [s0 + s2 | s1 + s3] per key, and the horizontal part runs for 16 keys at
// once: a butterfly of shuffles that pairs exactly the terms above (halves
// of 256, then 128 bits, then lanes 0+1 / 2+3, then the two pair sums), so no
// key pays a horizontal reduction of its own.
// V * p: lane (j mod 8) accumulators held in registers, 32 output elements
// per pass, instead of an 8 x hd array in memory.
__attribute__((always_inline)) inline __m512 DotPair(const float* q, const float* k, int hd) {
  __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
  for (int i = 0; i < hd; i += 32) {
    a = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), a);
    b = _mm512_fmadd_ps(_mm512_loadu_ps(q + i + 16), _mm512_loadu_ps(k + i + 16), b);
  }
  return _mm512_add_ps(a, b);  // [s0 + s2 | s1 + s3]
}
// [x_a | x_b]: x = low 256 + high 256 of each.
inline __m512 Fold256(__m512 ca, __m512 cb) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(ca, cb, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_f32x4(ca, cb, _MM_SHUFFLE(3, 2, 3, 2)));
}
// [u_a | u_b | u_c | u_d] from [x_a | x_b], [x_c | x_d]: u = x.lo128 + x.hi128.
inline __m512 Fold128(__m512 xab, __m512 xcd) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(xab, xcd, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(xab, xcd, _MM_SHUFFLE(3, 1, 3, 1)));
}
// Per 128-bit lane: [a0 + a1, a2 + a3, b0 + b1, b2 + b3].
inline __m512 FoldPairs(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The 16 dot products q . k_{jb + c} for c < 16 (keys outside [lo, hi) read
// as zero rows and are masked off by the caller), in key order.
__attribute__((always_inline)) inline __m512 Dot16(const float* q, const float* kblk, int hd,
                                                   int lo, int hi) {
  __m512 x[8];
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p) {
    const int c0 = 2 * p, c1 = 2 * p + 1;
    const __m512 ca = c0 >= lo && c0 < hi ? DotPair(q, kblk + c0 * hd, hd) : _mm512_setzero_ps();
    const __m512 cb = c1 >= lo && c1 < hi ? DotPair(q, kblk + c1 * hd, hd) : _mm512_setzero_ps();
    x[p] = Fold256(ca, cb);
  }
  const __m512 u0 = Fold128(x[0], x[1]), u1 = Fold128(x[2], x[3]);
  const __m512 u2 = Fold128(x[4], x[5]), u3 = Fold128(x[6], x[7]);
  const __m512 r = FoldPairs(FoldPairs(u0, u1), FoldPairs(u2, u3));
  // r holds key lane + 4 * pos at element 4 * lane + pos.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}

// Dot16 for a whole group of 16 keys with the head size fixed (kHd > 0) and
// q held in registers (qv[m] = q[16 m, 16 m + 16)): the same FMAs and folds as
// Dot16, without its per-key range tests or q reloads.
template <int kHd>
__attribute__((always_inline)) inline __m512 DotPairReg(const __m512* qv, const float* k) {
  __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int m = 0; m < kHd / 16; m += 2) {
    a = _mm512_fmadd_ps(qv[m], _mm512_loadu_ps(k + 16 * m), a);
    b = _mm512_fmadd_ps(qv[m + 1], _mm512_loadu_ps(k + 16 * m + 16), b);
  }
  return _mm512_add_ps(a, b);
}
template <int kHd>
__attribute__((always_inline)) inline __m512 Dot16Full(const __m512* qv, const float* kblk) {
  __m512 x[8];
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p) {
    x[p] = Fold256(DotPairReg<kHd>(qv, kblk + 2 * p * kHd),
                   DotPairReg<kHd>(qv, kblk + (2 * p + 1) * kHd));
  }
  const __m512 u0 = Fold128(x[0], x[1]), u1 = Fold128(x[2], x[3]);
  const __m512 u2 = Fold128(x[4], x[5]), u3 = Fold128(x[6], x[7]);
  const __m512 r = FoldPairs(FoldPairs(u0, u1), FoldPairs(u2, u3));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}

// Pass 1 of AttendAvx512: scores[j] for j in [max(j0, c0), min(j1, c1)),
// their running max folded into vmx (masked lane-wise max, the groups in
// position order) and returned. c0 is a multiple of 16 or <= j0, so the keys go
// through Dot16 in the same groups of 16 (aligned at position 0) whatever the
// chunking: every score is computed by the same operations, and chunks walked
// in position order with vmx carried give the very vmx of one whole-row pass.
// kHd > 0 fixes the head size at compile time (q stays in registers; the same
// operations in the same order as kHd == 0).
template <int kHd>
__m512 Avx512ScoresStep(const float* q, const float* const* kb, int B, int hd_rt, int64_t j0,
                        int64_t j1, int64_t c0, int64_t c1, float scale, float* scores,
                        __m512 vmx) {
  const int hd = kHd > 0 ? kHd : hd_rt;
  const int64_t a = std::max(j0, c0), z = std::min(j1, c1);
  const __m512 vscale = _mm512_set1_ps(scale);
  __m512 qv[kHd > 0 ? kHd / 16 : 1];
  if constexpr (kHd > 0) {
    for (int m = 0; m < kHd / 16; ++m) qv[m] = _mm512_loadu_ps(q + 16 * m);
  }
  // The block and the offset in it walk with jb (B % 16 == 0): no division per group.
  int64_t jb = a & ~int64_t{15};
  int64_t blk = jb / B, in_blk = jb % B;
  for (; jb < z; jb += 16) {
    const int lo = static_cast<int>(std::max<int64_t>(0, a - jb));
    const int hi = static_cast<int>(std::min<int64_t>(16, z - jb));
    const float* kblk = kb[blk] + in_blk * hd;
    if ((in_blk += 16) == B) {
      ++blk;
      in_blk = 0;
    }
    __m512 dots;
    if constexpr (kHd > 0) {
      dots = lo == 0 && hi == 16 ? Dot16Full<kHd>(qv, kblk) : Dot16(q, kblk, hd, lo, hi);
    } else {
      dots = Dot16(q, kblk, hd, lo, hi);
    }
    const __m512 sc = _mm512_mul_ps(dots, vscale);
    const __mmask16 m = static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
    _mm512_mask_storeu_ps(scores + jb, m, sc);
    vmx = _mm512_mask_max_ps(vmx, m, vmx, sc);
  }
  return vmx;
}

__m512 Avx512ScoresAny(const float* q, const float* const* kb, int B, int hd, int64_t j0,
                       int64_t j1, int64_t c0, int64_t c1, float scale, float* scores, __m512 vmx) {
  switch (hd) {
    case 64:
      return Avx512ScoresStep<64>(q, kb, B, hd, j0, j1, c0, c1, scale, scores, vmx);
    case 128:
      return Avx512ScoresStep<128>(q, kb, B, hd, j0, j1, c0, c1, scale, scores, vmx);
    case 256:  // Gemma 3
      return Avx512ScoresStep<256>(q, kb, B, hd, j0, j1, c0, c1, scale, scores, vmx);
    default:
      return Avx512ScoresStep<0>(q, kb, B, hd, j0, j1, c0, c1, scale, scores, vmx);
  }
}

// The scores of one chunk and their max (-inf when empty).
float Avx512Scores(const float* q, const float* const* kb, int B, int hd, int64_t j0, int64_t j1,
                   int64_t c0, int64_t c1, float scale, float* scores) {
  return _mm512_reduce_max_ps(
      Avx512ScoresAny(q, kb, B, hd, j0, j1, c0, c1, scale, scores, _mm512_set1_ps(-INFINITY)));
}

// Pass 2: scores [j0, j1) -> probabilities, given the max of all of them.
void Avx512Softmax(float* scores, int64_t j0, int64_t j1, float mx) {
  // exp in groups of 8 aligned at position 0, as AttendAvx2.
  double sum = 0;
  const __m256 mx8 = _mm256_set1_ps(mx);
  for (int64_t g = j0 & ~int64_t{7}; g < j1; g += 8) {
    const int lo = static_cast<int>(std::max<int64_t>(0, j0 - g));
    const int hi = static_cast<int>(std::min<int64_t>(8, j1 - g));
    const __mmask8 m = static_cast<__mmask8>(((1u << hi) - 1) & ~((1u << lo) - 1));
    const __m256 x = _mm256_mask_loadu_ps(_mm256_set1_ps(-INFINITY), m, scores + g);
    const __m256 e = Exp8Ggml(_mm256_sub_ps(x, mx8));
    sum += static_cast<double>(Hsum8(e));
    _mm256_mask_storeu_ps(scores + g, m, e);
  }
  const float inv = static_cast<float>(1.0 / sum);
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t g = j0 & ~int64_t{15}; g < j1; g += 16) {
    const int lo = static_cast<int>(std::max<int64_t>(0, j0 - g));
    const int hi = static_cast<int>(std::min<int64_t>(16, j1 - g));
    const __mmask16 m = static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
    _mm512_mask_storeu_ps(scores + g, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, scores + g), vinv));
  }
}

// Pass 3: out[e0, e1) (multiples of 32) = sum_j p_j v_j[e], lane (j mod 8) of
// an 8-lane accumulator per output element, positions in order.
// Over the groups of 8 positions g in [c0, c1) only (c0 and c1 multiples of
// 8, or c0 <= (j0 & ~7) and c1 >= j1): the accumulators start from acc_in (lane l of
// element e at acc_in[l * hd + e]; zeros when null), end in acc_out when it is
// not null, and are folded into out when out is not null. Chunks walked in
// position order with the accumulators carried through memory (exact) run
// the FMAs of one whole-row pass in the same order.
template <int kHd>
void Avx512ValuesStep(const float* scores, const float* const* vb, int B, int hd_rt, int64_t j0,
                      int64_t j1, int64_t c0, int64_t c1, int e0_begin, int e0_end,
                      const float* acc_in, float* acc_out, float* out) {
  const int hd = kHd > 0 ? kHd : hd_rt;
  const int64_t g_begin = std::max(j0 & ~int64_t{7}, c0), g_end = std::min(j1, c1);
  for (int e0 = e0_begin; e0 < e0_end; e0 += 32) {
    __m512 a[8], b[8];
    if (acc_in == nullptr) {
#pragma GCC unroll 8
      for (int l = 0; l < 8; ++l) a[l] = b[l] = _mm512_setzero_ps();
    } else {
#pragma GCC unroll 8
      for (int l = 0; l < 8; ++l) {
        a[l] = _mm512_loadu_ps(acc_in + l * hd + e0);
        b[l] = _mm512_loadu_ps(acc_in + l * hd + e0 + 16);
      }
    }
    int64_t blk = g_begin / B, in_blk = g_begin % B;  // walk with g (B % 8 == 0)
    for (int64_t g = g_begin; g < g_end; g += 8) {
      const float* vblk = vb[blk] + in_blk * hd + e0;  // B % 8 == 0: one block
      if ((in_blk += 8) == B) {
        ++blk;
        in_blk = 0;
      }
      // One walking pointer (8 precomputed row offsets spill registers).
      const float* v = vblk;
      const float* pj = scores + g;
      if (g >= j0 && g + 8 <= j1) {
#pragma GCC unroll 8
        for (int l = 0; l < 8; ++l) {
          const __m512 p = _mm512_set1_ps(pj[l]);
          a[l] = _mm512_fmadd_ps(_mm512_loadu_ps(v), p, a[l]);
          b[l] = _mm512_fmadd_ps(_mm512_loadu_ps(v + 16), p, b[l]);
          v += hd;
        }
      } else {
#pragma GCC unroll 8
        for (int l = 0; l < 8; ++l) {
          if (g + l >= j0 && g + l < j1) {
            const __m512 p = _mm512_set1_ps(pj[l]);
            a[l] = _mm512_fmadd_ps(_mm512_loadu_ps(v), p, a[l]);
            b[l] = _mm512_fmadd_ps(_mm512_loadu_ps(v + 16), p, b[l]);
          }
          v += hd;
        }
      }
    }
    if (acc_out != nullptr) {
#pragma GCC unroll 8
      for (int l = 0; l < 8; ++l) {
        _mm512_storeu_ps(acc_out + l * hd + e0, a[l]);
        _mm512_storeu_ps(acc_out + l * hd + e0 + 16, b[l]);
      }
    }
    if (out == nullptr) continue;
    // ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)), as AttendAvx2.
    const __m512 ta =
        _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6])),
                      _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7])));
    const __m512 tb =
        _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(b[0], b[4]), _mm512_add_ps(b[2], b[6])),
                      _mm512_add_ps(_mm512_add_ps(b[1], b[5]), _mm512_add_ps(b[3], b[7])));
    _mm512_storeu_ps(out + e0, ta);
    _mm512_storeu_ps(out + e0 + 16, tb);
  }
}

void Avx512ValuesAny(const float* scores, const float* const* vb, int B, int hd, int64_t j0,
                     int64_t j1, int64_t c0, int64_t c1, int e0_begin, int e0_end,
                     const float* acc_in, float* acc_out, float* out) {
  switch (hd) {
    case 64:
      return Avx512ValuesStep<64>(scores, vb, B, hd, j0, j1, c0, c1, e0_begin, e0_end, acc_in,
                                  acc_out, out);
    case 128:
      return Avx512ValuesStep<128>(scores, vb, B, hd, j0, j1, c0, c1, e0_begin, e0_end, acc_in,
                                   acc_out, out);
    case 256:
      return Avx512ValuesStep<256>(scores, vb, B, hd, j0, j1, c0, c1, e0_begin, e0_end, acc_in,
                                   acc_out, out);
    default:
      return Avx512ValuesStep<0>(scores, vb, B, hd, j0, j1, c0, c1, e0_begin, e0_end, acc_in,
                                 acc_out, out);
  }
}

void Avx512Values(const float* scores, const float* const* vb, int B, int hd, int64_t j0,
                  int64_t j1, int e0_begin, int e0_end, float* out) {
  Avx512ValuesAny(scores, vb, B, hd, j0, j1, 0, j1, e0_begin, e0_end, nullptr, nullptr, out);
}

// The tile path on AVX-512: pass 1 over the chunks with each row's running
// max carried (Avx512ScoresStep), pass 2 per row, pass 3 over the chunks with
// each row's accumulators carried through acc (Avx512ValuesStep). jlo is a
// multiple of kTileChunk.
void AttendTileAvx512(const AttendTileRow* rows, int n, const float* const* kb,
                      const float* const* vb, int B, int hd, float scale, float* scores,
                      int64_t stride, float* acc, int64_t jlo, int64_t jhi) {
  __m512 vmx[kTileMaxRows];
  for (int r = 0; r < n; ++r) vmx[r] = _mm512_set1_ps(-INFINITY);
  for (int64_t c0 = jlo; c0 < jhi; c0 += kTileChunk) {
    const int64_t c1 = c0 + kTileChunk;
    for (int r = 0; r < n; ++r) {
      const AttendTileRow& row = rows[r];
      if (row.j1 <= row.j0 || c0 >= row.j1 || c1 <= row.j0) continue;
      vmx[r] = Avx512ScoresAny(row.q, kb, B, hd, row.j0, row.j1, c0, c1, scale, scores + r * stride,
                               vmx[r]);
    }
  }
  for (int r = 0; r < n; ++r) {
    const AttendTileRow& row = rows[r];
    if (row.j1 <= row.j0) continue;
    Avx512Softmax(scores + r * stride, row.j0, row.j1, _mm512_reduce_max_ps(vmx[r]));
  }
  for (int64_t c0 = jlo; c0 < jhi; c0 += kTileChunk) {
    const int64_t c1 = c0 + kTileChunk;
    for (int r = 0; r < n; ++r) {
      const AttendTileRow& row = rows[r];
      const int64_t g0 = row.j0 & ~int64_t{7};
      if (row.j1 <= row.j0 || c0 >= row.j1 || c1 <= g0) continue;
      const bool first = c0 <= g0, last = c1 >= row.j1;
      float* a = acc + static_cast<int64_t>(r) * 8 * hd;
      Avx512ValuesAny(scores + r * stride, vb, B, hd, row.j0, row.j1, c0, c1, 0, hd,
                      first ? nullptr : a, last ? nullptr : a, last ? row.out : nullptr);
    }
  }
}

void AttendAvx512(const float* q, const float* const* kb, const float* const* vb, int B, int hd,
                  int64_t j0, int64_t j1, float scale, float* scores, float* out) {
  const float mx = Avx512Scores(q, kb, B, hd, j0, j1, j0, j1, scale, scores);
  Avx512Softmax(scores, j0, j1, mx);
  Avx512Values(scores, vb, B, hd, j0, j1, 0, hd, out);
}

#pragma GCC diagnostic pop
#pragma GCC pop_options

// AttendScalar's passes, as Avx2ScoresStep / Avx2SoftmaxExp / Avx2ValuesStep.
float ScalarScoresStep(const float* q, const float* const* kb, int B, int hd, int64_t j0,
                       int64_t j1, int64_t c0, int64_t c1, float scale, float* scores, float mx) {
  for (int64_t j = std::max(j0, c0), z = std::min(j1, c1); j < z; ++j) {
    const float* k = kb[j / B] + (j % B) * hd;
    const float s = DotVecScalar(q, k, hd) * scale;
    scores[j] = s;
    mx = MaxGgml(mx, s);
  }
  return mx;
}

float ScalarSoftmaxExp(float* scores, int64_t j0, int64_t j1, float mx) {
  double sum = 0;
  for (int64_t g = j0 & ~int64_t{7}; g < j1; g += 8) {
    float l[8];
    for (int i = 0; i < 8; ++i) {
      const int64_t j = g + i;
      l[i] = j >= j0 && j < j1 ? ExpGgmlScalar(scores[j] - mx) : 0.0f;
      if (j >= j0 && j < j1) scores[j] = l[i];
    }
    sum += static_cast<double>(Hsum8Scalar(l));
  }
  return static_cast<float>(1.0 / sum);
}

// lanes (8 or 32) accumulators per output element, position j in lane j mod lanes.
void ScalarValuesStep(const float* scores, float inv, const float* const* vb, int B, int hd,
                      int lanes, int64_t j0, int64_t j1, int64_t c0, int64_t c1, float* acc) {
  for (int64_t j = std::max(j0, c0), z = std::min(j1, c1); j < z; ++j) {
    const float* v = vb[j / B] + (j % B) * hd;
    float* a = acc + (j & (lanes - 1)) * hd;
    const float p = scores[j] * inv;
    for (int e = 0; e < hd; ++e) a[e] = std::fma(v[e], p, a[e]);
  }
}

void ScalarValuesFold(const float* acc, int hd, float* out) {
  for (int e = 0; e < hd; ++e) {
    float l[8];
    for (int k = 0; k < 8; ++k) l[k] = acc[k * hd + e];
    out[e] = Hsum8Scalar(l);
  }
}

void AttendScalar(const float* q, const float* const* kb, const float* const* vb, int B, int hd,
                  int64_t j0, int64_t j1, float scale, bool single, float* scores, float* acc,
                  float* out) {
  const float mx = ScalarScoresStep(q, kb, B, hd, j0, j1, j0, j1, scale, scores, -INFINITY);
  const float inv = ScalarSoftmaxExp(scores, j0, j1, mx);
  const int lanes = single ? 32 : 8;
  for (int i = 0; i < lanes * hd; ++i) acc[i] = 0.0f;
  ScalarValuesStep(scores, inv, vb, B, hd, lanes, j0, j1, j0, j1, acc);
  if (single) {
    for (int e = 0; e < hd; ++e) out[e] = ReduceColumn32(acc, hd, e);
    return;
  }
  ScalarValuesFold(acc, hd, out);
}

// The step functions AttendTileDriver runs on the scalar fallback.
struct ScalarTileSteps {
  static float Scores(const float* q, const float* const* kb, int B, int hd, int64_t j0, int64_t j1,
                      int64_t c0, int64_t c1, float scale, float* scores, float mx) {
    return ScalarScoresStep(q, kb, B, hd, j0, j1, c0, c1, scale, scores, mx);
  }
  static float Softmax(float* scores, int64_t j0, int64_t j1, float mx) {
    return ScalarSoftmaxExp(scores, j0, j1, mx);
  }
  static void Zero(float* a, int hd) {
    for (int i = 0; i < 8 * hd; ++i) a[i] = 0.0f;
  }
  static void Values(const float* scores, float inv, const float* const* vb, int B, int hd,
                     int64_t j0, int64_t j1, int64_t c0, int64_t c1, float* acc) {
    ScalarValuesStep(scores, inv, vb, B, hd, 8, j0, j1, c0, c1, acc);
  }
  static void Fold(const float* acc, int hd, float* out) { ScalarValuesFold(acc, hd, out); }
};

// The tile path on the scalar fallback, as AttendTileAvx2.
void AttendTileScalar(const AttendTileRow* rows, int n, const float* const* kb,
                      const float* const* vb, int B, int hd, float scale, float* scores,
                      int64_t stride, float* acc, int64_t jlo, int64_t jhi) {
  AttendTileDriver<ScalarTileSteps>(rows, n, kb, vb, B, hd, scale, scores, stride, acc, jlo, jhi);
}

}  // namespace

void RmsNormFast(const float* x, const float* w, int64_t n, float eps, float* y) {
  if (n <= 0) return;
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i] * x[i]);
  const float mean = static_cast<float>(ss / static_cast<double>(n));
  const float scale = 1.0f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * scale) * w[i];
}

void SiluMul(const float* gate, const float* up, int64_t n, float* out, KernelPath path) {
  if (UseAvx2(path)) return SiluMulAvx2(gate, up, n, out);
  // Same split as the vector path: whole groups of 8 with ExpGgml, libm expf
  // for the tail (ggml's ggml_vec_swiglu_f32).
  const int64_t n8 = n & ~int64_t{7};
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    const float e = i < n8 ? ExpGgmlScalar(-g) : std::exp(-g);
    out[i] = g / (1.0f + e) * up[i];
  }
}

void ExpGgml(const float* x, int64_t n, float* y, KernelPath path) {
  if (UseAvx2(path)) return ExpAvx2(x, n, y);
  for (int64_t i = 0; i < n; ++i) y[i] = ExpGgmlScalar(x[i]);
}

void AddInPlace(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

void RopeAnglesGgml(int64_t pos, float base, int rope_dim, float* cos, float* sin) {
  const float theta_scale = std::pow(base, -2.0f / static_cast<float>(rope_dim));
  float theta = static_cast<float>(pos);
  for (int i = 0; i < rope_dim / 2; ++i) {
    cos[i] = std::cos(theta);
    sin[i] = std::sin(theta);
    theta *= theta_scale;
  }
}

void RopeRotate(float* x, int half, bool neox, const float* cos, const float* sin,
                KernelPath path) {
  if (UseAvx2(path)) return RopeRotateAvx2(x, half, neox, cos, sin);
  for (int i = 0; i < half; ++i) {
    const int a = neox ? i : 2 * i;
    const int b = neox ? i + half : 2 * i + 1;
    const float x0 = x[a], x1 = x[b];
    // ggml's rope is C++ built with FMA contraction: the first product of
    // each expression is fused, the second rounded (x0 * cos - x1 * sin).
    x[a] = std::fma(x0, cos[i], -(x1 * sin[i]));
    x[b] = std::fma(x0, sin[i], x1 * cos[i]);
  }
}

void AttendRowGgml(const float* q, const float* const* k_blocks, const float* const* v_blocks,
                   int block_tokens, int hd, int64_t j0, int64_t j1, float scale, bool single_token,
                   float* scores, float* acc, float* out, KernelPath path) {
  if (j1 <= j0) {
    for (int e = 0; e < hd; ++e) out[e] = 0.0f;
    return;
  }
  if (path == KernelPath::kAuto) path = ResolvedKernelPath();
  if (path == KernelPath::kAvx512 && KernelPathSupported(KernelPath::kAvx512) && !single_token &&
      hd % 32 == 0 && block_tokens % 16 == 0) {
    return AttendAvx512(q, k_blocks, v_blocks, block_tokens, hd, j0, j1, scale, scores, out);
  }
  if (UseAvx2(path)) {
    return AttendAvx2(q, k_blocks, v_blocks, block_tokens, hd, j0, j1, scale, single_token, scores,
                      acc, out);
  }
  AttendScalar(q, k_blocks, v_blocks, block_tokens, hd, j0, j1, scale, single_token, scores, acc,
               out);
}

bool AttendSplitSupported(int block_tokens, int hd, KernelPath path) {
  if (path == KernelPath::kAuto) path = ResolvedKernelPath();
  return path == KernelPath::kAvx512 && KernelPathSupported(KernelPath::kAvx512) && hd % 32 == 0 &&
         block_tokens % 16 == 0;
}

float AttendScoresGgml(const float* q, const float* const* k_blocks, int block_tokens, int hd,
                       int64_t j0, int64_t j1, int64_t c0, int64_t c1, float scale, float* scores) {
  return Avx512Scores(q, k_blocks, block_tokens, hd, j0, j1, c0, c1, scale, scores);
}

void AttendSoftmaxGgml(float* scores, int64_t j0, int64_t j1, float max_score) {
  Avx512Softmax(scores, j0, j1, max_score);
}

void AttendValuesGgml(const float* p, const float* const* v_blocks, int block_tokens, int hd,
                      int64_t j0, int64_t j1, int e0, int e1, float* out) {
  if (j1 <= j0) {
    for (int e = e0; e < e1; ++e) out[e] = 0.0f;
    return;
  }
  Avx512Values(p, v_blocks, block_tokens, hd, j0, j1, e0, e1, out);
}

namespace {
int64_t TileStride(int64_t max_j1) { return (std::max<int64_t>(max_j1, 1) + 15) & ~int64_t{15}; }
}  // namespace

int64_t AttendTileScratchFloats(int64_t n_rows, int64_t max_j1, int hd) {
  const int64_t n = std::min<int64_t>(n_rows, kTileMaxRows);
  return n * (TileStride(max_j1) + 8 * static_cast<int64_t>(hd));
}

void AttendTileGgml(std::span<const AttendTileRow> rows, const float* const* k_blocks,
                    const float* const* v_blocks, int block_tokens, int hd, float scale,
                    float* scratch, KernelPath path) {
  if (path == KernelPath::kAuto) path = ResolvedKernelPath();
  const bool avx512 = path == KernelPath::kAvx512 && KernelPathSupported(KernelPath::kAvx512) &&
                      hd % 32 == 0 && block_tokens % 16 == 0;
  const bool avx2 = !avx512 && UseAvx2(path);
  for (size_t r0 = 0; r0 < rows.size(); r0 += kTileMaxRows) {
    const int n = static_cast<int>(std::min<size_t>(kTileMaxRows, rows.size() - r0));
    const AttendTileRow* rs = rows.data() + r0;
    int64_t jlo = INT64_MAX, jhi = 0;
    for (int r = 0; r < n; ++r) {
      if (rs[r].j1 <= rs[r].j0) {
        for (int e = 0; e < hd; ++e) rs[r].out[e] = 0.0f;  // as AttendRowGgml
        continue;
      }
      jlo = std::min(jlo, rs[r].j0);
      jhi = std::max(jhi, rs[r].j1);
    }
    if (jhi == 0) continue;
    jlo &= ~(kTileChunk - 1);
    const int64_t stride = TileStride(jhi);
    float* acc = scratch + n * stride;
    if (avx512) {
      AttendTileAvx512(rs, n, k_blocks, v_blocks, block_tokens, hd, scale, scratch, stride, acc,
                       jlo, jhi);
    } else if (avx2) {
      AttendTileAvx2(rs, n, k_blocks, v_blocks, block_tokens, hd, scale, scratch, stride, acc, jlo,
                     jhi);
    } else {
      AttendTileScalar(rs, n, k_blocks, v_blocks, block_tokens, hd, scale, scratch, stride, acc,
                       jlo, jhi);
    }
  }
}

}  // namespace kvrelay::engine
