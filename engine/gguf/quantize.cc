#include "engine/gguf/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace kvrelay::engine {
namespace {

constexpr int kQk = 32;

void StoreF16(uint8_t* p, float v) {
  const uint16_t h = Fp32ToFp16(v);
  std::memcpy(p, &h, sizeof(h));
}

// Rounds d to fp16, stores it, and returns the stored value's inverse (0 for d == 0).
float StoreScale(uint8_t* p, float d, float* stored) {
  StoreF16(p, d);
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  *stored = Fp16ToFp32(h);
  return *stored != 0.0f ? 1.0f / *stored : 0.0f;
}

int Clamp(int v, int lo, int hi) { return std::min(std::max(v, lo), hi); }

// The element of largest magnitude, keeping its sign (as ggml's Q4_0/Q5_0).
float SignedAbsMax(const float* x) {
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < kQk; ++j) {
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  return max;
}

// Q4_0 (bits=4) and Q5_0 (bits=5): symmetric, d = max / -2^(bits-1).
void QuantSymmetric(const float* x, uint8_t* b, int bits) {
  const int half = 1 << (bits - 1);
  float d;
  const float id = StoreScale(b, SignedAbsMax(x) / static_cast<float>(-half), &d);
  uint32_t qh = 0;
  uint8_t* qs = b + (bits == 5 ? 6 : 2);
  for (int j = 0; j < kQk / 2; ++j) {
    const int q0 = Clamp(static_cast<int>(std::floor(x[j] * id + half + 0.5f)), 0, 2 * half - 1);
    const int q1 =
        Clamp(static_cast<int>(std::floor(x[j + kQk / 2] * id + half + 0.5f)), 0, 2 * half - 1);
    qs[j] = static_cast<uint8_t>((q0 & 0x0F) | ((q1 & 0x0F) << 4));
    qh |= static_cast<uint32_t>((q0 >> 4) & 1) << j;
    qh |= static_cast<uint32_t>((q1 >> 4) & 1) << (j + kQk / 2);
  }
  if (bits == 5) std::memcpy(b + 2, &qh, sizeof(qh));
}

// Q4_1 (bits=4) and Q5_1 (bits=5): x ~ q * d + m with m = min(x).
void QuantAffine(const float* x, uint8_t* b, int bits) {
  const int levels = (1 << bits) - 1;
  float mn = x[0], mx = x[0];
  for (int j = 1; j < kQk; ++j) {
    mn = std::min(mn, x[j]);
    mx = std::max(mx, x[j]);
  }
  float d;
  const float id = StoreScale(b, (mx - mn) / static_cast<float>(levels), &d);
  float m;
  StoreScale(b + 2, mn, &m);
  uint32_t qh = 0;
  uint8_t* qs = b + (bits == 5 ? 8 : 4);
  for (int j = 0; j < kQk / 2; ++j) {
    const int q0 = Clamp(static_cast<int>(std::lround((x[j] - m) * id)), 0, levels);
    const int q1 = Clamp(static_cast<int>(std::lround((x[j + kQk / 2] - m) * id)), 0, levels);
    qs[j] = static_cast<uint8_t>((q0 & 0x0F) | ((q1 & 0x0F) << 4));
    qh |= static_cast<uint32_t>((q0 >> 4) & 1) << j;
    qh |= static_cast<uint32_t>((q1 >> 4) & 1) << (j + kQk / 2);
  }
  if (bits == 5) std::memcpy(b + 4, &qh, sizeof(qh));
}

// Q8_0 (with_sum=false) and Q8_1 (with_sum=true, s = d * sum(q) after d).
void Quant8(const float* x, uint8_t* b, bool with_sum) {
  float amax = 0.0f;
  for (int j = 0; j < kQk; ++j) amax = std::max(amax, std::fabs(x[j]));
  float d;
  const float id = StoreScale(b, amax / 127.0f, &d);
  int8_t* qs = reinterpret_cast<int8_t*>(b + (with_sum ? 4 : 2));
  int sum = 0;
  for (int j = 0; j < kQk; ++j) {
    qs[j] = static_cast<int8_t>(Clamp(static_cast<int>(std::lround(x[j] * id)), -127, 127));
    sum += qs[j];
  }
  if (with_sum) StoreF16(b + 2, d * static_cast<float>(sum));
}

}  // namespace

bool CanQuantizeForTest(GgmlType type) {
  switch (type) {
    case GgmlType::kF32:
    case GgmlType::kF16:
    case GgmlType::kBF16:
    case GgmlType::kQ4_0:
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1:
    case GgmlType::kQ8_0:
    case GgmlType::kQ8_1:
      return true;
    default:
      return false;
  }
}

std::vector<uint8_t> QuantizeRowForTest(GgmlType type, const float* x, int64_t n) {
  if (!CanQuantizeForTest(type)) return {};
  Result<int64_t> bytes = RowBytes(type, n);
  if (!bytes.ok()) return {};
  std::vector<uint8_t> out(static_cast<size_t>(*bytes));
  uint8_t* o = out.data();
  switch (type) {
    case GgmlType::kF32:
      std::memcpy(o, x, static_cast<size_t>(n) * sizeof(float));
      return out;
    case GgmlType::kF16:
    case GgmlType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = type == GgmlType::kF16 ? Fp32ToFp16(x[i]) : Fp32ToBf16(x[i]);
        std::memcpy(o + 2 * i, &h, sizeof(h));
      }
      return out;
    default:
      break;
  }
  const int64_t block_bytes = BlockBytes(type);
  for (int64_t i = 0; i < n / kQk; ++i) {
    const float* xb = x + i * kQk;
    uint8_t* b = o + i * block_bytes;
    switch (type) {
      case GgmlType::kQ4_0:
        QuantSymmetric(xb, b, 4);
        break;
      case GgmlType::kQ5_0:
        QuantSymmetric(xb, b, 5);
        break;
      case GgmlType::kQ4_1:
        QuantAffine(xb, b, 4);
        break;
      case GgmlType::kQ5_1:
        QuantAffine(xb, b, 5);
        break;
      case GgmlType::kQ8_0:
        Quant8(xb, b, false);
        break;
      case GgmlType::kQ8_1:
        Quant8(xb, b, true);
        break;
      default:
        break;
    }
  }
  return out;
}

}  // namespace kvrelay::engine
