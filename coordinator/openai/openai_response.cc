// OpenAI response bodies: completions and chat completions (whole and as
// stream chunks), usage, logprobs, the model list. The request side is
// openai_api.cc; both are declared in openai_api.h.
#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

#include "coordinator/openai/openai_api.h"

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
        // Text the model wrote besides its calls stays (as OpenAI and vLLM).
        if (c.text.empty()) array.back()["message"]["content"] = nullptr;
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

namespace {

constexpr std::string_view kOpenTag = "<tool_call>";
constexpr std::string_view kCloseTag = "</tool_call>";

// Length of the longest proper prefix of a tag (2 bytes at least) that `s`
// ends with: the start of a tag the answer was cut inside.
size_t PartialTagTail(std::string_view s) {
  size_t best = 0;
  for (std::string_view tag : {kOpenTag, kCloseTag}) {
    for (size_t k = std::min(tag.size() - 1, s.size()); k >= 2 && k > best; --k) {
      if (s.substr(s.size() - k) == tag.substr(0, k)) {
        best = k;
        break;
      }
    }
  }
  return best;
}

std::string_view Trim(std::string_view s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

}  // namespace

ToolCallSplit SplitToolCalls(const std::string& text, ToolChoice choice,
                             const std::string& id_prefix) {
  std::vector<json> calls;
  // One call from {"name", "arguments"} ("parameters" as some models write
  // it); arguments given as a string are passed on as they are.
  auto add = [&](std::string_view body) {
    json v = json::parse(Trim(body), nullptr, false);
    if (v.is_discarded() || !v.is_object() || !v.contains("name") || !v["name"].is_string()) {
      return;
    }
    json args = v.contains("arguments")    ? v["arguments"]
                : v.contains("parameters") ? v["parameters"]
                                           : json::object();
    calls.push_back(
        json{{"id", "call_" + id_prefix + "_" + std::to_string(calls.size())},
             {"type", "function"},
             {"function",
              {{"name", v["name"]}, {"arguments", args.is_string() ? args : json(args.dump())}}}});
  };
  ToolCallSplit out;
  if (choice == ToolChoice::kRequired || choice == ToolChoice::kNamed) {
    add(text);  // the whole answer is the grammar-constrained call
  } else {
    std::string content;
    bool cut = false;
    const std::string_view t(text);
    size_t pos = 0;
    while (pos < t.size()) {
      const size_t open = t.find(kOpenTag, pos);
      const size_t stray = t.find(kCloseTag, pos);
      if (stray < open) {  // a close without an open: dropped
        content.append(t.substr(pos, stray - pos));
        pos = stray + kCloseTag.size();
        cut = true;
        continue;
      }
      if (open == std::string_view::npos) {
        std::string_view rest = t.substr(pos);
        const size_t tail = PartialTagTail(rest);
        cut = cut || tail > 0;
        content.append(rest.substr(0, rest.size() - tail));
        break;
      }
      content.append(t.substr(pos, open - pos));
      cut = true;
      const size_t body = open + kOpenTag.size();
      const size_t close = t.find(kCloseTag, body);
      // An unterminated block runs to the end; its JSON may still be whole.
      if (choice == ToolChoice::kAuto)
        add(t.substr(body, close == std::string_view::npos ? t.npos : close - body));
      pos = close == std::string_view::npos ? t.size() : close + kCloseTag.size();
    }
    out.content = cut ? std::string(Trim(content)) : content;
  }
  if (!calls.empty()) {
    out.tool_calls = json(calls);
    if (out.content.is_string() && out.content.get<std::string>().empty()) out.content = nullptr;
  } else if (out.content.is_null()) {
    out.content = text;  // required / named, but not a call after all
  }
  return out;
}

nlohmann::json ExtractToolCalls(const std::string& text, ToolChoice choice,
                                const std::string& id_prefix) {
  if (choice == ToolChoice::kNone) return nullptr;
  return SplitToolCalls(text, choice, id_prefix).tool_calls;
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

nlohmann::json ModelsJson(const std::string& model, int64_t created, int64_t max_model_len) {
  json entry = {{"id", model}, {"object", "model"}, {"created", created}, {"owned_by", "kvrelay"}};
  if (max_model_len > 0) {
    entry["max_model_len"] = max_model_len;
    entry["context_length"] = max_model_len;
  }
  return json{{"object", "list"}, {"data", json::array({entry})}};
}

std::string DumpJson(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace kvrelay::coordinator
