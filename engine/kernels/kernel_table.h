// Internal to engine/kernels: one table of inner kernels per instruction-set
// path (portable scalar, AVX2, AVX-512 VNNI). matmul.cc owns threading and cache tiling and
// calls these on tiles; every entry is single-threaded and reentrant.
#pragma once

#include <cstdint>

#include "engine/kernels/quant_blocks.h"

namespace kvrelay::engine::kernels {

// Y[t * ldy + r] = dot(row r of W, token t of the activations) for rows
// [r0, r1) and tokens [t0, t1). W rows are `row_bytes` apart from `w`.
using GemmQFn = void (*)(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1,
                         const QuantizedActs& a, int64_t t0, int64_t t1, float* y, int64_t ldy);
// Same for float activations x ([t][cols], tokens [0, nt)) and rows [0, nr)
// of a float / fp16 weight matrix with leading dimension ldw (elements).
using GemmF32Fn = void (*)(const float* w, int64_t ldw, int64_t nr, const float* x, int64_t cols,
                           int64_t nt, float* y, int64_t ldy);
using GemmF16Fn = void (*)(const uint16_t* w, int64_t ldw, int64_t nr, const float* x, int64_t cols,
                           int64_t nt, float* y, int64_t ldy);
// Quantizes tokens [t0, t1) of x ([t][cols], cols % 32 == 0) into `a`.
using QuantizeFn = void (*)(const float* x, int64_t cols, int64_t t0, int64_t t1,
                            const QuantizedActs& a);

// Which instruction-set path a table belongs to, so that code choosing a
// matching table (matmul.cc's K-quant kernels) never has to call another
// path's getter: the AVX-512 one runs AVX-512 code to build its table.
enum class Isa : uint8_t { kScalar, kAvx2, kAvx512 };

struct KernelTable {
  const char* name;
  Isa isa;
  QuantizeFn quantize;
  GemmQFn gemm_q4_0;
  GemmQFn gemm_q4_1;
  GemmQFn gemm_q8_0;
  GemmF32Fn gemm_f32;
  GemmF16Fn gemm_f16;
  // True when quantize also fills QuantizedActs::dt / st (token-major
  // scales), resp. qp / dt / st (pair_layout), when they are non-null, and the
  // quantized products read them for batches of 2+ tokens.
  bool token_major_scales = false;
  bool pair_layout = false;
};

// Always available.
const KernelTable& ScalarKernels();
// Only call when the CPU supports AVX2, FMA and F16C (matmul.cc checks CPUID).
const KernelTable& Avx2Kernels();
// Only call when the CPU supports AVX-512 F/BW/VL/DQ/VNNI and the OS saves
// the zmm state (matmul.cc checks CPUID and XGETBV). Bit-identical to AVX2.
const KernelTable& Avx512Kernels();

}  // namespace kvrelay::engine::kernels
