#include "engine/kernels/matmul.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <span>
#include <string>
#include <vector>

#include "engine/kernels/kernel_table.h"
#include "engine/kernels/kquant.h"
#include "engine/kernels/ops.h"

namespace kvrelay::engine {
namespace {

using kernels::KernelTable;
using kernels::QuantizedActs;

bool CpuHasAvx2() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

// AVX-512 needs the CPU flags and the OS's consent: XCR0 bits 1-2 (SSE, AVX
// state) and 5-7 (opmask, upper zmm halves, zmm16-31) set, so a kernel or VM
// that does not save the zmm state never reaches those instructions.
bool CpuHasAvx512Vnni() {
#if defined(__x86_64__)
  if (!CpuHasAvx2()) return false;
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512dq") ||
      !__builtin_cpu_supports("avx512vnni")) {
    return false;
  }
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(1), "c"(0));
  if ((ecx & (1u << 27)) == 0) return false;  // OSXSAVE: XGETBV is usable
  unsigned lo = 0, hi = 0;
  __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  constexpr unsigned kZmmState = (1u << 1) | (1u << 2) | (1u << 5) | (1u << 6) | (1u << 7);
  return (lo & kZmmState) == kZmmState;
#else
  return false;
#endif
}

KernelPath ResolveOnce() {
  const char* env = std::getenv("KVRELAY_KERNELS");
  if (env != nullptr) {
    const std::string v(env);
    if (v == "scalar") return KernelPath::kScalar;
    if (v == "avx2" && CpuHasAvx2()) return KernelPath::kAvx2;
    if (v == "avx512" && CpuHasAvx512Vnni()) return KernelPath::kAvx512;
  }
  if (CpuHasAvx512Vnni()) return KernelPath::kAvx512;
  return CpuHasAvx2() ? KernelPath::kAvx2 : KernelPath::kScalar;
}

const KernelTable& Table(KernelPath path) {
  if (path == KernelPath::kAuto) path = ResolvedKernelPath();
  if (path == KernelPath::kAvx512 && KernelPathSupported(KernelPath::kAvx512)) {
    return kernels::Avx512Kernels();
  }
  if ((path == KernelPath::kAvx2 || path == KernelPath::kAvx512) &&
      KernelPathSupported(KernelPath::kAvx2)) {
    return kernels::Avx2Kernels();
  }
  return kernels::ScalarKernels();
}

// Per-thread scratch that only grows; bounded by the largest call's needs.
struct Scratch {
  std::vector<int8_t> q;
  std::vector<float> d, s, f;
  std::vector<float> kd;  // Q8_K activations (own vectors: d and s grow together)
  std::vector<int16_t> bsums;
  // The pair layout of QuantizedActs (AVX-512 batched tiles); qp is used
  // from a 64-byte aligned offset so each pair block is one cache line.
  std::vector<int8_t> qp;
  std::vector<float> dt, st;
};
Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

void RunParallel(ThreadPool* pool, int64_t n, int64_t grain,
                 const std::function<void(int64_t, int64_t, int)>& fn) {
  if (pool != nullptr && pool->num_threads() > 1) {
    pool->ParallelFor(n, fn, grain);
  } else if (n > 0) {
    fn(0, n, 0);
  }
}

// Tokens per cache tile: the quantized activations of one tile (~cols bytes
// per token) should sit in L2 next to the thread's weight rows.
int64_t TokenTile(int64_t cols) {
  const int64_t t = (128 * 1024) / (cols + cols / 4);
  return std::max<int64_t>(4, t & ~int64_t{3});
}

// Rows per work unit handed to a thread: a multiple of the micro-tiles.
constexpr int64_t kRowUnit = 8;
// Below this many multiply-adds a call runs on the calling thread alone: the
// wake-up of a second thread would cost more than it saves.
constexpr int64_t kMinParallelMacs = 32 * 1024;

// One quantized product of a MatMulShared group.
struct QuantJob {
  const GgufTensor* w;
  kernels::GemmQFn gemm;
  int64_t row_bytes;
  float* y;
  int64_t first_unit;  // units of all jobs are numbered consecutively
};

// The K-quant kernels of the same instruction-set path as `k`. `k` came from
// Table(), which checked CPUID (and XGETBV for AVX-512), and that covers what
// the matching K-quant table needs. Chosen by k.isa, never by comparing with
// another path's getter: Avx512Kernels() itself runs AVX-512 code (SIGILL on
// an AVX2-only CPU).
const kernels::KQuantKernels& KQuant(const KernelTable& k) {
  switch (k.isa) {
    case kernels::Isa::kAvx512:
      return kernels::Avx512KQuantKernels();
    case kernels::Isa::kAvx2:
      return kernels::Avx2KQuantKernels();
    case kernels::Isa::kScalar:
      break;
  }
  return kernels::ScalarKQuantKernels();
}

kernels::GemmQFn QuantGemm(const KernelTable& k, GgmlType type) {
  switch (type) {
    case GgmlType::kQ5_0:
      return KQuant(k).gemm_q5_0;
    case GgmlType::kQ4_0:
      return k.gemm_q4_0;
    case GgmlType::kQ4_1:
      return k.gemm_q4_1;
    case GgmlType::kQ8_0:
      return k.gemm_q8_0;
    default:
      return nullptr;
  }
}

// Quantizes x once and runs every job in one parallel section. All jobs'
// weights have `cols` columns and a type QuantGemm accepts.
void MatMulQuantized(const KernelTable& k, std::span<QuantJob> jobs, int64_t cols, const float* x,
                     int64_t n_tokens, ThreadPool* pool) {
  const int64_t nb = cols / kernels::kBlock;
  Scratch& scratch = ThreadScratch();
  if (static_cast<int64_t>(scratch.q.size()) < n_tokens * cols) scratch.q.resize(n_tokens * cols);
  if (static_cast<int64_t>(scratch.d.size()) < n_tokens * nb) {
    scratch.d.resize(n_tokens * nb);
    scratch.s.resize(n_tokens * nb);
  }
  QuantizedActs acts{scratch.q.data(), scratch.d.data(), scratch.s.data(), nb};
  if ((k.pair_layout || k.token_major_scales) && n_tokens >= 2) {
    // Pairs of tokens (the last one padded), and a token stride for dt / st
    // with room for an 8-token vector load at any even token of the batch.
    const int64_t pairs = (n_tokens + 1) / 2;
    const int64_t ldt = (n_tokens + 7) / 8 * 8 + 8;
    if (static_cast<int64_t>(scratch.dt.size()) < nb * ldt) {
      scratch.dt.resize(nb * ldt);
      scratch.st.resize(nb * ldt);
    }
    acts.dt = scratch.dt.data();
    acts.st = scratch.st.data();
    acts.ldt = ldt;
    if (k.pair_layout) {
      const size_t qp_bytes = static_cast<size_t>(pairs * nb * 64);
      if (scratch.qp.size() < qp_bytes + 64) scratch.qp.resize(qp_bytes + 64);
      const uintptr_t base = reinterpret_cast<uintptr_t>(scratch.qp.data());
      acts.qp = scratch.qp.data() + ((64 - base % 64) % 64);
      // Padding entries are zero (quantize writes only real tokens).
      if (n_tokens % 2 != 0) std::memset(acts.qp + (pairs - 1) * nb * 64, 0, nb * 64);
    }
    for (int64_t b = 0; b < nb; ++b) {
      std::fill(acts.dt + b * ldt + n_tokens, acts.dt + (b + 1) * ldt, 0.0f);
      std::fill(acts.st + b * ldt + n_tokens, acts.st + (b + 1) * ldt, 0.0f);
    }
  }
  int64_t units = 0;
  int64_t total_rows = 0;
  for (QuantJob& job : jobs) {
    job.first_unit = units;
    units += (job.w->Rows() + kRowUnit - 1) / kRowUnit;
    total_rows += job.w->Rows();
  }
  ThreadPool* use_pool = total_rows * cols * n_tokens >= kMinParallelMacs ? pool : nullptr;

  if (n_tokens >= 8) {
    RunParallel(use_pool, n_tokens, 4,
                [&](int64_t t0, int64_t t1, int) { k.quantize(x, cols, t0, t1, acts); });
  } else {
    k.quantize(x, cols, 0, n_tokens, acts);
  }
  const int64_t tile = TokenTile(cols);
  RunParallel(use_pool, units, 1, [&](int64_t u0, int64_t u1, int) {
    for (int64_t t0 = 0; t0 < n_tokens; t0 += tile) {
      const int64_t t1 = std::min(n_tokens, t0 + tile);
      for (const QuantJob& job : jobs) {
        const int64_t rows = job.w->Rows();
        const int64_t ju1 = job.first_unit + (rows + kRowUnit - 1) / kRowUnit;
        const int64_t a = std::max(u0, job.first_unit);
        const int64_t b = std::min(u1, ju1);
        if (a >= b) continue;
        const int64_t r0 = (a - job.first_unit) * kRowUnit;
        const int64_t r1 = std::min(rows, (b - job.first_unit) * kRowUnit);
        job.gemm(job.w->data, job.row_bytes, r0, r1, acts, t0, t1, job.y, rows);
      }
    }
  });
}

// Q4_K / Q6_K in place: x quantized once to Q8_K (kquant.h), then rows split
// over the pool as in MatMulQuantized.
void MatMulQ8K(const KernelTable& k, const GgufTensor& w, const float* x, int64_t n_tokens,
               float* y, ThreadPool* pool) {
  const kernels::KQuantKernels& kq = KQuant(k);
  const kernels::GemmQ8KFn gemm = w.type == GgmlType::kQ4_K ? kq.gemm_q4_k : kq.gemm_q6_k;
  const int64_t cols = w.Cols(), rows = w.Rows();
  const int64_t nb = cols / kernels::kBlockK;
  const int64_t row_bytes = RowBytes(w.type, cols).value();
  Scratch& scratch = ThreadScratch();
  if (static_cast<int64_t>(scratch.q.size()) < n_tokens * cols) scratch.q.resize(n_tokens * cols);
  if (static_cast<int64_t>(scratch.kd.size()) < n_tokens * nb) scratch.kd.resize(n_tokens * nb);
  if (static_cast<int64_t>(scratch.bsums.size()) < n_tokens * nb * 16) {
    scratch.bsums.resize(n_tokens * nb * 16);
  }
  const kernels::Q8KActs acts{scratch.q.data(), scratch.kd.data(), scratch.bsums.data(), nb};
  ThreadPool* use_pool = rows * cols * n_tokens >= kMinParallelMacs ? pool : nullptr;
  if (n_tokens >= 8) {
    RunParallel(use_pool, n_tokens, 4,
                [&](int64_t t0, int64_t t1, int) { kq.quantize_q8k(x, cols, t0, t1, acts); });
  } else {
    kq.quantize_q8k(x, cols, 0, n_tokens, acts);
  }
  const int64_t tile = TokenTile(cols);
  // Batches go to threads in units of 16 rows: the AVX-512 kernels' register
  // tile (one row per zmm lane; smaller pieces take its slower AVX2 tail).
  const int64_t unit = n_tokens >= 4 ? 2 * kRowUnit : kRowUnit;
  const int64_t units = (rows + unit - 1) / unit;
  RunParallel(use_pool, units, 1, [&](int64_t u0, int64_t u1, int) {
    const int64_t r0 = u0 * unit, r1 = std::min(rows, u1 * unit);
    for (int64_t t0 = 0; t0 < n_tokens; t0 += tile) {
      gemm(w.data, row_bytes, r0, r1, acts, t0, std::min(n_tokens, t0 + tile), y, rows);
    }
  });
}

void MatMulFloat(const KernelTable& k, const GgufTensor& w, const float* x, int64_t n_tokens,
                 float* y, ThreadPool* pool) {
  const int64_t cols = w.Cols();
  const int64_t rows = w.Rows();
  ThreadPool* use_pool = rows * cols * n_tokens >= kMinParallelMacs ? pool : nullptr;
  const int64_t units = (rows + kRowUnit - 1) / kRowUnit;
  const bool direct = w.type == GgmlType::kF32 || w.type == GgmlType::kF16;
  const int64_t row_bytes = direct ? 0 : RowBytes(w.type, cols).value();
  RunParallel(use_pool, units, 1, [&](int64_t u0, int64_t u1, int) {
    const int64_t r0 = u0 * kRowUnit;
    const int64_t r1 = std::min(rows, u1 * kRowUnit);
    if (w.type == GgmlType::kF32) {
      k.gemm_f32(reinterpret_cast<const float*>(w.data) + r0 * cols, cols, r1 - r0, x, cols,
                 n_tokens, y + r0, rows);
    } else if (w.type == GgmlType::kF16) {
      k.gemm_f16(reinterpret_cast<const uint16_t*>(w.data) + r0 * cols, cols, r1 - r0, x, cols,
                 n_tokens, y + r0, rows);
    } else {
      // Dequantize-to-tile fallback: kRowUnit rows at a time, reused by every token.
      std::vector<float>& buf = ThreadScratch().f;
      buf.resize(kRowUnit * cols);
      for (int64_t r = r0; r < r1; r += kRowUnit) {
        const int64_t nr = std::min(kRowUnit, r1 - r);
        for (int64_t i = 0; i < nr; ++i) {
          DequantizeRow(w.type, w.data + (r + i) * row_bytes, buf.data() + i * cols, cols);
        }
        k.gemm_f32(buf.data(), cols, nr, x, cols, n_tokens, y + r, rows);
      }
    }
  });
}

}  // namespace

bool KernelPathSupported(KernelPath path) {
  static const bool avx2 = CpuHasAvx2();
  static const bool avx512 = CpuHasAvx512Vnni();
  switch (path) {
    case KernelPath::kAuto:
    case KernelPath::kScalar:
      return true;
    case KernelPath::kAvx2:
      return avx2;
    case KernelPath::kAvx512:
      return avx512;
  }
  return false;
}

KernelPath ResolvedKernelPath() {
  static const KernelPath path = ResolveOnce();
  return path;
}

std::string_view KernelPathName(KernelPath path) {
  switch (path) {
    case KernelPath::kAuto:
      return "auto";
    case KernelPath::kScalar:
      return "scalar";
    case KernelPath::kAvx2:
      return "avx2";
    case KernelPath::kAvx512:
      return "avx512";
  }
  return "unknown";
}

bool MatMulQuantizesActivations(GgmlType type) {
  return type == GgmlType::kQ4_0 || type == GgmlType::kQ4_1 || type == GgmlType::kQ8_0 ||
         type == GgmlType::kQ5_0;
}

int MatMulActivationBlock(GgmlType type) {
  if (MatMulQuantizesActivations(type)) return 32;
  if (type == GgmlType::kQ4_K || type == GgmlType::kQ6_K) return 256;
  return 0;
}

void MatMulReference(const GgufTensor& w, const float* x, int64_t n_tokens, float* y) {
  const int64_t cols = w.Cols();
  const int64_t rows = w.Rows();
  const int64_t row_bytes = RowBytes(w.type, cols).value();
  std::vector<float> buf(cols);
  for (int64_t r = 0; r < rows; ++r) {
    DequantizeRow(w.type, w.data + r * row_bytes, buf.data(), cols);
    for (int64_t t = 0; t < n_tokens; ++t) {
      const float* xt = x + t * cols;
      double acc = 0;
      for (int64_t c = 0; c < cols; ++c) acc += static_cast<double>(buf[c]) * xt[c];
      y[t * rows + r] = static_cast<float>(acc);
    }
  }
}

void MatMulWithPath(const GgufTensor& w, const float* x, int64_t n_tokens, float* y,
                    ThreadPool* pool, KernelPath path) {
  if (n_tokens <= 0 || w.Rows() <= 0) return;
  const KernelTable& k = Table(path);
  if (kernels::GemmQFn gemm = QuantGemm(k, w.type)) {
    QuantJob job{&w, gemm, RowBytes(w.type, w.Cols()).value(), y, 0};
    return MatMulQuantized(k, std::span<QuantJob>(&job, 1), w.Cols(), x, n_tokens, pool);
  }
  if (w.type == GgmlType::kQ4_K || w.type == GgmlType::kQ6_K) {
    return MatMulQ8K(k, w, x, n_tokens, y, pool);
  }
  MatMulFloat(k, w, x, n_tokens, y, pool);
}

void MatMulShared(std::span<const GgufTensor* const> ws, const float* x, int64_t n_tokens,
                  std::span<float* const> ys, ThreadPool* pool) {
  if (n_tokens <= 0 || ws.empty()) return;
  const KernelTable& k = Table(KernelPath::kAuto);
  QuantJob jobs[8];
  size_t n_jobs = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    kernels::GemmQFn gemm = QuantGemm(k, ws[i]->type);
    if (gemm != nullptr && n_jobs < std::size(jobs) && ws[i]->Rows() > 0) {
      jobs[n_jobs++] = {ws[i], gemm, RowBytes(ws[i]->type, ws[i]->Cols()).value(), ys[i], 0};
    } else {
      MatMulWithPath(*ws[i], x, n_tokens, ys[i], pool, KernelPath::kAuto);
    }
  }
  if (n_jobs > 0) {
    MatMulQuantized(k, std::span<QuantJob>(jobs, n_jobs), ws[0]->Cols(), x, n_tokens, pool);
  }
}

void MatMul(const GgufTensor& w, const float* x, int64_t n_tokens, float* y, ThreadPool* pool) {
  MatMulWithPath(w, x, n_tokens, y, pool, KernelPath::kAuto);
}

void GetRow(const GgufTensor& w, int64_t row, float* dst) {
  const int64_t cols = w.Cols();
  const int64_t row_bytes = RowBytes(w.type, cols).value();
  DequantizeRow(w.type, w.data + row * row_bytes, dst, cols);
}

}  // namespace kvrelay::engine
