// Byte layouts of the ggml block formats the fast kernels read directly, and the
// int8 activation format they multiply against. Internal to engine/kernels.
//
// Weight blocks (on disk, exactly as ggml writes them; 32 elements each):
//   Q4_0: fp16 d, 16 bytes of nibbles      value = d * (q - 8)
//   Q4_1: fp16 d, fp16 m, 16 bytes nibbles  value = d * q + m
//   Q8_0: fp16 d, 32 int8                  value = d * q
// Nibble order: byte j holds element j in its low nibble and element j+16 in
// its high nibble.
#pragma once

#include <cstdint>
#include <cstring>

namespace kvrelay::engine::kernels {

inline constexpr int kBlock = 32;

struct BlockQ4_0 {
  uint16_t d;
  uint8_t qs[16];
};
struct BlockQ4_1 {
  uint16_t d;
  uint16_t m;
  uint8_t qs[16];
};
struct BlockQ8_0 {
  uint16_t d;
  int8_t qs[32];
};
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ8_0) == 34);

// Activations quantized per block of 32 exactly as ggml's CPU backend quantizes
// them to Q8_0 / Q8_1 (kept in structure-of-arrays form): for token t, block b,
//   q[(t * nb + b) * 32 + j]  int8 in [-127, 127]: round-half-even(x_j * (127 / amax))
//   d[t * nb + b]             fp16(amax / 127), held as the float it decodes to
//   s[t * nb + b]             fp16((amax / 127) * sum_j q_j) (the Q8_1 block sum,
//                             used by Q4_0/Q4_1), also held as a float
// The multiplier is 127 / amax (not 1 / d) and d, s are rounded to fp16 because
// ggml stores them that way; matching it bit for bit keeps our logits on
// llama.cpp's (docs/ENGINE_NUMERICS.md). With d0 = amax / 127:
// |x_j - d0 q_j| <= d0 / 2 and |d - d0| <= 2^-11 d0, so
// |x_j - d q_j| <= d0 (1/2 + 127 * 2^-11) ~= 0.562 d0, and
// |s - d * sum_j q_j| <= 2^-10 d0 |sum_j q_j| (both fp16 roundings).
struct QuantizedActs {
  int8_t* q = nullptr;
  float* d = nullptr;
  float* s = nullptr;
  int64_t nb = 0;  // blocks per token
  // Optional copies in the layouts of the batched tiles (filled by the
  // quantize of a table with token_major_scales (dt, st) or pair_layout (all
  // three), when matmul.cc provides them; the values are the same numbers as
  // q / d / s, only placed differently):
  //   qp[((t / 2) * nb + b) * 64 + 8 i + 4 (t % 2) + k] = q[(t * nb + b) * 32 + 4 i + k]
  //     (i < 8, k < 4: the 4-byte groups of the two tokens of a pair interleaved,
  //     so one 512-bit vpdpbusd gives both tokens' 8 ggml lanes, interleaved)
  //   dt[b * ldt + t] = d[t * nb + b], st[b * ldt + t] = s[t * nb + b]
  //     (token-contiguous per block: one vector multiply scales 8 tokens)
  // Entries for padding tokens (t >= n_tokens, up to ldt) are zero.
  int8_t* qp = nullptr;
  float* dt = nullptr;
  float* st = nullptr;
  int64_t ldt = 0;
};

// IEEE half -> float, exact (no F16C needed).
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F;
  uint32_t mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mant & 0x3FF) << 13;
    }
  } else if (exp == 0x1F) {
    bits = sign | 0x7F800000u | mant << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

}  // namespace kvrelay::engine::kernels
