// The per-token cost of structured output's token mask against TPOT at
// batch 1 (#18), side by side in one run: the same prompt decoded greedily
// without a grammar and with a JSON schema, alternated `--reps` times, and
// the grammar's Mask + Accept replayed over the constrained tokens with a
// cold mask cache (every state computed) and a warm one.
//
// usage: grammar_mask_bench MODEL.gguf [--reps N] [--threads N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "engine/grammar/json_grammar.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/model.h"
#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/tokenizer.h"

using namespace kvrelay;
using namespace kvrelay::engine;
using Clock = std::chrono::steady_clock;

namespace {

constexpr const char* kSchema =
    R"({"type":"array","minItems":6,"maxItems":6,"items":{"type":"object","properties":{)"
    R"("name":{"type":"string","maxLength":16},"age":{"type":"integer"},"city":{"type":"string",)"
    R"("maxLength":12}},"required":["name","age","city"]}})";

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct RunResult {
  std::vector<int32_t> tokens;
  std::vector<double> step_ms;  // decode steps (after the first token)
};

RunResult Generate(Engine& engine, const std::vector<int32_t>& prompt, int max_tokens,
                   const std::string& schema, RequestId id) {
  RequestSpec spec;
  spec.id = id;
  spec.prompt = prompt;
  spec.sampling.temperature = 0;
  spec.sampling.max_tokens = max_tokens;
  spec.sampling.ignore_eos = true;
  spec.sampling.json_schema = schema;
  spec.want_text = false;
  RunResult r;
  if (!engine.Submit(spec).ok()) return r;
  while (engine.HasWork()) {
    const auto t0 = Clock::now();
    auto events = engine.Step();
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    if (!events.ok()) break;
    for (const auto& e : *events) {
      if (e.token < 0) continue;
      if (!r.tokens.empty()) r.step_ms.push_back(ms);
      r.tokens.push_back(e.token);
    }
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s MODEL.gguf [--reps N] [--threads N]\n", argv[0]);
    return 2;
  }
  int reps = 5;
  int threads = 0;
  for (int i = 2; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--reps")) reps = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--threads")) threads = std::atoi(argv[i + 1]);
  }
  auto model = Model::Load(argv[1]);
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 1;
  }
  std::shared_ptr<const Model> m(std::move(*model));
  EngineOptions eo;
  eo.kv_dtype = KvDtype::kF16;
  eo.kv_capacity_bytes = 64 << 20;
  eo.threads = threads;
  eo.max_running = 4;
  auto engine = Engine::Create(eo, m);
  if (!engine.ok()) {
    std::fprintf(stderr, "%s\n", engine.status().ToString().c_str());
    return 1;
  }
  auto rendered = m->chat_template()->Render(
      {{"user", "List six people with their age and city as JSON."}}, true);
  std::vector<int32_t> prompt = m->tokenizer()->Encode(*rendered, false, true);

  RequestId id = 1;
  // Warm up both paths (the grammar's first masks are computed here).
  RunResult constrained = Generate(**engine, prompt, 200, kSchema, id++);
  const int n = static_cast<int>(constrained.tokens.size());
  (void)Generate(**engine, prompt, n, "", id++);
  std::vector<double> plain_tpot, json_tpot;
  for (int r = 0; r < reps; ++r) {
    plain_tpot.push_back(Median(Generate(**engine, prompt, n, "", id++).step_ms));
    json_tpot.push_back(Median(Generate(**engine, prompt, n, kSchema, id++).step_ms));
  }

  // The mask alone, replayed over the constrained tokens.
  const Tokenizer& tok = *m->tokenizer();
  std::vector<std::string> pieces(tok.vocab_size());
  std::vector<bool> usable(tok.vocab_size());
  std::vector<int32_t> eog;
  for (int32_t i = 0; i < tok.vocab_size(); ++i) {
    pieces[i] = tok.TokenToPiece(i);
    usable[i] = tok.token_type(i) == TokenType::kNormal || tok.token_type(i) == TokenType::kByte;
    if (tok.IsEndOfGeneration(i)) eog.push_back(i);
  }
  const auto vb0 = Clock::now();
  auto vocab = grammar::TokenVocabulary::Build(pieces, usable, eog);
  const double vocab_ms = std::chrono::duration<double, std::milli>(Clock::now() - vb0).count();
  auto g = grammar::CompileJsonSchema(kSchema);
  auto factory = std::make_shared<grammar::ConstraintFactory>(*g, vocab);
  std::vector<float> logits(tok.vocab_size());
  auto replay = [&](std::vector<double>* per_token_us) {
    grammar::GrammarMatcher matcher(factory);
    for (int32_t t : constrained.tokens) {
      std::fill(logits.begin(), logits.end(), 0.0f);
      const auto t0 = Clock::now();
      matcher.Mask(logits.data(), static_cast<int64_t>(logits.size()));
      (void)matcher.Accept(t);
      per_token_us->push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
  };
  std::vector<double> cold_us, warm_us;
  replay(&cold_us);
  const auto stats = factory->stats();
  for (int r = 0; r < reps; ++r) replay(&warm_us);
  double cold_total = 0;
  for (double x : cold_us) cold_total += x;

  const double tp = Median(plain_tpot), tj = Median(json_tpot);
  std::printf("tokens per run: %d (constrained output of the schema, greedy)\n", n);
  std::printf("TPOT batch 1, no grammar:   %.2f ms (median of %d runs)\n", tp, reps);
  std::printf("TPOT batch 1, JSON schema:  %.2f ms (median of %d runs, warm mask cache)\n", tj,
              reps);
  std::printf("TPOT overhead:              %+.2f ms (%+.1f%%)\n", tj - tp, 100 * (tj - tp) / tp);
  std::printf("mask+accept per token, warm cache: %.1f us median (%.2f%% of TPOT)\n",
              Median(warm_us), 100 * Median(warm_us) / 1000 / tp);
  std::printf(
      "mask+accept per token, cold cache: %.1f us median, %.1f ms max, %.1f ms total "
      "for %lld distinct states\n",
      Median(cold_us), *std::max_element(cold_us.begin(), cold_us.end()) / 1000, cold_total / 1000,
      static_cast<long long>(stats.misses));
  std::printf("token trie build (once per engine): %.1f ms\n", vocab_ms);
  std::string text = tok.Decode(constrained.tokens);
  std::printf("output: %s\n", text.c_str());
  return 0;
}
