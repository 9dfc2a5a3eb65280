#include "coordinator/openai/openai_api.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <set>

#include "common/logging.h"
#include "coordinator/openai/openai_fields.h"

namespace kvrelay::coordinator {
namespace {

using api_fields::Field;
using api_fields::GetBool;
using api_fields::GetInt;
using api_fields::GetNumber;
using api_fields::ParseResponseFormat;
using api_fields::ParseTools;
using api_fields::TypeName;
using api_fields::WrongType;
using nlohmann::json;

constexpr int kMaxJsonDepth = 64;

// Rejects nesting deeper than kMaxJsonDepth before the parser sees it, so a
// body of a million '[' cannot exhaust memory or stack anywhere downstream.
bool DepthWithin(std::string_view body, int max_depth) {
  int depth = 0;
  bool in_string = false;
  bool escape = false;
  for (char c : body) {
    if (in_string) {
      if (escape) {
        escape = false;
      } else if (c == '\\') {
        escape = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return false;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return true;
}

std::optional<ApiError> ParseContent(const json& content, const std::string& field,
                                     std::string* out) {
  if (content.is_string()) {
    *out = content.get<std::string>();
    return std::nullopt;
  }
  if (!content.is_array())
    return WrongType(field, "a string or an array of content parts", content);
  out->clear();
  for (size_t j = 0; j < content.size(); ++j) {
    const json& part = content[j];
    std::string pf = field + "[" + std::to_string(j) + "]";
    if (!part.is_object()) return WrongType(pf, "an object", part);
    const json* type = Field(part, "type");
    if (type == nullptr)
      return BadRequest("missing required parameter: '" + pf + ".type'", pf + ".type",
                        "missing_required_parameter");
    if (!type->is_string()) return WrongType(pf + ".type", "a string", *type);
    if (type->get<std::string>() != "text") {
      return BadRequest(
          "content part type '" + type->get<std::string>() + "' is not supported (only 'text')",
          pf + ".type", "unsupported_value");
    }
    const json* text = Field(part, "text");
    if (text == nullptr)
      return BadRequest("missing required parameter: '" + pf + ".text'", pf + ".text",
                        "missing_required_parameter");
    if (!text->is_string()) return WrongType(pf + ".text", "a string", *text);
    *out += text->get<std::string>();
  }
  return std::nullopt;
}

std::optional<ApiError> ParseMessages(const json& body, std::vector<ChatMessage>* out) {
  const json* messages = Field(body, "messages");
  if (messages == nullptr) {
    return BadRequest("missing required parameter: 'messages'", "messages",
                      "missing_required_parameter");
  }
  if (!messages->is_array()) return WrongType("messages", "an array", *messages);
  if (messages->empty())
    return BadRequest("'messages' must not be empty", "messages", "invalid_value");
  for (size_t i = 0; i < messages->size(); ++i) {
    const json& m = (*messages)[i];
    std::string field = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) return WrongType(field, "an object", m);
    const json* role = Field(m, "role");
    if (role == nullptr)
      return BadRequest("missing required parameter: '" + field + ".role'", field + ".role",
                        "missing_required_parameter");
    if (!role->is_string()) return WrongType(field + ".role", "a string", *role);
    std::string r = role->get<std::string>();
    if (r != "system" && r != "user" && r != "assistant" && r != "developer" && r != "tool") {
      return BadRequest(
          "'" + field + ".role' must be one of system, developer, user, assistant, tool; got '" +
              r + "'",
          field + ".role", "invalid_value");
    }
    ChatMessage msg;
    msg.role = r == "developer" ? "system" : r;
    const json* content = Field(m, "content");
    if (content == nullptr) {
      if (r != "assistant") {
        return BadRequest("missing required parameter: '" + field + ".content'", field + ".content",
                          "missing_required_parameter");
      }
    } else if (auto err = ParseContent(*content, field + ".content", &msg.content)) {
      return err;
    }
    // Tool calls the assistant made, rendered as the model is asked to write
    // them (RenderTools).
    if (const json* calls = Field(m, "tool_calls"); calls != nullptr && r == "assistant") {
      if (!calls->is_array()) return WrongType(field + ".tool_calls", "an array", *calls);
      for (size_t k = 0; k < calls->size(); ++k) {
        const json& c = (*calls)[k];
        const std::string cf = field + ".tool_calls[" + std::to_string(k) + "]";
        const json* fn = c.is_object() ? Field(c, "function") : nullptr;
        if (fn == nullptr || !fn->is_object() || Field(*fn, "name") == nullptr ||
            !(*fn)["name"].is_string()) {
          return BadRequest("'" + cf + ".function.name' is required", cf + ".function.name",
                            "missing_required_parameter");
        }
        json args = json::object();
        if (const json* a = Field(*fn, "arguments")) {
          args = a->is_string() ? json::parse(a->get<std::string>(), nullptr, false) : *a;
          if (args.is_discarded()) {
            return BadRequest("'" + cf + ".function.arguments' is not valid JSON",
                              cf + ".function.arguments", "invalid_value");
          }
        }
        msg.content += std::string(msg.content.empty() ? "" : "\n") + "<tool_call>\n" +
                       "{\"name\":" + (*fn)["name"].dump() + ",\"arguments\":" + args.dump() + "}" +
                       "\n</tool_call>";
      }
    }
    out->push_back(std::move(msg));
  }
  return std::nullopt;
}

std::optional<ApiError> ParsePrompt(const json& body, CompletionParams* out) {
  const json* prompt = Field(body, "prompt");
  if (prompt == nullptr) {
    return BadRequest("missing required parameter: 'prompt'", "prompt",
                      "missing_required_parameter");
  }
  if (prompt->is_string()) {
    out->prompt = prompt->get<std::string>();
    return std::nullopt;
  }
  if (!prompt->is_array()) {
    return WrongType("prompt", "a string, an array of strings or an array of token ids", *prompt);
  }
  if (prompt->empty()) return BadRequest("'prompt' must not be empty", "prompt", "invalid_value");
  if ((*prompt)[0].is_string()) {
    for (size_t i = 0; i < prompt->size(); ++i) {
      const json& t = (*prompt)[i];
      if (!t.is_string()) {
        return WrongType("prompt[" + std::to_string(i) + "]", "a string (like prompt[0])", t);
      }
      out->batch_prompts.push_back(t.get<std::string>());
    }
    out->prompt = out->batch_prompts.front();
    if (out->batch_prompts.size() == 1) out->batch_prompts.clear();
    return std::nullopt;
  }
  auto token_ids = [](const json& arr, const std::string& where,
                      std::vector<int32_t>* ids) -> std::optional<ApiError> {
    if (!arr.is_array() || arr.empty())
      return WrongType(where, "a non-empty array of token ids", arr);
    for (size_t i = 0; i < arr.size(); ++i) {
      const json& t = arr[i];
      std::string field = where + "[" + std::to_string(i) + "]";
      if (!t.is_number_integer()) return WrongType(field, "an integer token id", t);
      int64_t id = t.get<int64_t>();
      if (id < 0 || id > std::numeric_limits<int32_t>::max()) {
        return BadRequest("'" + field + "' is not a valid token id", field, "invalid_value");
      }
      ids->push_back(static_cast<int32_t>(id));
    }
    return std::nullopt;
  };
  out->prompt_is_tokens = true;
  if ((*prompt)[0].is_array()) {
    for (size_t i = 0; i < prompt->size(); ++i) {
      std::vector<int32_t> ids;
      if (auto err = token_ids((*prompt)[i], "prompt[" + std::to_string(i) + "]", &ids)) {
        return err;
      }
      out->batch_prompt_token_ids.push_back(std::move(ids));
    }
    out->prompt_token_ids = out->batch_prompt_token_ids.front();
    if (out->batch_prompt_token_ids.size() == 1) out->batch_prompt_token_ids.clear();
    return std::nullopt;
  }
  return token_ids(*prompt, "prompt", &out->prompt_token_ids);
}

// OpenAI logit_bias: {"<token id>": bias in [-100, 100]}. Ids are checked
// against the vocabulary by the engine (the parser does not know it).
std::optional<ApiError> ParseLogitBias(const json& lb,
                                       std::vector<std::pair<int32_t, float>>* out) {
  if (!lb.is_object()) return WrongType("logit_bias", "an object", lb);
  constexpr size_t kMaxEntries = 1024;
  if (lb.size() > kMaxEntries) {
    return BadRequest("'logit_bias' has " + std::to_string(lb.size()) + " entries; at most " +
                          std::to_string(kMaxEntries) + " are allowed",
                      "logit_bias", "invalid_value");
  }
  for (const auto& [key, value] : lb.items()) {
    const std::string field = "logit_bias." + key;
    int64_t id = -1;
    bool digits = !key.empty() && key.size() <= 9;
    for (char c : key) digits = digits && c >= '0' && c <= '9';
    if (digits) id = std::stoll(key);
    if (id < 0) {
      return BadRequest(
          "'logit_bias' keys must be token ids (non-negative integers), got '" + key + "'",
          "logit_bias", "invalid_value");
    }
    if (!value.is_number()) return WrongType(field, "a number", value);
    const double bias = value.get<double>();
    if (!std::isfinite(bias) || bias < -100.0 || bias > 100.0) {
      return BadRequest("'" + field + "' must be between -100 and 100, got " + value.dump(),
                        "logit_bias", "invalid_value");
    }
    out->emplace_back(static_cast<int32_t>(id), static_cast<float>(bias));
  }
  return std::nullopt;
}

// The body as a JSON object, or the 400 for it.
std::optional<ApiError> ParseBody(std::string_view body_text, json* body) {
  if (!DepthWithin(body_text, kMaxJsonDepth)) {
    return BadRequest(
        "request body nests JSON deeper than " + std::to_string(kMaxJsonDepth) + " levels", "",
        "invalid_json");
  }
  try {
    *body = json::parse(body_text);
  } catch (const json::exception& e) {
    return BadRequest(std::string("request body is not valid JSON: ") + e.what(), "",
                      "invalid_json");
  }
  if (!body->is_object()) {
    return BadRequest(std::string("request body must be a JSON object, got ") + TypeName(*body), "",
                      "invalid_json");
  }
  return std::nullopt;
}

// `model`: optional (absent or null: the served model, as vLLM), a string when given.
std::optional<ApiError> GetModel(const json& body, std::string* out) {
  out->clear();
  const json* model = Field(body, "model");
  if (model == nullptr) return std::nullopt;
  if (!model->is_string()) return WrongType("model", "a string", *model);
  *out = model->get<std::string>();
  return std::nullopt;
}

// Tools offered, or a tool call in the history: the model may write
// <tool_call> blocks (see SplitToolCalls).
bool HasToolMarkup(const json& body) {
  if (const json* tools = Field(body, "tools"); tools != nullptr && tools->is_array()) {
    if (!tools->empty()) return true;
  }
  const json* messages = Field(body, "messages");
  if (messages == nullptr || !messages->is_array()) return false;
  for (const json& m : *messages) {
    if (m.is_object() && Field(m, "tool_calls") != nullptr) return true;
  }
  return false;
}

// The request fields ParseCompletionRequest understands (some only in their
// no-op form, e.g. logprobs false, best_of 1, tools []); their types are
// checked. `user` is the caller's end-user id, which OpenAI uses for abuse
// monitoring only. Every other field is ignored with a warning.
bool KnownField(Endpoint endpoint, std::string_view key) {
  static constexpr std::string_view kCommon[] = {"model",
                                                 "max_tokens",
                                                 "temperature",
                                                 "top_p",
                                                 "presence_penalty",
                                                 "frequency_penalty",
                                                 "repetition_penalty",
                                                 "min_p",
                                                 "top_k",
                                                 "seed",
                                                 "n",
                                                 "stop",
                                                 "stream",
                                                 "stream_options",
                                                 "ignore_eos",
                                                 "logit_bias",
                                                 "logprobs",
                                                 "response_format",
                                                 "user"};
  static constexpr std::string_view kChat[] = {"messages",     "max_completion_tokens",
                                               "tools",        "tool_choice",
                                               "top_logprobs", "parallel_tool_calls"};
  static constexpr std::string_view kCompletions[] = {"prompt", "echo", "best_of", "suffix"};
  for (auto k : kCommon)
    if (k == key) return true;
  if (endpoint == Endpoint::kChatCompletions) {
    for (auto k : kChat)
      if (k == key) return true;
  } else {
    for (auto k : kCompletions)
      if (k == key) return true;
  }
  return false;
}

}  // namespace

ApiError BadRequest(std::string message, std::string param, std::string code) {
  ApiError e;
  e.http_status = 400;
  e.message = std::move(message);
  e.param = std::move(param);
  e.code = std::move(code);
  return e;
}

nlohmann::json ErrorToJson(const ApiError& e) {
  json err = {{"message", e.message}, {"type", e.type}};
  err["param"] = e.param.empty() ? json(nullptr) : json(e.param);
  err["code"] = e.code.empty() ? json(nullptr) : json(e.code);
  return json{{"error", err}};
}

std::optional<ApiError> ParseCompletionRequest(Endpoint endpoint, std::string_view body_text,
                                               const ApiLimits& limits, CompletionParams* out) {
  *out = CompletionParams();
  out->endpoint = endpoint;
  json body;
  if (auto err = ParseBody(body_text, &body)) return err;

  if (auto err = GetModel(body, &out->model)) return err;

  if (endpoint == Endpoint::kChatCompletions) {
    if (auto err = ParseMessages(body, &out->messages)) return err;
    out->tool_markup = HasToolMarkup(body);
  } else {
    if (auto err = ParsePrompt(body, out)) return err;
  }

  // max_completion_tokens (new name) wins over max_tokens (deprecated for chat).
  std::optional<int64_t> max_tokens;
  if (auto err = GetInt(body, "max_tokens", 1, limits.max_tokens_limit, &max_tokens)) return err;
  if (endpoint == Endpoint::kChatCompletions) {
    std::optional<int64_t> mct;
    if (auto err = GetInt(body, "max_completion_tokens", 1, limits.max_tokens_limit, &mct))
      return err;
    if (mct) max_tokens = mct;
  }
  out->max_tokens_given = max_tokens.has_value();
  out->max_tokens = static_cast<int>(max_tokens.value_or(limits.max_tokens_default));

  std::optional<double> d;
  if (auto err = GetNumber(body, "temperature", 0.0, 2.0, &d)) return err;
  if (d) out->sampling.temperature = static_cast<float>(*d);
  d.reset();
  if (auto err = GetNumber(body, "top_p", 0.0, 1.0, &d)) return err;
  if (d) {
    if (*d <= 0.0) return BadRequest("'top_p' must be greater than 0", "top_p", "invalid_value");
    out->sampling.top_p = static_cast<float>(*d);
  }
  d.reset();
  if (auto err = GetNumber(body, "presence_penalty", -2.0, 2.0, &d)) return err;
  if (d) out->sampling.presence_penalty = static_cast<float>(*d);
  d.reset();
  if (auto err = GetNumber(body, "frequency_penalty", -2.0, 2.0, &d)) return err;
  if (d) out->sampling.frequency_penalty = static_cast<float>(*d);
  d.reset();
  // vLLM extensions.
  if (auto err = GetNumber(body, "repetition_penalty", 0.01, 100.0, &d)) return err;
  if (d) out->sampling.repetition_penalty = static_cast<float>(*d);
  d.reset();
  if (auto err = GetNumber(body, "min_p", 0.0, 1.0, &d)) return err;
  if (d) out->sampling.min_p = static_cast<float>(*d);
  d.reset();

  std::optional<int64_t> i;
  if (auto err = GetInt(body, "top_k", -1, 1 << 20, &i)) return err;
  if (i) out->sampling.top_k = static_cast<int>(std::max<int64_t>(0, *i));
  i.reset();
  if (auto err = GetInt(body, "seed", std::numeric_limits<int64_t>::min(),
                        std::numeric_limits<int64_t>::max(), &i)) {
    return err;
  }
  if (i) out->seed = static_cast<uint64_t>(*i);
  i.reset();
  if (auto err = GetInt(body, "n", 1, 128, &i)) return err;
  if (i) {
    if (*i > limits.max_n) {
      return BadRequest(
          "'n' > " + std::to_string(limits.max_n) + " is not supported; send separate requests",
          "n", "unsupported_value");
    }
    out->n = static_cast<int>(*i);
  }
  if (out->batch_size() * out->n > limits.max_n) {
    return BadRequest(std::to_string(out->batch_size()) +
                          " prompts x n = " + std::to_string(out->n) + " choices; at most " +
                          std::to_string(limits.max_n) + " per request",
                      "prompt", "unsupported_value");
  }

  if (const json* stop = Field(body, "stop")) {
    if (stop->is_string()) {
      out->stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (size_t k = 0; k < stop->size(); ++k) {
        std::string field = "stop[" + std::to_string(k) + "]";
        if (!(*stop)[k].is_string()) return WrongType(field, "a string", (*stop)[k]);
        out->stop.push_back((*stop)[k].get<std::string>());
      }
    } else {
      return WrongType("stop", "a string or an array of strings", *stop);
    }
    if (static_cast<int>(out->stop.size()) > limits.max_stop_strings) {
      return BadRequest("'stop' has " + std::to_string(out->stop.size()) + " entries; at most " +
                            std::to_string(limits.max_stop_strings) + " are allowed",
                        "stop", "invalid_value");
    }
    for (size_t k = 0; k < out->stop.size(); ++k) {
      const std::string& s = out->stop[k];
      if (s.empty() || static_cast<int>(s.size()) > limits.max_stop_string_bytes) {
        return BadRequest("'stop[" + std::to_string(k) + "]' must be 1 to " +
                              std::to_string(limits.max_stop_string_bytes) + " bytes",
                          "stop", "invalid_value");
      }
    }
  }

  if (auto err = GetBool(body, "stream", &out->stream)) return err;
  if (auto err = GetBool(body, "ignore_eos", &out->sampling.ignore_eos)) return err;
  if (const json* so = Field(body, "stream_options")) {
    if (!so->is_object()) return WrongType("stream_options", "an object", *so);
    if (const json* iu = Field(*so, "include_usage")) {
      if (!iu->is_boolean()) return WrongType("stream_options.include_usage", "a boolean", *iu);
      out->include_usage = iu->get<bool>();
    }
  }
  if (const json* lb = Field(body, "logit_bias")) {
    if (auto err = ParseLogitBias(*lb, &out->sampling.logit_bias)) return err;
  }
  if (endpoint == Endpoint::kCompletions) {
    if (Field(body, "suffix") != nullptr && !Field(body, "suffix")->is_null()) {
      return BadRequest("'suffix' (text insertion) is not supported", "suffix",
                        "unsupported_value");
    }
    if (auto err = GetBool(body, "echo", &out->echo)) return err;
    // Completions: logprobs is the number of alternatives (0 = the sampled
    // token's only).
    std::optional<int64_t> lp;
    if (auto err = GetInt(body, "logprobs", 0, engine::kMaxTopLogprobs, &lp)) return err;
    if (lp) {
      out->logprobs = true;
      out->sampling.logprobs = static_cast<int>(*lp);
    }
    if (out->echo && out->logprobs) {
      return BadRequest("'echo' together with 'logprobs' (prompt logprobs) is not supported",
                        "echo", "unsupported_value");
    }
    if (const json* bo = Field(body, "best_of")) {
      if (!bo->is_number_integer()) return WrongType("best_of", "an integer", *bo);
      if (bo->get<int64_t>() != 1)
        return BadRequest("'best_of' other than 1 is not supported", "best_of",
                          "unsupported_value");
    }
  } else {
    if (auto err = GetBool(body, "logprobs", &out->logprobs)) return err;
    std::optional<int64_t> top;
    if (auto err = GetInt(body, "top_logprobs", 0, engine::kMaxTopLogprobs, &top)) return err;
    if (top && !out->logprobs) {
      return BadRequest("'top_logprobs' requires 'logprobs' to be true", "top_logprobs",
                        "invalid_value");
    }
    if (out->logprobs) out->sampling.logprobs = static_cast<int>(top.value_or(0));
  }
  if (const json* rf = Field(body, "response_format")) {
    if (auto err = ParseResponseFormat(*rf, &out->sampling.json_schema)) return err;
    if (!out->sampling.json_schema.empty() && Field(*rf, "json_schema") != nullptr) {
      // Again in document order: the output writes properties in the order
      // the schema lists them (json sorts object keys).
      auto ordered = nlohmann::ordered_json::parse(body_text, nullptr, false);
      if (!ordered.is_discarded()) {
        out->sampling.json_schema = ordered["response_format"]["json_schema"]["schema"].dump();
      }
    }
  }
  if (endpoint == Endpoint::kChatCompletions) {
    if (auto err = ParseTools(body, body_text, out)) return err;
  }
  // Fields not understood above are ignored, as vLLM and llama-server do
  // (clients send store, metadata, reasoning_effort, ... unasked); the server
  // warns about each name once (LogIgnoredFields).
  for (const auto& [key, value] : body.items()) {
    if (!KnownField(endpoint, key)) out->ignored_fields.push_back(key);
  }
  return std::nullopt;
}

std::optional<ApiError> CheckModel(std::string_view requested, const std::string& served,
                                   const ApiLimits& limits) {
  if (requested.empty() || requested == served) return std::nullopt;
  for (const std::string& alias : limits.model_aliases) {
    if (requested == alias) return std::nullopt;
  }
  ApiError e;
  e.http_status = 404;
  e.type = "invalid_request_error";
  e.message = "The model '" + std::string(requested) + "' does not exist (this server serves '" +
              served + "')";
  e.param = "model";
  e.code = "model_not_found";
  return e;
}

void LogIgnoredFields(const std::vector<std::string>& fields) {
  if (fields.empty()) return;
  // Bounded: a client sending random names cannot grow the set forever.
  constexpr size_t kMaxRemembered = 1024;
  static std::mutex mutex;
  static std::set<std::string, std::less<>> warned;  // guarded by mutex
  std::lock_guard<std::mutex> lock(mutex);
  for (const std::string& f : fields) {
    if (warned.size() >= kMaxRemembered || !warned.insert(f).second) continue;
    LOG_WARNING << "the request field '" << f.substr(0, 64)
                << "' is not supported and was ignored (warned once per field name)";
  }
}

std::optional<ApiError> TokenizeJson(std::string_view body_text, const TextCodec& codec,
                                     const std::string& served_model, const ApiLimits& limits,
                                     int64_t max_model_len, nlohmann::json* out) {
  json body;
  if (auto err = ParseBody(body_text, &body)) return err;
  std::string model;
  if (auto err = GetModel(body, &model)) return err;
  if (auto err = CheckModel(model, served_model, limits)) return err;
  const bool chat = Field(body, "messages") != nullptr;
  if (!chat && Field(body, "prompt") == nullptr) {
    return BadRequest("missing required parameter: 'prompt' (or 'messages')", "prompt",
                      "missing_required_parameter");
  }
  bool add_special = !chat;  // vLLM's defaults: true for a prompt, false for messages
  bool add_generation_prompt = true;
  bool token_strs = false;
  if (auto err = GetBool(body, "add_special_tokens", &add_special)) return err;
  if (auto err = GetBool(body, "add_generation_prompt", &add_generation_prompt)) return err;
  if (auto err = GetBool(body, "return_token_strs", &token_strs)) return err;
  Result<std::vector<int32_t>> tokens = std::vector<int32_t>();
  std::vector<std::string> ignored;
  if (chat) {
    std::vector<ChatMessage> messages;
    if (auto err = ParseMessages(body, &messages)) return err;
    tokens = codec.EncodeChatTemplate(messages, add_generation_prompt);
  } else {
    const json& prompt = body["prompt"];
    if (!prompt.is_string()) return WrongType("prompt", "a string", prompt);
    tokens = codec.Encode(prompt.get<std::string>(), add_special);
  }
  if (!tokens.ok()) {
    return BadRequest("cannot tokenize: " + tokens.status().message(),
                      chat ? "messages" : "prompt");
  }
  static constexpr std::string_view kKnown[] = {"model",
                                                "prompt",
                                                "messages",
                                                "add_special_tokens",
                                                "add_generation_prompt",
                                                "return_token_strs"};
  for (const auto& [key, value] : body.items()) {
    if (std::find(std::begin(kKnown), std::end(kKnown), key) == std::end(kKnown)) {
      ignored.push_back(key);
    }
  }
  LogIgnoredFields(ignored);
  *out = json{{"tokens", *tokens},
              {"count", tokens->size()},
              {"max_model_len", max_model_len > 0 ? json(max_model_len) : json(nullptr)}};
  if (token_strs) {
    json strs = json::array();
    for (int32_t t : *tokens) strs.push_back(codec.TokenPiece(t));
    (*out)["token_strs"] = strs;
  }
  return std::nullopt;
}

std::optional<ApiError> DetokenizeJson(std::string_view body_text, const TextCodec& codec,
                                       const std::string& served_model, const ApiLimits& limits,
                                       nlohmann::json* out) {
  json body;
  if (auto err = ParseBody(body_text, &body)) return err;
  std::string model;
  if (auto err = GetModel(body, &model)) return err;
  if (auto err = CheckModel(model, served_model, limits)) return err;
  const json* tokens = Field(body, "tokens");
  if (tokens == nullptr) {
    return BadRequest("missing required parameter: 'tokens'", "tokens",
                      "missing_required_parameter");
  }
  if (!tokens->is_array()) return WrongType("tokens", "an array of token ids", *tokens);
  const int64_t vocab = codec.VocabSize();
  std::vector<int32_t> ids;
  ids.reserve(tokens->size());
  for (size_t i = 0; i < tokens->size(); ++i) {
    const json& t = (*tokens)[i];
    const std::string field = "tokens[" + std::to_string(i) + "]";
    if (!t.is_number_integer()) return WrongType(field, "an integer token id", t);
    const bool negative = t.is_number_integer() && !t.is_number_unsigned() && t.get<int64_t>() < 0;
    const uint64_t id = negative ? 0 : t.get<uint64_t>();
    if (negative || id > static_cast<uint64_t>(std::numeric_limits<int32_t>::max()) ||
        (vocab > 0 && id >= static_cast<uint64_t>(vocab))) {
      return BadRequest("token id " + t.dump() + " (" + field + ") is out of the vocabulary [0, " +
                            (vocab > 0 ? std::to_string(vocab) : std::string("2^31")) + ")",
                        field, "invalid_value");
    }
    ids.push_back(static_cast<int32_t>(id));
  }
  std::vector<std::string> ignored;
  for (const auto& [key, value] : body.items()) {
    if (key != "model" && key != "tokens") ignored.push_back(key);
  }
  LogIgnoredFields(ignored);
  *out = json{{"prompt", codec.Decode(ids)}};
  return std::nullopt;
}

}  // namespace kvrelay::coordinator
