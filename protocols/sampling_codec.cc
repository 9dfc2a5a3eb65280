#include "protocols/sampling_codec.h"

#include <algorithm>

namespace kvrelay::protocols {

void ToProto(const engine::SamplingParams& s, proto::SamplingParams* out) {
  out->set_temperature(s.temperature);
  out->set_top_p(s.top_p);
  out->set_top_k(static_cast<uint32_t>(std::max(0, s.top_k)));
  out->set_seed(s.seed);
  out->set_max_tokens(static_cast<uint32_t>(std::max(0, s.max_tokens)));
  out->set_ignore_eos(s.ignore_eos);
  out->set_min_p(s.min_p);
  out->set_repetition_penalty(s.repetition_penalty);
  out->set_presence_penalty(s.presence_penalty);
  out->set_frequency_penalty(s.frequency_penalty);
  // penalty_last_n + 1 so that 0 on the wire means "unset" (the default 64).
  out->set_penalty_last_n_plus_1(static_cast<uint32_t>(std::max(0, s.penalty_last_n)) + 1);
  for (const std::string& stop : s.stop) out->add_stop(stop);
  for (const auto& [token, bias] : s.logit_bias) {
    out->add_logit_bias_token_ids(token);
    out->add_logit_bias_values(bias);
  }
  // logprobs + 1 so that 0 on the wire means "off" (-1).
  out->set_logprobs_plus_1(static_cast<uint32_t>(std::max(-1, s.logprobs) + 1));
  out->set_json_schema(s.json_schema);
}

engine::SamplingParams FromProto(const proto::SamplingParams& s) {
  engine::SamplingParams p;
  p.temperature = s.temperature();
  p.top_p = s.top_p() > 0 ? s.top_p() : 1.0f;
  p.top_k = static_cast<int>(s.top_k());
  p.seed = s.seed();
  p.max_tokens = static_cast<int>(s.max_tokens());
  p.ignore_eos = s.ignore_eos();
  p.min_p = s.min_p();
  p.repetition_penalty = s.repetition_penalty() > 0 ? s.repetition_penalty() : 1.0f;
  p.presence_penalty = s.presence_penalty();
  p.frequency_penalty = s.frequency_penalty();
  if (s.penalty_last_n_plus_1() > 0) {
    p.penalty_last_n = static_cast<int>(s.penalty_last_n_plus_1() - 1);
  }
  p.stop.assign(s.stop().begin(), s.stop().end());
  const int n = std::min(s.logit_bias_token_ids_size(), s.logit_bias_values_size());
  for (int i = 0; i < n; ++i) {
    p.logit_bias.emplace_back(s.logit_bias_token_ids(i), s.logit_bias_values(i));
  }
  p.logprobs = static_cast<int>(s.logprobs_plus_1()) - 1;
  p.json_schema = s.json_schema();
  return p;
}

void ToProto(const engine::TokenLogprobs& l, proto::TokenLogprob* out) {
  out->set_logprob(l.logprob);
  for (const auto& [token, lp] : l.top) {
    out->add_top_token_ids(token);
    out->add_top_logprobs(lp);
  }
}

engine::TokenLogprobs FromProto(const proto::TokenLogprob& l) {
  engine::TokenLogprobs out;
  out.logprob = l.logprob();
  const int n = std::min(l.top_token_ids_size(), l.top_logprobs_size());
  for (int i = 0; i < n; ++i) out.top.emplace_back(l.top_token_ids(i), l.top_logprobs(i));
  return out;
}

}  // namespace kvrelay::protocols
