// engine::SamplingParams and engine::TokenLogprobs <-> their control-plane
// messages (control.proto). The one mapping: the coordinator encodes with it,
// the prefill and decode workers decode with it.
#pragma once

#include "engine/runtime/sampler.h"
#include "protocols/control.pb.h"

namespace kvrelay::protocols {

void ToProto(const engine::SamplingParams& s, proto::SamplingParams* out);
// Fields a peer left unset (0) take their "off" values (top_p 1,
// repetition_penalty 1).
engine::SamplingParams FromProto(const proto::SamplingParams& s);

void ToProto(const engine::TokenLogprobs& l, proto::TokenLogprob* out);
engine::TokenLogprobs FromProto(const proto::TokenLogprob& l);

}  // namespace kvrelay::protocols
