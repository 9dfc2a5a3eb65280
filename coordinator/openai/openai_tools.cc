#include <string>

#include "coordinator/openai/openai_fields.h"
#include "engine/grammar/json_grammar.h"

namespace kvrelay::coordinator::api_fields {

using nlohmann::json;

// response_format: text, json_object (any JSON object), or json_schema
// (the schema compiled now, so an unsupported keyword is a 400 naming it).
std::optional<ApiError> ParseResponseFormat(const json& rf, std::string* schema_out) {
  if (!rf.is_object()) return WrongType("response_format", "an object", rf);
  const json* type = Field(rf, "type");
  if (type == nullptr) {
    return BadRequest("missing required parameter: 'response_format.type'", "response_format.type",
                      "missing_required_parameter");
  }
  if (!type->is_string()) return WrongType("response_format.type", "a string", *type);
  const std::string t = type->get<std::string>();
  if (t == "text") return std::nullopt;
  if (t == "json_object") {
    *schema_out = R"({"type":"object"})";
    return std::nullopt;
  }
  if (t != "json_schema") {
    return BadRequest(
        "'response_format.type' must be text, json_object or json_schema; got '" + t + "'",
        "response_format.type", "invalid_value");
  }
  const json* js = Field(rf, "json_schema");
  if (js == nullptr) {
    return BadRequest("missing required parameter: 'response_format.json_schema'",
                      "response_format.json_schema", "missing_required_parameter");
  }
  if (!js->is_object()) return WrongType("response_format.json_schema", "an object", *js);
  const json* schema = Field(*js, "schema");
  if (schema == nullptr) {
    return BadRequest("missing required parameter: 'response_format.json_schema.schema'",
                      "response_format.json_schema.schema", "missing_required_parameter");
  }
  if (const json* strict = Field(*js, "strict"); strict != nullptr && !strict->is_boolean()) {
    return WrongType("response_format.json_schema.strict", "a boolean", *strict);
  }
  const std::string text = schema->dump();
  auto compiled = engine::grammar::CompileJsonSchema(text);
  if (!compiled.ok()) {
    return BadRequest("response_format.json_schema.schema: " + compiled.status().message(),
                      "response_format.json_schema.schema", "unsupported_value");
  }
  *schema_out = text;
  return std::nullopt;
}

// tools / tool_choice: the functions are described to the model in a system
// message (SmolLM2's template has no tool syntax; as llama.cpp and vLLM do
// for such templates, a Hermes-style <tool_call> JSON convention); required
// and named choices are grammar-constrained to {"name","arguments"} with the
// function's parameters schema.
std::optional<ApiError> ParseTools(const json& body, std::string_view body_text,
                                   CompletionParams* out) {
  const json* tools = Field(body, "tools");
  const json* choice = Field(body, "tool_choice");
  if (tools == nullptr || (tools->is_array() && tools->empty())) {
    if (choice != nullptr && !(choice->is_string() && (*choice == "none" || *choice == "auto"))) {
      return BadRequest("'tool_choice' needs 'tools'", "tool_choice", "invalid_value");
    }
    return std::nullopt;
  }
  if (!tools->is_array()) return WrongType("tools", "an array", *tools);
  // Again in document order (the parameters' properties keep their order).
  nlohmann::ordered_json ordered = nlohmann::ordered_json::parse(body_text, nullptr, false);
  nlohmann::ordered_json grammar_tools = nlohmann::ordered_json::array();
  std::string described;
  std::vector<std::string> names;
  for (size_t i = 0; i < tools->size(); ++i) {
    const json& t = (*tools)[i];
    const std::string f = "tools[" + std::to_string(i) + "]";
    if (!t.is_object()) return WrongType(f, "an object", t);
    const json* type = Field(t, "type");
    if (type == nullptr || *type != "function") {
      return BadRequest("'" + f + ".type' must be 'function'", f + ".type", "invalid_value");
    }
    const json* fn = Field(t, "function");
    if (fn == nullptr || !fn->is_object()) {
      return BadRequest("'" + f + ".function' is required", f + ".function",
                        "missing_required_parameter");
    }
    const json* name = Field(*fn, "name");
    if (name == nullptr || !name->is_string() || name->get<std::string>().empty()) {
      return BadRequest("'" + f + ".function.name' is required", f + ".function.name",
                        "missing_required_parameter");
    }
    names.push_back(name->get<std::string>());
    nlohmann::ordered_json params = nlohmann::ordered_json::object();
    if (!ordered.is_discarded() && ordered["tools"][i]["function"].contains("parameters")) {
      params = ordered["tools"][i]["function"]["parameters"];
    }
    if (!params.empty()) {
      auto compiled = engine::grammar::CompileJsonSchema(params.dump());
      if (!compiled.ok()) {
        return BadRequest(f + ".function.parameters: " + compiled.status().message(),
                          f + ".function.parameters", "unsupported_value");
      }
    }
    grammar_tools.push_back({{"name", names.back()}, {"parameters", params}});
    nlohmann::ordered_json d = {{"name", names.back()}};
    if (const json* desc = Field(*fn, "description"); desc != nullptr && desc->is_string()) {
      d["description"] = desc->get<std::string>();
    }
    d["parameters"] = params;
    described += d.dump() + "\n";
  }
  out->tool_choice = ToolChoice::kAuto;
  if (choice != nullptr) {
    if (choice->is_string()) {
      const std::string c = choice->get<std::string>();
      if (c == "none") {
        out->tool_choice = ToolChoice::kNone;
      } else if (c == "required") {
        out->tool_choice = ToolChoice::kRequired;
      } else if (c != "auto") {
        return BadRequest(
            "'tool_choice' must be none, auto, required or a function; got '" + c + "'",
            "tool_choice", "invalid_value");
      }
    } else if (choice->is_object()) {
      const json* fn = Field(*choice, "function");
      const json* name = fn != nullptr && fn->is_object() ? Field(*fn, "name") : nullptr;
      if (name == nullptr || !name->is_string()) {
        return BadRequest("'tool_choice.function.name' is required", "tool_choice.function.name",
                          "missing_required_parameter");
      }
      const auto it = std::find(names.begin(), names.end(), name->get<std::string>());
      if (it == names.end()) {
        return BadRequest(
            "'tool_choice' names '" + name->get<std::string>() + "', which is not in 'tools'",
            "tool_choice.function.name", "invalid_value");
      }
      out->tool_choice = ToolChoice::kNamed;
      nlohmann::ordered_json one = nlohmann::ordered_json::array();
      one.push_back(grammar_tools[static_cast<size_t>(it - names.begin())]);
      grammar_tools = one;
    } else {
      return WrongType("tool_choice", "a string or an object", *choice);
    }
  }
  if (out->tool_choice == ToolChoice::kNone) return std::nullopt;  // as if no tools
  if (out->tool_choice != ToolChoice::kAuto) {
    if (!out->sampling.json_schema.empty()) {
      return BadRequest("'response_format' and a required tool call cannot be combined",
                        "tool_choice", "invalid_value");
    }
    out->sampling.json_schema =
        nlohmann::ordered_json{{"x-kvrelay-tool-calls", grammar_tools}}.dump();
  }
  std::string system =
      "You can call functions. To call one, reply with exactly\n<tool_call>\n"
      "{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}\n"
      "</tool_call>\nThe functions:\n" +
      described;
  if (out->tool_choice == ToolChoice::kRequired || out->tool_choice == ToolChoice::kNamed) {
    system += "Call " +
              (out->tool_choice == ToolChoice::kNamed
                   ? "the function " + grammar_tools[0]["name"].get<std::string>()
                   : std::string("one of the functions")) +
              " now; reply with its JSON only.\n";
  }
  // Into the first system message, or a new one in front.
  if (!out->messages.empty() && out->messages[0].role == "system") {
    out->messages[0].content += "\n\n" + system;
  } else {
    out->messages.insert(out->messages.begin(), ChatMessage{"system", system});
  }
  return std::nullopt;
}

}  // namespace kvrelay::coordinator::api_fields
