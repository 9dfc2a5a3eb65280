// Element-wise ops against double-precision references.
#include "engine/kernels/ops.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

namespace kvrelay::engine {
namespace {

std::vector<float> Random(int64_t n, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = g(rng);
  return v;
}

TEST(Ops, RmsNormMatchesDoubleReference) {
  for (int64_t n : {1, 7, 64, 576, 1003}) {
    const auto x = Random(n, 3.0f, 1), w = Random(n, 1.0f, 2);
    std::vector<float> y(n);
    RmsNormFast(x.data(), w.data(), n, 1e-5f, y.data());
    double ss = 0;
    for (float v : x) ss += double(v) * v;
    const double scale = 1.0 / std::sqrt(ss / n + 1e-5);
    for (int64_t i = 0; i < n; ++i) {
      const double want = x[i] * scale * w[i];
      // float sum of squares (n * 2^-24 relative), scale and two products.
      EXPECT_NEAR(y[i], want, std::fabs(want) * (n + 8) * 6e-8 + 1e-30) << "n=" << n << " i=" << i;
    }
  }
}

TEST(Ops, RmsNormInPlace) {
  auto x = Random(100, 1.0f, 3);
  const auto w = Random(100, 1.0f, 4);
  std::vector<float> y(100);
  RmsNormFast(x.data(), w.data(), 100, 1e-5f, y.data());
  RmsNormFast(x.data(), w.data(), 100, 1e-5f, x.data());
  EXPECT_EQ(x, y);
}

TEST(Ops, SiluMulMatchesDoubleReference) {
  auto g = Random(1003, 4.0f, 5);
  g[0] = -100.0f;  // exp overflow side: silu -> -0
  g[1] = 100.0f;   // silu(g) -> g
  g[2] = 0.0f;
  const auto u = Random(1003, 1.0f, 6);
  std::vector<float> out(1003);
  SiluMul(g.data(), u.data(), 1003, out.data());
  for (int i = 0; i < 1003; ++i) {
    const double want = g[i] / (1.0 + std::exp(-double(g[i]))) * u[i];
    // exp polynomial ~2e-7 relative, plus four float roundings.
    EXPECT_NEAR(out[i], want, std::fabs(want) * 1e-6 + 1e-30) << "i=" << i << " g=" << g[i];
  }
}

TEST(Ops, AddInPlace) {
  std::vector<float> y = {1, 2, 3}, x = {0.5f, -2, 4};
  AddInPlace(y.data(), x.data(), 3);
  EXPECT_EQ(y, (std::vector<float>{1.5f, 0, 7}));
}

}  // namespace
}  // namespace kvrelay::engine
