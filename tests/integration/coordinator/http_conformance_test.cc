// HTTP/1.1 conformance of the coordinator (#21): every route and every error
// path it can produce, driven through Python's h11 (which enforces message
// framing) over one keep-alive connection, plus one connection per path that
// closes. The server is the real coordinator over the real model in-process.
//
// 500 / 503 / a failure mid-stream / an unhealthy backend cannot be had from a
// healthy engine on demand, so the backend is the real LocalEngineBackend
// behind a fault-injecting decorator that the HTTP client steers through the
// request's seed (the only request field that reaches the backend unchanged).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>

#include "common/metrics.h"
#include "coordinator/http/server.h"
#include "coordinator/local_engine_backend.h"
#include "coordinator/openai/engine_text_codec.h"
#include "engine/runtime/model.h"
#include "engine/tokenizer/tokenizer.h"
#include "tests/testing/skip.h"
#include "tests/testing/test_env.h"

namespace kvrelay::coordinator {
namespace {

namespace fs = std::filesystem;

using testing::BinaryDir;
using testing::RunCommand;
using testing::SourceDir;

// Faults chosen by the request's seed (kept in step with
// http_conformance_check.py); any other seed passes straight through.
constexpr uint64_t kSeedSubmitInternal = 4242001;      // Submit fails: Internal -> 500
constexpr uint64_t kSeedSubmitUnavailable = 4242002;   // Submit fails: Unavailable -> 503
constexpr uint64_t kSeedFailAfterTwoTokens = 4242003;  // the stream fails after 2 tokens
constexpr uint64_t kSeedMarkUnhealthy = 4242004;       // served; /health says 503 from now
constexpr uint64_t kSeedMarkHealthy = 4242005;         // served; /health says 200 again

class FaultInjectingBackend : public Backend {
 public:
  explicit FaultInjectingBackend(Backend* inner) : inner_(inner) {}

  Status Submit(GenerationRequest request, TokenSink sink) override {
    const uint64_t seed = request.sampling.seed;
    if (seed == kSeedSubmitInternal) return Internal("injected: submit failed");
    if (seed == kSeedSubmitUnavailable) return Unavailable("injected: no worker can take it");
    if (seed == kSeedMarkUnhealthy) healthy_.store(false);
    if (seed == kSeedMarkHealthy) healthy_.store(true);
    if (seed != kSeedFailAfterTwoTokens) return inner_->Submit(std::move(request), std::move(sink));
    // After two tokens: cancel the real request and turn its final event
    // into a failure; tokens in between are dropped.
    struct State {
      int tokens = 0;
      bool failing = false;
    };
    auto state = std::make_shared<State>();
    const uint64_t id = request.id;
    Backend* inner = inner_;
    return inner_->Submit(std::move(request), [state, id, inner, sink](const TokenEvent& ev) {
      if (state->failing) {
        if (!ev.finished) return;
        TokenEvent fail;
        fail.finished = true;
        fail.finish_reason = FinishReason::kError;
        fail.error = Internal("injected: the worker failed after 2 tokens");
        return sink(fail);
      }
      sink(ev);
      if (ev.token >= 0 && ++state->tokens == 2 && !ev.finished) {
        state->failing = true;
        inner->Cancel(id);
      }
    });
  }
  void Cancel(uint64_t id) override { inner_->Cancel(id); }
  Status Health() override {
    if (!healthy_.load()) return Unavailable("injected: marked unhealthy");
    return inner_->Health();
  }
  std::vector<WorkerInfo> Workers() override { return inner_->Workers(); }

 private:
  Backend* const inner_;
  std::atomic<bool> healthy_{true};
};

TEST(HttpConformanceTest, EveryRouteAndErrorThroughH11OnOneConnection) {
  const std::string path = SourceDir() + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!fs::exists(path))
    KVRELAY_SKIP_OR_FAIL() << "model file not present (run scripts/fetch-model.sh)";
  const std::string venv = BinaryDir() + "/h11-venv";
  std::string log;
  if (!fs::exists(venv + "/bin/python") ||
      RunCommand("'" + venv + "/bin/python' -c 'import h11' 2>&1", &log) != 0) {
    log.clear();
    if (RunCommand(
            "python3 -m venv '" + venv + "' 2>&1 && '" + venv + "/bin/pip' install -q h11 2>&1",
            &log) != 0) {
      KVRELAY_SKIP_OR_FAIL() << "cannot install h11 from PyPI into a venv: " << log;
    }
  }

  auto loaded = engine::Model::Load(path);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  std::shared_ptr<const engine::Model> model = std::move(*loaded);
  engine::EngineOptions eo;
  eo.model_path = path;
  eo.kv_dtype = engine::KvDtype::kF16;
  eo.kv_capacity_bytes = 64 << 20;  // ~2,900 tokens: a 4,000-token request can never fit
  eo.max_running = 4;
  auto eng = engine::Engine::Create(eo, model);
  ASSERT_TRUE(eng.ok()) << eng.status().ToString();
  LocalEngineBackend::Options bo;
  const engine::Tokenizer* tok = model->tokenizer();
  bo.is_end_of_generation = [tok](int32_t id) { return tok->IsEndOfGeneration(id); };
  auto local = LocalEngineBackend::Create(std::move(*eng), bo);
  ASSERT_TRUE(local.ok()) << local.status().ToString();
  FaultInjectingBackend backend(local->get());
  EngineTextCodec codec(model->tokenizer(), model->chat_template());
  MetricsRegistry metrics;

  ServerOptions so;
  so.port = 0;
  so.model_name = "smollm2";
  so.max_context_tokens = static_cast<int>(model->config().context_length);
  so.max_running = 2;  // one side stream of n = 2 fills the server: the next request is a 429
  so.max_queue = 0;
  so.max_body_bytes = 64 << 10;
  so.max_header_bytes = 8 << 10;
  so.max_prompt_tokens = 512;
  so.header_timeout_ms = 30'000;
  so.api_keys.Add("sk-conformance", "conformance");
  auto server = Server::Create(so, &backend, &codec, &metrics);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  ASSERT_TRUE((*server)->Start().ok());

  std::string out;
  const std::string script =
      SourceDir() + "/tests/integration/coordinator/http_conformance_check.py";
  const int rc =
      RunCommand("'" + venv + "/bin/python' '" + script + "' " + std::to_string((*server)->port()) +
                     " smollm2 sk-conformance " + std::to_string(so.max_context_tokens) + " 2>&1",
                 &out);
  (*server)->Stop();
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("\"failures\": []"), std::string::npos) << out;
  std::printf("%s\n", out.c_str());
}

}  // namespace
}  // namespace kvrelay::coordinator
