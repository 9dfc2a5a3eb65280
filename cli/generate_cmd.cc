// kvrelay generate: one prompt through the in-process engine, text streamed
// to stdout as it is generated (or one JSON object with --json).
#include <chrono>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "common/clock.h"
#include "common/flags.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/model.h"
#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/tokenizer.h"

namespace kvrelay::cli {
namespace {

using engine::Engine;
using engine::EngineOptions;
using engine::Model;
using engine::RequestSpec;

int Fail(const Status& st) {
  std::fprintf(stderr, "kvrelay generate: %s\n", st.ToString().c_str());
  return st.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

const FlagSpec kSpec = {
    "kvrelay generate",
    "One prompt through the in-process engine; the text is streamed to stdout, the statistics\n"
    "line goes to stderr (or one JSON object on stdout with --json).",
    "",
    0,
    {{"model", "", "GGUF model path (required)"},
     {"prompt", "", "prompt text (required)"},
     {"chat", "", "wrap the prompt in the model's chat template", true},
     {"no-special", "",
      "treat special-token text in --prompt (<|im_start|>, ...) as plain text; by default it is "
      "parsed into the special tokens, as llama.cpp does for a raw prompt",
      true},
     {"max-tokens", "128", "tokens to generate at most"},
     {"temperature", "0", "sampling temperature (0 = greedy)"},
     {"top-k", "0", "top-k sampling (0 = off)"},
     {"top-p", "1", "nucleus sampling"},
     {"min-p", "0", "min-p sampling"},
     {"seed", "0", "sampler seed"},
     {"repeat-penalty", "1", "repetition penalty"},
     {"stop", "", "a stop string"},
     {"threads", "0", "compute threads (0 = all cores)"},
     {"kv-dtype", "f32", "KV cache dtype: f32|f16|bf16|int8|kivi4|kivi2"},
     {"json", "", "print one JSON object (ids, text, timings) instead of the text", true}}};

int RunGenerate(const std::vector<std::string>& args) {
  int exit_code = 0;
  auto flags = ParseCommandFlags(args, kSpec, &exit_code);
  if (!flags) return exit_code;
  const Flags& f = *flags;
  if (!f.Has("model")) return Fail(InvalidArgument("--model is required"));
  if (!f.Has("prompt")) return Fail(InvalidArgument("--prompt is required"));
  auto max_tokens = f.GetInt("max-tokens", 128);
  auto temperature = f.GetDouble("temperature", 0.0);
  auto top_k = f.GetInt("top-k", 0);
  auto top_p = f.GetDouble("top-p", 1.0);
  auto min_p = f.GetDouble("min-p", 0.0);
  auto seed = f.GetInt("seed", 0);
  auto threads = f.GetInt("threads", 0);
  auto repeat = f.GetDouble("repeat-penalty", 1.0);
  for (const Status& st :
       {max_tokens.status(), temperature.status(), top_k.status(), top_p.status(), min_p.status(),
        seed.status(), threads.status(), repeat.status()}) {
    if (!st.ok()) return Fail(st);
  }
  auto dtype = engine::ParseKvDtype(f.Get("kv-dtype", "f32"));
  if (!dtype.ok()) return Fail(dtype.status());
  const bool json = f.Has("json");

  auto model = Model::Load(f.Get("model"));
  if (!model.ok()) return Fail(model.status());
  std::shared_ptr<const Model> m(std::move(model).value());
  const engine::Tokenizer& tok = *m->tokenizer();

  const std::string text = f.Get("prompt");
  // Special-token text in the user's prompt (<|im_start|>, ...) is parsed
  // into those tokens, as llama.cpp does, unless --no-special keeps it text.
  const bool user_special = !f.Has("no-special");
  RequestSpec spec;
  spec.id = 1;
  if (f.Has("chat") && m->chat_template() == nullptr) {
    return Fail(FailedPrecondition("--chat: the model has no supported chat template"));
  }
  if (f.Has("chat") && user_special) {
    auto rendered = m->chat_template()->Render({{"user", text}}, /*add_generation_prompt=*/true);
    if (!rendered.ok()) return Fail(rendered.status());
    spec.prompt = tok.Encode(*rendered, /*add_special=*/false, /*parse_special=*/true);
  } else if (f.Has("chat")) {
    // Render around a marker: the template's own special tokens are parsed,
    // the user's text stays text.
    const std::string marker = "\x01kvrelay-user-text\x01";
    auto rendered = m->chat_template()->Render({{"user", marker}}, /*add_generation_prompt=*/true);
    if (!rendered.ok()) return Fail(rendered.status());
    const size_t at = rendered->find(marker);
    if (at == std::string::npos) return Fail(Internal("the chat template dropped the prompt"));
    for (const auto& [part, special] : {std::pair<std::string, bool>{rendered->substr(0, at), true},
                                        {text, false},
                                        {rendered->substr(at + marker.size()), true}}) {
      std::vector<int32_t> ids = tok.Encode(part, /*add_special=*/false, special);
      spec.prompt.insert(spec.prompt.end(), ids.begin(), ids.end());
    }
  } else {
    spec.prompt = tok.Encode(text, /*add_special=*/true, user_special);
  }
  if (spec.prompt.empty()) return Fail(InvalidArgument("--prompt tokenizes to nothing"));
  spec.sampling.max_tokens = static_cast<int>(*max_tokens);
  spec.sampling.temperature = static_cast<float>(*temperature);
  spec.sampling.top_k = static_cast<int>(*top_k);
  spec.sampling.top_p = static_cast<float>(*top_p);
  spec.sampling.min_p = static_cast<float>(*min_p);
  spec.sampling.seed = static_cast<uint64_t>(*seed);
  spec.sampling.repetition_penalty = static_cast<float>(*repeat);
  if (f.Has("stop")) spec.sampling.stop = {f.Get("stop")};

  EngineOptions eo;
  eo.kv_dtype = *dtype;
  eo.threads = static_cast<int>(*threads);
  eo.max_running = 1;
  eo.max_context = std::min<int64_t>(m->config().context_length,
                                     static_cast<int64_t>(spec.prompt.size()) + *max_tokens + 16);
  // Just the KV this one request can use (plus a block of slack).
  eo.kv_capacity_bytes =
      static_cast<int64_t>(m->MakeKvLayout(*dtype, eo.block_tokens).BlockBytes() *
                           ((eo.max_context + eo.block_tokens - 1) / eo.block_tokens + 1));
  auto created = Engine::Create(eo, m);
  if (!created.ok()) return Fail(created.status());
  Engine& e = **created;
  const std::vector<int32_t> prompt_ids = spec.prompt;
  if (Status st = e.Submit(spec); !st.ok()) return Fail(st);

  const TimePoint start = Clock::now();
  double ttft_ms = -1;
  TimePoint first_token_at = start;
  std::vector<int32_t> out_ids;
  std::string out_text;
  std::string finish = "none";
  while (e.HasWork()) {
    auto events = e.Step();
    if (!events.ok()) return Fail(events.status());
    for (const auto& ev : *events) {
      if (ev.finish_reason == engine::FinishReason::kError) return Fail(ev.error);
      if (ev.token >= 0) {
        if (out_ids.empty()) {
          first_token_at = Clock::now();
          ttft_ms = SecondsSince(start) * 1e3;
        }
        out_ids.push_back(ev.token);
      }
      out_text += ev.text;
      if (!json) {
        std::fwrite(ev.text.data(), 1, ev.text.size(), stdout);
        std::fflush(stdout);
      }
      if (ev.finished) finish = std::string(engine::FinishReasonName(ev.finish_reason));
    }
  }
  const double decode_s = SecondsSince(first_token_at);
  const double decode_tps =
      out_ids.size() > 1 && decode_s > 0 ? (out_ids.size() - 1) / decode_s : 0.0;
  // What the request held at most, in whole pool blocks of every KV cache
  // group (a sliding-window group holds only its window: the one-group rate
  // of bytes per token times the length overstates a grouped cache).
  int64_t kv_bytes = 0;
  for (int64_t blocks : e.stats().peak_group_blocks) {
    kv_bytes += blocks * e.pool()->layout().BlockBytes();
  }
  if (json) {
    nlohmann::json j;
    j["prompt_ids"] = prompt_ids;
    j["token_ids"] = out_ids;
    j["text"] = out_text;
    j["ttft_ms"] = ttft_ms;
    j["decode_tokens_per_s"] = decode_tps;
    j["kv_bytes"] = kv_bytes;
    j["finish_reason"] = finish;
    std::cout << j.dump() << std::endl;
  } else {
    // The text's line is ended and flushed before the statistics go to
    // stderr, so with both on one terminal or file (2>&1) the statistics are
    // on a line of their own.
    std::fputs("\n", stdout);
    std::fflush(stdout);
    std::fprintf(stderr, "[%zu prompt tokens, %zu generated, ttft %.1f ms, %.1f tokens/s, %s]\n",
                 prompt_ids.size(), out_ids.size(), ttft_ms, decode_tps, finish.c_str());
  }
  return 0;
}

}  // namespace

KVRELAY_COMMAND(generate, "generate",
                "generate --model PATH --prompt TEXT [--chat] [--no-special] [--max-tokens N] "
                "[--temperature T] "
                "[--top-k K] [--top-p P] [--min-p P] [--seed S] [--repeat-penalty R] [--stop S] "
                "[--threads N] [--kv-dtype f32|f16|bf16|int8|kivi4|kivi2] [--json]",
                RunGenerate);

}  // namespace kvrelay::cli
