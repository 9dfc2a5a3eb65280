// Portable K-quant kernels (kquant.h): the fallback and the yardstick of the
// vector path. Integer sums are exact; the float steps use std::fma exactly
// where the vector path fuses, so both paths return the same bits.
#include <cmath>
#include <cstring>

#include "engine/gguf/ggml_type.h"
#include "engine/kernels/kquant.h"

namespace kvrelay::engine::kernels {
namespace {

float LoadHalfAt(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return HalfToFloat(h);
}

void QuantizeQ8K(const float* x, int64_t cols, int64_t t0, int64_t t1, const Q8KActs& a) {
  const int64_t nb = cols / kBlockK;
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + t * cols + b * kBlockK;
      int8_t* q = a.q + (t * nb + b) * kBlockK;
      int16_t* bs = a.bsums + (t * nb + b) * (kBlockK / 16);
      float max = 0, amax = 0;
      for (int j = 0; j < kBlockK; ++j) {
        const float ax = std::fabs(xb[j]);
        if (ax > amax) {
          amax = ax;
          max = xb[j];
        }
      }
      if (amax == 0.0f) {
        a.d[t * nb + b] = 0.0f;
        std::memset(q, 0, kBlockK);
        std::memset(bs, 0, sizeof(int16_t) * (kBlockK / 16));
        continue;
      }
      const float iscale = -127.0f / max;
      for (int j = 0; j < kBlockK; ++j) {
        // nearbyint: round half to even, as ggml's nearest_int (the 1.5 * 2^23 trick).
        const int v = static_cast<int>(std::nearbyint(iscale * xb[j]));
        q[j] = static_cast<int8_t>(v < 127 ? v : 127);
      }
      for (int s = 0; s < kBlockK / 16; ++s) {
        int sum = 0;
        for (int j = 0; j < 16; ++j) sum += q[s * 16 + j];
        bs[s] = static_cast<int16_t>(sum);
      }
      a.d[t * nb + b] = 1.0f / iscale;
    }
  }
}

constexpr int64_t kQ4KBytes = 4 + 12 + 128;
constexpr int64_t kQ6KBytes = 128 + 64 + 16 + 2;
constexpr int64_t kQ5_0Bytes = 2 + 4 + 16;

// Q4_K in llama.cpp's order for a prompt pass (ggml_gemm_q4_K_8x8_q8_K, the
// interleaved repack its CPU backend uses on AVX2): two float accumulators,
// one fma per 64 elements (a pair of sub-blocks) into each, subtracted at the
// end.
void GemmQ4K(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const Q8KActs& a,
             int64_t t0, int64_t t1, float* y, int64_t ldy) {
  const int64_t nb = a.nb;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    for (int64_t t = t0; t < t1; ++t) {
      float acc = 0, acc_min = 0;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * kQ4KBytes;
        uint8_t sc[8], mn[8];
        UnpackQ4KScales(blk + 4, sc, mn);
        const uint8_t* qs = blk + 16;
        const int8_t* xq = a.q + (t * nb + b) * kBlockK;
        const int16_t* bs = a.bsums + (t * nb + b) * (kBlockK / 16);
        const float dx = a.d[t * nb + b];
        const float dd = LoadHalfAt(blk) * dx, dm = LoadHalfAt(blk + 2) * dx;
        for (int j = 0; j < 4; ++j) {
          int lo = 0, hi = 0;
          for (int l = 0; l < 32; ++l) {
            lo += (qs[32 * j + l] & 0x0F) * xq[64 * j + l];
            hi += (qs[32 * j + l] >> 4) * xq[64 * j + 32 + l];
          }
          const int sumi = sc[2 * j] * lo + sc[2 * j + 1] * hi;
          const int summ = mn[2 * j] * (bs[4 * j] + bs[4 * j + 1]) +
                           mn[2 * j + 1] * (bs[4 * j + 2] + bs[4 * j + 3]);
          acc = std::fma(static_cast<float>(sumi), dd, acc);
          acc_min = std::fma(static_cast<float>(summ), dm, acc_min);
        }
      }
      y[t * ldy + r] = acc - acc_min;
    }
  }
}

// The 256 6-bit values (0..63) of a Q6_K block in element order.
void UnpackQ6K(const uint8_t* blk, uint8_t* v) {
  const uint8_t* ql = blk;
  const uint8_t* qh = blk + 128;
  for (int n = 0; n < 2; ++n) {
    for (int l = 0; l < 32; ++l) {
      v[128 * n + l] = static_cast<uint8_t>((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4));
      v[128 * n + l + 32] = static_cast<uint8_t>((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4));
      v[128 * n + l + 64] = static_cast<uint8_t>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
      v[128 * n + l + 96] = static_cast<uint8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
    }
    ql += 64;
    qh += 32;
  }
}

void GemmQ6K(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const Q8KActs& a,
             int64_t t0, int64_t t1, float* y, int64_t ldy) {
  const int64_t nb = a.nb;
  uint8_t v[kBlockK];
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    for (int64_t t = t0; t < t1; ++t) {
      float acc = 0;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * kQ6KBytes;
        UnpackQ6K(blk, v);
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        const int8_t* xq = a.q + (t * nb + b) * kBlockK;
        const int16_t* bs = a.bsums + (t * nb + b) * (kBlockK / 16);
        int sumi = 0;
        for (int s = 0; s < 16; ++s) {
          int dot = 0;
          for (int j = 0; j < 16; ++j) dot += v[16 * s + j] * xq[16 * s + j];
          sumi += sc[s] * (dot - 32 * bs[s]);
        }
        // llama.cpp's prompt-pass order (its tiled K-quant matmul): the
        // weight scale times the block sum first, then fused with dx.
        acc = std::fma(LoadHalfAt(blk + 208) * static_cast<float>(sumi), a.d[t * nb + b], acc);
      }
      y[t * ldy + r] = acc;
    }
  }
}

// Q5_0: the float sum runs in the 8 lanes of the AVX2 path (lane m holds
// elements 4m..4m+3 of every block) and is reduced in its order.
void GemmQ5_0(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const QuantizedActs& a,
              int64_t t0, int64_t t1, float* y, int64_t ldy) {
  const int64_t nb = a.nb;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    for (int64_t t = t0; t < t1; ++t) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * kQ5_0Bytes;
        uint32_t qh;
        std::memcpy(&qh, blk + 2, 4);
        const uint8_t* qs = blk + 6;
        const int8_t* xq = a.q + (t * nb + b) * kBlock;
        int v[32];
        for (int j = 0; j < 16; ++j) {
          v[j] = static_cast<int>((qs[j] & 0x0F) | (((qh >> j) & 1u) << 4)) - 16;
          v[j + 16] = static_cast<int>((qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4)) - 16;
        }
        const float d = LoadHalfAt(blk) * a.d[t * nb + b];
        for (int m = 0; m < 8; ++m) {
          int lane = 0;
          for (int j = 4 * m; j < 4 * m + 4; ++j) lane += v[j] * xq[j];
          acc[m] = std::fma(d, static_cast<float>(lane), acc[m]);
        }
      }
      y[t * ldy + r] =
          ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    }
  }
}

}  // namespace

const KQuantKernels& ScalarKQuantKernels() {
  static const KQuantKernels table = {"scalar", &QuantizeQ8K, &GemmQ4K, &GemmQ6K, &GemmQ5_0};
  return table;
}

}  // namespace kvrelay::engine::kernels
