// Token sampling: penalties, temperature, top-k / top-p / min-p, seeded RNG,
// and stop conditions (max tokens, stop strings, end-of-generation tokens).
//
// A Sampler belongs to one request and is not thread-safe. With the same
// SamplingParams (seed included) and the same logits it draws the same tokens
// on every run and platform (std::mt19937_64 and our own uniform mapping).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/status.h"

namespace kvrelay::engine {

struct SamplingParams {
  // 0 (or any value <= 0) means greedy: the argmax after penalties.
  float temperature = 0.0f;
  int top_k = 0;       // 0 = off
  float top_p = 1.0f;  // 1 = off; keeps the smallest prefix with mass >= top_p
  float min_p = 0.0f;  // 0 = off; drops tokens with p < min_p * p_max
  // llama.cpp semantics: a logit of a token seen in the context (prompt and
  // generated) is divided by the penalty when positive, multiplied when negative.
  float repetition_penalty = 1.0f;  // 1 = off
  float presence_penalty = 0.0f;    // subtracted once if the token was generated
  float frequency_penalty = 0.0f;   // subtracted per occurrence in the generated text
  uint64_t seed = 0;
  int max_tokens = 256;           // generated tokens, the first one included
  std::vector<std::string> stop;  // stop strings, matched on detokenized text
  bool ignore_eos = false;        // keep going past end-of-generation tokens
  // How far back repetition_penalty looks (tokens; 0 = whole context).
  int penalty_last_n = 64;

  // InvalidArgument naming the field when a value is out of range.
  Status Validate() const;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);

  // Picks the next token from `logits` (vocab floats; modified in place by
  // penalties and filtering). `context` is every token so far (prompt then
  // generated); `n_generated` of them at the end were generated.
  int32_t Sample(float* logits, int64_t vocab, const std::vector<int32_t>& context,
                 int64_t n_generated);

  const SamplingParams& params() const { return params_; }

 private:
  double NextUniform();  // [0, 1)

  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> candidates_;  // scratch
};

}  // namespace kvrelay::engine
