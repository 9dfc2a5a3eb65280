// Kernel micro-benchmarks on the shapes of the default model (SmolLM2-135M:
// d_model 576, kv 192, ffn 1536, vocab 49152) with random weights:
//   kvrelay_bench_kernels [--benchmark_filter=...]
// BM_MatMul/<type>/<rows>/<cols>/<tokens>/<threads>/<path>. Counters: bytes of
// weights read per second and multiply-adds per second.
#include <benchmark/benchmark.h>

#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "common/thread_pool.h"
#include "engine/gguf/ggml_type.h"
#include "engine/kernels/matmul.h"
#include "engine/kernels/ops.h"

namespace kvrelay::engine {
namespace {

struct Matrix {
  std::vector<uint8_t> bytes;
  GgufTensor t;
};

Matrix MakeMatrix(GgmlType type, int64_t rows, int64_t cols) {
  Matrix m;
  const int64_t row_bytes = RowBytes(type, cols).value();
  m.bytes.resize(rows * row_bytes);
  std::mt19937 rng(7);
  for (auto& b : m.bytes) b = static_cast<uint8_t>(rng());
  const int64_t bb = BlockBytes(type);
  for (int64_t i = 0; i < static_cast<int64_t>(m.bytes.size()); i += bb) {
    const uint16_t h = Fp32ToFp16(0.01f);
    if (type == GgmlType::kF32) {
      const float v = 0.01f;
      std::memcpy(&m.bytes[i], &v, 4);
    } else {
      std::memcpy(&m.bytes[i], &h, 2);
      if (type == GgmlType::kQ4_1) std::memcpy(&m.bytes[i + 2], &h, 2);
    }
  }
  m.t.type = type;
  m.t.dims = {cols, rows};
  m.t.data = m.bytes.data();
  m.t.nbytes = m.bytes.size();
  return m;
}

void BM_MatMul(benchmark::State& state, GgmlType type, KernelPath path) {
  const int64_t rows = state.range(0), cols = state.range(1), tokens = state.range(2);
  const int threads = static_cast<int>(state.range(3));
  if (!KernelPathSupported(path)) {
    state.SkipWithError("path not supported on this CPU");
    return;
  }
  Matrix m = MakeMatrix(type, rows, cols);
  std::vector<float> x(tokens * cols), y(tokens * rows);
  std::mt19937 rng(1);
  std::normal_distribution<float> g;
  for (auto& v : x) v = g(rng);
  ThreadPool pool(threads, "bench");
  for (auto _ : state) {
    MatMulWithPath(m.t, x.data(), tokens, y.data(), &pool, path);
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["weight_GBps"] = benchmark::Counter(
      static_cast<double>(m.bytes.size()) * state.iterations() / 1e9, benchmark::Counter::kIsRate);
  state.counters["GMACps"] =
      benchmark::Counter(static_cast<double>(rows * cols * tokens) * state.iterations() / 1e9,
                         benchmark::Counter::kIsRate);
}

void Shapes(benchmark::internal::Benchmark* b) {
  // {rows, cols} of the layer matrices, decode (1 token), a small batch and prefill.
  for (auto rc : std::vector<std::pair<int, int>>{{576, 576}, {1536, 576}, {576, 1536}}) {
    for (int tokens : {1, 16, 64, 512}) {
      for (int threads : {1, 2}) b->Args({rc.first, rc.second, tokens, threads});
    }
  }
}

void LmHead(benchmark::internal::Benchmark* b) {
  for (int threads : {1, 2}) b->Args({49152, 576, 1, threads});
}

BENCHMARK_CAPTURE(BM_MatMul, q4_1_avx2, GgmlType::kQ4_1, KernelPath::kAvx2)
    ->Apply(Shapes)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_MatMul, q4_1_avx512, GgmlType::kQ4_1, KernelPath::kAvx512)
    ->Apply(Shapes)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_MatMul, q4_1_scalar, GgmlType::kQ4_1, KernelPath::kScalar)
    ->Args({576, 576, 1, 1})
    ->Args({576, 576, 16, 1})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_MatMul, q4_0_avx2, GgmlType::kQ4_0, KernelPath::kAvx2)
    ->Args({1536, 576, 1, 1})
    ->Args({1536, 576, 512, 1})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_MatMul, q8_0_avx2, GgmlType::kQ8_0, KernelPath::kAvx2)
    ->Apply(LmHead)
    ->Args({1536, 576, 512, 1})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_MatMul, q8_0_avx512, GgmlType::kQ8_0, KernelPath::kAvx512)
    ->Apply(LmHead)
    ->Args({1536, 576, 512, 1})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_MatMul, f32_avx2, GgmlType::kF32, KernelPath::kAvx2)
    ->Args({576, 576, 1, 1})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

void BM_SiluMul(benchmark::State& state) {
  std::vector<float> g(1536, 0.3f), u(1536, 1.1f), o(1536);
  for (auto _ : state) {
    SiluMul(g.data(), u.data(), 1536, o.data());
    benchmark::DoNotOptimize(o.data());
  }
}
BENCHMARK(BM_SiluMul);

}  // namespace
}  // namespace kvrelay::engine

BENCHMARK_MAIN();
