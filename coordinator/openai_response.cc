// OpenAI response bodies: completions and chat completions (whole and as
// stream chunks), usage, logprobs, the model list. The request side is
// openai_api.cc; both are declared in openai_api.h.
#include <string>
#include <vector>

#include "coordinator/openai_api.h"

namespace kvrelay::coordinator {

using json = nlohmann::json;

nlohmann::json FinishReasonJson(FinishReason r) {
  switch (r) {
    case FinishReason::kStop:
    case FinishReason::kCancelled:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kError:
      return "error";
    case FinishReason::kNone:
      break;
  }
  return nullptr;
}

nlohmann::json UsageJson(const UsageCounts& u) {
  return json{{"prompt_tokens", u.prompt_tokens},
              {"completion_tokens", u.completion_tokens},
              {"total_tokens", u.prompt_tokens + u.completion_tokens},
              {"prompt_tokens_details", {{"cached_tokens", u.cached_tokens}}}};
}

nlohmann::json CompletionResponseJson(Endpoint endpoint, const ResponseIdentity& ident,
                                      const std::string& text, FinishReason finish,
                                      const UsageCounts& usage) {
  return CompletionResponseJson(endpoint, ident, std::vector<ChoiceResult>{{text, finish, nullptr}},
                                usage);
}

nlohmann::json CompletionResponseJson(Endpoint endpoint, const ResponseIdentity& ident,
                                      const std::vector<ChoiceResult>& choices,
                                      const UsageCounts& usage) {
  json array = json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const ChoiceResult& c = choices[i];
    if (endpoint == Endpoint::kChatCompletions) {
      array.push_back(json{{"index", i},
                           {"message", {{"role", "assistant"}, {"content", c.text}}},
                           {"logprobs", c.logprobs},
                           {"finish_reason", FinishReasonJson(c.finish)}});
      if (!c.tool_calls.is_null()) {
        array.back()["message"]["content"] = nullptr;
        array.back()["message"]["tool_calls"] = c.tool_calls;
        array.back()["finish_reason"] = "tool_calls";
      }
    } else {
      array.push_back(json{{"index", i},
                           {"text", c.text},
                           {"logprobs", c.logprobs},
                           {"finish_reason", FinishReasonJson(c.finish)}});
    }
  }
  return json{
      {"id", ident.id},
      {"object", endpoint == Endpoint::kChatCompletions ? "chat.completion" : "text_completion"},
      {"created", ident.created},
      {"model", ident.model},
      {"choices", array},
      {"usage", UsageJson(usage)}};
}

nlohmann::json StreamChunkJson(Endpoint endpoint, const ResponseIdentity& ident,
                               const std::string& delta, bool first, FinishReason finish, int index,
                               nlohmann::json logprobs) {
  json choice;
  if (endpoint == Endpoint::kChatCompletions) {
    json d = json::object();
    if (first) d["role"] = "assistant";
    if (!delta.empty() || (first && finish == FinishReason::kNone)) d["content"] = delta;
    choice = json{{"index", index},
                  {"delta", d},
                  {"logprobs", logprobs},
                  {"finish_reason", FinishReasonJson(finish)}};
  } else {
    choice = json{{"index", index},
                  {"text", delta},
                  {"logprobs", logprobs},
                  {"finish_reason", FinishReasonJson(finish)}};
  }
  return json{{"id", ident.id},
              {"object", endpoint == Endpoint::kChatCompletions ? "chat.completion.chunk"
                                                                : "text_completion"},
              {"created", ident.created},
              {"model", ident.model},
              {"choices", json::array({choice})}};
}

namespace {
json BytesJson(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(static_cast<int>(c));
  return b;
}
}  // namespace

nlohmann::json LogprobsJson(Endpoint endpoint, const std::vector<LogprobEntry>& entries,
                            size_t offset) {
  if (endpoint == Endpoint::kChatCompletions) {
    json content = json::array();
    for (const LogprobEntry& e : entries) {
      json top = json::array();
      for (const auto& [tok, lp] : e.top) {
        top.push_back(json{{"token", tok}, {"logprob", lp}, {"bytes", BytesJson(tok)}});
      }
      content.push_back(json{{"token", e.token},
                             {"logprob", e.logprob},
                             {"bytes", BytesJson(e.token)},
                             {"top_logprobs", top}});
    }
    return json{{"content", content}, {"refusal", nullptr}};
  }
  json tokens = json::array();
  json token_logprobs = json::array();
  json top_logprobs = json::array();
  json text_offset = json::array();
  for (const LogprobEntry& e : entries) {
    tokens.push_back(e.token);
    token_logprobs.push_back(e.logprob);
    json top = json::object();
    // Two alternatives may render as the same text; the more likely one wins.
    for (const auto& [tok, lp] : e.top) {
      if (!top.contains(tok)) top[tok] = lp;
    }
    top_logprobs.push_back(top);
    text_offset.push_back(offset);
    offset += e.token.size();
  }
  return json{{"tokens", tokens},
              {"token_logprobs", token_logprobs},
              {"top_logprobs", top_logprobs},
              {"text_offset", text_offset}};
}

nlohmann::json ExtractToolCalls(const std::string& text, ToolChoice choice,
                                const std::string& id_prefix) {
  std::vector<json> calls;
  auto add = [&](const std::string& body) {
    json v = json::parse(body, nullptr, false);
    if (v.is_discarded() || !v.is_object() || !v.contains("name") || !v["name"].is_string()) {
      return;
    }
    json args = v.contains("arguments") ? v["arguments"] : json::object();
    calls.push_back(json{{"id", "call_" + id_prefix + "_" + std::to_string(calls.size())},
                         {"type", "function"},
                         {"function", {{"name", v["name"]}, {"arguments", args.dump()}}}});
  };
  if (choice == ToolChoice::kRequired || choice == ToolChoice::kNamed) {
    add(text);
  } else if (choice == ToolChoice::kAuto) {
    const std::string open = "<tool_call>", close = "</tool_call>";
    for (size_t at = text.find(open); at != std::string::npos; at = text.find(open, at + 1)) {
      const size_t end = text.find(close, at);
      if (end == std::string::npos) break;
      add(text.substr(at + open.size(), end - at - open.size()));
    }
  }
  if (calls.empty()) return nullptr;
  return json(calls);
}

nlohmann::json UsageChunkJson(Endpoint endpoint, const ResponseIdentity& ident,
                              const UsageCounts& usage) {
  return json{{"id", ident.id},
              {"object", endpoint == Endpoint::kChatCompletions ? "chat.completion.chunk"
                                                                : "text_completion"},
              {"created", ident.created},
              {"model", ident.model},
              {"choices", json::array()},
              {"usage", UsageJson(usage)}};
}

nlohmann::json ModelsJson(const std::string& model, int64_t created) {
  return json{
      {"object", "list"},
      {"data",
       json::array({json{
           {"id", model}, {"object", "model"}, {"created", created}, {"owned_by", "kvrelay"}}})}};
}

std::string DumpJson(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace kvrelay::coordinator
