// What tests/integration/coordinator/openai_client_check.py (the official
// `openai` Python client against a running coordinator) must report, whatever
// backend serves it: response objects and roles, streaming equal to
// non-streaming, the models list, 404 / 400 errors and n = 2 choices.
// Shared by the coordinator and the cluster integration tests.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>

namespace kvrelay::testing {

inline void ExpectOpenAiClientReport(const nlohmann::json& j, const std::string& model,
                                     size_t completion_prompt_tokens) {
  using nlohmann::json;
  EXPECT_EQ(j["chat"]["object"], "chat.completion");
  EXPECT_EQ(j["chat"]["role"], "assistant");
  EXPECT_FALSE(j["chat"]["content"].get<std::string>().empty());
  EXPECT_EQ(j["chat_stream"]["content"], j["chat"]["content"]);
  EXPECT_EQ(j["chat_stream"]["finish_reason"], j["chat"]["finish_reason"]);
  EXPECT_EQ(j["chat_stream"]["completion_tokens"], j["chat"]["completion_tokens"]);
  EXPECT_EQ(j["completion"]["object"], "text_completion");
  EXPECT_FALSE(j["completion"]["text"].get<std::string>().empty());
  EXPECT_EQ(j["completion_stream"]["text"], j["completion"]["text"]);
  EXPECT_EQ(j["completion"]["prompt_tokens"], completion_prompt_tokens);
  EXPECT_EQ(j["models"], json::array({model}));
  EXPECT_EQ(j["unknown_model"]["status"], 404);
  EXPECT_EQ(j["bad_max_tokens"]["status"], 400);
  EXPECT_EQ(j["bad_max_tokens"]["param"], "max_tokens");
  // n = 2, greedy: two choices, indexes 0 and 1, the same text.
  EXPECT_EQ(j["n_choices"]["indexes"], json::array({0, 1}));
  EXPECT_EQ(j["n_choices"]["same"], true);
  EXPECT_EQ(j["n_choices"]["completion_tokens"], 8);
  // #18: logprobs. Greedy: the sampled token is the most likely one; the
  // token pieces make up the text; the stream reports the same tokens.
  const json& lp = j["chat_logprobs"];
  ASSERT_EQ(lp["tokens"].size(), lp["completion_tokens"].get<size_t>()) << lp.dump();
  std::string joined;
  for (const auto& t : lp["tokens"]) joined += t.get<std::string>();
  EXPECT_EQ(joined, lp["text"]);
  for (size_t i = 0; i < lp["tokens"].size(); ++i) {
    EXPECT_LE(lp["logprobs"][i].get<double>(), 0.0);
    EXPECT_EQ(lp["top_sizes"][i], 2);
    EXPECT_NEAR(lp["top_first"][i].get<double>(), lp["logprobs"][i].get<double>(), 1e-6);
  }
  EXPECT_EQ(lp["bytes_ok"], true);
  EXPECT_EQ(j["chat_logprobs_stream"]["tokens"], lp["tokens"]);
  ASSERT_EQ(j["chat_logprobs_stream"]["logprobs"].size(), lp["logprobs"].size());
  for (size_t i = 0; i < lp["logprobs"].size(); ++i) {
    EXPECT_NEAR(j["chat_logprobs_stream"]["logprobs"][i].get<double>(),
                lp["logprobs"][i].get<double>(), 1e-4);
  }
  const json& clp = j["completion_logprobs"];
  EXPECT_EQ(clp["tokens"].size(), 8u);
  EXPECT_EQ(clp["text"], j["completion"]["text"]);
  for (const auto& n : clp["top_sizes"]) EXPECT_GE(n.get<int>(), 1);
  // #18: tools.
  const json& tn = j["tool_named"];
  EXPECT_EQ(tn["finish_reason"], "tool_calls");
  EXPECT_TRUE(tn["content"].is_null());
  EXPECT_EQ(tn["name"], "get_weather");
  EXPECT_EQ(tn["type"], "function");
  EXPECT_EQ(tn["id"].get<std::string>().rfind("call_", 0), 0u);
  EXPECT_TRUE(tn["args"]["city"].is_string()) << tn.dump();
  EXPECT_TRUE(tn["args"]["unit"] == "celsius" || tn["args"]["unit"] == "fahrenheit") << tn.dump();
  const json& tr = j["tool_required"];
  EXPECT_TRUE(tr["name"] == "get_weather" || tr["name"] == "get_time") << tr.dump();
  EXPECT_TRUE(tr["args"].is_object()) << tr.dump();
  EXPECT_EQ(j["tool_stream"]["name"], "get_weather");
  EXPECT_EQ(j["tool_stream"]["args"], tn["args"]);
  EXPECT_EQ(j["tool_stream"]["finish_reason"], "tool_calls");
  EXPECT_TRUE(j["tool_followup"]["tool_calls"].is_null());
  EXPECT_FALSE(j["tool_followup"]["content"].get<std::string>().empty());
  // logit_bias +100 on one token: it is all the model says.
  EXPECT_EQ(j["logit_bias"]["completion_tokens"], 4);
  EXPECT_NE(j["logit_bias"]["text"], j["completion"]["text"]);
  // Structured output: valid for the strict schema, whole and streamed alike.
  const auto& so = j["structured"];
  ASSERT_TRUE(so["parsed"].is_object()) << so.dump();
  EXPECT_EQ(so["parsed"].size(), 2u) << so.dump();
  EXPECT_TRUE(so["parsed"]["city"].is_string()) << so.dump();
  EXPECT_TRUE(so["parsed"]["population"].is_number_integer()) << so.dump();
  EXPECT_EQ(so["finish_reason"], "stop") << so.dump();
  EXPECT_EQ(so["stream_equal"], true) << so.dump();
  // A prompt array: one choice per prompt, each as if sent alone.
  EXPECT_EQ(j["prompt_array"]["indices"], nlohmann::json::array({0, 1}));
  EXPECT_EQ(j["prompt_array"]["second_equals_solo"], true);
  EXPECT_GT(j["prompt_array"]["prompt_tokens"].get<int>(), 8);
}

}  // namespace kvrelay::testing
