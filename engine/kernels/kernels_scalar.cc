// Portable scalar kernels: the fallback for CPUs without AVX2, and the
// yardstick the vector path is tested against. The same arithmetic as the AVX2
// path in the same order (its 8 float lanes, lane m holding elements
// 4m..4m+3 of every block, reduced as its Hsum; std::fma where it fuses), so
// both return the same bits (tests/unit/kernels/matmul_test.cc) and both are
// llama.cpp's (its AVX2 vec_dot / sgemm use those lanes too).
#include <cmath>
#include <cstring>

#include "engine/gguf/ggml_type.h"
#include "engine/kernels/kernel_table.h"

namespace kvrelay::engine::kernels {
namespace {

void Quantize(const float* x, int64_t cols, int64_t t0, int64_t t1, const QuantizedActs& a) {
  const int64_t nb = cols / kBlock;
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + t * cols + b * kBlock;
      float amax = 0;
      for (int j = 0; j < kBlock; ++j) amax = std::fmax(amax, std::fabs(xb[j]));
      // As ggml's quantize_row_q8_0/q8_1: multiplier 127 / amax, d and the
      // block sum stored as fp16 (quant_blocks.h).
      const float d = amax / 127.0f;
      const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
      int8_t* q = a.q + (t * nb + b) * kBlock;
      int sum = 0;
      for (int j = 0; j < kBlock; ++j) {
        // nearbyint: round half to even, like _mm256_round_ps in the AVX2 path.
        const int v = static_cast<int>(std::nearbyint(xb[j] * id));
        q[j] = static_cast<int8_t>(v);
        sum += v;
      }
      a.d[t * nb + b] = Fp16ToFp32(Fp32ToFp16(d));
      a.s[t * nb + b] = Fp16ToFp32(Fp32ToFp16(d * static_cast<float>(sum)));
    }
  }
}

// The AVX2 path's horizontal sum: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)).
float Hsum8(const float* a) {
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

// Q4_0 and Q4_1 share one kernel: with unsigned nibbles u, Q4_0 is
// d * u + (-8 d), so both are d * u + m and the m term becomes m * s
// (summed apart, fused, and added after the lanes, as the AVX2 tiles).
template <bool kHasMin>
void GemmQ4(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const QuantizedActs& a,
            int64_t t0, int64_t t1, float* y, int64_t ldy) {
  const int64_t nb = a.nb;
  constexpr int64_t kBytes = kHasMin ? sizeof(BlockQ4_1) : sizeof(BlockQ4_0);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    for (int64_t t = t0; t < t1; ++t) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      float ms = 0;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * kBytes;
        uint16_t dh;
        std::memcpy(&dh, blk, 2);
        const float dw = HalfToFloat(dh);
        float m;
        if constexpr (kHasMin) {
          uint16_t mh;
          std::memcpy(&mh, blk + 2, 2);
          m = HalfToFloat(mh);
        } else {
          m = -8.0f * dw;
        }
        const uint8_t* qs = blk + (kHasMin ? 4 : 2);
        const int8_t* xq = a.q + (t * nb + b) * kBlock;
        const float d = dw * a.d[t * nb + b];
        // Element j < 16 is the low nibble of qs[j], j >= 16 the high nibble of qs[j - 16].
        for (int lane = 0; lane < 8; ++lane) {
          int isum = 0;
          for (int j = 4 * lane; j < 4 * lane + 4; ++j) {
            const int u = j < 16 ? (qs[j] & 0x0F) : (qs[j - 16] >> 4);
            isum += u * xq[j];
          }
          acc[lane] = std::fma(static_cast<float>(isum), d, acc[lane]);
        }
        ms = std::fma(m, a.s[t * nb + b], ms);
      }
      y[t * ldy + r] = Hsum8(acc) + ms;
    }
  }
}

void GemmQ8_0(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const QuantizedActs& a,
              int64_t t0, int64_t t1, float* y, int64_t ldy) {
  const int64_t nb = a.nb;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    for (int64_t t = t0; t < t1; ++t) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * sizeof(BlockQ8_0);
        uint16_t dh;
        std::memcpy(&dh, blk, 2);
        const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 2);
        const int8_t* xq = a.q + (t * nb + b) * kBlock;
        const float d = HalfToFloat(dh) * a.d[t * nb + b];
        for (int lane = 0; lane < 8; ++lane) {
          int isum = 0;
          for (int j = 4 * lane; j < 4 * lane + 4; ++j) isum += qs[j] * xq[j];
          acc[lane] = std::fma(static_cast<float>(isum), d, acc[lane]);
        }
      }
      y[t * ldy + r] = Hsum8(acc);
    }
  }
}

void GemmF32(const float* w, int64_t ldw, int64_t nr, const float* x, int64_t cols, int64_t nt,
             float* y, int64_t ldy) {
  for (int64_t r = 0; r < nr; ++r) {
    for (int64_t t = 0; t < nt; ++t) {
      float acc = 0;
      for (int64_t c = 0; c < cols; ++c) acc += w[r * ldw + c] * x[t * cols + c];
      y[t * ldy + r] = acc;
    }
  }
}

void GemmF16(const uint16_t* w, int64_t ldw, int64_t nr, const float* x, int64_t cols, int64_t nt,
             float* y, int64_t ldy) {
  for (int64_t r = 0; r < nr; ++r) {
    for (int64_t t = 0; t < nt; ++t) {
      float acc = 0;
      for (int64_t c = 0; c < cols; ++c) acc += HalfToFloat(w[r * ldw + c]) * x[t * cols + c];
      y[t * ldy + r] = acc;
    }
  }
}

}  // namespace

const KernelTable& ScalarKernels() {
  static const KernelTable table = {"scalar",      Isa::kScalar, &Quantize, &GemmQ4<false>,
                                    &GemmQ4<true>, &GemmQ8_0,    &GemmF32,  &GemmF16};
  return table;
}

}  // namespace kvrelay::engine::kernels
