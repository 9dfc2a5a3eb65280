#include "coordinator/openai/openai_api.h"

#include <gtest/gtest.h>

#include <map>

namespace kvrelay::coordinator {
namespace {

using nlohmann::json;

std::optional<ApiError> ParseChat(const std::string& body, CompletionParams* out,
                                  ApiLimits limits = {}) {
  return ParseCompletionRequest(Endpoint::kChatCompletions, body, limits, out);
}
std::optional<ApiError> ParseCompl(const std::string& body, CompletionParams* out) {
  return ParseCompletionRequest(Endpoint::kCompletions, body, ApiLimits{}, out);
}

TEST(OpenAiApiTest, ParsesFullChatRequest) {
  CompletionParams p;
  auto err = ParseChat(R"({"model":"m","messages":[{"role":"system","content":"be brief"},
      {"role":"user","content":[{"type":"text","text":"hi "},{"type":"text","text":"there"}]}],
      "max_completion_tokens":7,"max_tokens":99,"temperature":0.5,"top_p":0.9,"seed":42,
      "stop":["a","b"],"n":1,"stream":true,"stream_options":{"include_usage":true},"user":"x"})",
                       &p);
  ASSERT_FALSE(err.has_value()) << err->message;
  EXPECT_EQ(p.model, "m");
  ASSERT_EQ(p.messages.size(), 2u);
  EXPECT_EQ(p.messages[0].role, "system");
  EXPECT_EQ(p.messages[1].content, "hi there");
  EXPECT_EQ(p.max_tokens, 7);  // max_completion_tokens wins
  EXPECT_FLOAT_EQ(p.sampling.temperature, 0.5f);
  EXPECT_FLOAT_EQ(p.sampling.top_p, 0.9f);
  ASSERT_TRUE(p.seed.has_value());
  EXPECT_EQ(*p.seed, 42u);
  EXPECT_EQ(p.stop, (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(p.stream);
  EXPECT_TRUE(p.include_usage);
}

TEST(OpenAiApiTest, PenaltiesAndVllmSamplingExtensions) {
  CompletionParams p;
  auto err = ParseChat(R"({"model":"m","messages":[{"role":"user","content":"x"}],
      "presence_penalty":0.5,"frequency_penalty":-1.25,"repetition_penalty":1.1,"min_p":0.05})",
                       &p);
  ASSERT_FALSE(err.has_value()) << err->message;
  EXPECT_FLOAT_EQ(p.sampling.presence_penalty, 0.5f);
  EXPECT_FLOAT_EQ(p.sampling.frequency_penalty, -1.25f);
  EXPECT_FLOAT_EQ(p.sampling.repetition_penalty, 1.1f);
  EXPECT_FLOAT_EQ(p.sampling.min_p, 0.05f);
  CompletionParams q;
  auto bad = ParseChat(
      R"({"model":"m","messages":[{"role":"user","content":"x"}],"frequency_penalty":3})", &q);
  ASSERT_TRUE(bad.has_value());
  EXPECT_EQ(bad->param, "frequency_penalty");
  bad = ParseChat(R"({"model":"m","messages":[{"role":"user","content":"x"}],"min_p":2})", &q);
  ASSERT_TRUE(bad.has_value());
  EXPECT_EQ(bad->param, "min_p");
}

TEST(OpenAiApiTest, DefaultsAndNulls) {
  CompletionParams p;
  ApiLimits limits;
  limits.max_tokens_default = 33;
  auto err = ParseChat(R"({"model":"m","messages":[{"role":"user","content":"x"}],
      "temperature":null,"stop":null,"max_tokens":null})",
                       &p, limits);
  ASSERT_FALSE(err.has_value()) << err->message;
  EXPECT_EQ(p.max_tokens, 33);
  EXPECT_FLOAT_EQ(p.sampling.temperature, 1.0f);
  EXPECT_TRUE(p.stop.empty());
  EXPECT_FALSE(p.stream);
}

TEST(OpenAiApiTest, CompletionPromptForms) {
  CompletionParams p;
  ASSERT_FALSE(ParseCompl(R"({"model":"m","prompt":"abc","stop":"\n","echo":true})", &p));
  EXPECT_EQ(p.prompt, "abc");
  EXPECT_EQ(p.stop, std::vector<std::string>{"\n"});
  EXPECT_TRUE(p.echo);
  ASSERT_FALSE(ParseCompl(R"({"model":"m","prompt":["only one"]})", &p));
  EXPECT_EQ(p.prompt, "only one");
  ASSERT_FALSE(ParseCompl(R"({"model":"m","prompt":[1,2,3]})", &p));
  EXPECT_TRUE(p.prompt_is_tokens);
  EXPECT_EQ(p.prompt_token_ids, (std::vector<int32_t>{1, 2, 3}));
}

struct BadCase {
  Endpoint endpoint;
  const char* body;
  const char* param;   // expected "param"
  const char* needle;  // must appear in the message
};

TEST(OpenAiApiTest, PromptArraysAreBatchedCompletions) {
  CompletionParams p;
  auto err = ParseCompletionRequest(Endpoint::kCompletions,
                                    R"({"model":"m","prompt":["one","two","three"],"n":2})",
                                    ApiLimits{}, &p);
  ASSERT_FALSE(err.has_value()) << err->message;
  EXPECT_EQ(p.batch_size(), 3);
  EXPECT_EQ(p.prompt, "one");
  EXPECT_EQ(p.batch_prompts, (std::vector<std::string>{"one", "two", "three"}));
  CompletionParams t;
  err = ParseCompletionRequest(Endpoint::kCompletions, R"({"model":"m","prompt":[[1,2],[3]]})",
                               ApiLimits{}, &t);
  ASSERT_FALSE(err.has_value()) << err->message;
  EXPECT_TRUE(t.prompt_is_tokens);
  EXPECT_EQ(t.batch_size(), 2);
  EXPECT_EQ(t.prompt_token_ids, (std::vector<int32_t>{1, 2}));
  // One prompt in an array is an ordinary request.
  CompletionParams one;
  err = ParseCompletionRequest(Endpoint::kCompletions, R"({"model":"m","prompt":["solo"]})",
                               ApiLimits{}, &one);
  ASSERT_FALSE(err.has_value());
  EXPECT_EQ(one.batch_size(), 1);
  EXPECT_EQ(one.prompt, "solo");
}

TEST(OpenAiApiTest, EachErrorNamesTheField) {
  const BadCase cases[] = {
      {Endpoint::kChatCompletions, R"({"model":"m",)", "", "not valid JSON"},
      {Endpoint::kChatCompletions, R"([1,2])", "", "JSON object"},
      {Endpoint::kChatCompletions, R"({"model":5,"messages":[]})", "model", "string"},
      {Endpoint::kChatCompletions, R"({"model":"m"})", "messages", "'messages'"},
      {Endpoint::kChatCompletions, R"({"model":"m","messages":"hi"})", "messages", "array"},
      {Endpoint::kChatCompletions, R"({"model":"m","messages":[]})", "messages", "empty"},
      {Endpoint::kChatCompletions, R"({"model":"m","messages":[{"content":"x"}]})",
       "messages[0].role", "messages[0].role"},
      {Endpoint::kChatCompletions,
       R"({"model":"m","messages":[{"role":"user","content":"a"},{"role":"wizard","content":"x"}]})",
       "messages[1].role", "wizard"},
      {Endpoint::kChatCompletions, R"({"model":"m","messages":[{"role":"user"}]})",
       "messages[0].content", "content"},
      {Endpoint::kChatCompletions, R"({"model":"m","messages":[{"role":"user","content":7}]})",
       "messages[0].content", "got integer"},
      {Endpoint::kChatCompletions,
       R"({"model":"m","messages":[{"role":"user","content":[{"type":"image_url"}]}]})",
       "messages[0].content[0].type", "image_url"},
      {Endpoint::kChatCompletions,
       R"({"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":"5"})", "max_tokens",
       "integer"},
      {Endpoint::kChatCompletions,
       R"({"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":0})", "max_tokens",
       "between"},
      {Endpoint::kChatCompletions,
       R"({"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":2.5})", "max_tokens",
       "integer"},
      {Endpoint::kChatCompletions,
       R"({"model":"m","messages":[{"role":"user","content":"x"}],"max_completion_tokens":-1})",
       "max_completion_tokens", "between"},
      {Endpoint::kChatCompletions,
       R"({"model":"m","messages":[{"role":"user","content":"x"}],"temperature":3})", "temperature",
       "between"},
      {Endpoint::kChatCompletions,
       R"({"model":"m","messages":[{"role":"user","content":"x"}],"temperature":"hot"})",
       "temperature", "number"},
      {Endpoint::kChatCompletions,
       R"({"model":"m","messages":[{"role":"user","content":"x"}],"top_p":0})", "top_p",
       "greater than 0"},
      {Endpoint::kChatCompletions,
       R"({"model":"m","messages":[{"role":"user","content":"x"}],"seed":"s"})", "seed", "integer"},
      {Endpoint::kChatCompletions,
       R"({"model":"m","messages":[{"role":"user","content":"x"}],"n":17})", "n", "not supported"},
      {Endpoint::kChatCompletions,
       R"({"model":"m","messages":[{"role":"user","content":"x"}],"stop":5})", "stop", "string"},
      {Endpoint::kChatCompletions,
       R"({"model":"m","messages":[{"role":"user","content":"x"}],"stop":["a",1]})", "stop[1]",
       "stop[1]"},
      {Endpoint::kChatCompletions,
       R"({"model":"m","messages":[{"role":"user","content":"x"}],"stop":["a","b","c","d","e"]})",
       "stop", "at most 4"},
      {Endpoint::kChatCompletions,
       R"({"model":"m","messages":[{"role":"user","content":"x"}],"stream":"yes"})", "stream",
       "boolean"},
      {Endpoint::kChatCompletions,
       R"({"model":"m","messages":[{"role":"user","content":"x"}],"stream_options":{"include_usage":1}})",
       "stream_options.include_usage", "boolean"},
      {Endpoint::kChatCompletions,
       R"({"model":"m","messages":[{"role":"user","content":"x"}],"top_logprobs":2})",
       "top_logprobs", "requires 'logprobs'"},
      {Endpoint::kChatCompletions,
       R"({"model":"m","messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":21})",
       "top_logprobs", "between 0 and 20"},
      {Endpoint::kChatCompletions,
       R"({"model":"m","messages":[{"role":"user","content":"x"}],"logit_bias":{"x":1}})",
       "logit_bias", "token ids"},
      {Endpoint::kChatCompletions,
       R"({"model":"m","messages":[{"role":"user","content":"x"}],"logit_bias":{"5":101}})",
       "logit_bias", "between -100 and 100"},
      {Endpoint::kCompletions, R"({"model":"m","prompt":"x","logprobs":true})", "logprobs",
       "integer"},
      {Endpoint::kCompletions, R"({"model":"m","prompt":"x","logprobs":2,"echo":true})", "echo",
       "echo"},
      {Endpoint::kChatCompletions,
       R"({"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]})",
       "tools[0].function", "is required"},
      {Endpoint::kCompletions, R"({"model":"m"})", "prompt", "'prompt'"},
      {Endpoint::kCompletions, R"({"model":"m","prompt":["a",1]})", "prompt[1]", "string"},
      {Endpoint::kCompletions, R"({"model":"m","prompt":[[1],[]]})", "prompt[1]", "non-empty"},
      {Endpoint::kCompletions, R"({"model":"m","prompt":["a","b","c","d","e"],"n":4})", "prompt",
       "at most 16"},
      {Endpoint::kCompletions, R"({"model":"m","prompt":[1,"x"]})", "prompt[1]", "prompt[1]"},
      {Endpoint::kCompletions, R"({"model":"m","prompt":[-3]})", "prompt[0]", "token id"},
      {Endpoint::kCompletions, R"({"model":"m","prompt":{}})", "prompt", "string"},
      {Endpoint::kCompletions, R"({"model":"m","prompt":"x","best_of":3})", "best_of", "best_of"},
  };
  for (const auto& c : cases) {
    CompletionParams p;
    auto err = ParseCompletionRequest(c.endpoint, c.body, ApiLimits{}, &p);
    ASSERT_TRUE(err.has_value()) << c.body;
    EXPECT_EQ(err->http_status, 400) << c.body;
    EXPECT_EQ(err->param, c.param) << c.body << " -> " << err->message;
    EXPECT_NE(err->message.find(c.needle), std::string::npos) << c.body << " -> " << err->message;
  }
}

TEST(OpenAiApiTest, DeepNestingIsRejectedWithoutParsing) {
  std::string body = R"({"model":"m","messages":)" + std::string(100000, '[');
  CompletionParams p;
  auto err = ParseChat(body, &p);
  ASSERT_TRUE(err.has_value());
  EXPECT_NE(err->message.find("deeper"), std::string::npos);
  // Brackets inside strings do not count.
  std::string ok =
      R"({"model":"m","messages":[{"role":"user","content":")" + std::string(1000, '[') + R"("}]})";
  EXPECT_FALSE(ParseChat(ok, &p).has_value());
}

TEST(OpenAiApiTest, ErrorShape) {
  ApiError e = BadRequest("bad", "messages[0].role", "invalid_value");
  json j = ErrorToJson(e);
  EXPECT_EQ(j["error"]["message"], "bad");
  EXPECT_EQ(j["error"]["type"], "invalid_request_error");
  EXPECT_EQ(j["error"]["param"], "messages[0].role");
  EXPECT_EQ(j["error"]["code"], "invalid_value");
  json k = ErrorToJson(BadRequest("x"));
  EXPECT_TRUE(k["error"]["param"].is_null());
  EXPECT_TRUE(k["error"]["code"].is_null());
}

TEST(OpenAiApiTest, ResponseShapes) {
  ResponseIdentity id{"chatcmpl-1", 1700000000, "m"};
  UsageCounts u{10, 3, 4};
  json r = CompletionResponseJson(Endpoint::kChatCompletions, id, "hey", FinishReason::kLength, u);
  EXPECT_EQ(r["object"], "chat.completion");
  EXPECT_EQ(r["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(r["choices"][0]["message"]["content"], "hey");
  EXPECT_EQ(r["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(r["usage"]["total_tokens"], 13);
  EXPECT_EQ(r["usage"]["prompt_tokens_details"]["cached_tokens"], 4);
  json c = CompletionResponseJson(Endpoint::kCompletions, id, "hey", FinishReason::kStop, u);
  EXPECT_EQ(c["object"], "text_completion");
  EXPECT_EQ(c["choices"][0]["text"], "hey");
  EXPECT_EQ(c["choices"][0]["finish_reason"], "stop");

  json first = StreamChunkJson(Endpoint::kChatCompletions, id, "a", true, FinishReason::kNone);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(first["choices"][0]["delta"]["content"], "a");
  EXPECT_TRUE(first["choices"][0]["finish_reason"].is_null());
  json last = StreamChunkJson(Endpoint::kChatCompletions, id, "", false, FinishReason::kStop);
  EXPECT_FALSE(last["choices"][0]["delta"].contains("content"));
  EXPECT_EQ(last["choices"][0]["finish_reason"], "stop");
  json usage = UsageChunkJson(Endpoint::kChatCompletions, id, u);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 3);
}

TEST(OpenAiApiTest, DumpReplacesInvalidUtf8) {
  json j = {{"text", std::string("a\xff"
                                 "b")}};
  EXPECT_EQ(DumpJson(j),
            "{\"text\":\"a\xEF\xBF\xBD"
            "b\"}");
}

// #18: every field kvrelay does not implement is a 400 naming it, never a
// silent no-op: suffix and fields it does not know.
TEST(OpenAiApiTest, UnsupportedValuesAreRefusedByNameUnknownFieldsIgnored) {
  CompletionParams p;
  auto suffix = ParseCompl(R"({"model":"m","prompt":"a","suffix":"b"})", &p);
  ASSERT_TRUE(suffix.has_value());
  EXPECT_EQ(suffix->http_status, 400);
  EXPECT_EQ(suffix->param, "suffix");
  EXPECT_FALSE(ParseCompl(R"({"model":"m","prompt":"a","suffix":null})", &p).has_value());
  // #42: unknown fields are ignored (as vLLM), named for the server's warning.
  auto unknown = ParseChat(R"({"model":"m","messages":[{"role":"user","content":"x"}],
                               "frobnicate":1,"prediction":{}})",
                           &p);
  ASSERT_FALSE(unknown.has_value()) << unknown->message;
  EXPECT_EQ(p.ignored_fields, (std::vector<std::string>{"frobnicate", "prediction"}));
  // A completions-only field on chat is unknown there.
  ASSERT_FALSE(
      ParseChat(R"({"model":"m","messages":[{"role":"user","content":"x"}],"echo":true})", &p)
          .has_value());
  EXPECT_EQ(p.ignored_fields, std::vector<std::string>{"echo"});
  // max_tokens given or not is recorded (the server fills in what fits).
  ASSERT_FALSE(ParseCompl(R"({"model":"m","prompt":"a"})", &p).has_value());
  EXPECT_FALSE(p.max_tokens_given);
  ASSERT_FALSE(ParseCompl(R"({"model":"m","prompt":"a","max_tokens":3})", &p).has_value());
  EXPECT_TRUE(p.max_tokens_given);
}

// #18: logit_bias and logprobs land in the one SamplingParams the engine uses.
TEST(OpenAiApiTest, LogitBiasAndLogprobsAreParsedIntoSamplingParams) {
  CompletionParams p;
  ASSERT_FALSE(ParseChat(R"({"model":"m","messages":[{"role":"user","content":"x"}],
                             "logit_bias":{"42":-100,"7":5.5}})",
                         &p)
                   .has_value());
  ASSERT_EQ(p.sampling.logit_bias.size(), 2u);
  std::map<int32_t, float> bias(p.sampling.logit_bias.begin(), p.sampling.logit_bias.end());
  EXPECT_FLOAT_EQ(bias[42], -100.0f);
  EXPECT_FLOAT_EQ(bias[7], 5.5f);
  EXPECT_FALSE(p.logprobs);
  EXPECT_EQ(p.sampling.logprobs, -1);
  ASSERT_FALSE(ParseChat(R"({"model":"m","messages":[{"role":"user","content":"x"}],
                             "logprobs":true,"top_logprobs":3})",
                         &p)
                   .has_value());
  EXPECT_TRUE(p.logprobs);
  EXPECT_EQ(p.sampling.logprobs, 3);
  ASSERT_FALSE(ParseChat(R"({"model":"m","messages":[{"role":"user","content":"x"}],
                             "logprobs":true})",
                         &p)
                   .has_value());
  EXPECT_EQ(p.sampling.logprobs, 0);
  ASSERT_FALSE(ParseCompl(R"({"model":"m","prompt":"a","logprobs":5})", &p).has_value());
  EXPECT_TRUE(p.logprobs);
  EXPECT_EQ(p.sampling.logprobs, 5);
  ASSERT_FALSE(ParseCompl(R"({"model":"m","prompt":"a","logprobs":0})", &p).has_value());
  EXPECT_EQ(p.sampling.logprobs, 0);
}

TEST(OpenAiApiTest, LogprobsJsonShapes) {
  std::vector<LogprobEntry> entries = {{"Hi", -0.5f, {{"Hi", -0.5f}, {"Ho", -1.5f}}},
                                       {"!", -0.25f, {{"!", -0.25f}, {".", -2.0f}}}};
  json chat = LogprobsJson(Endpoint::kChatCompletions, entries);
  ASSERT_EQ(chat["content"].size(), 2u);
  EXPECT_EQ(chat["content"][0]["token"], "Hi");
  EXPECT_FLOAT_EQ(chat["content"][0]["logprob"].get<float>(), -0.5f);
  EXPECT_EQ(chat["content"][0]["bytes"], json::array({72, 105}));
  ASSERT_EQ(chat["content"][1]["top_logprobs"].size(), 2u);
  EXPECT_EQ(chat["content"][1]["top_logprobs"][1]["token"], ".");
  EXPECT_TRUE(chat["refusal"].is_null());
  json compl_json = LogprobsJson(Endpoint::kCompletions, entries, 10);
  EXPECT_EQ(compl_json["tokens"], json::array({"Hi", "!"}));
  EXPECT_EQ(compl_json["text_offset"], json::array({10, 12}));
  EXPECT_FLOAT_EQ(compl_json["top_logprobs"][0]["Ho"].get<float>(), -1.5f);
}

// #18: response_format: json_object and json_schema become the grammar the
// engine enforces (schema order kept); unsupported keywords are a 400 naming
// them.
TEST(OpenAiApiTest, ResponseFormatBecomesTheResponseGrammar) {
  CompletionParams p;
  ASSERT_FALSE(ParseChat(R"({"model":"m","messages":[{"role":"user","content":"x"}],
                             "response_format":{"type":"json_object"}})",
                         &p)
                   .has_value());
  EXPECT_EQ(p.sampling.json_schema, R"({"type":"object"})");
  ASSERT_FALSE(ParseChat(R"({"model":"m","messages":[{"role":"user","content":"x"}],
                             "response_format":{"type":"json_schema","json_schema":{"name":"n",
                             "strict":true,"schema":{"type":"object","properties":{
                             "zeta":{"type":"string"},"alpha":{"type":"integer"}}}}}})",
                         &p)
                   .has_value());
  EXPECT_EQ(
      p.sampling.json_schema,
      R"({"type":"object","properties":{"zeta":{"type":"string"},"alpha":{"type":"integer"}}})");
  ASSERT_FALSE(ParseChat(R"({"model":"m","messages":[{"role":"user","content":"x"}],
                             "response_format":{"type":"text"}})",
                         &p)
                   .has_value());
  EXPECT_TRUE(p.sampling.json_schema.empty());
  auto bad = ParseChat(R"({"model":"m","messages":[{"role":"user","content":"x"}],
                          "response_format":{"type":"json_schema","json_schema":{"name":"n",
                          "schema":{"type":"string","pattern":"a+"}}}})",
                       &p);
  ASSERT_TRUE(bad.has_value());
  EXPECT_EQ(bad->http_status, 400);
  EXPECT_EQ(bad->param, "response_format.json_schema.schema");
  EXPECT_NE(bad->message.find("'pattern'"), std::string::npos) << bad->message;
  auto missing = ParseChat(R"({"model":"m","messages":[{"role":"user","content":"x"}],
                              "response_format":{"type":"json_schema"}})",
                           &p);
  ASSERT_TRUE(missing.has_value());
  EXPECT_EQ(missing->param, "response_format.json_schema");
  auto other = ParseChat(R"({"model":"m","messages":[{"role":"user","content":"x"}],
                            "response_format":{"type":"yaml"}})",
                         &p);
  ASSERT_TRUE(other.has_value());
  EXPECT_EQ(other->param, "response_format.type");
  // Completions take it too (as vLLM).
  ASSERT_FALSE(
      ParseCompl(R"({"model":"m","prompt":"a","response_format":{"type":"json_object"}})", &p)
          .has_value());
  EXPECT_FALSE(p.sampling.json_schema.empty());
}

// #18: tools. Named and required choices become a tool-call grammar; the
// functions are described in the system message; history tool calls render.
TEST(OpenAiApiTest, ToolsAndToolChoice) {
  const std::string tools = R"("tools":[{"type":"function","function":{"name":"get_weather",
      "parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}},
      {"type":"function","function":{"name":"get_time"}}])";
  CompletionParams p;
  ASSERT_FALSE(
      ParseChat(R"({"model":"m","messages":[{"role":"user","content":"x"}],)" + tools +
                    R"(,"tool_choice":{"type":"function","function":{"name":"get_weather"}}})",
                &p)
          .has_value());
  EXPECT_EQ(p.tool_choice, ToolChoice::kNamed);
  EXPECT_NE(p.sampling.json_schema.find("x-kvrelay-tool-calls"), std::string::npos);
  EXPECT_EQ(p.sampling.json_schema.find("get_time"), std::string::npos);  // only the named one
  ASSERT_GE(p.messages.size(), 2u);
  EXPECT_EQ(p.messages[0].role, "system");
  EXPECT_NE(p.messages[0].content.find("get_weather"), std::string::npos);
  ASSERT_FALSE(ParseChat(R"({"model":"m","messages":[{"role":"user","content":"x"}],)" + tools +
                             R"(,"tool_choice":"required"})",
                         &p)
                   .has_value());
  EXPECT_EQ(p.tool_choice, ToolChoice::kRequired);
  EXPECT_NE(p.sampling.json_schema.find("get_time"), std::string::npos);
  ASSERT_FALSE(
      ParseChat(R"({"model":"m","messages":[{"role":"user","content":"x"}],)" + tools + "}", &p)
          .has_value());
  EXPECT_EQ(p.tool_choice, ToolChoice::kAuto);
  EXPECT_TRUE(p.sampling.json_schema.empty());
  ASSERT_FALSE(ParseChat(R"({"model":"m","messages":[{"role":"user","content":"x"}],)" + tools +
                             R"(,"tool_choice":"none"})",
                         &p)
                   .has_value());
  EXPECT_EQ(p.tool_choice, ToolChoice::kNone);
  EXPECT_EQ(p.messages.size(), 1u);  // nothing described
  auto unknown = ParseChat(R"({"model":"m","messages":[{"role":"user","content":"x"}],)" + tools +
                               R"(,"tool_choice":{"type":"function","function":{"name":"nope"}}})",
                           &p);
  ASSERT_TRUE(unknown.has_value());
  EXPECT_EQ(unknown->param, "tool_choice.function.name");
  auto bad_params = ParseChat(R"({"model":"m","messages":[{"role":"user","content":"x"}],
      "tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object",
      "properties":{"a":{"type":"string","pattern":"x"}}}}}]})",
                              &p);
  ASSERT_TRUE(bad_params.has_value());
  EXPECT_EQ(bad_params->param, "tools[0].function.parameters");
  // History: the assistant's call and the tool's answer.
  ASSERT_FALSE(ParseChat(R"({"model":"m","messages":[{"role":"user","content":"x"},
      {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function",
       "function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},
      {"role":"tool","tool_call_id":"c1","content":"sunny"}]})",
                         &p)
                   .has_value());
  ASSERT_EQ(p.messages.size(), 3u);
  EXPECT_EQ(
      p.messages[1].content,
      "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call>");
  EXPECT_EQ(p.messages[2].role, "tool");
  // Extraction.
  json calls = ExtractToolCalls(R"({"name":"f","arguments":{"a":1}})", ToolChoice::kNamed, "x");
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0]["function"]["name"], "f");
  EXPECT_EQ(calls[0]["function"]["arguments"], R"({"a":1})");
  EXPECT_TRUE(ExtractToolCalls("hello", ToolChoice::kAuto, "x").is_null());
  EXPECT_EQ(
      ExtractToolCalls("ok <tool_call>\n{\"name\":\"g\"}\n</tool_call>", ToolChoice::kAuto, "x")
          .size(),
      1u);
}

}  // namespace
}  // namespace kvrelay::coordinator
