// The coordinator serving the real model in one process (LocalEngineBackend),
// checked from C++ and with the official `openai` Python client.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include "common/http_client.h"
#include "common/metrics.h"
#include "coordinator/http/server.h"
#include "coordinator/http/sse.h"
#include "coordinator/local_engine_backend.h"
#include "coordinator/openai/engine_text_codec.h"
#include "engine/runtime/model.h"
#include "engine/tokenizer/tokenizer.h"
#include "tests/testing/openai_client_report.h"
#include "tests/testing/skip.h"
#include "tests/testing/test_env.h"

namespace kvrelay::coordinator {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

using testing::BinaryDir;
using testing::EnsureOpenAiVenv;
using testing::RunCommand;
using testing::SourceDir;

class OpenAiIntegrationTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::string path = SourceDir() + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
    if (!fs::exists(path)) return;
    auto model = engine::Model::Load(path);
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    model_ = std::shared_ptr<const engine::Model>(std::move(*model));
    engine::EngineOptions eo;
    eo.model_path = path;
    eo.kv_dtype = engine::KvDtype::kF16;
    eo.kv_capacity_bytes = 64 << 20;
    eo.max_running = 8;
    auto eng = engine::Engine::Create(eo, model_);
    ASSERT_TRUE(eng.ok()) << eng.status().ToString();
    LocalEngineBackend::Options bo;
    const engine::Tokenizer* tok = model_->tokenizer();
    bo.is_end_of_generation = [tok](int32_t id) { return tok->IsEndOfGeneration(id); };
    auto backend = LocalEngineBackend::Create(std::move(*eng), bo);
    ASSERT_TRUE(backend.ok()) << backend.status().ToString();
    backend_ = std::move(*backend).release();
    codec_ = new EngineTextCodec(model_->tokenizer(), model_->chat_template());
    metrics_ = new MetricsRegistry();
    ServerOptions so;
    so.port = 0;
    so.model_name = "smollm2";
    so.max_context_tokens = static_cast<int>(model_->config().context_length);
    auto server = Server::Create(so, backend_, codec_, metrics_);
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(*server).release();
    ASSERT_TRUE(server_->Start().ok());
  }
  static void TearDownTestSuite() {
    delete server_;
    delete backend_;
    delete codec_;
    delete metrics_;
    model_.reset();
  }
  void SetUp() override {
    if (server_ == nullptr)
      KVRELAY_SKIP_OR_FAIL() << "model file not present (run scripts/fetch-model.sh)";
  }

  static HttpCallResult Post(const std::string& target, const json& body) {
    HttpCallSpec spec;
    spec.method = "POST";
    spec.port = server_->port();
    spec.target = target;
    spec.body = body.dump();
    spec.headers = {{"Content-Type", "application/json"}};
    spec.timeout_ms = 300'000;
    auto r = HttpCall(spec);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : HttpCallResult{};
  }

  static inline std::shared_ptr<const engine::Model> model_;
  static inline LocalEngineBackend* backend_ = nullptr;
  static inline EngineTextCodec* codec_ = nullptr;
  static inline MetricsRegistry* metrics_ = nullptr;
  static inline Server* server_ = nullptr;
};

TEST_F(OpenAiIntegrationTest, GreedyStreamingMatchesNonStreaming) {
  json body = {{"model", "smollm2"},
               {"messages", {{{"role", "user"}, {"content", "Name three colors."}}}},
               {"max_tokens", 16},
               {"temperature", 0}};
  HttpCallResult plain = Post("/v1/chat/completions", body);
  ASSERT_EQ(plain.status, 200) << plain.body;
  json r = json::parse(plain.body);
  std::string text = r["choices"][0]["message"]["content"];
  EXPECT_FALSE(text.empty());
  // prompt_tokens is what the chat template + tokenizer produce for these messages.
  auto expected_prompt = codec_->EncodeChat({{"user", "Name three colors."}});
  ASSERT_TRUE(expected_prompt.ok());
  EXPECT_EQ(r["usage"]["prompt_tokens"], expected_prompt->size());
  int completion_tokens = r["usage"]["completion_tokens"];
  EXPECT_GE(completion_tokens, 1);
  EXPECT_LE(completion_tokens, 16);
  if (r["choices"][0]["finish_reason"] == "length") {
    EXPECT_EQ(completion_tokens, 16);
  }

  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  HttpCallResult streamed = Post("/v1/chat/completions", body);
  ASSERT_EQ(streamed.status, 200);
  SseParser parser;
  ASSERT_TRUE(parser.Feed(streamed.body));
  std::string joined;
  bool done = false;
  json usage;
  while (auto e = parser.Next()) {
    if (*e == "[DONE]") {
      done = true;
      continue;
    }
    json j = json::parse(*e);
    if (j.contains("usage")) usage = j["usage"];
    if (!j["choices"].empty() && j["choices"][0]["delta"].contains("content")) {
      joined += j["choices"][0]["delta"]["content"].get<std::string>();
    }
  }
  EXPECT_TRUE(done);
  EXPECT_EQ(joined, text);  // greedy decoding is deterministic
  EXPECT_EQ(usage["completion_tokens"], completion_tokens);
  // The second identical prompt reuses the first one's full prefix blocks.
  EXPECT_GT(usage["prompt_tokens_details"]["cached_tokens"].get<int>(), 0);
}

TEST_F(OpenAiIntegrationTest, OfficialPythonClient) {
  const std::string venv = BinaryDir() + "/openai-venv";
  std::string log;
  if (EnsureOpenAiVenv(venv, &log) != 0) {
    KVRELAY_SKIP_OR_FAIL() << "cannot create a venv with the openai client: " << log;
  }
  std::string out;
  std::string script = SourceDir() + "/tests/integration/coordinator/openai_client_check.py";
  std::string url = "http://127.0.0.1:" + std::to_string(server_->port()) + "/v1";
  int rc = RunCommand("'" + venv + "/bin/python' '" + script + "' " + url + " smollm2", &out);
  if (rc != 0 && out.find("No module named 'openai'") != std::string::npos)
    KVRELAY_SKIP_OR_FAIL() << out;
  ASSERT_EQ(rc, 0) << out;
  json j = json::parse(out);
  auto expected = codec_->Encode("The capital of France is", true);
  ASSERT_TRUE(expected.ok());
  testing::ExpectOpenAiClientReport(j, "smollm2", expected->size());
}

}  // namespace
}  // namespace kvrelay::coordinator
