// Kernel micro-benchmarks on the shapes of the default model (SmolLM2-135M:
// d_model 576, kv 192, ffn 1536, vocab 49152) with random weights:
//   kvrelay_bench_kernels [--benchmark_filter=...]
// BM_MatMul/<type>/<rows>/<cols>/<tokens>/<threads>/<path>. Counters: bytes of
// weights read per second and multiply-adds per second.
#include <benchmark/benchmark.h>

#include <cstring>
#include <memory>
#include <random>
#include <span>
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

// Prefill attention of one KV head of SmolLM2 (3 query heads, head size 64,
// 16-position blocks): the last 96 prompt tokens of a prompt of C positions,
// row by row (AttendRowGgml, tiled = 0) or in tiles of 16 tokens x 3 heads
// (AttendTileGgml, tiled = 1), as forward.cc issues them. Same bits; CPU time
// of the one thread (a fair A/B on a shared machine).
// BM_AttendPrefill/<path>/<C>/<tiled>; counter: (row, key) pairs per second.
void BM_AttendPrefill(benchmark::State& state, KernelPath path) {
  if (!KernelPathSupported(path)) {
    state.SkipWithError("path not supported on this CPU");
    return;
  }
  const int64_t ctx = state.range(0);
  const bool tiled = state.range(1) != 0;
  const int hd = 64, B = 16, group = 3;
  const int64_t tokens = 96, tile_tokens = 16;
  std::mt19937 rng(3);
  std::normal_distribution<float> g;
  std::vector<float> k(ctx * hd), v(ctx * hd), q(tokens * group * hd), out(tokens * group * hd);
  for (float& x : k) x = g(rng);
  for (float& x : v) x = g(rng);
  for (float& x : q) x = g(rng);
  std::vector<const float*> kb, vb;
  for (int64_t b = 0; b * B < ctx; ++b) {
    kb.push_back(k.data() + b * B * hd);
    vb.push_back(v.data() + b * B * hd);
  }
  std::vector<AttendTileRow> rows;
  int64_t pairs = 0;
  for (int64_t i = 0; i < tokens; ++i) {
    const int64_t pos = ctx - tokens + i;
    for (int h = 0; h < group; ++h) {
      const int64_t r = static_cast<int64_t>(rows.size());
      rows.push_back({q.data() + r * hd, out.data() + r * hd, 0, pos + 1});
      pairs += pos + 1;
    }
  }
  std::vector<float> scratch(AttendTileScratchFloats(tile_tokens * group, ctx, hd));
  std::vector<float> scores(ctx), acc(8 * hd);
  for (auto _ : state) {
    if (tiled) {
      for (int64_t r0 = 0; r0 < static_cast<int64_t>(rows.size()); r0 += tile_tokens * group) {
        AttendTileGgml(std::span<const AttendTileRow>(rows.data() + r0, tile_tokens * group),
                       kb.data(), vb.data(), B, hd, 0.125f, scratch.data(), path);
      }
    } else {
      for (const AttendTileRow& r : rows) {
        AttendRowGgml(r.q, kb.data(), vb.data(), B, hd, r.j0, r.j1, 0.125f, false, scores.data(),
                      acc.data(), r.out, path);
      }
    }
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["pairs"] =
      benchmark::Counter(static_cast<double>(pairs), benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK_CAPTURE(BM_AttendPrefill, avx512, KernelPath::kAvx512)
    ->ArgsProduct({{512, 2048, 4096}, {0, 1}})
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_AttendPrefill, avx2, KernelPath::kAvx2)
    ->ArgsProduct({{512, 4096}, {0, 1}})
    ->Unit(benchmark::kMillisecond);

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
