#include "engine/kv_cache/kv_codec.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace kvrelay::engine::kvcodec {
namespace {

constexpr float kHalfMax = 65504.0f;

int KiviGroups(int head_dim) { return (head_dim + kKiviGroup - 1) / kKiviGroup; }

int64_t KiviDataBytes(int bits, int block_tokens, int head_dim) {
  return static_cast<int64_t>(block_tokens) * head_dim * bits / 8;
}

// Next representable binary16 toward -inf / +inf (h finite).
uint16_t HalfNextDown(uint16_t h) {
  if (h == 0x0000) return 0x8001;                       // +0 -> smallest negative subnormal
  if (h & 0x8000) return static_cast<uint16_t>(h + 1);  // negative: magnitude grows
  return static_cast<uint16_t>(h - 1);
}
uint16_t HalfNextUp(uint16_t h) {
  if (h == 0x8000) return 0x0001;
  if (h & 0x8000) return static_cast<uint16_t>(h - 1);
  return static_cast<uint16_t>(h + 1);
}

// Largest binary16 <= x (x clamped to the finite binary16 range).
uint16_t HalfFloor(float x) {
  x = std::clamp(x, -kHalfMax, kHalfMax);
  uint16_t h = FloatToHalf(x);
  if (HalfToFloat(h) > x) h = HalfNextDown(h);
  return h;
}
uint16_t HalfCeil(float x) {
  x = std::clamp(x, -kHalfMax, kHalfMax);
  uint16_t h = FloatToHalf(x);
  if (HalfToFloat(h) < x) h = HalfNextUp(h);
  return h;
}

uint16_t LoadU16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
void StoreU16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }

// Round half to even for |x| <= 2^22 (callers clamp first). Avoids the libm
// call std::nearbyint compiles to without SSE4.1.
inline float RoundEven(float x) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  return (x + kMagic) - kMagic;
}

struct Range {
  float lo, step;
  int levels;
  float Dequantize(uint32_t q) const { return lo + static_cast<float>(q) * step; }
};

Range MakeRange(uint16_t lo16, uint16_t hi16, int levels) {
  const float lo = HalfToFloat(lo16);
  const float hi = HalfToFloat(hi16);
  return Range{lo, (hi - lo) / static_cast<float>(levels), levels};
}

#if defined(__x86_64__)
// F16C paths, selected at run time (the build does not assume -mf16c).
__attribute__((target("avx,f16c"))) void HalfRowsToFloatF16c(const uint8_t* src, int64_t n,
                                                             float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) out[i] = HalfToFloat(LoadU16(src + 2 * i));
}
__attribute__((target("avx,f16c"))) void FloatRowToHalfF16c(const float* x, int64_t n,
                                                            uint8_t* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i), h);
  }
  for (; i < n; ++i) StoreU16(dst + 2 * i, FloatToHalf(x[i]));
}
// CPUID leaf 1 rather than __builtin_cpu_supports("f16c"), which clang 14 (the
// libFuzzer build) rejects. Same answer as the builtin pair it replaces: the
// F16C and AVX flags, and AVX only where the OS saves the ymm state (OSXSAVE,
// XCR0 bits 1-2), as libgcc's "avx" requires.
bool CpuHasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return false;
  constexpr unsigned kNeed = bit_AVX | bit_F16C | bit_OSXSAVE;
  if ((ecx & kNeed) != kNeed) return false;
  unsigned lo = 0, hi = 0;
  __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  constexpr unsigned kYmmState = (1u << 1) | (1u << 2);
  return (lo & kYmmState) == kYmmState;
}
const bool kHasF16c = CpuHasF16c();
#else
constexpr bool kHasF16c = false;
void HalfRowsToFloatF16c(const uint8_t*, int64_t, float*) {}
void FloatRowToHalfF16c(const float*, int64_t, uint8_t*) {}
#endif

}  // namespace

uint16_t FloatToHalf(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or nan
    return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {  // subnormal or zero in half
    // value = abs_float; half subnormal unit = 2^-24. Use float arithmetic: exact RNE.
    const float a = std::bit_cast<float>(abs);
    const float scaled = a * 16777216.0f;  // * 2^24, exact (power of two)
    const uint32_t m = static_cast<uint32_t>(std::nearbyint(scaled));  // <= 1024
    return static_cast<uint16_t>(sign | m);
  }
  // Normal: rebias exponent (127 -> 15) and round 23-bit mantissa to 10 bits.
  uint32_t h = ((abs - 0x38000000u) >> 13);
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // carry may bump exponent: correct
  return static_cast<uint16_t>(sign | h);
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    const float v = static_cast<float>(man) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (man << 13));
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (man << 13));
}

uint16_t FloatToBf16(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // nan
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

float Bf16ToFloat(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

int KiviBits(KvDtype d) {
  switch (d) {
    case KvDtype::kKivi4:
      return 4;
    case KvDtype::kKivi2:
      return 2;
    default:
      return 0;
  }
}

bool IsKivi(KvDtype d) { return KiviBits(d) != 0; }

int64_t SlabBytes(KvDtype d, int block_tokens, int head_dim) {
  const int64_t n = static_cast<int64_t>(block_tokens) * head_dim;
  switch (d) {
    case KvDtype::kF32:
      return n * 4;
    case KvDtype::kF16:
    case KvDtype::kBF16:
      return n * 2;
    case KvDtype::kInt8:
      return n + 4 * static_cast<int64_t>(block_tokens);
    case KvDtype::kKivi4:
    case KvDtype::kKivi2: {
      const int64_t params =
          std::max<int64_t>(4 * static_cast<int64_t>(head_dim),
                            4 * static_cast<int64_t>(block_tokens) * KiviGroups(head_dim));
      return KiviDataBytes(KiviBits(d), block_tokens, head_dim) + params;
    }
  }
  return 0;
}

void EncodeRow(KvDtype d, uint8_t* slab, int block_tokens, int head_dim, int t, const float* x) {
  const int64_t row = static_cast<int64_t>(t) * head_dim;
  switch (d) {
    case KvDtype::kF32:
      std::memcpy(slab + row * 4, x, static_cast<size_t>(head_dim) * 4);
      return;
    case KvDtype::kF16: {
      uint8_t* p = slab + row * 2;
      if (kHasF16c) {
        FloatRowToHalfF16c(x, head_dim, p);
      } else {
        for (int i = 0; i < head_dim; ++i) StoreU16(p + 2 * i, FloatToHalf(x[i]));
      }
      return;
    }
    case KvDtype::kBF16: {
      uint8_t* p = slab + row * 2;
      for (int i = 0; i < head_dim; ++i) StoreU16(p + 2 * i, FloatToBf16(x[i]));
      return;
    }
    case KvDtype::kInt8: {
      float amax = 0.0f;
      for (int i = 0; i < head_dim; ++i) amax = std::max(amax, std::fabs(x[i]));
      const float scale = amax / 127.0f;
      const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
      int8_t* q = reinterpret_cast<int8_t*>(slab + row);
      for (int i = 0; i < head_dim; ++i) {
        float v = x[i] * inv;
        v = v > -127.0f ? v : -127.0f;  // also maps NaN to -127
        v = v < 127.0f ? v : 127.0f;
        v = RoundEven(v);
        q[i] = static_cast<int8_t>(v);
      }
      std::memcpy(slab + static_cast<int64_t>(block_tokens) * head_dim + 4 * t, &scale, 4);
      return;
    }
    case KvDtype::kKivi4:
    case KvDtype::kKivi2:
      return;  // KIVI slabs are written whole by QuantizeKivi.
  }
}

void DecodeRows(KvDtype d, bool is_key, const uint8_t* slab, int block_tokens, int head_dim, int n,
                float* out) {
  const int64_t count = static_cast<int64_t>(n) * head_dim;
  switch (d) {
    case KvDtype::kF32:
      std::memcpy(out, slab, static_cast<size_t>(count) * 4);
      return;
    case KvDtype::kF16:
      if (kHasF16c) {
        HalfRowsToFloatF16c(slab, count, out);
      } else {
        for (int64_t i = 0; i < count; ++i) out[i] = HalfToFloat(LoadU16(slab + 2 * i));
      }
      return;
    case KvDtype::kBF16:
      for (int64_t i = 0; i < count; ++i) out[i] = Bf16ToFloat(LoadU16(slab + 2 * i));
      return;
    case KvDtype::kInt8: {
      const int8_t* q = reinterpret_cast<const int8_t*>(slab);
      const uint8_t* scales = slab + static_cast<int64_t>(block_tokens) * head_dim;
      for (int t = 0; t < n; ++t) {
        float scale;
        std::memcpy(&scale, scales + 4 * t, 4);
        const int64_t row = static_cast<int64_t>(t) * head_dim;
        for (int i = 0; i < head_dim; ++i) out[row + i] = static_cast<float>(q[row + i]) * scale;
      }
      return;
    }
    case KvDtype::kKivi4:
    case KvDtype::kKivi2: {
      const int bits = KiviBits(d);
      const int levels = (1 << bits) - 1;
      const uint8_t* params = slab + KiviDataBytes(bits, block_tokens, head_dim);
      const int64_t row_bytes = static_cast<int64_t>(head_dim) * bits / 8;  // whole bytes
      if (is_key) {
        // Per-channel lo and step, then rows decoded with contiguous channels.
        constexpr int kStack = 256;
        float lo_stack[kStack], step_stack[kStack];
        std::vector<float> heap;
        float* lo = lo_stack;
        float* step = step_stack;
        if (head_dim > kStack) {
          heap.resize(2 * static_cast<size_t>(head_dim));
          lo = heap.data();
          step = heap.data() + head_dim;
        }
        for (int c = 0; c < head_dim; ++c) {
          const Range r = MakeRange(LoadU16(params + 4 * c), LoadU16(params + 4 * c + 2), levels);
          lo[c] = r.lo;
          step[c] = r.step;
        }
        for (int t = 0; t < n; ++t) {
          const uint8_t* codes = slab + t * row_bytes;
          float* o = out + static_cast<int64_t>(t) * head_dim;
          if (bits == 4) {
            for (int j = 0; j < head_dim / 2; ++j) {
              const uint8_t b = codes[j];
              o[2 * j] = lo[2 * j] + static_cast<float>(b & 15) * step[2 * j];
              o[2 * j + 1] = lo[2 * j + 1] + static_cast<float>(b >> 4) * step[2 * j + 1];
            }
          } else {
            for (int j = 0; j < head_dim / 4; ++j) {
              const uint8_t b = codes[j];
              for (int k = 0; k < 4; ++k) {
                o[4 * j + k] =
                    lo[4 * j + k] + static_cast<float>((b >> (2 * k)) & 3) * step[4 * j + k];
              }
            }
          }
        }
      } else {
        const int groups = KiviGroups(head_dim);
        for (int t = 0; t < n; ++t) {
          const uint8_t* codes = slab + t * row_bytes;
          float* o = out + static_cast<int64_t>(t) * head_dim;
          for (int g = 0; g < groups; ++g) {
            const uint8_t* p = params + 4 * (static_cast<int64_t>(t) * groups + g);
            const Range r = MakeRange(LoadU16(p), LoadU16(p + 2), levels);
            const int end = std::min(head_dim, (g + 1) * kKiviGroup);
            for (int c = g * kKiviGroup; c < end; ++c) {
              const uint32_t q = (codes[(c * bits) >> 3] >> ((c * bits) & 7)) & levels;
              o[c] = r.lo + static_cast<float>(q) * r.step;
            }
          }
        }
      }
      return;
    }
  }
}

void QuantizeKivi(KvDtype d, bool is_key, uint8_t* slab, int block_tokens, int head_dim, int n,
                  const float* src) {
  const int bits = KiviBits(d);
  if (bits == 0) return;
  const int levels = (1 << bits) - 1;
  const int64_t data_bytes = KiviDataBytes(bits, block_tokens, head_dim);
  const int64_t row_bytes = static_cast<int64_t>(head_dim) * bits / 8;  // whole bytes
  uint8_t* params = slab + data_bytes;
  // Zero codes and the unused tail of the parameter area, so equal inputs give equal bytes.
  std::memset(slab, 0, static_cast<size_t>(SlabBytes(d, block_tokens, head_dim)));
  // Scratch: per-channel lo / inverse step / step (keys) and one row of codes.
  constexpr int kStack = 256;
  float stack[3 * kStack];
  uint8_t qstack[kStack];
  std::vector<float> heap;
  std::vector<uint8_t> qheap;
  float* lo = stack;
  uint8_t* q = qstack;
  if (head_dim > kStack) {
    heap.resize(3 * static_cast<size_t>(head_dim));
    qheap.resize(static_cast<size_t>(head_dim));
    lo = heap.data();
    q = qheap.data();
  }
  float* inv = lo + head_dim;
  float* hi = inv + head_dim;  // max, then unused
  const float lv = static_cast<float>(levels);
  auto code = [lv](float x, float lo_v, float inv_v) {
    float t = (x - lo_v) * inv_v;
    t = t > 0.0f ? t : 0.0f;  // also maps NaN to 0
    t = t < lv ? t : lv;
    return static_cast<uint8_t>(RoundEven(t));
  };
  auto pack_row = [&](int t) {
    uint8_t* out = slab + t * row_bytes;
    if (bits == 4) {
      for (int j = 0; j < head_dim / 2; ++j)
        out[j] = static_cast<uint8_t>(q[2 * j] | (q[2 * j + 1] << 4));
    } else {
      for (int j = 0; j < head_dim / 4; ++j) {
        out[j] = static_cast<uint8_t>(q[4 * j] | (q[4 * j + 1] << 2) | (q[4 * j + 2] << 4) |
                                      (q[4 * j + 3] << 6));
      }
    }
  };
  if (is_key) {
    if (n > 0) {
      std::memcpy(lo, src, static_cast<size_t>(head_dim) * sizeof(float));
      std::memcpy(hi, src, static_cast<size_t>(head_dim) * sizeof(float));
    } else {
      std::fill(lo, lo + 2 * head_dim, 0.0f);
      std::fill(hi, hi + head_dim, 0.0f);
    }
    for (int t = 1; t < n; ++t) {
      const float* row = src + static_cast<int64_t>(t) * head_dim;
      for (int c = 0; c < head_dim; ++c) {
        lo[c] = std::min(lo[c], row[c]);
        hi[c] = std::max(hi[c], row[c]);
      }
    }
    for (int c = 0; c < head_dim; ++c) {
      const uint16_t lo16 = HalfFloor(lo[c]), hi16 = HalfCeil(hi[c]);
      StoreU16(params + 4 * c, lo16);
      StoreU16(params + 4 * c + 2, hi16);
      const Range r = MakeRange(lo16, hi16, levels);
      lo[c] = r.lo;
      inv[c] = r.step > 0.0f ? 1.0f / r.step : 0.0f;
    }
    for (int t = 0; t < n; ++t) {
      const float* row = src + static_cast<int64_t>(t) * head_dim;
      for (int c = 0; c < head_dim; ++c) q[c] = code(row[c], lo[c], inv[c]);
      pack_row(t);
    }
  } else {
    const int groups = KiviGroups(head_dim);
    for (int t = 0; t < block_tokens; ++t) {
      const float* row = src + static_cast<int64_t>(t) * head_dim;
      for (int g = 0; g < groups; ++g) {
        const int begin = g * kKiviGroup, end = std::min(head_dim, (g + 1) * kKiviGroup);
        float mn = 0.0f, mx = 0.0f;
        if (t < n) {
          mn = mx = row[begin];
          for (int c = begin + 1; c < end; ++c) {
            mn = std::min(mn, row[c]);
            mx = std::max(mx, row[c]);
          }
        }
        const uint16_t lo16 = HalfFloor(mn), hi16 = HalfCeil(mx);
        uint8_t* p = params + 4 * (static_cast<int64_t>(t) * groups + g);
        StoreU16(p, lo16);
        StoreU16(p + 2, hi16);
        if (t >= n) continue;
        const Range r = MakeRange(lo16, hi16, levels);
        const float iv = r.step > 0.0f ? 1.0f / r.step : 0.0f;
        for (int c = begin; c < end; ++c) q[c] = code(row[c], r.lo, iv);
      }
      if (t < n) pack_row(t);
    }
  }
}

}  // namespace kvrelay::engine::kvcodec
