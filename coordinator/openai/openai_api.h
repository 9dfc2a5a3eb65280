// The OpenAI-compatible request and response shapes: parsing and validating
// /v1/chat/completions and /v1/completions bodies, and building responses,
// stream chunks and error objects the official clients accept.
//
// Also the tokenizer endpoints (/tokenize, /detokenize) and the model-name
// check every endpoint shares.
//
// Pure functions over nlohmann::json and a TextCodec, thread-safe; the only
// I/O is LogIgnoredFields' warning.
#pragma once

#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "coordinator/backend.h"
#include "coordinator/openai/text_codec.h"

namespace kvrelay::coordinator {

// An error answered to the client as {"error":{"message","type","param","code"}}.
struct ApiError {
  int http_status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // the offending field ("messages[1].content"), "" = null
  std::string code;   // machine-readable code, "" = null
};

nlohmann::json ErrorToJson(const ApiError& e);
ApiError BadRequest(std::string message, std::string param = "", std::string code = "");

enum class Endpoint { kChatCompletions, kCompletions };

struct ApiLimits {
  // When the request gives none: this many, lowered to what fits the
  // context and KV pool (never refused for it); 0 = all the remaining context
  // (as vLLM).
  int max_tokens_default = 0;
  // A larger max_tokens is a 400 when parsing. The real bound is the server's:
  // the context (ServerOptions::max_context_tokens) minus the prompt.
  int max_tokens_limit = std::numeric_limits<int32_t>::max();
  int max_stop_strings = 4;  // as OpenAI
  int max_stop_string_bytes = 256;
  int max_n = 16;  // n > max_n is a 400 (each choice is a request of its own)
  // Names a request's `model` may give besides ServerOptions::model_name
  // (the first --served-model-name, which responses echo): the other served
  // names, the model file's name and the GGUF's general.name. An omitted or
  // empty `model` means the served model (as vLLM).
  std::vector<std::string> model_aliases;
};

// Nullopt when `requested` names the served model (`served` or an alias, or
// is empty); else OpenAI's 404 model_not_found.
std::optional<ApiError> CheckModel(std::string_view requested, const std::string& served,
                                   const ApiLimits& limits);

// Warns (once per field name for the process) that a request field is not
// understood and was ignored, as vLLM does.
void LogIgnoredFields(const std::vector<std::string>& fields);

// tool_choice (kNone also when the request has no tools).
enum class ToolChoice { kNone, kAuto, kRequired, kNamed };

inline SamplingParams ApiDefaultSampling() {
  SamplingParams s;
  s.temperature = 1.0f;
  return s;
}

// A validated generation request, before tokenization.
struct CompletionParams {
  Endpoint endpoint = Endpoint::kChatCompletions;
  std::string model;
  std::vector<ChatMessage> messages;      // chat
  std::string prompt;                     // completions, text prompt
  std::vector<int32_t> prompt_token_ids;  // completions, pre-tokenized prompt
  bool prompt_is_tokens = false;
  // completions with several prompts (an array of strings or of token
  // arrays): every prompt, the first one also in prompt / prompt_token_ids.
  // Choice i * n + j answers prompt i (OpenAI's order).
  std::vector<std::string> batch_prompts;
  std::vector<std::vector<int32_t>> batch_prompt_token_ids;
  int batch_size() const {
    return static_cast<int>(prompt_is_tokens ? std::max<size_t>(1, batch_prompt_token_ids.size())
                                             : std::max<size_t>(1, batch_prompts.size()));
  }
  int max_tokens = 0;
  bool max_tokens_given = false;  // false: the server may lower max_tokens to what fits
  // temperature, top_p, top_k, min_p, penalties, ignore_eos, logit_bias,
  // logprobs and json_schema; max_tokens and seed are set when the request is
  // built (below are the values the client gave). OpenAI's default
  // temperature is 1.
  SamplingParams sampling = ApiDefaultSampling();
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  int n = 1;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  bool echo = false;           // completions: prepend the prompt to the text
  // logprobs asked for: chat `logprobs: true` (top_logprobs in
  // sampling.logprobs), completions `logprobs: k` (k alternatives).
  bool logprobs = false;
  // Chat with tools: the functions are described in the system message;
  // required / named calls are constrained by sampling.json_schema.
  ToolChoice tool_choice = ToolChoice::kNone;
  // Tools were offered or the history holds tool calls: the answer may carry
  // <tool_call> blocks, which never reach `content` (SplitToolCalls).
  bool tool_markup = false;
  // Top-level fields not understood, ignored (for LogIgnoredFields).
  std::vector<std::string> ignored_fields;
};

// The tool calls in a chat answer: for kRequired / kNamed the whole text is
// {"name","arguments"}; for kAuto the <tool_call>...</tool_call> blocks.
// Returns the OpenAI "tool_calls" array (ids "call_<prefix>_<i>"), or null
// when the text holds none.
nlohmann::json ExtractToolCalls(const std::string& text, ToolChoice choice,
                                const std::string& id_prefix);

// A chat answer split into what the client sees: `content` (a string, or
// null when nothing but tool calls) and `tool_calls` (as ExtractToolCalls).
// For kAuto and kNone every <tool_call> fragment is cut from the content:
// complete blocks, a block the answer ended inside, a stray </tool_call> and
// a partial tag at the very end; with kNone no call is made of them (the
// client asked for none). An unterminated block still counts as a call when
// its JSON is complete (the model stopped at EOS before closing it).
struct ToolCallSplit {
  nlohmann::json content;
  nlohmann::json tool_calls;
};
ToolCallSplit SplitToolCalls(const std::string& text, ToolChoice choice,
                             const std::string& id_prefix);

// Parses and validates a body. On failure returns the error naming the field;
// the model name is not checked here (see the server: 404 for unknown models).
std::optional<ApiError> ParseCompletionRequest(Endpoint endpoint, std::string_view body,
                                               const ApiLimits& limits, CompletionParams* out);

// OpenAI finish_reason string ("stop", "length"), or null when not finished.
nlohmann::json FinishReasonJson(FinishReason r);

struct UsageCounts {
  int prompt_tokens = 0;
  int completion_tokens = 0;
  int cached_tokens = 0;
};
nlohmann::json UsageJson(const UsageCounts& u);

// Identity of one response: "chatcmpl-<hex>" / "cmpl-<hex>", created (unix seconds).
struct ResponseIdentity {
  std::string id;
  int64_t created = 0;
  std::string model;
};

// Full non-streaming body with one choice ...
nlohmann::json CompletionResponseJson(Endpoint endpoint, const ResponseIdentity& ident,
                                      const std::string& text, FinishReason finish,
                                      const UsageCounts& usage);
// ... or with n (choice i has "index": i).
struct ChoiceResult {
  std::string text;
  FinishReason finish = FinishReason::kNone;
  nlohmann::json logprobs = nullptr;    // LogprobsJson(...) when asked for
  nlohmann::json tool_calls = nullptr;  // ExtractToolCalls(...): then content is null
};

// One generated token's log-probabilities, rendered for the client.
struct LogprobEntry {
  std::string token;  // the token's bytes (may be an incomplete UTF-8 sequence)
  float logprob = 0.0f;
  std::vector<std::pair<std::string, float>> top;  // most likely first
};
// The "logprobs" object of a choice or a stream chunk: chat
// {"content": [{token, logprob, bytes, top_logprobs}], "refusal": null};
// completions {"tokens", "token_logprobs", "top_logprobs", "text_offset"},
// `text_offset` counting from `offset` (bytes of text before these tokens).
nlohmann::json LogprobsJson(Endpoint endpoint, const std::vector<LogprobEntry>& entries,
                            size_t offset = 0);
nlohmann::json CompletionResponseJson(Endpoint endpoint, const ResponseIdentity& ident,
                                      const std::vector<ChoiceResult>& choices,
                                      const UsageCounts& usage);
// One streaming chunk with a text delta of choice `index`; `first` adds
// role:"assistant" for chat.
nlohmann::json StreamChunkJson(Endpoint endpoint, const ResponseIdentity& ident,
                               const std::string& delta, bool first, FinishReason finish,
                               int index = 0, nlohmann::json logprobs = nullptr);
// The final usage-only chunk (choices: []), for stream_options.include_usage.
nlohmann::json UsageChunkJson(Endpoint endpoint, const ResponseIdentity& ident,
                              const UsageCounts& usage);

// GET /v1/models body; each entry carries max_model_len (as vLLM) and
// context_length (as OpenRouter and LM Studio) when `max_model_len` > 0.
nlohmann::json ModelsJson(const std::string& model, int64_t created, int64_t max_model_len = 0);

// POST /tokenize, vLLM's shapes: {model?, prompt, add_special_tokens?} or
// {model?, messages, add_generation_prompt?, add_special_tokens?} ->
// {tokens, count, max_model_len}. Sets *out, or returns the error (400
// naming the field, 404 for another model).
std::optional<ApiError> TokenizeJson(std::string_view body, const TextCodec& codec,
                                     const std::string& served_model, const ApiLimits& limits,
                                     int64_t max_model_len, nlohmann::json* out);
// POST /detokenize: {model?, tokens} -> {prompt}; an id outside the
// vocabulary is a 400 naming it.
std::optional<ApiError> DetokenizeJson(std::string_view body, const TextCodec& codec,
                                       const std::string& served_model, const ApiLimits& limits,
                                       nlohmann::json* out);

// Serializes without throwing: invalid UTF-8 becomes U+FFFD.
std::string DumpJson(const nlohmann::json& j);

}  // namespace kvrelay::coordinator
