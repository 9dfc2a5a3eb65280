#include "engine/runtime/sampler.h"

#include <algorithm>
#include <cmath>
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
  return Status::Ok();
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {}

double Sampler::NextUniform() {
  // 53 random bits -> [0, 1), identical on every platform (unlike
  // std::uniform_real_distribution, whose algorithm is unspecified).
  return static_cast<double>(rng_() >> 11) * (1.0 / 9007199254740992.0);
}

int32_t Sampler::Sample(float* logits, int64_t vocab, const std::vector<int32_t>& context,
                        int64_t n_generated) {
  const SamplingParams& p = params_;
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
  return candidates_[keep - 1].second;
}

}  // namespace kvrelay::engine
