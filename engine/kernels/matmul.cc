#include "engine/kernels/matmul.h"

#include <vector>

namespace kvrelay::engine {

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

void MatMul(const GgufTensor& w, const float* x, int64_t n_tokens, float* y, ThreadPool* pool) {
  // Simple correct version: dequantize a row once, dot it with every token.
  const int64_t cols = w.Cols();
  const int64_t rows = w.Rows();
  const int64_t row_bytes = RowBytes(w.type, cols).value();
  auto work = [&](int64_t r0, int64_t r1, int) {
    std::vector<float> buf(cols);
    for (int64_t r = r0; r < r1; ++r) {
      DequantizeRow(w.type, w.data + r * row_bytes, buf.data(), cols);
      for (int64_t t = 0; t < n_tokens; ++t) {
        const float* xt = x + t * cols;
        float acc = 0;
        for (int64_t c = 0; c < cols; ++c) acc += buf[c] * xt[c];
        y[t * rows + r] = acc;
      }
    }
  };
  if (pool) {
    pool->ParallelFor(rows, work, 16);
  } else {
    work(0, rows, 0);
  }
}

void GetRow(const GgufTensor& w, int64_t row, float* dst) {
  const int64_t cols = w.Cols();
  const int64_t row_bytes = RowBytes(w.type, cols).value();
  DequantizeRow(w.type, w.data + row * row_bytes, dst, cols);
}

}  // namespace kvrelay::engine
