#include "coordinator/openai/openai_fields.h"

#include <cmath>
#include <limits>

namespace kvrelay::coordinator::api_fields {

using nlohmann::json;

const char* TypeName(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "boolean";
    case json::value_t::string:
      return "string";
    case json::value_t::array:
      return "array";
    case json::value_t::object:
      return "object";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      return "integer";
    case json::value_t::number_float:
      return "number";
    default:
      return "unknown";
  }
}

ApiError WrongType(const std::string& field, const char* expected, const json& v) {
  return BadRequest("'" + field + "' must be " + expected + ", got " + TypeName(v), field,
                    "invalid_type");
}

// Present and not null.
const json* Field(const json& obj, const char* name) {
  auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<ApiError> GetNumber(const json& obj, const char* name, double lo, double hi,
                                  std::optional<double>* out) {
  const json* v = Field(obj, name);
  if (v == nullptr) return std::nullopt;
  if (!v->is_number()) return WrongType(name, "a number", *v);
  double d = v->get<double>();
  if (!std::isfinite(d) || d < lo || d > hi) {
    return BadRequest("'" + std::string(name) + "' must be between " + json(lo).dump() + " and " +
                          json(hi).dump() + ", got " + v->dump(),
                      name, "invalid_value");
  }
  *out = d;
  return std::nullopt;
}

std::optional<ApiError> GetInt(const json& obj, const char* name, int64_t lo, int64_t hi,
                               std::optional<int64_t>* out) {
  const json* v = Field(obj, name);
  if (v == nullptr) return std::nullopt;
  int64_t value = 0;
  if (v->is_number_integer()) {
    if (v->is_number_unsigned() &&
        v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      value = std::numeric_limits<int64_t>::max();
    } else {
      value = v->get<int64_t>();
    }
  } else if (v->is_number_float() && std::floor(v->get<double>()) == v->get<double>() &&
             std::fabs(v->get<double>()) < 9e15) {
    value = static_cast<int64_t>(v->get<double>());  // 16.0 is an integer in JSON
  } else {
    return WrongType(name, "an integer", *v);
  }
  if (value < lo || value > hi) {
    return BadRequest("'" + std::string(name) + "' must be between " + std::to_string(lo) +
                          " and " + std::to_string(hi) + ", got " + v->dump(),
                      name, "invalid_value");
  }
  *out = value;
  return std::nullopt;
}

std::optional<ApiError> GetBool(const json& obj, const char* name, bool* out) {
  const json* v = Field(obj, name);
  if (v == nullptr) return std::nullopt;
  if (!v->is_boolean()) return WrongType(name, "a boolean", *v);
  *out = v->get<bool>();
  return std::nullopt;
}

}  // namespace kvrelay::coordinator::api_fields
