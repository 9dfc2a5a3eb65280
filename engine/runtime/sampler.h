// Token sampling: penalties, temperature, top-k / top-p / min-p, seeded RNG,
// and stop conditions (max tokens, stop strings, end-of-generation tokens).
//
// SamplingParams is THE sampling description of a request everywhere: the
// coordinator's API parsing fills it, the local backend hands it to the
// engine, the cluster protocol carries it (protocols/sampling_codec.h) and
// the CUDA sampler maps it (engine/cuda/cuda_sampler.h). Do not copy it into
// another struct.
//
// A Sampler belongs to one request and is not thread-safe. With the same
// SamplingParams (seed included) and the same logits it draws the same tokens
// on every run and platform (std::mt19937_64 and our own uniform mapping).
#pragma once

#include <cstdint>
#include <memory>
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
  // OpenAI logit_bias: (token id, bias in [-100, 100]) added to the raw logit
  // before the penalties. Ids must be inside the vocabulary (the engine
  // refuses a request whose ids are not).
  std::vector<std::pair<int32_t, float>> logit_bias;
  // -1: no logprobs. 0..kMaxTopLogprobs: each sampled token comes with its
  // log-probability and this many most likely alternatives (TokenLogprobs).
  int logprobs = -1;
  // Constrained decoding: a JSON schema (text) the output must match, "" for
  // none. Compiled by the engine against its vocabulary (engine/grammar/).
  std::string json_schema;

  // InvalidArgument naming the field when a value is out of range.
  Status Validate() const;
};

inline constexpr int kMaxTopLogprobs = 20;

// A per-request restriction of the tokens that may come next (constrained
// decoding, engine/grammar/). The Sampler masks the logits with it after the
// bias and penalties and tells it the token drawn.
class TokenConstraint {
 public:
  virtual ~TokenConstraint() = default;
  // Sets the logits of the tokens not allowed now to -infinity.
  virtual void Mask(float* logits, int64_t vocab) = 0;
  // Advances past `token` (sampled here, or the first token sampled by the
  // prefill side). An error when the token is not allowed.
  virtual Status Accept(int32_t token) = 0;
  // The constrained output is complete: the request should end.
  virtual bool Complete() const = 0;
};

// The log-probabilities of one sampled token, from the distribution the
// sampler drew from: log_softmax of the logits after logit_bias, penalties
// and any token mask, at the request's temperature (1 when greedy), before
// the top-k / top-p / min-p truncation (vLLM's "processed_logprobs").
struct TokenLogprobs {
  float logprob = 0.0f;                        // of the sampled token
  std::vector<std::pair<int32_t, float>> top;  // the most likely tokens, best first
};

// One pick a compute backend makes itself (the CUDA table samples on the
// device and copies back a token instead of the logit row), with Sampler's
// semantics: greedy (first maximum) when temperature <= 0; otherwise the
// top_k candidates (1..kMaxBackendTopK; logit descending, ties by smaller
// id), softmax at temperature in double, min-p, top-p, and the pick by
// `uniform`, the request RNG's draw (Sampler::NextPickForBackend).
struct BackendPick {
  float temperature = 0.0f;
  int top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  double uniform = 0.0;
};
inline constexpr int kMaxBackendTopK = 1024;

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);

  // Whether a backend may make this request's next pick (BackendPick): no
  // logit bias, penalties, grammar or logprobs, and a top_k in
  // [1, kMaxBackendTopK] and <= vocab when sampling at a temperature.
  bool BackendCanPick(int64_t vocab) const;
  // The next pick for a backend. Draws from the request's RNG exactly what
  // Sample would (one uniform at a temperature, none when greedy), so the
  // seeded sequence of picks is the same wherever each is made.
  BackendPick NextPickForBackend();

  // Picks the next token from `logits` (vocab floats; modified in place by
  // penalties and filtering). `context` is every token so far (prompt then
  // generated); `n_generated` of them at the end were generated.
  // When `logprobs` is not null and params().logprobs >= 0, fills it for the
  // token returned.
  int32_t Sample(float* logits, int64_t vocab, const std::vector<int32_t>& context,
                 int64_t n_generated, TokenLogprobs* logprobs = nullptr);

  const SamplingParams& params() const { return params_; }

  // Installs the request's constraint (params().json_schema compiled by the
  // engine); applied by every Sample from now on. May be null.
  void SetConstraint(std::unique_ptr<TokenConstraint> c) { constraint_ = std::move(c); }
  TokenConstraint* constraint() const { return constraint_.get(); }

 private:
  double NextUniform();  // [0, 1)
  int32_t Pick(const float* logits, int64_t vocab);
  void FillLogprobs(const float* logits, int64_t vocab, int32_t token, TokenLogprobs* out) const;

  SamplingParams params_;
  std::unique_ptr<TokenConstraint> constraint_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> candidates_;  // scratch
};

}  // namespace kvrelay::engine
