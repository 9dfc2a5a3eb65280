#include "engine/runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_map>

namespace kvrelay::engine {

Status SamplingParams::Validate() const {
  if (!std::isfinite(temperature)) return InvalidArgument("sampling.temperature must be finite");
  if (top_k < 0) return InvalidArgument("sampling.top_k must be >= 0");
  if (!(top_p > 0.0f && top_p <= 1.0f)) return InvalidArgument("sampling.top_p must be in (0, 1]");
  if (!(min_p >= 0.0f && min_p <= 1.0f)) return InvalidArgument("sampling.min_p must be in [0, 1]");
  if (!(repetition_penalty > 0.0f) || !std::isfinite(repetition_penalty)) {
    return InvalidArgument("sampling.repetition_penalty must be > 0");
  }
  if (!std::isfinite(presence_penalty) || !std::isfinite(frequency_penalty)) {
    return InvalidArgument("sampling.presence_penalty/frequency_penalty must be finite");
  }
  if (max_tokens < 1) return InvalidArgument("sampling.max_tokens must be >= 1");
  if (penalty_last_n < 0) return InvalidArgument("sampling.penalty_last_n must be >= 0");
  for (const std::string& s : stop) {
    if (s.empty()) return InvalidArgument("sampling.stop contains an empty string");
  }
  for (const auto& [token, bias] : logit_bias) {
    if (token < 0) return InvalidArgument("sampling.logit_bias has a negative token id");
    if (!(bias >= -100.0f && bias <= 100.0f)) {
      return InvalidArgument("sampling.logit_bias values must be in [-100, 100]");
    }
  }
  if (logprobs < -1 || logprobs > kMaxTopLogprobs) {
    return InvalidArgument("sampling.logprobs must be in [-1, " + std::to_string(kMaxTopLogprobs) +
                           "]");
  }
  return Status::Ok();
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {}

double Sampler::NextUniform() {
  // 53 random bits -> [0, 1), identical on every platform (unlike
  // std::uniform_real_distribution, whose algorithm is unspecified).
  return static_cast<double>(rng_() >> 11) * (1.0 / 9007199254740992.0);
}

bool Sampler::BackendCanPick(int64_t vocab) const {
  const SamplingParams& p = params_;
  if (constraint_ != nullptr || !p.logit_bias.empty() || p.repetition_penalty != 1.0f ||
      p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f || !p.json_schema.empty() ||
      p.logprobs >= 0) {
    return false;
  }
  return p.temperature <= 0.0f ||
         (p.top_k >= 1 && p.top_k <= kMaxBackendTopK && static_cast<int64_t>(p.top_k) <= vocab);
}

BackendPick Sampler::NextPickForBackend() {
  BackendPick b;
  b.temperature = params_.temperature;
  b.top_k = params_.top_k;
  b.top_p = params_.top_p;
  b.min_p = params_.min_p;
  if (params_.temperature > 0.0f) b.uniform = NextUniform();  // Pick draws exactly one
  return b;
}

int32_t Sampler::Sample(float* logits, int64_t vocab, const std::vector<int32_t>& context,
                        int64_t n_generated, TokenLogprobs* logprobs) {
  const SamplingParams& p = params_;
  for (const auto& [t, bias] : p.logit_bias) {
    if (t >= 0 && t < vocab) logits[t] += bias;
  }
  // Penalties.
  if (p.repetition_penalty != 1.0f) {
    const int64_t n = static_cast<int64_t>(context.size());
    const int64_t from = p.penalty_last_n > 0 ? std::max<int64_t>(0, n - p.penalty_last_n) : 0;
    std::vector<int32_t> seen(context.begin() + from, context.end());
    std::sort(seen.begin(), seen.end());
    seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
    for (int32_t t : seen) {
      if (t < 0 || t >= vocab) continue;
      logits[t] =
          logits[t] > 0 ? logits[t] / p.repetition_penalty : logits[t] * p.repetition_penalty;
    }
  }
  if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
    std::unordered_map<int32_t, int> counts;
    const int64_t n = static_cast<int64_t>(context.size());
    for (int64_t i = std::max<int64_t>(0, n - n_generated); i < n; ++i) ++counts[context[i]];
    for (const auto& [t, cnt] : counts) {
      if (t < 0 || t >= vocab) continue;
      logits[t] -= p.presence_penalty + p.frequency_penalty * static_cast<float>(cnt);
    }
  }
  if (constraint_ != nullptr) constraint_->Mask(logits, vocab);
  const int32_t token = Pick(logits, vocab);
  if (logprobs != nullptr && p.logprobs >= 0) FillLogprobs(logits, vocab, token, logprobs);
  if (constraint_ != nullptr) (void)constraint_->Accept(token);  // allowed: it passed the mask
  return token;
}

void Sampler::FillLogprobs(const float* logits, int64_t vocab, int32_t token,
                           TokenLogprobs* out) const {
  const double inv_t = params_.temperature > 0.0f ? 1.0 / params_.temperature : 1.0;
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < vocab; ++i) mx = std::max(mx, logits[i]);
  double sum = 0;
  for (int64_t i = 0; i < vocab; ++i)
    sum += std::exp((static_cast<double>(logits[i]) - mx) * inv_t);
  const double lse = std::log(sum);
  auto lp = [&](int32_t t) {
    return static_cast<float>((static_cast<double>(logits[t]) - mx) * inv_t - lse);
  };
  out->logprob = lp(token);
  out->top.clear();
  const int64_t k = std::min<int64_t>(params_.logprobs, vocab);
  if (k <= 0) return;
  std::vector<int32_t> ids(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) ids[i] = static_cast<int32_t>(i);
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  });
  for (int64_t i = 0; i < k; ++i) out->top.emplace_back(ids[i], lp(ids[i]));
}

int32_t Sampler::Pick(const float* logits, int64_t vocab) {
  const SamplingParams& p = params_;
  // Greedy: first index of the maximum (deterministic tie-break).
  if (p.temperature <= 0.0f) {
    int64_t best = 0;
    for (int64_t i = 1; i < vocab; ++i) {
      if (logits[i] > logits[best]) best = i;
    }
    return static_cast<int32_t>(best);
  }
  // Candidates sorted by logit (descending, ties by id).
  candidates_.clear();
  candidates_.reserve(vocab);
  for (int64_t i = 0; i < vocab; ++i) candidates_.emplace_back(logits[i], static_cast<int32_t>(i));
  auto by_logit = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  };
  size_t keep = candidates_.size();
  if (p.top_k > 0 && static_cast<size_t>(p.top_k) < keep) {
    keep = static_cast<size_t>(p.top_k);
    std::partial_sort(candidates_.begin(), candidates_.begin() + keep, candidates_.end(), by_logit);
    candidates_.resize(keep);
  } else {
    std::sort(candidates_.begin(), candidates_.end(), by_logit);
  }
  // Softmax at temperature.
  const double inv_t = 1.0 / p.temperature;
  const double mx = candidates_[0].first;
  std::vector<double> probs(keep);
  double sum = 0;
  for (size_t i = 0; i < keep; ++i) {
    probs[i] = std::exp((candidates_[i].first - mx) * inv_t);
    sum += probs[i];
  }
  for (double& q : probs) q /= sum;
  // min-p relative to the most likely token.
  if (p.min_p > 0.0f) {
    const double floor = p.min_p * probs[0];
    size_t n = 1;
    while (n < keep && probs[n] >= floor) ++n;
    keep = n;
  }
  // top-p: smallest prefix whose mass reaches top_p.
  if (p.top_p < 1.0f) {
    double cum = 0;
    size_t n = 0;
    while (n < keep) {
      cum += probs[n++];
      if (cum >= p.top_p) break;
    }
    keep = std::max<size_t>(n, 1);
  }
  double total = 0;
  for (size_t i = 0; i < keep; ++i) total += probs[i];
  const double r = NextUniform() * total;
  double cum = 0;
  for (size_t i = 0; i < keep; ++i) {
    cum += probs[i];
    if (r < cum) return candidates_[i].second;
  }
  // Rounding left r at the total: the last candidate with any mass (never a
  // masked-out one).
  size_t last = keep - 1;
  while (last > 0 && probs[last] <= 0) --last;
  return candidates_[last].second;
}

}  // namespace kvrelay::engine
