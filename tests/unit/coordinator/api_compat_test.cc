// Issue #42: the API is as lenient as the clients it serves (vLLM's and
// llama-server's behaviour): unknown fields ignored with a warning, served
// model names and aliases, max_tokens up to the context, /tokenize and
// /detokenize, the context length in /v1/models, no <tool_call> fragment in
// `content`, and one access line per request. Real sockets on 127.0.0.1, the
// fake backend and byte codec of fakes.h.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "common/http_client.h"
#include "common/logging.h"
#include "coordinator/http/http_errors.h"
#include "coordinator/http/server.h"
#include "coordinator/http/sse.h"
#include "coordinator/openai/openai_api.h"
#include "tests/unit/coordinator/fakes.h"

namespace kvrelay::coordinator {
namespace {

using nlohmann::json;
using testing::ByteCodec;
using testing::FakeBackend;

std::optional<ApiError> ParseChat(const std::string& body, CompletionParams* out) {
  return ParseCompletionRequest(Endpoint::kChatCompletions, body, ApiLimits{}, out);
}

// --- the parser ---

TEST(ApiCompatParseTest, UnknownFieldsAreIgnoredAndNamedForTheWarning) {
  CompletionParams p;
  auto err = ParseChat(R"({"model":"m","messages":[{"role":"user","content":"x"}],
      "store":false,"metadata":{"a":"b"},"reasoning_effort":"low",
      "chat_template_kwargs":{"enable_thinking":false},"echo":true})",
                       &p);
  ASSERT_FALSE(err.has_value()) << err->message;
  EXPECT_EQ(p.ignored_fields, (std::vector<std::string>{"chat_template_kwargs", "echo", "metadata",
                                                        "reasoning_effort", "store"}));
  // Wrong types of known fields are still a 400 naming the field.
  for (const auto& [body, field] : std::vector<std::pair<std::string, std::string>>{
           {R"("temperature":"hot")", "temperature"},
           {R"("max_tokens":"5")", "max_tokens"},
           {R"("stream":1)", "stream"},
           {R"("model":7)", "model"},
           {R"("stop":5)", "stop"},
           {R"("max_completion_tokens":[1])", "max_completion_tokens"}}) {
    auto e =
        ParseChat(R"({"messages":[{"role":"user","content":"x"}],"store":1,)" + body + "}", &p);
    ASSERT_TRUE(e.has_value()) << body;
    EXPECT_EQ(e->http_status, 400);
    EXPECT_EQ(e->param, field) << e->message;
    EXPECT_EQ(e->code, "invalid_type") << e->message;
  }
}

TEST(ApiCompatParseTest, ModelMayBeOmittedAndMaxTokensIsNotCappedAt4096) {
  CompletionParams p;
  ASSERT_FALSE(ParseChat(R"({"messages":[{"role":"user","content":"x"}],"max_tokens":8000})", &p)
                   .has_value());
  EXPECT_EQ(p.model, "");
  EXPECT_EQ(p.max_tokens, 8000);
  ASSERT_FALSE(
      ParseChat(R"({"messages":[{"role":"user","content":"x"}],"max_completion_tokens":7000})", &p)
          .has_value());
  EXPECT_EQ(p.max_tokens, 7000);
  auto zero = ParseChat(R"({"messages":[{"role":"user","content":"x"}],"max_tokens":0})", &p);
  ASSERT_TRUE(zero.has_value());
  EXPECT_EQ(zero->param, "max_tokens");
}

TEST(ApiCompatParseTest, CheckModelAcceptsServedNamesAliasesAndNone) {
  ApiLimits limits;
  limits.model_aliases = {"alias", "SmolLM2-135M-Instruct.Q4_1", "SmolLM2 135M Instruct"};
  EXPECT_FALSE(CheckModel("served", "served", limits).has_value());
  EXPECT_FALSE(CheckModel("", "served", limits).has_value());
  EXPECT_FALSE(CheckModel("alias", "served", limits).has_value());
  EXPECT_FALSE(CheckModel("SmolLM2 135M Instruct", "served", limits).has_value());
  auto e = CheckModel("gpt-4o", "served", limits);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->http_status, 404);
  EXPECT_EQ(e->code, "model_not_found");
  EXPECT_EQ(e->param, "model");
}

// --- tool calls: no <tool_call> fragment ever reaches the content ---

TEST(ApiCompatToolsTest, FragmentsNeverReachTheContent) {
  const std::string call = R"({"name": "get_weather", "arguments": {"city": "Paris"}})";
  // The leak of #42: a block the answer ended inside (EOS before the close).
  ToolCallSplit s = SplitToolCalls("Let me check.\n<tool_call>\n" + call, ToolChoice::kAuto, "x");
  EXPECT_EQ(s.content, "Let me check.");
  ASSERT_TRUE(s.tool_calls.is_array());
  ASSERT_EQ(s.tool_calls.size(), 1u);
  EXPECT_EQ(s.tool_calls[0]["function"]["name"], "get_weather");
  EXPECT_EQ(s.tool_calls[0]["function"]["arguments"], R"({"city":"Paris"})");
  // A block cut inside its JSON: no call, and no fragment either.
  s = SplitToolCalls("Sure.<tool_call>\n{\"name\": \"get_wea", ToolChoice::kAuto, "x");
  EXPECT_EQ(s.content, "Sure.");
  EXPECT_TRUE(s.tool_calls.is_null());
  // A partial tag at the very end, a stray close tag, malformed JSON.
  EXPECT_EQ(SplitToolCalls("Hello <tool_c", ToolChoice::kAuto, "x").content, "Hello");
  EXPECT_EQ(SplitToolCalls("Hello </tool", ToolChoice::kAuto, "x").content, "Hello");
  EXPECT_EQ(SplitToolCalls("</tool_call>\nIt is sunny.", ToolChoice::kAuto, "x").content,
            "It is sunny.");
  s = SplitToolCalls("A<tool_call>{not json}</tool_call>B", ToolChoice::kAuto, "x");
  EXPECT_EQ(s.content, "AB");
  EXPECT_TRUE(s.tool_calls.is_null());
  // Complete blocks: calls, with the text around them kept; none left: null.
  s = SplitToolCalls("<tool_call>\n" + call + "\n</tool_call>", ToolChoice::kAuto, "x");
  EXPECT_TRUE(s.content.is_null());
  ASSERT_EQ(s.tool_calls.size(), 1u);
  EXPECT_EQ(s.tool_calls[0]["id"], "call_x_0");
  // tool_choice none (the round trip of #42): blocks cut, no call made.
  s = SplitToolCalls("It is 18 degrees.\n<tool_call>\n" + call + "\n</tool_call>",
                     ToolChoice::kNone, "x");
  EXPECT_EQ(s.content, "It is 18 degrees.");
  EXPECT_TRUE(s.tool_calls.is_null());
  // Text without markup is untouched (whitespace too).
  EXPECT_EQ(SplitToolCalls(" a < b \n", ToolChoice::kAuto, "x").content, " a < b \n");
  // Models that write "parameters", or arguments as a JSON string.
  s = SplitToolCalls(R"(<tool_call>{"name":"f","parameters":{"a":1}}</tool_call>)",
                     ToolChoice::kAuto, "x");
  EXPECT_EQ(s.tool_calls[0]["function"]["arguments"], R"({"a":1})");
  s = SplitToolCalls(R"(<tool_call>{"name":"f","arguments":"{\"a\":1}"}</tool_call>)",
                     ToolChoice::kAuto, "x");
  EXPECT_EQ(s.tool_calls[0]["function"]["arguments"], R"({"a":1})");
}

// tool_choice "auto" on outputs SmolLM2-135M-Instruct.Q4_1 wrote (greedy,
// 2026-12-04): with a call in the history it calls again; on a first question
// it once echoed the function's description as bare JSON, which is no call.
TEST(ApiCompatToolsTest, RecordedModelOutputs) {
  ToolCallSplit s = SplitToolCalls(
      "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Rome\"}}\n</tool_call>",
      ToolChoice::kAuto, "x");
  EXPECT_TRUE(s.content.is_null());
  ASSERT_EQ(s.tool_calls.size(), 1u);
  EXPECT_EQ(s.tool_calls[0]["function"]["name"], "get_weather");
  EXPECT_EQ(s.tool_calls[0]["function"]["arguments"], R"({"city":"Rome"})");
  // Cut by max_tokens 12: no call, and nothing of it in the content.
  s = SplitToolCalls("<tool_call>\n{\"name\":\"get_weather\",\"arg", ToolChoice::kAuto, "x");
  EXPECT_EQ(s.content, "");
  EXPECT_TRUE(s.tool_calls.is_null());
  const std::string echoed =
      "{\"name\":\"get_weather\",\"description\":\"Get the current weather in Tokyo\","
      "\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}},"
      "\"required\":[\"city\"]}}\n\nThe function is returning a JSON object with the current "
      "weather in Tokyo.";
  s = SplitToolCalls(echoed, ToolChoice::kAuto, "x");
  EXPECT_EQ(s.content, echoed);
  EXPECT_TRUE(s.tool_calls.is_null());
}

// --- the server ---

class ApiCompatServerTest : public ::testing::Test {
 protected:
  void StartServer(ServerOptions options = {}, FakeBackend::Options backend_options = {}) {
    backend_ = std::make_unique<FakeBackend>(backend_options);
    options.port = 0;
    options.model_name = "test-model";
    options.header_timeout_ms = 5000;
    auto server = Server::Create(std::move(options), backend_.get(), &codec_, &metrics_);
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(*server);
    ASSERT_TRUE(server_->Start().ok());
  }
  void TearDown() override {
    if (server_) server_->Stop();
    server_.reset();
    backend_.reset();
  }
  HttpCallResult Call(const std::string& method, const std::string& target,
                      const std::string& body = "", HttpHeaders headers = {}) {
    HttpCallSpec spec;
    spec.headers = std::move(headers);
    spec.method = method;
    spec.port = server_->port();
    spec.target = target;
    spec.body = body;
    spec.timeout_ms = 10000;
    if (!body.empty()) spec.headers.push_back({"Content-Type", "application/json"});
    auto r = HttpCall(spec);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : HttpCallResult{};
  }
  json Post(const std::string& target, const json& body, int expect_status,
            HttpHeaders headers = {}) {
    HttpCallResult r = Call("POST", target, body.dump(), std::move(headers));
    EXPECT_EQ(r.status, expect_status) << r.body;
    return json::parse(r.body, nullptr, false);
  }
  std::vector<json> Stream(const std::string& target, const json& body) {
    HttpCallResult r = Call("POST", target, body.dump());
    EXPECT_EQ(r.status, 200) << r.body;
    SseParser parser;
    EXPECT_TRUE(parser.Feed(r.body));
    std::vector<json> events;
    while (auto e = parser.Next()) {
      if (*e != "[DONE]") events.push_back(json::parse(*e));
    }
    return events;
  }
  static json Chat(const std::string& content) {
    return json{{"messages", {{{"role", "user"}, {"content", content}}}}, {"max_tokens", 64}};
  }

  ByteCodec codec_;
  MetricsRegistry metrics_;
  std::unique_ptr<FakeBackend> backend_;
  std::unique_ptr<Server> server_;
};

TEST_F(ApiCompatServerTest, UnknownFieldsAreServedAndWarnedAboutOncePerName) {
  StartServer();
  json body = Chat("hi");
  body["model"] = "test-model";
  body["store"] = true;
  body["x_kvrelay_test_field_42"] = {{"a", 1}};
  ::testing::internal::CaptureStderr();
  json first = Post("/v1/chat/completions", body, 200);
  json second = Post("/v1/chat/completions", body, 200);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(first["choices"][0]["message"]["content"], "Hello, world!");
  const std::string warning = "'x_kvrelay_test_field_42' is not supported and was ignored";
  const size_t at = log.find(warning);
  ASSERT_NE(at, std::string::npos) << log;
  EXPECT_EQ(log.find(warning, at + 1), std::string::npos) << "warned twice:\n" << log;
  EXPECT_NE(log.rfind(" W ", at), std::string::npos) << "not at warning level:\n" << log;
  // A known field of the wrong type is still refused, by name.
  body["top_p"] = "high";
  json e = Post("/v1/chat/completions", body, 400);
  EXPECT_EQ(e["error"]["param"], "top_p");
}

TEST_F(ApiCompatServerTest, ServedNameAliasesAndAnOmittedModel) {
  ServerOptions o;
  o.limits.model_aliases = {"alias-one", "SmolLM2-135M-Instruct.Q4_1"};
  StartServer(o);
  for (const char* model : {"test-model", "alias-one", "SmolLM2-135M-Instruct.Q4_1"}) {
    json body = Chat("hi");
    body["model"] = model;
    json r = Post("/v1/chat/completions", body, 200);
    EXPECT_EQ(r["model"], "test-model") << model;  // the served name is echoed
  }
  json r = Post("/v1/completions", json{{"prompt", "hi"}, {"max_tokens", 4}}, 200);
  EXPECT_EQ(r["model"], "test-model");
  json body = Chat("hi");
  body["model"] = "gpt-4o";
  json e = Post("/v1/chat/completions", body, 404);
  EXPECT_EQ(e["error"]["code"], "model_not_found");
  EXPECT_EQ(e["error"]["param"], "model");
  EXPECT_EQ(Call("GET", "/v1/models/alias-one").status, 200);
  EXPECT_EQ(Call("GET", "/v1/models/gpt-4o").status, 404);
}

TEST_F(ApiCompatServerTest, MaxTokensUpToTheContextAndVllmStyleRefusal) {
  ServerOptions o;
  o.max_context_tokens = 1000;  // the fake worker's pool holds 1600 tokens
  StartServer(o);
  const std::string prompt(100, 'x');
  json ok = Post("/v1/completions", json{{"prompt", prompt}, {"max_tokens", 900}}, 200);
  EXPECT_EQ(ok["usage"]["prompt_tokens"], 100);
  json e = Post("/v1/completions", json{{"prompt", prompt}, {"max_tokens", 901}}, 400);
  EXPECT_EQ(e["error"]["code"], "context_length_exceeded");
  EXPECT_EQ(e["error"]["param"], "max_tokens");
  EXPECT_EQ(e["error"]["message"],
            "This model's maximum context length is 1000 tokens. However, you requested 1001 "
            "tokens (100 in the prompt, 901 in the completion). Please reduce the length of the "
            "prompt or completion.");
  // Without max_tokens: all of the remaining context (as vLLM) by default.
  Post("/v1/completions", json{{"prompt", prompt}}, 200);
  const auto submitted = backend_->submitted();
  ASSERT_EQ(submitted.size(), 2u);
  EXPECT_EQ(submitted[0].sampling.max_tokens, 900);
  EXPECT_EQ(submitted[1].sampling.max_tokens, 900);
}

TEST_F(ApiCompatServerTest, TokenizeAndDetokenize) {
  ServerOptions o;
  o.max_context_tokens = 8192;
  StartServer(o);
  json t = Post("/tokenize", json{{"model", "test-model"}, {"prompt", "hi"}}, 200);
  EXPECT_EQ(t["tokens"], json::array({104, 105}));
  EXPECT_EQ(t["count"], 2);
  EXPECT_EQ(t["max_model_len"], 8192);
  t = Post("/tokenize",
           json{{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                {"add_generation_prompt", false},
                {"return_token_strs", true}},
           200);
  EXPECT_EQ(t["count"], std::string("user: hi\n").size());
  EXPECT_EQ(t["token_strs"][0], "u");
  t = Post("/tokenize", json{{"messages", {{{"role", "user"}, {"content", "hi"}}}}}, 200);
  EXPECT_EQ(t["count"], std::string("user: hi\nassistant: ").size());
  json d = Post("/detokenize", json{{"model", "test-model"}, {"tokens", {104, 105}}}, 200);
  EXPECT_EQ(d["prompt"], "hi");
  json e = Post("/detokenize", json{{"tokens", {104, 300}}}, 400);
  EXPECT_EQ(e["error"]["param"], "tokens[1]");
  EXPECT_NE(e["error"]["message"].get<std::string>().find("300"), std::string::npos);
  e = Post("/detokenize", json{{"tokens", {-1}}}, 400);
  EXPECT_EQ(e["error"]["param"], "tokens[0]");
  e = Post("/detokenize", json{{"tokens", "hi"}}, 400);
  EXPECT_EQ(e["error"]["param"], "tokens");
  e = Post("/tokenize", json{{"prompt", 5}}, 400);
  EXPECT_EQ(e["error"]["param"], "prompt");
  e = Post("/tokenize", json{{"model", "nope"}, {"prompt", "hi"}}, 404);
  EXPECT_EQ(e["error"]["code"], "model_not_found");
  EXPECT_EQ(Call("GET", "/tokenize").status, 405);
}

TEST_F(ApiCompatServerTest, ModelsCarryTheContextLength) {
  ServerOptions o;
  o.max_context_tokens = 8192;
  StartServer(o);
  HttpCallResult r = Call("GET", "/v1/models");
  ASSERT_EQ(r.status, 200);
  json m = json::parse(r.body)["data"][0];
  EXPECT_EQ(m["id"], "test-model");
  EXPECT_EQ(m["max_model_len"], 8192);
  EXPECT_EQ(m["context_length"], 8192);
  json one = json::parse(Call("GET", "/v1/models/test-model").body);
  EXPECT_EQ(one["max_model_len"], 8192);
}

const char* const kTools = R"([{"type":"function","function":{"name":"get_weather",
    "parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}])";

// #42: the model stopped inside its <tool_call> block; the raw fragment
// went to `content`.
TEST_F(ApiCompatServerTest, AnUnclosedToolCallIsACallNotContent) {
  FakeBackend::Options bo;
  bo.reply =
      "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}";
  StartServer({}, bo);
  json body = Chat("Weather in Paris?");
  body["max_tokens"] = 128;  // the whole reply, then EOS
  body["tools"] = json::parse(kTools);
  json r = Post("/v1/chat/completions", body, 200);
  const json& msg = r["choices"][0]["message"];
  EXPECT_EQ(msg["content"], "Checking.");
  ASSERT_TRUE(msg.contains("tool_calls")) << r.dump();
  ASSERT_EQ(msg["tool_calls"].size(), 1u);
  EXPECT_EQ(msg["tool_calls"][0]["function"]["arguments"], R"({"city":"Paris"})");
  EXPECT_EQ(r["choices"][0]["finish_reason"], "tool_calls");
  body["stream"] = true;
  std::string content;
  json calls = json::array();
  for (const json& ev : Stream("/v1/chat/completions", body)) {
    const json& delta = ev["choices"][0]["delta"];
    if (delta.contains("content")) content += delta["content"].get<std::string>();
    if (delta.contains("tool_calls")) calls = delta["tool_calls"];
  }
  EXPECT_EQ(content, "Checking.");
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0]["function"]["name"], "get_weather");
}

// #42's round trip: the call and its result in the history, tool_choice
// none; the model imitates the history's markup.
TEST_F(ApiCompatServerTest, RoundTripWithToolChoiceNoneKeepsMarkupOutOfContent) {
  FakeBackend::Options bo;
  bo.reply = "It is 18 degrees.\n<tool_call>\n{\"name\": \"get_wea";
  StartServer({}, bo);
  json body = json::parse(R"({"max_tokens":64,"tool_choice":"none","messages":[
      {"role":"user","content":"Weather in Paris?"},
      {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function",
       "function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},
      {"role":"tool","tool_call_id":"c1","content":"18 degrees, sunny"}]})");
  body["tools"] = json::parse(kTools);
  json r = Post("/v1/chat/completions", body, 200);
  EXPECT_EQ(r["choices"][0]["message"]["content"], "It is 18 degrees.");
  EXPECT_FALSE(r["choices"][0]["message"].contains("tool_calls"));
  EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
  body["stream"] = true;
  std::string content;
  for (const json& ev : Stream("/v1/chat/completions", body)) {
    const json& delta = ev["choices"][0]["delta"];
    if (delta.contains("content")) content += delta["content"].get<std::string>();
  }
  EXPECT_EQ(content, "It is 18 degrees.");
}

TEST_F(ApiCompatServerTest, OneAccessLinePerRequestAtInfo) {
  FakeBackend::Options bo;
  bo.cached_tokens = 3;
  ServerOptions o;
  o.api_keys.Add("sk-alice", "alice");
  StartServer(o, bo);
  json body = Chat("hi");
  body["n"] = 2;
  ::testing::internal::CaptureStderr();
  json r = Post("/v1/chat/completions", body, 200, {{"Authorization", "Bearer sk-alice"}});
  const std::string log = ::testing::internal::GetCapturedStderr();
  const std::string id = r["id"];
  size_t lines = 0;
  std::string line;
  for (size_t at = log.find("request " + id); at != std::string::npos;
       at = log.find("request " + id, at + 1)) {
    ++lines;
    const size_t begin = log.rfind('\n', at) == std::string::npos ? 0 : log.rfind('\n', at) + 1;
    line = log.substr(begin, log.find('\n', at) - begin);
  }
  ASSERT_EQ(lines, 1u) << log;
  EXPECT_NE(line.find(" I "), std::string::npos) << line;
  const int prompt = r["usage"]["prompt_tokens"];
  for (const std::string& part :
       {std::string("tenant=alice"), "prompt=" + std::to_string(prompt), std::string("cached=3"),
        std::string("generated=26"), std::string("ttft_ms="), std::string("total_ms="),
        std::string("finish=stop")}) {
    EXPECT_NE(line.find(part), std::string::npos) << part << " not in: " << line;
  }
}

}  // namespace
}  // namespace kvrelay::coordinator
