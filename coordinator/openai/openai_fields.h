// Internal to the OpenAI request parser: typed JSON field getters that turn
// a wrong type or range into the 400 the API returns, and the parsers of the
// structured-output and tool fields (openai_tools.cc). Not part of the
// coordinator's interface; included by openai_api.cc and openai_tools.cc.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "coordinator/openai/openai_api.h"

namespace kvrelay::coordinator::api_fields {

// The JSON type name used in error messages ("integer", "object", ...).
const char* TypeName(const nlohmann::json& v);
ApiError WrongType(const std::string& field, const char* expected, const nlohmann::json& v);
// The member `name` when it is present and not null, else nullptr.
const nlohmann::json* Field(const nlohmann::json& obj, const char* name);
// Each leaves *out untouched when the field is absent or null.
std::optional<ApiError> GetNumber(const nlohmann::json& obj, const char* name, double lo, double hi,
                                  std::optional<double>* out);
std::optional<ApiError> GetInt(const nlohmann::json& obj, const char* name, int64_t lo, int64_t hi,
                               std::optional<int64_t>* out);
std::optional<ApiError> GetBool(const nlohmann::json& obj, const char* name, bool* out);

// response_format: text, json_object or json_schema (compiled now).
std::optional<ApiError> ParseResponseFormat(const nlohmann::json& rf, std::string* schema_out);
// tools / tool_choice: rendered into the system message, constrained when required or named.
std::optional<ApiError> ParseTools(const nlohmann::json& body, std::string_view body_text,
                                   CompletionParams* out);

}  // namespace kvrelay::coordinator::api_fields
