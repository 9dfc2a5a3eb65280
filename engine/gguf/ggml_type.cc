// ggml tensor formats: block geometry and exact dequantization, following the
// block layouts of ggml (ggml-common.h / ggml-quants.c). All multi-byte fields
// are little-endian; this file reads them with memcpy so unaligned blocks work.
#include "engine/gguf/ggml_type.h"

#include <bit>
#include <cstring>
#include <string>

namespace kvrelay::engine {
namespace {

static_assert(std::endian::native == std::endian::little, "GGUF readers assume little-endian");

constexpr int64_t kQk = 32;    // elements per block of the legacy formats
constexpr int64_t kQkK = 256;  // elements per super-block of the k-quants
constexpr int64_t kKScaleBytes = 12;

struct TypeInfo {
  GgmlType type;
  std::string_view name;
  int64_t block_elems;
  int64_t block_bytes;
  bool dequantize;
};

// Byte sizes: Q4_0 = fp16 d + 16 nibble bytes; Q4_1 adds fp16 m; Q5_0 = d + qh[4] + qs[16];
// Q5_1 adds m; Q8_0 = d + 32 int8; Q8_1 = d + s + 32 int8; Q2_K = scales[16] + qs[64] + d + dmin;
// Q3_K = hmask[32] + qs[64] + scales[12] + d; Q4_K = d + dmin + scales[12] + qs[128];
// Q5_K = d + dmin + scales[12] + qh[32] + qs[128]; Q6_K = ql[128] + qh[64] + scales[16] + d;
// Q8_K = float d + qs[256] + int16 bsums[16].
constexpr TypeInfo kTypes[] = {
    {GgmlType::kF32, "F32", 1, 4, true},
    {GgmlType::kF16, "F16", 1, 2, true},
    {GgmlType::kQ4_0, "Q4_0", kQk, 2 + kQk / 2, true},
    {GgmlType::kQ4_1, "Q4_1", kQk, 4 + kQk / 2, true},
    {GgmlType::kQ5_0, "Q5_0", kQk, 2 + 4 + kQk / 2, true},
    {GgmlType::kQ5_1, "Q5_1", kQk, 4 + 4 + kQk / 2, true},
    {GgmlType::kQ8_0, "Q8_0", kQk, 2 + kQk, true},
    {GgmlType::kQ8_1, "Q8_1", kQk, 4 + kQk, true},
    {GgmlType::kQ2_K, "Q2_K", kQkK, kQkK / 16 + kQkK / 4 + 4, true},
    {GgmlType::kQ3_K, "Q3_K", kQkK, kQkK / 8 + kQkK / 4 + 12 + 2, true},
    {GgmlType::kQ4_K, "Q4_K", kQkK, 4 + kKScaleBytes + kQkK / 2, true},
    {GgmlType::kQ5_K, "Q5_K", kQkK, 4 + kKScaleBytes + kQkK / 8 + kQkK / 2, true},
    {GgmlType::kQ6_K, "Q6_K", kQkK, kQkK / 2 + kQkK / 4 + kQkK / 16 + 2, true},
    {GgmlType::kQ8_K, "Q8_K", kQkK, 4 + kQkK + 2 * kQkK / 16, true},
    {GgmlType::kBF16, "BF16", 1, 2, true},
};

const TypeInfo* Info(GgmlType type) {
  for (const TypeInfo& t : kTypes) {
    if (t.type == type) return &t;
  }
  return nullptr;
}

uint16_t LoadU16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
uint32_t LoadU32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
float LoadF16(const uint8_t* p) { return Fp16ToFp32(LoadU16(p)); }

void DequantQ4_0(const uint8_t* b, float* y) {
  const float d = LoadF16(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < kQk / 2; ++j) {
    y[j] = static_cast<float>((qs[j] & 0x0F) - 8) * d;
    y[j + kQk / 2] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

void DequantQ4_1(const uint8_t* b, float* y) {
  const float d = LoadF16(b);
  const float m = LoadF16(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < kQk / 2; ++j) {
    y[j] = static_cast<float>(qs[j] & 0x0F) * d + m;
    y[j + kQk / 2] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}

// Q5: the 5th bit of element j (j < 16) is bit j of qh, of element j + 16 is bit j + 16.
void DequantQ5_0(const uint8_t* b, float* y) {
  const float d = LoadF16(b);
  const uint32_t qh = LoadU32(b + 2);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < kQk / 2; ++j) {
    const int x0 = static_cast<int>((qs[j] & 0x0F) | (((qh >> j) & 1u) << 4)) - 16;
    const int x1 = static_cast<int>((qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4)) - 16;
    y[j] = static_cast<float>(x0) * d;
    y[j + kQk / 2] = static_cast<float>(x1) * d;
  }
}

void DequantQ5_1(const uint8_t* b, float* y) {
  const float d = LoadF16(b);
  const float m = LoadF16(b + 2);
  const uint32_t qh = LoadU32(b + 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < kQk / 2; ++j) {
    const uint32_t x0 = (qs[j] & 0x0F) | (((qh >> j) & 1u) << 4);
    const uint32_t x1 = (qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4);
    y[j] = static_cast<float>(x0) * d + m;
    y[j + kQk / 2] = static_cast<float>(x1) * d + m;
  }
}

void DequantQ8_0(const uint8_t* b, float* y) {
  const float d = LoadF16(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < kQk; ++j) y[j] = static_cast<float>(qs[j]) * d;
}

// Q8_1 carries s = d * sum(qs) for dot products; the values are qs * d.
void DequantQ8_1(const uint8_t* b, float* y) {
  const float d = LoadF16(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 4);
  for (int j = 0; j < kQk; ++j) y[j] = static_cast<float>(qs[j]) * d;
}

void DequantQ2_K(const uint8_t* b, float* y) {
  const uint8_t* scales = b;
  const uint8_t* q = b + 16;
  const float d = LoadF16(b + 16 + 64);
  const float dmin = LoadF16(b + 16 + 64 + 2);
  int is = 0;
  for (int n = 0; n < kQkK; n += 128) {
    int shift = 0;
    for (int j = 0; j < 4; ++j) {
      for (int half = 0; half < 2; ++half) {
        const uint8_t sc = scales[is++];
        const float dl = d * static_cast<float>(sc & 0x0F);
        const float ml = dmin * static_cast<float>(sc >> 4);
        for (int l = 0; l < 16; ++l) {
          *y++ = dl * static_cast<float>((q[l + 16 * half] >> shift) & 3) - ml;
        }
      }
      shift += 2;
    }
    q += 32;
  }
}

void DequantQ3_K(const uint8_t* b, float* y) {
  const uint8_t* hm = b;
  const uint8_t* q = b + 32;
  const uint8_t* packed = b + 32 + 64;
  const float d_all = LoadF16(b + 32 + 64 + 12);
  // 16 6-bit scales: low 4 bits in packed[0..7] (two per byte), high 2 bits in packed[8..11].
  int8_t scales[16];
  for (int i = 0; i < 16; ++i) {
    const int low = (i < 8) ? (packed[i] & 0x0F) : (packed[i - 8] >> 4);
    const int high = (packed[8 + (i % 4)] >> (2 * (i / 4))) & 3;
    scales[i] = static_cast<int8_t>((low | (high << 4)) - 32);
  }
  int is = 0;
  uint8_t m = 1;
  for (int n = 0; n < kQkK; n += 128) {
    int shift = 0;
    for (int j = 0; j < 4; ++j) {
      for (int half = 0; half < 2; ++half) {
        const float dl = d_all * static_cast<float>(scales[is++]);
        for (int l = 0; l < 16; ++l) {
          const int idx = l + 16 * half;
          const int v = ((q[idx] >> shift) & 3) - ((hm[idx] & m) ? 0 : 4);
          *y++ = dl * static_cast<float>(v);
        }
      }
      shift += 2;
      m = static_cast<uint8_t>(m << 1);
    }
    q += 32;
  }
}

// The 8 6-bit (scale, min) pairs of Q4_K/Q5_K packed into 12 bytes.
void ScaleMinK4(int j, const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = static_cast<uint8_t>((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4));
    *mn = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

void DequantQ4_K(const uint8_t* b, float* y) {
  const float d = LoadF16(b);
  const float dmin = LoadF16(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 4 + kKScaleBytes;
  int is = 0;
  for (int j = 0; j < kQkK; j += 64) {
    uint8_t sc, mn;
    ScaleMinK4(is, scales, &sc, &mn);
    const float d1 = d * sc, m1 = dmin * mn;
    ScaleMinK4(is + 1, scales, &sc, &mn);
    const float d2 = d * sc, m2 = dmin * mn;
    for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>(q[l] & 0x0F) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>(q[l] >> 4) - m2;
    q += 32;
    is += 2;
  }
}

void DequantQ5_K(const uint8_t* b, float* y) {
  const float d = LoadF16(b);
  const float dmin = LoadF16(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 4 + kKScaleBytes;
  const uint8_t* ql = qh + kQkK / 8;
  int is = 0;
  uint8_t u1 = 1, u2 = 2;
  for (int j = 0; j < kQkK; j += 64) {
    uint8_t sc, mn;
    ScaleMinK4(is, scales, &sc, &mn);
    const float d1 = d * sc, m1 = dmin * mn;
    ScaleMinK4(is + 1, scales, &sc, &mn);
    const float d2 = d * sc, m2 = dmin * mn;
    for (int l = 0; l < 32; ++l) {
      *y++ = d1 * static_cast<float>((ql[l] & 0x0F) + ((qh[l] & u1) ? 16 : 0)) - m1;
    }
    for (int l = 0; l < 32; ++l) {
      *y++ = d2 * static_cast<float>((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - m2;
    }
    ql += 32;
    is += 2;
    u1 = static_cast<uint8_t>(u1 << 2);
    u2 = static_cast<uint8_t>(u2 << 2);
  }
}

void DequantQ6_K(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + kQkK / 2;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + kQkK / 2 + kQkK / 4);
  const float d = LoadF16(b + kQkK / 2 + kQkK / 4 + kQkK / 16);
  for (int n = 0; n < kQkK; n += 128) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * static_cast<float>(sc[is + 0]) * static_cast<float>(q1);
      y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
      y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
      y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

void DequantQ8_K(const uint8_t* b, float* y) {
  float d;
  std::memcpy(&d, b, sizeof(d));
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 4);
  for (int j = 0; j < kQkK; ++j) y[j] = d * static_cast<float>(qs[j]);
}

}  // namespace

std::optional<GgmlType> GgmlTypeFromId(uint32_t id) {
  for (const TypeInfo& t : kTypes) {
    if (static_cast<uint32_t>(t.type) == id) return t.type;
  }
  return std::nullopt;
}

std::string_view GgmlTypeName(GgmlType type) {
  const TypeInfo* info = Info(type);
  return info ? info->name : std::string_view("UNKNOWN");
}

int64_t BlockElems(GgmlType type) {
  const TypeInfo* info = Info(type);
  return info ? info->block_elems : 0;
}

int64_t BlockBytes(GgmlType type) {
  const TypeInfo* info = Info(type);
  return info ? info->block_bytes : 0;
}

Result<int64_t> RowBytes(GgmlType type, int64_t n) {
  const TypeInfo* info = Info(type);
  if (info == nullptr) {
    return InvalidArgument("unknown ggml type id " + std::to_string(static_cast<uint32_t>(type)));
  }
  if (n < 0) return InvalidArgument("negative row length " + std::to_string(n));
  if (n % info->block_elems != 0) {
    return InvalidArgument("row length " + std::to_string(n) + " is not a multiple of the " +
                           std::string(info->name) + " block size " +
                           std::to_string(info->block_elems));
  }
  const int64_t blocks = n / info->block_elems;
  if (blocks > INT64_MAX / info->block_bytes) {
    return InvalidArgument("row of " + std::to_string(n) + " elements overflows");
  }
  return blocks * info->block_bytes;
}

bool CanDequantize(GgmlType type) {
  const TypeInfo* info = Info(type);
  return info != nullptr && info->dequantize;
}

void DequantizeRow(GgmlType type, const void* src, float* dst, int64_t n) {
  const uint8_t* s = static_cast<const uint8_t*>(src);
  switch (type) {
    case GgmlType::kF32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case GgmlType::kF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = Fp16ToFp32(LoadU16(s + 2 * i));
      return;
    case GgmlType::kBF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToFp32(LoadU16(s + 2 * i));
      return;
    default:
      break;
  }
  const TypeInfo* info = Info(type);
  if (info == nullptr || !info->dequantize) return;
  void (*fn)(const uint8_t*, float*) = nullptr;
  switch (type) {
    case GgmlType::kQ4_0:
      fn = DequantQ4_0;
      break;
    case GgmlType::kQ4_1:
      fn = DequantQ4_1;
      break;
    case GgmlType::kQ5_0:
      fn = DequantQ5_0;
      break;
    case GgmlType::kQ5_1:
      fn = DequantQ5_1;
      break;
    case GgmlType::kQ8_0:
      fn = DequantQ8_0;
      break;
    case GgmlType::kQ8_1:
      fn = DequantQ8_1;
      break;
    case GgmlType::kQ2_K:
      fn = DequantQ2_K;
      break;
    case GgmlType::kQ3_K:
      fn = DequantQ3_K;
      break;
    case GgmlType::kQ4_K:
      fn = DequantQ4_K;
      break;
    case GgmlType::kQ5_K:
      fn = DequantQ5_K;
      break;
    case GgmlType::kQ6_K:
      fn = DequantQ6_K;
      break;
    case GgmlType::kQ8_K:
      fn = DequantQ8_K;
      break;
    default:
      return;
  }
  const int64_t blocks = n / info->block_elems;
  for (int64_t i = 0; i < blocks; ++i) {
    fn(s + i * info->block_bytes, dst + i * info->block_elems);
  }
}

float Fp16ToFp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;  // signed zero
    } else {
      // Subnormal half: normalize into a float32 normal.
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      mant &= 0x3FFu;
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | (mant << 13);
    }
  } else if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);  // inf / nan (payload kept)
  } else {
    bits = sign | ((exp + (127 - 15)) << 23) | (mant << 13);
  }
  return std::bit_cast<float>(bits);
}

uint16_t Fp32ToFp16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t abs = x & 0x7FFFFFFFu;
  if (abs >= 0x7F800000u) {  // inf or nan
    return static_cast<uint16_t>(sign | 0x7C00u | (abs > 0x7F800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477FF000u) {  // rounds to >= 65520: overflow to inf
    return static_cast<uint16_t>(sign | 0x7C00u);
  }
  const int32_t exp = static_cast<int32_t>(abs >> 23) - 127;
  if (exp < -14) {
    // Subnormal (or zero) half: value = mant * 2^-24. Shift with round-to-nearest-even.
    if (exp < -25) return sign;  // below half the smallest subnormal: rounds to zero
    const uint32_t mant = (abs & 0x7FFFFFu) | 0x800000u;  // 24-bit significand, value m*2^(exp-23)
    const int shift = -exp - 1;  // m * 2^(exp-23) / 2^-24 = m >> (-1 - exp)
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  // Normal: drop 13 mantissa bits with round-to-nearest-even; a carry into the
  // exponent is correct (it rounds up to the next binade).
  uint32_t h = ((static_cast<uint32_t>(exp + 15)) << 10) | ((abs >> 13) & 0x3FFu);
  const uint32_t rem = abs & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

float Bf16ToFp32(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

uint16_t Fp32ToBf16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) {
    return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet nan
  }
  const uint32_t rounding = 0x7FFFu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

}  // namespace kvrelay::engine
