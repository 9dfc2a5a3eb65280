#include "engine/runtime/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>

namespace kvrelay::engine {
namespace {

std::vector<float> Logits() { return {1.0f, 3.0f, 2.0f, 3.0f, -1.0f, 0.5f}; }

TEST(SamplerTest, GreedyPicksFirstMaximum) {
  Sampler s(SamplingParams{});
  auto l = Logits();
  EXPECT_EQ(s.Sample(l.data(), 6, {}, 0), 1);  // tie 1 vs 3: lowest id
}

TEST(SamplerTest, RepetitionPenaltyDividesPositiveAndMultipliesNegative) {
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  Sampler s(p);
  auto l = Logits();
  // Context holds token 1 (logit 3 -> 1.5) and token 4 (-1 -> -2).
  EXPECT_EQ(s.Sample(l.data(), 6, {1, 4, 1}, 0), 3);
  EXPECT_FLOAT_EQ(l[1], 1.5f);
  EXPECT_FLOAT_EQ(l[4], -2.0f);
  EXPECT_FLOAT_EQ(l[3], 3.0f);
}

TEST(SamplerTest, PresenceAndFrequencyPenaltiesCountGeneratedTokensOnly) {
  SamplingParams p;
  p.presence_penalty = 0.5f;
  p.frequency_penalty = 0.25f;
  Sampler s(p);
  auto l = Logits();
  // Prompt {3}, generated {1, 1, 2}: only the last 3 count.
  s.Sample(l.data(), 6, {3, 1, 1, 2}, 3);
  EXPECT_FLOAT_EQ(l[1], 3.0f - 0.5f - 0.5f);
  EXPECT_FLOAT_EQ(l[2], 2.0f - 0.5f - 0.25f);
  EXPECT_FLOAT_EQ(l[3], 3.0f);
}

TEST(SamplerTest, SeedReproducibleAndDistributionFollowsSoftmax) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 1234;
  std::map<int32_t, int> counts;
  Sampler a(p), b(p);
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    auto la = Logits(), lb = Logits();
    const int32_t ta = a.Sample(la.data(), 6, {}, 0);
    ASSERT_EQ(ta, b.Sample(lb.data(), 6, {}, 0));
    ++counts[ta];
  }
  // Expected frequency softmax(l); 5 sigma binomial bound per token.
  auto l = Logits();
  double z = 0;
  for (float v : l) z += std::exp(v);
  for (int t = 0; t < 6; ++t) {
    const double prob = std::exp(l[t]) / z;
    const double sigma = std::sqrt(n * prob * (1 - prob));
    EXPECT_NEAR(counts[t], n * prob, 5 * sigma + 1) << "token " << t;
  }
}

TEST(SamplerTest, TopKTopPMinPRestrictTheSupport) {
  auto support = [](SamplingParams p) {
    p.temperature = 1.0f;
    std::map<int32_t, int> seen;
    Sampler s(p);
    for (int i = 0; i < 3000; ++i) {
      auto l = Logits();
      ++seen[s.Sample(l.data(), 6, {}, 0)];
    }
    std::vector<int32_t> ids;
    for (auto& [id, c] : seen) ids.push_back(id);
    return ids;
  };
  SamplingParams k;
  k.top_k = 3;  // logits 3, 3, 2
  EXPECT_EQ(support(k), (std::vector<int32_t>{1, 2, 3}));
  // softmax: p(3)=0.368 each for ids 1,3; 0.135 for id 2; top_p 0.7 needs ids 1 and 3.
  SamplingParams tp;
  tp.top_p = 0.7f;
  EXPECT_EQ(support(tp), (std::vector<int32_t>{1, 3}));
  // min_p 0.3: keep p >= 0.3 * p_max, i.e. logit >= 3 + ln 0.3 = 1.80: ids 1, 2, 3.
  SamplingParams mp;
  mp.min_p = 0.3f;
  EXPECT_EQ(support(mp), (std::vector<int32_t>{1, 2, 3}));
}

TEST(SamplerTest, ValidateNamesTheField) {
  SamplingParams p;
  p.top_p = 1.5f;
  Status st = p.Validate();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("top_p"), std::string::npos);
  p = {};
  p.max_tokens = 0;
  EXPECT_NE(p.Validate().message().find("max_tokens"), std::string::npos);
}

// #18: logit_bias is added to the raw logit before anything else.
TEST(SamplerTest, LogitBiasMovesTheArgmaxAndCanBanAToken) {
  SamplingParams p;
  p.logit_bias = {{1, -100.0f}, {3, -100.0f}, {5, 4.0f}};
  Sampler s(p);
  auto l = Logits();
  EXPECT_EQ(s.Sample(l.data(), 6, {}, 0), 5);  // 0.5 + 4 beats 2
  SamplingParams ban;
  ban.temperature = 1.0f;
  ban.seed = 3;
  ban.logit_bias = {{1, -100.0f}, {3, -100.0f}};
  Sampler t(ban);
  for (int i = 0; i < 200; ++i) {
    auto m = Logits();
    const int32_t tok = t.Sample(m.data(), 6, {}, 0);
    EXPECT_NE(tok, 1);
    EXPECT_NE(tok, 3);
  }
  SamplingParams bad;
  bad.logit_bias = {{2, 100.5f}};
  EXPECT_FALSE(bad.Validate().ok());
}

// #18: logprobs are log_softmax(logits after bias and penalties, at the
// temperature) for the sampled token and the top alternatives, best first.
TEST(SamplerTest, LogprobsComeFromTheSamplingDistribution) {
  for (float temperature : {0.0f, 0.7f}) {
    SamplingParams p;
    p.temperature = temperature;
    p.top_k = 2;  // truncation does not change the reported distribution
    p.logprobs = 3;
    p.logit_bias = {{5, 1.0f}};
    Sampler s(p);
    auto l = Logits();
    TokenLogprobs lp;
    const int32_t tok = s.Sample(l.data(), 6, {}, 0, &lp);
    std::vector<double> biased = {1.0, 3.0, 2.0, 3.0, -1.0, 1.5};
    const double t = temperature > 0 ? temperature : 1.0;
    double z = 0;
    for (double x : biased) z += std::exp(x / t);
    auto expect = [&](int id) { return biased[id] / t - std::log(z); };
    EXPECT_NEAR(lp.logprob, expect(tok), 1e-5);
    ASSERT_EQ(lp.top.size(), 3u);
    EXPECT_EQ(lp.top[0].first, 1);  // ties by id
    EXPECT_EQ(lp.top[1].first, 3);
    EXPECT_EQ(lp.top[2].first, 2);
    for (const auto& [id, v] : lp.top) EXPECT_NEAR(v, expect(id), 1e-5);
  }
  SamplingParams off;
  Sampler s(off);
  auto l = Logits();
  TokenLogprobs lp;
  lp.logprob = 42.0f;
  s.Sample(l.data(), 6, {}, 0, &lp);
  EXPECT_EQ(lp.logprob, 42.0f);  // not asked for: untouched
}

}  // namespace
}  // namespace kvrelay::engine
