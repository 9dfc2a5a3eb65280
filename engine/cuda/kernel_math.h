// The per-element and per-block arithmetic of the CUDA kernels, as
// __host__ __device__ functions. The kernels (kernels.cu) call exactly these;
// tests/unit/cuda/ runs them on the CPU against the CPU engine's kernels
// (engine/kernels/) in the normal, GPU-less test run, so the only CUDA code no
// CPU test covers is the launch and reduction plumbing (tests/gpu/ does).
//
// Plain C++17 with no CUDA headers: g++ compiles it for the host tests, nvcc
// for the device. Every function is pure and reentrant.
#pragma once

#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define KVR_HD __host__ __device__ __forceinline__
#else
#include <cmath>
#define KVR_HD inline
#endif

namespace kvrelay::engine::cuda::math {

// ---- bits ----
KVR_HD uint32_t FloatBits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}
KVR_HD float BitsFloat(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}
KVR_HD float Fma(float a, float b, float c) {
#ifdef __CUDA_ARCH__
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
KVR_HD float Fabs(float x) { return x < 0.0f ? -x : x; }
KVR_HD float Fmax(float a, float b) { return a > b ? a : (b == b ? b : a); }

// Unaligned little-endian loads from weight blocks (ggml blocks are only
// 2-byte aligned: 18 / 20 / 34 bytes each).
KVR_HD uint16_t Load16(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | (static_cast<uint16_t>(p[1]) << 8));
}
// p must be 2-byte aligned on the device (every use is: block starts and
// their quant arrays sit at even offsets).
KVR_HD uint32_t Load32From16(const uint8_t* p) {
#ifdef __CUDA_ARCH__
  const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
  return static_cast<uint32_t>(h[0]) | (static_cast<uint32_t>(h[1]) << 16);
#else
  uint32_t u;
  std::memcpy(&u, p, 4);
  return u;
#endif
}

// IEEE binary16 -> float, exact (as quant_blocks.h HalfToFloat).
KVR_HD float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F;
  uint32_t mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {
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
  return BitsFloat(bits);
}

// float -> IEEE binary16, round to nearest even (as gguf Fp32ToFp16 and
// __float2half_rn for finite values; NaN becomes a quiet NaN).
KVR_HD uint16_t FloatToHalf(float f) {
  const uint32_t x = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t abs = x & 0x7FFFFFFFu;
  if (abs >= 0x7F800000u)
    return static_cast<uint16_t>(sign | 0x7C00u | (abs > 0x7F800000u ? 0x200u : 0u));
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);
  const int32_t exp = static_cast<int32_t>(abs >> 23) - 127;
  if (exp < -14) {
    if (exp < -25) return sign;
    const uint32_t mant = (abs & 0x7FFFFFu) | 0x800000u;
    const int shift = -exp - 1;
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  uint32_t h = (static_cast<uint32_t>(exp + 15) << 10) | ((abs >> 13) & 0x3FFu);
  const uint32_t rem = abs & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}
KVR_HD float RoundToHalf(float f) { return HalfToFloat(FloatToHalf(f)); }

// ---- element-wise ops (docs/ENGINE_NUMERICS.md: ggml's arithmetic) ----

// ggml_v_expf, operation for operation as ExpGgmlScalar in
// engine/kernels/ops.cc (so results are bit-identical to the CPU engine).
KVR_HD float ExpGgml(float x) {
  const float kShift = 0x1.8p23f, kInvLn2 = 0x1.715476p+0f, kLn2Hi = 0x1.62e4p-1f,
              kLn2Lo = 0x1.7f7d1cp-20f, kC0 = 0x1.ffffecp-1f, kC1 = 0x1.fffdb6p-2f,
              kC2 = 0x1.555e66p-3f, kC3 = 0x1.573e2ep-5f, kC4 = 0x1.0e4020p-7f;
  const float z = Fma(x, kInvLn2, kShift);
  const float n = z - kShift;
  const float r = Fma(-n, kLn2Lo, Fma(-n, kLn2Hi, x));
  const uint32_t e = FloatBits(z) << 23;
  const float k = BitsFloat(e + FloatBits(1.0f));
  const float r2 = r * r;
  const float p = Fma(Fma(Fma(kC4, r, kC3), r2, Fma(kC2, r, kC1)), r2, kC0 * r);
  if (!(Fabs(n) > 126.0f)) return Fma(p, k, k);
  const uint32_t g = n <= 0.0f ? 0x82000000u : 0u;
  const float s1 = BitsFloat(g + 0x7F000000u);
  const float s2 = BitsFloat(e - g);
  if (Fabs(n) > 192.0f) return s1 * s1;
  return Fma(s2, p, s2) * s1;
}

// silu(g) * u as engine SiluMul: element i of n uses ExpGgml when it lies in
// a whole group of 8 (i < n & ~7), libm-style expf for the tail.
KVR_HD float SiluMulElem(float g, float u, bool in_group_of_8) {
#ifdef __CUDA_ARCH__
  const float e = in_group_of_8 ? ExpGgml(-g) : expf(-g);
#else
  const float e = in_group_of_8 ? ExpGgml(-g) : std::exp(-g);
#endif
  return g / (1.0f + e) * u;
}

// gelu(g) * u as engine GeluTanhMulGgml (Gemma's GeGLU): ggml's fp16 table
// (gelu.h GeluTableGgml, uploaded) inside (-10, 10), 0 below, g above.
KVR_HD float GeluMulElem(float g, float u, const uint16_t* table) {
  if (g <= -10.0f) return 0.0f;
  if (g >= 10.0f) return g * u;
  return HalfToFloat(table[FloatToHalf(g)]) * u;
}

// Final-logit soft-capping as llama.cpp: scale by 1/cap, tanh, scale by cap.
KVR_HD float SoftcapElem(float v, float inv_cap, float cap) {
#ifdef __CUDA_ARCH__
  return tanhf(v * inv_cap) * cap;
#else
  return std::tanh(v * inv_cap) * cap;
#endif
}

// RMSNorm's scale from the double sum of float squares (RmsNormFast).
KVR_HD float RmsScale(double sum_squares, int64_t n, float eps) {
  const float mean = static_cast<float>(sum_squares / static_cast<double>(n));
#ifdef __CUDA_ARCH__
  return 1.0f / sqrtf(mean + eps);
#else
  return 1.0f / std::sqrt(mean + eps);
#endif
}
KVR_HD float RmsApply(float x, float scale, float w) { return (x * scale) * w; }

// RoPE angle of pair i at position pos: ggml_rope_cache_init's iterated float
// product theta_i = float(pos) * s^i, s = powf(base, -2 / rope_dim) computed
// once on the host (RopeThetaScale) so both sides use the same float.
KVR_HD float RopeTheta(int64_t pos, float theta_scale, int i) {
  float theta = static_cast<float>(pos);
  for (int k = 0; k < i; ++k) theta *= theta_scale;
  return theta;
}
// The pair rotation of RopeRotate (first product fused, second rounded).
KVR_HD void RopePair(float* x0, float* x1, float c, float s) {
  const float a = *x0, b = *x1;
  *x0 = Fma(a, c, -(b * s));
  *x1 = Fma(a, s, b * c);
}

// The key elements unit u of a head owns in the fused RoPE + KV write
// (kernels.cu RopeWriteKvKernel): units u < rope_dim / 2 are the rotated pair
// (e0, e1) of RopeTheta's index u; the rest are the unrotated tail element
// rope_dim + u - rope_dim / 2 (e1 = -1). hd - rope_dim / 2 units cover a head.
KVR_HD void RopeKvUnit(int u, int rope_dim, bool neox, int* e0, int* e1) {
  const int half = rope_dim / 2;
  if (u < half) {
    *e0 = neox ? u : 2 * u;
    *e1 = neox ? u + half : 2 * u + 1;
  } else {
    *e0 = rope_dim + u - half;
    *e1 = -1;
  }
}

// ---- activation quantization (quant_blocks.h QuantizedActs) ----
// For a block with absolute maximum amax: the per-element code and the two
// fp16-rounded floats, as the CPU's Quantize.
KVR_HD float Q8Inverse(float amax) { return amax != 0.0f ? 127.0f / amax : 0.0f; }
KVR_HD int8_t Q8Code(float x, float inv) {
#ifdef __CUDA_ARCH__
  return static_cast<int8_t>(__float2int_rn(x * inv));  // round half to even
#else
  return static_cast<int8_t>(static_cast<int>(std::nearbyint(x * inv)));
#endif
}
KVR_HD float Q8Scale(float amax) { return RoundToHalf(amax / 127.0f); }
KVR_HD float Q8Sum(float amax, int code_sum) {
  return RoundToHalf((amax / 127.0f) * static_cast<float>(code_sum));
}
// A whole block on one thread (the host tests; the device kernel spreads the
// 32 elements over a warp and reduces amax / code_sum with shuffles).
KVR_HD void QuantizeBlockQ8(const float* x, int8_t* q, float* d, float* s) {
  float amax = 0.0f;
  for (int j = 0; j < 32; ++j) amax = Fmax(amax, Fabs(x[j]));
  const float inv = Q8Inverse(amax);
  int sum = 0;
  for (int j = 0; j < 32; ++j) {
    q[j] = Q8Code(x[j], inv);
    sum += q[j];
  }
  *d = Q8Scale(amax);
  *s = Q8Sum(amax, sum);
}

// Type codes are ggml's (engine/gguf/ggml_type.h).
inline constexpr uint32_t kTypeF32 = 0, kTypeF16 = 1, kTypeQ4_0 = 2, kTypeQ4_1 = 3, kTypeQ8_0 = 8,
                          kTypeQ4_K = 12, kTypeQ6_K = 14;

// ---- weight blocks against int8 activations ----
// 4-way int8 dot with accumulate (dp4a on the device).
KVR_HD int Dp4a(uint32_t a, uint32_t b, int c) {
#ifdef __CUDA_ARCH__
  return __dp4a(static_cast<int>(a), static_cast<int>(b), c);
#else
  for (int k = 0; k < 4; ++k) {
    c += static_cast<int8_t>((a >> (8 * k)) & 0xFF) * static_cast<int8_t>((b >> (8 * k)) & 0xFF);
  }
  return c;
#endif
}
inline constexpr int kQ4_0Bytes = 18, kQ4_1Bytes = 20, kQ8_0Bytes = 34;

// sum_j u_j * xq_j over one 32-element nibble block (u: unsigned nibbles,
// byte j holds elements j and j + 16). xq is 4-byte aligned.
KVR_HD int NibbleDot(const uint8_t* qs, const int8_t* xq) {
  const uint32_t* x = reinterpret_cast<const uint32_t*>(xq);
  int acc = 0;
  for (int k = 0; k < 4; ++k) {
    const uint32_t v = Load32From16(qs + 4 * k);
    acc = Dp4a(v & 0x0F0F0F0Fu, x[k], acc);
    acc = Dp4a((v >> 4) & 0x0F0F0F0Fu, x[k + 4], acc);
  }
  return acc;
}
// One block's term of a row dot, as the CPU's GemmQ4 / GemmQ8_0:
//   Q4_0 / Q4_1: dw * dx * isum + m * sx    (Q4_0: m = -8 dw)
//   Q8_0:        dw * dx * isum
KVR_HD float BlockTermQ4_0(const uint8_t* blk, const int8_t* xq, float dx, float sx) {
  const float dw = HalfToFloat(Load16(blk));
  return dw * dx * static_cast<float>(NibbleDot(blk + 2, xq)) + (-8.0f * dw) * sx;
}
KVR_HD float BlockTermQ4_1(const uint8_t* blk, const int8_t* xq, float dx, float sx) {
  const float dw = HalfToFloat(Load16(blk));
  const float m = HalfToFloat(Load16(blk + 2));
  return dw * dx * static_cast<float>(NibbleDot(blk + 4, xq)) + m * sx;
}
KVR_HD float BlockTermQ8_0(const uint8_t* blk, const int8_t* xq, float dx) {
  const uint32_t* x = reinterpret_cast<const uint32_t*>(xq);
  int acc = 0;
  for (int k = 0; k < 8; ++k) acc = Dp4a(Load32From16(blk + 2 + 4 * k), x[k], acc);
  return HalfToFloat(Load16(blk)) * dx * static_cast<float>(acc);
}

// ---- mmvq: the decode GEMV's view of a weight block (kernels.cu MmvqKernel) ----
// Each 32-element block of a Q4_0 / Q4_1 / Q8_0 row is split over
// kMmvqParts = 2 threads. Part p holds four int8 quads of weights (Q4: the
// unsigned nibbles 0..15) loaded and unpacked once per step, then dotted with
// dp4a against the four activation ints (of the block's eight) they meet, for
// every token of the batch. A part's term is
//   fma(d * dx, isum_p, p == 0 ? m * sx : 0)
// with m = -8 d (Q4_0), the block min (Q4_1) or 0 (Q8_0), so the two parts
// sum to BlockTerm*'s value up to one float rounding (docs/gpu-numerics.md).
// The explicit Fma keeps the device's contraction choices out of the result.
inline constexpr int kMmvqParts = 2;
struct WeightPart {
  uint32_t w[4];  // int8 quads (Q4: nibbles in 0..15)
  float d;        // block scale
  float m;        // multiplies the activation block sum (part 0 only)
};

// Index (0..7) of the activation int that quad i of part `part` meets.
KVR_HD int MmvqActInt(uint32_t type, int part, int i) {
  if (type == kTypeQ8_0) return 4 * part + i;
  return 2 * part + (i >> 1) + 4 * (i & 1);  // nibble byte k holds elements k, k + 16
}

KVR_HD WeightPart LoadWeightPart(uint32_t type, const uint8_t* blk, int part) {
  WeightPart wp;
  wp.d = HalfToFloat(Load16(blk));
  if (type == kTypeQ8_0) {
    wp.m = 0.0f;
    for (int i = 0; i < 4; ++i) wp.w[i] = Load32From16(blk + 2 + 4 * (4 * part + i));
    return wp;
  }
  const uint8_t* qs = blk + 2;
  if (type == kTypeQ4_1) {
    wp.m = HalfToFloat(Load16(blk + 2));
    qs = blk + 4;
  } else {
    wp.m = -8.0f * wp.d;
  }
  for (int j = 0; j < 2; ++j) {
    const uint32_t v = Load32From16(qs + 4 * (2 * part + j));
    wp.w[2 * j] = v & 0x0F0F0F0Fu;
    wp.w[2 * j + 1] = (v >> 4) & 0x0F0F0F0Fu;
  }
  return wp;
}

// xa: the block's activation ints for this part, in quad order
// (xa[i] = activation int MmvqActInt(type, part, i)).
KVR_HD float PartTerm(const WeightPart& wp, const uint32_t* xa, float dx, float sx, int part) {
  int acc = 0;
  for (int i = 0; i < 4; ++i) acc = Dp4a(wp.w[i], xa[i], acc);
  return Fma(wp.d * dx, static_cast<float>(acc), part == 0 ? wp.m * sx : 0.0f);
}

// ---- element dequantization (embeddings, fp16 tiles for prefill, the
// float-activation path of K-quants) ----
inline constexpr int kQ4_KBytes = 144, kQ6_KBytes = 210;

// The 6-bit (scale, min) pair j of a Q4_K super-block's 12 scale bytes.
KVR_HD void ScaleMinK4(int j, const uint8_t* q, int* sc, int* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Element c of a row (row = first byte of the row) of the given type; the
// same float the CPU's DequantizeRow produces.
KVR_HD float DequantElem(uint32_t type, const uint8_t* row, int64_t c) {
  switch (type) {
    case kTypeF32: {
      uint32_t u = Load32From16(row + 4 * c);
      return BitsFloat(u);
    }
    case kTypeF16:
      return HalfToFloat(Load16(row + 2 * c));
    case kTypeQ4_0: {
      const uint8_t* b = row + (c / 32) * kQ4_0Bytes;
      const int j = static_cast<int>(c % 32);
      const int u = j < 16 ? (b[2 + j] & 0x0F) : (b[2 + j - 16] >> 4);
      return HalfToFloat(Load16(b)) * static_cast<float>(u - 8);
    }
    case kTypeQ4_1: {
      const uint8_t* b = row + (c / 32) * kQ4_1Bytes;
      const int j = static_cast<int>(c % 32);
      const int u = j < 16 ? (b[4 + j] & 0x0F) : (b[4 + j - 16] >> 4);
      return HalfToFloat(Load16(b)) * static_cast<float>(u) + HalfToFloat(Load16(b + 2));
    }
    case kTypeQ8_0: {
      const uint8_t* b = row + (c / 32) * kQ8_0Bytes;
      return HalfToFloat(Load16(b)) * static_cast<float>(static_cast<int8_t>(b[2 + c % 32]));
    }
    case kTypeQ4_K: {
      const uint8_t* b = row + (c / 256) * kQ4_KBytes;
      const int i = static_cast<int>(c % 256);
      const int chunk = i / 64, within = i % 64, hi = within / 32, l = within % 32;
      int sc, mn;
      ScaleMinK4(2 * chunk + hi, b + 4, &sc, &mn);
      const uint8_t q = b[16 + chunk * 32 + l];
      const int u = hi ? (q >> 4) : (q & 0x0F);
      const float d = HalfToFloat(Load16(b)), dmin = HalfToFloat(Load16(b + 2));
      return (d * static_cast<float>(sc)) * static_cast<float>(u) - dmin * static_cast<float>(mn);
    }
    case kTypeQ6_K: {
      const uint8_t* b = row + (c / 256) * kQ6_KBytes;
      const int i = static_cast<int>(c % 256);
      const int n = i / 128, r = i % 128, quarter = r / 32, l = r % 32;
      const uint8_t* ql = b + n * 64;
      const uint8_t* qh = b + 128 + n * 32;
      const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192) + n * 8;
      const float d = HalfToFloat(Load16(b + 208));
      int q;
      switch (quarter) {
        case 0:
          q = (ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4);
          break;
        case 1:
          q = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
          break;
        case 2:
          q = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
          break;
        default:
          q = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
          break;
      }
      const int is = l / 16 + 2 * quarter;
      return d * static_cast<float>(scales[is]) * static_cast<float>(q - 32);
    }
    default:
      return 0.0f;  // unreachable: the backend refuses other types at load
  }
}
KVR_HD bool DeviceSupportsType(uint32_t type) {
  return type == kTypeF32 || type == kTypeF16 || type == kTypeQ4_0 || type == kTypeQ4_1 ||
         type == kTypeQ8_0 || type == kTypeQ4_K || type == kTypeQ6_K;
}
// Types the GEMV multiplies in place against int8 activations (else float).
KVR_HD bool QuantizedActivationType(uint32_t type) {
  return type == kTypeQ4_0 || type == kTypeQ4_1 || type == kTypeQ8_0;
}

// ---- attention: online softmax over a split of positions ----
// A partial result over some positions: running max m, sum l of exp(s - m),
// and acc = sum exp(s - m) v (held by the caller). Merging b into a rescales
// both to the larger max; exp is expf (the GPU does not reproduce ggml's
// two-pass softmax, so attention agrees with the CPU to float rounding, not
// bit for bit; see the tolerance in scripts/gpu-check.sh).
struct SoftmaxState {
  float m;
  float l;
};
KVR_HD float Expf(float x) {
#ifdef __CUDA_ARCH__
  return expf(x);
#else
  return std::exp(x);
#endif
}
// Scale factors (for a's and b's accumulators) of the merged state.
KVR_HD SoftmaxState MergeSoftmax(SoftmaxState a, SoftmaxState b, float* scale_a, float* scale_b) {
  if (b.l == 0.0f) {
    *scale_a = 1.0f;
    *scale_b = 0.0f;
    return a;
  }
  if (a.l == 0.0f) {
    *scale_a = 0.0f;
    *scale_b = 1.0f;
    return b;
  }
  const float m = a.m > b.m ? a.m : b.m;
  *scale_a = Expf(a.m - m);
  *scale_b = Expf(b.m - m);
  return {m, a.l * *scale_a + b.l * *scale_b};
}
// Adds one position with score s to a state; *scale_acc rescales the old
// accumulator and *p weighs the new value row.
KVR_HD SoftmaxState PushSoftmax(SoftmaxState a, float s, float* scale_acc, float* p) {
  if (a.l == 0.0f) {
    *scale_acc = 0.0f;
    *p = 1.0f;
    return {s, 1.0f};
  }
  const float m = a.m > s ? a.m : s;
  *scale_acc = Expf(a.m - m);
  *p = Expf(s - m);
  return {m, a.l * *scale_acc + *p};
}

// ---- sampling (engine/runtime/sampler.cc, after penalties) ----
// Candidate order: logit descending, ties by smaller id.
KVR_HD bool CandidateBefore(float la, int32_t ia, float lb, int32_t ib) {
  return la != lb ? la > lb : ia < ib;
}
// The Sampler's choice among `keep` candidates already sorted by
// CandidateBefore (the top_k of them, or all), given the uniform u in [0, 1)
// the request's RNG drew: softmax at temperature in double, min-p, top-p,
// then the first candidate whose cumulative mass exceeds u * total. `probs`
// is scratch for keep doubles. Same double arithmetic as Sampler::Sample.
KVR_HD int32_t PickSorted(const float* logits, const int32_t* ids, int keep, float temperature,
                          float min_p, float top_p, double u, double* probs) {
  const double inv_t = 1.0 / temperature;
  const double mx = logits[0];
  double sum = 0;
  for (int i = 0; i < keep; ++i) {
#ifdef __CUDA_ARCH__
    probs[i] = exp((logits[i] - mx) * inv_t);
#else
    probs[i] = std::exp((logits[i] - mx) * inv_t);
#endif
    sum += probs[i];
  }
  for (int i = 0; i < keep; ++i) probs[i] /= sum;
  if (min_p > 0.0f) {
    const double floor = min_p * probs[0];
    int n = 1;
    while (n < keep && probs[n] >= floor) ++n;
    keep = n;
  }
  if (top_p < 1.0f) {
    double cum = 0;
    int n = 0;
    while (n < keep) {
      cum += probs[n++];
      if (cum >= top_p) break;
    }
    keep = n > 1 ? n : 1;
  }
  double total = 0;
  for (int i = 0; i < keep; ++i) total += probs[i];
  const double r = u * total;
  double cum = 0;
  for (int i = 0; i < keep; ++i) {
    cum += probs[i];
    if (r < cum) return ids[i];
  }
  return ids[keep - 1];
}

}  // namespace kvrelay::engine::cuda::math
