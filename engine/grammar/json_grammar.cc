#include "engine/grammar/json_grammar.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>

namespace kvrelay::engine::grammar {

// Ordered: properties are written in the order the schema lists them.
using json = nlohmann::ordered_json;

// ---------------------------------------------------------------- the automaton
//
// A state is a stack of frames; the top frame reads the next byte. A frame
// whose value is complete pops itself; values that end only when a byte
// that cannot continue them arrives (numbers, literals with a longer
// alternative) pop and hand that byte to their parent (Step::kRefeed). A
// parent sets its own "after the child" phase before pushing the child.

enum class Kind : uint8_t {
  kAny,         // any JSON value: becomes one of the kinds below at its first byte
  kUnion,       // one of several kinds with distinct first bytes (type: [...])
  kObject,      // closed object: properties in schema order, optional ones may be left out
  kFreeObject,  // any keys; every value matches `value`
  kArray,
  kString,
  kNumber,
  kInteger,
  kLiteral,  // one of fixed texts: enum, const, true/false, null
  kTagged,   // a tool call: one of `{"name":"<fn>","arguments":` then that function's
             // arguments, then '}'
};

struct JsonGrammar::Node {
  Kind kind = Kind::kAny;
  // kObject: `"key":` literals, value nodes, required flags.
  std::vector<std::string> keys;
  std::vector<uint32_t> values;
  std::vector<bool> required;
  // kFreeObject: value node. kArray: item node.
  uint32_t child = 0;
  int32_t min_items = 0;
  int32_t max_items = -1;  // -1 = unbounded
  // kString
  int32_t min_len = 0;
  int32_t max_len = -1;
  // kLiteral; kTagged: the prefixes, with `values` the argument nodes
  std::vector<std::string> alternatives;
  // kUnion: node by first byte class (0 = none)
  uint32_t on_object = 0, on_array = 0, on_string = 0, on_number = 0, on_true_false = 0,
           on_null = 0;
};

JsonGrammar::JsonGrammar() = default;
JsonGrammar::~JsonGrammar() = default;

namespace {

// Node ids every grammar has.
constexpr uint32_t kAnyNode = 0;
constexpr uint32_t kAnyObjectNode = 1;
constexpr uint32_t kAnyArrayNode = 2;
constexpr uint32_t kAnyStringNode = 3;
constexpr uint32_t kAnyNumberNode = 4;
constexpr uint32_t kAnyLiteralNode = 5;  // true, false, null

// Bounds that keep a small model from writing forever inside one value and
// keep the state space (the mask cache) finite.
constexpr int kMaxIntDigits = 15;
constexpr int kMaxFracDigits = 9;
constexpr int kMaxExpDigits = 2;  // 1e99 at most: every value fits a double
constexpr size_t kMaxDepth = 32;  // frames on the stack
constexpr const char* kToolCallsKeyword = "x-kvrelay-tool-calls";

bool IsDigit(uint8_t c) { return c >= '0' && c <= '9'; }
bool IsHex(uint8_t c) { return IsDigit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

// Among `alts` (indices [lo, hi]), the first one that agrees with alts[cur]
// on its first `b` bytes and has `byte` at b; -1 if none.
int NextAlternative(const std::vector<std::string>& alts, int lo, int hi, int cur, int b,
                    uint8_t byte) {
  for (int j = lo; j <= hi; ++j) {
    const std::string& s = alts[j];
    if (static_cast<int>(s.size()) <= b || static_cast<uint8_t>(s[b]) != byte) continue;
    if (b > 0 && s.compare(0, b, alts[cur], 0, b) != 0) continue;
    return j;
  }
  return -1;
}

// True when some alternative in [lo, hi] extends alts[cur] (of length b).
bool LongerAlternative(const std::vector<std::string>& alts, int lo, int hi, int cur, int b) {
  for (int j = lo; j <= hi; ++j) {
    if (static_cast<int>(alts[j].size()) > b && alts[j].compare(0, b, alts[cur], 0, b) == 0) {
      return true;
    }
  }
  return false;
}

// Object phases.
enum : uint8_t {
  kObjOpen = 0,
  kObjFirst = 1,  // after '{'
  kObjKey = 2,    // inside a `"key":` literal
  kObjAfter = 3,  // after a value
  kObjComma = 4,  // after ','
  kObjColon = 5,  // free object: after the key string
};

}  // namespace

GrammarState JsonGrammar::Start() const {
  GrammarState st;
  st.reserve(8);
  st.push_back(GrammarFrame{root_, 0, 0, 0, 0});
  return st;
}

bool JsonGrammar::PushChild(GrammarState* st, uint32_t node, uint8_t phase) const {
  if (st->size() >= kMaxDepth) return false;
  st->push_back(GrammarFrame{node, phase, 0, 0, 0});
  return true;
}

bool JsonGrammar::Feed(GrammarState* st, uint8_t byte) const {
  while (!st->empty()) {
    switch (StepFrame(st, byte)) {
      case Step::kOk:
        return true;
      case Step::kReject:
        return false;
      case Step::kRefeed:
        continue;  // the frame popped (or replaced itself): the byte goes on
    }
  }
  return false;  // complete: nothing more is accepted
}

bool JsonGrammar::FeedAll(GrammarState* st, std::string_view bytes) const {
  for (char c : bytes) {
    if (!Feed(st, static_cast<uint8_t>(c))) return false;
  }
  return true;
}

JsonGrammar::Step JsonGrammar::StepFrame(GrammarState* st, uint8_t c) const {
  GrammarFrame& f = st->back();
  const Node& n = nodes_[f.node];
  auto pop = [&] {
    st->pop_back();
    return Step::kOk;
  };
  auto pop_refeed = [&] {
    st->pop_back();
    return Step::kRefeed;
  };
  switch (n.kind) {
    case Kind::kAny:
    case Kind::kUnion: {
      uint32_t next = 0;
      if (n.kind == Kind::kAny) {
        if (c == '{') next = kAnyObjectNode;
        if (c == '[') next = kAnyArrayNode;
        if (c == '"') next = kAnyStringNode;
        if (c == '-' || IsDigit(c)) next = kAnyNumberNode;
        if (c == 't' || c == 'f' || c == 'n') next = kAnyLiteralNode;
      } else {
        if (c == '{') next = n.on_object;
        if (c == '[') next = n.on_array;
        if (c == '"') next = n.on_string;
        if (c == '-' || IsDigit(c)) next = n.on_number;
        if (c == 't' || c == 'f') next = n.on_true_false;
        if (c == 'n') next = n.on_null;
      }
      if (next == 0) return Step::kReject;
      f = GrammarFrame{next, 0, 0, 0, 0};
      return Step::kRefeed;
    }
    case Kind::kObject: {
      const int count = static_cast<int>(n.keys.size());
      // The last candidate a key may be: up to the first required property.
      auto window_end = [&](int from) {
        int hi = from;
        while (hi < count && !n.required[hi]) ++hi;
        return std::min(hi, count - 1);
      };
      auto none_required_from = [&](int from) {
        for (int i = from; i < count; ++i) {
          if (n.required[i]) return false;
        }
        return true;
      };
      switch (f.phase) {
        case kObjOpen:
          if (c != '{') return Step::kReject;
          f.phase = kObjFirst;
          f.a = 0;
          return Step::kOk;
        case kObjFirst:
        case kObjComma: {
          if (c == '}' && f.phase == kObjFirst && none_required_from(f.a)) return pop();
          if (c != '"' || f.a >= count) return Step::kReject;
          const int j = NextAlternative(n.keys, f.a, window_end(f.a), f.a, 0, c);
          if (j < 0) return Step::kReject;
          f.phase = kObjKey;
          f.c = j;
          f.b = 1;
          return Step::kOk;
        }
        case kObjKey: {
          const int j = NextAlternative(n.keys, f.a, window_end(f.a), f.c, f.b, c);
          if (j < 0) return Step::kReject;
          f.c = j;
          ++f.b;
          if (f.b < static_cast<int>(n.keys[j].size())) return Step::kOk;
          // `"key":` complete (keys are distinct and all end with ':').
          f.phase = kObjAfter;
          f.a = j + 1;
          f.b = 0;
          return PushChild(st, n.values[j]) ? Step::kOk : Step::kReject;
        }
        case kObjAfter:
          if (c == ',' && f.a < count) {
            f.phase = kObjComma;
            return Step::kOk;
          }
          if (c == '}' && none_required_from(f.a)) return pop();
          return Step::kReject;
      }
      return Step::kReject;
    }
    case Kind::kFreeObject:
      switch (f.phase) {
        case kObjOpen:
          if (c != '{') return Step::kReject;
          f.phase = kObjFirst;
          return Step::kOk;
        case kObjFirst:
        case kObjComma:
          if (c == '}' && f.phase == kObjFirst) return pop();
          if (c != '"') return Step::kReject;
          f.phase = kObjColon;
          return PushChild(st, kAnyStringNode, /*phase=*/1) ? Step::kOk : Step::kReject;
        case kObjColon:
          if (c != ':') return Step::kReject;
          f.phase = kObjAfter;
          return PushChild(st, n.child) ? Step::kOk : Step::kReject;
        case kObjAfter:
          if (c == ',') {
            f.phase = kObjComma;
            return Step::kOk;
          }
          if (c == '}') return pop();
          return Step::kReject;
      }
      return Step::kReject;
    case Kind::kArray:
      // a = items so far.
      switch (f.phase) {
        case 0:
          if (c != '[') return Step::kReject;
          f.phase = 1;
          return Step::kOk;
        case 1:  // after '['
          if (c == ']') return n.min_items == 0 ? pop() : Step::kReject;
          if (n.max_items == 0) return Step::kReject;
          f.phase = 2;
          f.a = 1;
          return PushChild(st, n.child) ? Step::kRefeed : Step::kReject;
        case 2:  // after an item
          if (c == ',' && (n.max_items < 0 || f.a < n.max_items)) {
            f.phase = 3;
            return Step::kOk;
          }
          if (c == ']' && f.a >= n.min_items) return pop();
          return Step::kReject;
        case 3:  // after ','
          f.phase = 2;
          ++f.a;
          return PushChild(st, n.child) ? Step::kRefeed : Step::kReject;
      }
      return Step::kReject;
    case Kind::kString: {
      // a = characters so far (counted only when the length is bounded);
      // b = UTF-8 continuation bytes or hex digits still expected.
      const bool counted = n.min_len > 0 || n.max_len >= 0;
      auto one_more = [&] {
        if (!counted) return true;
        if (n.max_len >= 0 && f.a >= n.max_len) return false;
        ++f.a;
        return true;
      };
      switch (f.phase) {
        case 0:
          if (c != '"') return Step::kReject;
          f.phase = 1;
          return Step::kOk;
        case 1:
          if (c == '"') return f.a >= n.min_len ? pop() : Step::kReject;
          if (c < 0x20) return Step::kReject;
          if (!one_more()) return Step::kReject;
          if (c == '\\') {
            f.phase = 2;
          } else if (c >= 0x80) {
            if (c >= 0xC2 && c <= 0xDF) {
              f.b = 1;
            } else if (c >= 0xE0 && c <= 0xEF) {
              f.b = 2;
            } else if (c >= 0xF0 && c <= 0xF4) {
              f.b = 3;
            } else {
              return Step::kReject;
            }
            f.phase = 3;
          }
          return Step::kOk;
        case 2:  // after a backslash
          if (c == 'u') {
            f.phase = 4;
            f.b = 4;
            return Step::kOk;
          }
          if (c == '"' || c == '\\' || c == '/' || c == 'b' || c == 'f' || c == 'n' || c == 'r' ||
              c == 't') {
            f.phase = 1;
            return Step::kOk;
          }
          return Step::kReject;
        case 3:  // UTF-8 continuation
          if (c < 0x80 || c > 0xBF) return Step::kReject;
          if (--f.b == 0) f.phase = 1;
          return Step::kOk;
        case 4:  // \uXXXX
          if (!IsHex(c)) return Step::kReject;
          if (--f.b == 0) f.phase = 1;
          return Step::kOk;
      }
      return Step::kReject;
    }
    case Kind::kNumber:
    case Kind::kInteger: {
      const bool integer = n.kind == Kind::kInteger;
      // Phases: 0 start, 1 after '-', 2 integer digits, 3 after a leading 0,
      // 4 after '.', 5 fraction digits, 6 after 'e', 7 after the exponent's
      // sign, 8 exponent digits. a = digits in the current part.
      switch (f.phase) {
        case 0:
          if (c == '-') {
            f.phase = 1;
            return Step::kOk;
          }
          [[fallthrough]];
        case 1:
          if (c == '0') {
            f.phase = 3;
            return Step::kOk;
          }
          if (IsDigit(c)) {
            f.phase = 2;
            f.a = 1;
            return Step::kOk;
          }
          return Step::kReject;
        case 2:
          if (IsDigit(c)) {
            if (f.a >= kMaxIntDigits) return Step::kReject;
            ++f.a;
            return Step::kOk;
          }
          [[fallthrough]];
        case 3:
          if (!integer && c == '.') {
            f.phase = 4;
            return Step::kOk;
          }
          if (!integer && (c == 'e' || c == 'E')) {
            f.phase = 6;
            return Step::kOk;
          }
          return pop_refeed();
        case 4:
          if (!IsDigit(c)) return Step::kReject;
          f.phase = 5;
          f.a = 1;
          return Step::kOk;
        case 5:
          if (IsDigit(c)) {
            if (f.a >= kMaxFracDigits) return Step::kReject;
            ++f.a;
            return Step::kOk;
          }
          if (c == 'e' || c == 'E') {
            f.phase = 6;
            return Step::kOk;
          }
          return pop_refeed();
        case 6:
          if (c == '+' || c == '-') {
            f.phase = 7;
            return Step::kOk;
          }
          [[fallthrough]];
        case 7:
          if (!IsDigit(c)) return Step::kReject;
          f.phase = 8;
          f.a = 1;
          return Step::kOk;
        case 8:
          if (IsDigit(c)) {
            if (f.a >= kMaxExpDigits) return Step::kReject;
            ++f.a;
            return Step::kOk;
          }
          return pop_refeed();
      }
      return Step::kReject;
    }
    case Kind::kTagged: {
      if (f.phase == 1) {  // after the arguments
        return c == '}' ? pop() : Step::kReject;
      }
      const int hi = static_cast<int>(n.alternatives.size()) - 1;
      const int j = NextAlternative(n.alternatives, 0, hi, f.c, f.b, c);
      if (j < 0) return Step::kReject;
      f.c = j;
      ++f.b;
      if (f.b < static_cast<int>(n.alternatives[j].size())) return Step::kOk;
      f.phase = 1;  // the prefixes end with ':' and none is a prefix of another
      return PushChild(st, n.values[j]) ? Step::kOk : Step::kReject;
    }
    case Kind::kLiteral: {
      // c = the alternative followed, b = its bytes matched.
      const int hi = static_cast<int>(n.alternatives.size()) - 1;
      const int j = NextAlternative(n.alternatives, 0, hi, f.c, f.b, c);
      if (j < 0) {
        // A complete alternative ends at a byte that cannot continue it.
        if (f.b > 0 && f.b == static_cast<int>(n.alternatives[f.c].size())) return pop_refeed();
        return Step::kReject;
      }
      f.c = j;
      ++f.b;
      if (f.b == static_cast<int>(n.alternatives[j].size()) &&
          !LongerAlternative(n.alternatives, 0, hi, j, f.b)) {
        return pop();
      }
      return Step::kOk;
    }
  }
  return Step::kReject;
}

bool JsonGrammar::CanEnd(const GrammarState& state) const {
  // Every frame left must be one that a following byte would close: then
  // "the end" closes them all.
  for (size_t i = state.size(); i-- > 0;) {
    const GrammarFrame& f = state[i];
    const Node& n = nodes_[f.node];
    if (n.kind == Kind::kNumber || n.kind == Kind::kInteger) {
      if (f.phase != 2 && f.phase != 3 && f.phase != 5 && f.phase != 8) return false;
      if (i != 0) return false;  // inside a container: its closing byte is missing
      continue;
    }
    if (n.kind == Kind::kLiteral && i == 0 && f.b > 0 &&
        f.b == static_cast<int>(n.alternatives[f.c].size())) {
      continue;
    }
    return false;
  }
  return true;
}

// ---------------------------------------------------------------- the compiler

class SchemaCompiler {
 public:
  explicit SchemaCompiler(JsonGrammar* g) : g_(g) {
    using Node = JsonGrammar::Node;
    g_->nodes_.resize(6);
    g_->nodes_[kAnyNode].kind = Kind::kAny;
    Node& obj = g_->nodes_[kAnyObjectNode];
    obj.kind = Kind::kFreeObject;
    obj.child = kAnyNode;
    Node& arr = g_->nodes_[kAnyArrayNode];
    arr.kind = Kind::kArray;
    arr.child = kAnyNode;
    g_->nodes_[kAnyStringNode].kind = Kind::kString;
    g_->nodes_[kAnyNumberNode].kind = Kind::kNumber;
    Node& lit = g_->nodes_[kAnyLiteralNode];
    lit.kind = Kind::kLiteral;
    lit.alternatives = {"true", "false", "null"};
  }

  Result<uint32_t> Compile(const json& s, const std::string& path, int depth) {
    if (depth > 32) return InvalidArgument("JSON schema nests deeper than 32 levels at " + path);
    if (g_->nodes_.size() > 10000) return InvalidArgument("JSON schema is too large");
    if (s.is_boolean()) {
      if (s.get<bool>()) return kAnyNode;
      return InvalidArgument("JSON schema 'false' at " + path + " matches nothing");
    }
    if (!s.is_object()) return InvalidArgument("JSON schema at " + path + " must be an object");
    if (depth == 0 && s.contains(kToolCallsKeyword)) return ToolCalls(s[kToolCallsKeyword], path);
    static const char* kKnown[] = {"type",        "properties", "required", "additionalProperties",
                                   "items",       "minItems",   "maxItems", "minLength",
                                   "maxLength",   "enum",       "const",    "title",
                                   "description", "default",    "examples", "$schema",
                                   "$id",         "$comment"};
    for (const auto& [key, value] : s.items()) {
      bool known = false;
      for (const char* k : kKnown) known = known || key == k;
      if (!known) {
        return InvalidArgument("unsupported JSON schema keyword '" + key + "' at " + path);
      }
    }
    if (s.contains("const")) return Literal({s["const"]}, s, path);
    if (s.contains("enum")) {
      const json& e = s["enum"];
      if (!e.is_array() || e.empty()) {
        return InvalidArgument("'enum' at " + path + " must be a non-empty array");
      }
      return Literal(std::vector<json>(e.begin(), e.end()), s, path);
    }
    std::vector<std::string> types;
    if (s.contains("type")) {
      const json& t = s["type"];
      if (t.is_string()) {
        types.push_back(t.get<std::string>());
      } else if (t.is_array() && !t.empty()) {
        for (const json& x : t) {
          if (!x.is_string()) return InvalidArgument("'type' at " + path + " must name types");
          types.push_back(x.get<std::string>());
        }
      } else {
        return InvalidArgument("'type' at " + path + " must be a string or an array of strings");
      }
    } else if (s.contains("properties") || s.contains("required") ||
               s.contains("additionalProperties")) {
      types.push_back("object");
    } else if (s.contains("items") || s.contains("minItems") || s.contains("maxItems")) {
      types.push_back("array");
    } else if (s.contains("minLength") || s.contains("maxLength")) {
      types.push_back("string");
    } else {
      return kAnyNode;  // annotations only
    }
    if (types.size() == 1) return CompileType(types[0], s, path, depth);
    // A union: the kinds start with distinct bytes.
    JsonGrammar::Node u;
    u.kind = Kind::kUnion;
    bool has_number = false;
    bool has_integer = false;
    for (const std::string& t : types) {
      has_number = has_number || t == "number";
      has_integer = has_integer || t == "integer";
    }
    for (const std::string& t : types) {
      if (t == "integer" && has_number) continue;  // every integer is a number
      ASSIGN_OR_RETURN(uint32_t id, CompileType(t, s, path, depth));
      uint32_t* slot = nullptr;
      if (t == "object") slot = &u.on_object;
      if (t == "array") slot = &u.on_array;
      if (t == "string") slot = &u.on_string;
      if (t == "number" || t == "integer") slot = &u.on_number;
      if (t == "boolean") slot = &u.on_true_false;
      if (t == "null") slot = &u.on_null;
      if (*slot != 0) return InvalidArgument("'type' at " + path + " names '" + t + "' twice");
      *slot = id;
    }
    (void)has_integer;
    return Add(std::move(u));
  }

 private:
  uint32_t Add(JsonGrammar::Node n) {
    g_->nodes_.push_back(std::move(n));
    return static_cast<uint32_t>(g_->nodes_.size() - 1);
  }

  static Result<int32_t> Count(const json& s, const char* key, const std::string& path) {
    if (!s.contains(key)) return -1;
    const json& v = s[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > 100000) {
      return InvalidArgument(std::string("'") + key + "' at " + path +
                             " must be an integer in [0, 100000]");
    }
    return static_cast<int32_t>(v.get<int64_t>());
  }

  // Keywords that belong to another type than the one compiled are refused:
  // they would not be enforced.
  static Status OnlyFor(const json& s, const std::string& type, const std::string& path) {
    static const std::pair<const char*, const char*> kOwner[] = {
        {"properties", "object"}, {"required", "object"}, {"additionalProperties", "object"},
        {"items", "array"},       {"minItems", "array"},  {"maxItems", "array"},
        {"minLength", "string"},  {"maxLength", "string"}};
    for (const auto& [key, owner] : kOwner) {
      if (s.contains(key) && type != owner) {
        return InvalidArgument(std::string("JSON schema keyword '") + key + "' at " + path +
                               " applies to type '" + owner + "', not '" + type + "'");
      }
    }
    return Status::Ok();
  }

  Result<uint32_t> CompileType(const std::string& t, const json& s, const std::string& path,
                               int depth) {
    if (t != "object" && t != "array" && t != "string" && t != "number" && t != "integer" &&
        t != "boolean" && t != "null") {
      return InvalidArgument("unknown JSON schema type '" + t + "' at " + path);
    }
    const bool single = !s.contains("type") || s["type"].is_string();
    if (single) RETURN_IF_ERROR(OnlyFor(s, t, path));
    JsonGrammar::Node n;
    if (t == "string") {
      n.kind = Kind::kString;
      ASSIGN_OR_RETURN(int32_t lo, Count(s, "minLength", path));
      ASSIGN_OR_RETURN(int32_t hi, Count(s, "maxLength", path));
      n.min_len = std::max(0, lo);
      n.max_len = hi;
      if (hi >= 0 && n.min_len > hi) {
        return InvalidArgument("'minLength' > 'maxLength' at " + path);
      }
      if (n.min_len == 0 && n.max_len < 0) return kAnyStringNode;
      return Add(std::move(n));
    }
    if (t == "number") return kAnyNumberNode;
    if (t == "integer") {
      n.kind = Kind::kInteger;
      return Add(std::move(n));
    }
    if (t == "boolean") {
      n.kind = Kind::kLiteral;
      n.alternatives = {"true", "false"};
      return Add(std::move(n));
    }
    if (t == "null") {
      n.kind = Kind::kLiteral;
      n.alternatives = {"null"};
      return Add(std::move(n));
    }
    if (t == "array") {
      n.kind = Kind::kArray;
      ASSIGN_OR_RETURN(int32_t lo, Count(s, "minItems", path));
      ASSIGN_OR_RETURN(int32_t hi, Count(s, "maxItems", path));
      n.min_items = std::max(0, lo);
      n.max_items = hi;
      if (hi >= 0 && n.min_items > hi) return InvalidArgument("'minItems' > 'maxItems' at " + path);
      n.child = kAnyNode;
      if (s.contains("items")) {
        ASSIGN_OR_RETURN(n.child, Compile(s["items"], path + ".items", depth + 1));
      }
      return Add(std::move(n));
    }
    // object
    const json* props = s.contains("properties") ? &s["properties"] : nullptr;
    if (props != nullptr && !props->is_object()) {
      return InvalidArgument("'properties' at " + path + " must be an object");
    }
    std::vector<std::string> required;
    if (s.contains("required")) {
      const json& r = s["required"];
      if (!r.is_array()) return InvalidArgument("'required' at " + path + " must be an array");
      for (const json& x : r) {
        if (!x.is_string()) return InvalidArgument("'required' at " + path + " must name strings");
        if (props == nullptr || !props->contains(x.get<std::string>())) {
          return InvalidArgument("'required' at " + path + " names '" + x.get<std::string>() +
                                 "', which is not in 'properties'");
        }
        required.push_back(x.get<std::string>());
      }
    }
    if (props == nullptr || props->empty()) {
      if (!required.empty()) return InvalidArgument("'required' without properties at " + path);
      n.kind = Kind::kFreeObject;
      n.child = kAnyNode;
      if (s.contains("additionalProperties")) {
        const json& ap = s["additionalProperties"];
        if (ap.is_boolean() && !ap.get<bool>()) {
          // {} only.
          n.kind = Kind::kObject;
          return Add(std::move(n));
        }
        ASSIGN_OR_RETURN(n.child, Compile(ap, path + ".additionalProperties", depth + 1));
      }
      if (n.child == kAnyNode) return kAnyObjectNode;
      return Add(std::move(n));
    }
    if (s.contains("additionalProperties")) {
      const json& ap = s["additionalProperties"];
      // Closed to the listed properties either way (a subset of what an open
      // object allows, so the output still validates).
      if (!ap.is_boolean() && !ap.is_object()) {
        return InvalidArgument("'additionalProperties' at " + path +
                               " must be a boolean or a schema");
      }
    }
    n.kind = Kind::kObject;
    for (const auto& [name, sub] : props->items()) {
      ASSIGN_OR_RETURN(uint32_t id, Compile(sub, path + ".properties." + name, depth + 1));
      n.keys.push_back(json(name).dump() + ":");
      n.values.push_back(id);
      n.required.push_back(std::find(required.begin(), required.end(), name) != required.end());
    }
    return Add(std::move(n));
  }

  Result<uint32_t> Literal(const std::vector<json>& values, const json& s,
                           const std::string& path) {
    if (s.contains("type")) {
      // The values must be of the type, or the output would not validate.
      std::vector<std::string> types;
      if (s["type"].is_string()) types.push_back(s["type"]);
      if (s["type"].is_array()) {
        for (const json& t : s["type"]) {
          if (t.is_string()) types.push_back(t);
        }
      }
      for (const json& v : values) {
        bool ok = false;
        for (const std::string& t : types) {
          ok = ok || (t == "string" && v.is_string()) || (t == "number" && v.is_number()) ||
               (t == "integer" &&
                (v.is_number_integer() ||
                 (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>()))) ||
               (t == "boolean" && v.is_boolean()) || (t == "null" && v.is_null()) ||
               (t == "object" && v.is_object()) || (t == "array" && v.is_array());
        }
        if (!ok) {
          return InvalidArgument("'enum'/'const' value " + v.dump() + " at " + path +
                                 " is not of the schema's type");
        }
      }
    }
    JsonGrammar::Node n;
    n.kind = Kind::kLiteral;
    for (const json& v : values) {
      std::string text = v.dump();
      if (std::find(n.alternatives.begin(), n.alternatives.end(), text) == n.alternatives.end()) {
        n.alternatives.push_back(std::move(text));
      }
    }
    return Add(std::move(n));
  }

  // {"x-kvrelay-tool-calls": [{"name": N, "parameters": SCHEMA}, ...]}: one
  // call of one of the functions, {"name":N,"arguments":<SCHEMA>}.
  Result<uint32_t> ToolCalls(const json& tools, const std::string& path) {
    if (!tools.is_array() || tools.empty()) {
      return InvalidArgument(std::string("'") + kToolCallsKeyword + "' must be a non-empty array");
    }
    JsonGrammar::Node n;
    n.kind = Kind::kTagged;
    for (size_t i = 0; i < tools.size(); ++i) {
      const json& t = tools[i];
      if (!t.is_object() || !t.contains("name") || !t["name"].is_string()) {
        return InvalidArgument("tool " + std::to_string(i) + " has no name");
      }
      const std::string name = t["name"];
      const json params = t.contains("parameters") ? t["parameters"] : json::object();
      ASSIGN_OR_RETURN(uint32_t args, Compile(params.empty() ? json{{"type", "object"}} : params,
                                              path + ".tools[" + name + "].parameters", 1));
      n.alternatives.push_back("{\"name\":" + json(name).dump() + ",\"arguments\":");
      n.values.push_back(args);
    }
    return Add(std::move(n));
  }

  JsonGrammar* g_;
};

Result<std::shared_ptr<const JsonGrammar>> CompileJsonSchema(std::string_view schema_text) {
  json schema = json::parse(schema_text, nullptr, /*allow_exceptions=*/false);
  if (schema.is_discarded()) return InvalidArgument("the JSON schema is not valid JSON");
  auto g = std::make_shared<JsonGrammar>();
  SchemaCompiler compiler(g.get());
  ASSIGN_OR_RETURN(g->root_, compiler.Compile(schema, "schema", 0));
  return std::shared_ptr<const JsonGrammar>(std::move(g));
}

// ---------------------------------------------------------------- vocabulary and masks

std::shared_ptr<const TokenVocabulary> TokenVocabulary::Build(
    const std::vector<std::string>& pieces, const std::vector<bool>& usable,
    std::vector<int32_t> eog) {
  auto v = std::make_shared<TokenVocabulary>();
  v->vocab_ = static_cast<int64_t>(pieces.size());
  v->pieces_ = pieces;
  v->eog_ = std::move(eog);
  std::sort(v->eog_.begin(), v->eog_.end());
  // Tokens sorted by bytes: each trie node's subtree is a contiguous range.
  std::vector<int32_t> ids;
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (i < usable.size() && usable[i] && !pieces[i].empty())
      ids.push_back(static_cast<int32_t>(i));
  }
  std::sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) {
    return pieces[a] != pieces[b] ? pieces[a] < pieces[b] : a < b;
  });
  // Breadth-first construction so that a node's children are contiguous.
  struct Pending {
    int32_t node;
    size_t lo, hi;  // ids[lo, hi): tokens below this node
    size_t depth;
  };
  v->nodes_.push_back(Node{});
  std::vector<Pending> queue = {{0, 0, ids.size(), 0}};
  for (size_t q = 0; q < queue.size(); ++q) {
    const Pending p = queue[q];
    size_t i = p.lo;
    // Tokens that end exactly here come first in sorted order.
    Node& here = v->nodes_[p.node];
    here.first_token = static_cast<int32_t>(v->tokens_.size());
    while (i < p.hi && pieces[ids[i]].size() == p.depth) v->tokens_.push_back(ids[i++]);
    v->nodes_[p.node].n_tokens = static_cast<int32_t>(v->tokens_.size()) - here.first_token;
    v->nodes_[p.node].first_child = static_cast<int32_t>(v->nodes_.size());
    while (i < p.hi) {
      const uint8_t byte = static_cast<uint8_t>(pieces[ids[i]][p.depth]);
      size_t j = i;
      while (j < p.hi && static_cast<uint8_t>(pieces[ids[j]][p.depth]) == byte) ++j;
      Node child;
      child.byte = byte;
      v->nodes_.push_back(child);
      queue.push_back({static_cast<int32_t>(v->nodes_.size() - 1), i, j, p.depth + 1});
      ++v->nodes_[p.node].n_children;
      i = j;
    }
  }
  return v;
}

bool TokenVocabulary::is_eog(int32_t id) const {
  return std::binary_search(eog_.begin(), eog_.end(), id);
}

namespace {

std::string StateKey(const GrammarState& st) {
  std::string key;
  key.resize(st.size() * sizeof(GrammarFrame));
  for (size_t i = 0; i < st.size(); ++i) {
    // Field by field: no padding bytes in the key.
    char* p = key.data() + i * sizeof(GrammarFrame);
    std::memset(p, 0, sizeof(GrammarFrame));
    std::memcpy(p, &st[i].node, 4);
    std::memcpy(p + 4, &st[i].phase, 1);
    std::memcpy(p + 5, &st[i].a, 4);
    std::memcpy(p + 9, &st[i].b, 4);
    std::memcpy(p + 13, &st[i].c, 4);
  }
  return key;
}

}  // namespace

std::shared_ptr<const TokenMask> ConstraintFactory::MaskFor(const GrammarState& state) const {
  const std::string key = StateKey(state);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cache_.find(key);
    if (it != cache_.end()) {
      ++stats_.hits;
      return it->second;
    }
    ++stats_.misses;
  }
  std::shared_ptr<const TokenMask> mask = Compute(state);
  std::lock_guard<std::mutex> lock(mu_);
  if (cache_.size() > 100000) cache_.clear();  // a bound on memory, never hit in practice
  cache_.emplace(key, mask);
  return mask;
}

ConstraintFactory::CacheStats ConstraintFactory::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

std::shared_ptr<const TokenMask> ConstraintFactory::Compute(const GrammarState& state) const {
  const TokenVocabulary& v = *vocab_;
  const JsonGrammar& g = *grammar_;
  auto mask = std::make_shared<TokenMask>((v.vocab_ + 63) / 64, 0);
  auto allow = [&](int32_t t) { (*mask)[t >> 6] |= uint64_t{1} << (t & 63); };
  bool any = false;
  if (!JsonGrammar::Complete(state)) {
    // Depth-first over the trie, one automaton state per edge taken.
    struct Item {
      int32_t node;
      GrammarState st;
    };
    std::vector<Item> stack;
    stack.push_back({0, state});
    while (!stack.empty()) {
      Item it = std::move(stack.back());
      stack.pop_back();
      const TokenVocabulary::Node& n = v.nodes_[it.node];
      for (int32_t k = 0; k < n.n_children; ++k) {
        const int32_t child = n.first_child + k;
        const TokenVocabulary::Node& cn = v.nodes_[child];
        GrammarState next = it.st;
        if (!g.Feed(&next, cn.byte)) continue;
        for (int32_t t = 0; t < cn.n_tokens; ++t) allow(v.tokens_[cn.first_token + t]);
        any = any || cn.n_tokens > 0;
        if (cn.n_children > 0 && !JsonGrammar::Complete(next)) {
          stack.push_back({child, std::move(next)});
        }
      }
    }
  }
  // End-of-generation once the value is complete, or when nothing else can
  // be written (never leave the sampler without a token).
  if (g.CanEnd(state) || !any) {
    for (int32_t t : v.eog_) {
      if (t >= 0 && t < v.vocab_) allow(t);
    }
  }
  return mask;
}

GrammarMatcher::GrammarMatcher(std::shared_ptr<const ConstraintFactory> factory)
    : factory_(std::move(factory)), state_(factory_->grammar().Start()) {}

void GrammarMatcher::Mask(float* logits, int64_t vocab) {
  std::shared_ptr<const TokenMask> mask = factory_->MaskFor(state_);
  const TokenMask& m = *mask;
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t w = 0; w * 64 < vocab; ++w) {
    const uint64_t bits = w < static_cast<int64_t>(m.size()) ? m[w] : 0;
    if (bits == ~uint64_t{0}) continue;
    const int64_t end = std::min<int64_t>(vocab, (w + 1) * 64);
    for (int64_t i = w * 64; i < end; ++i) {
      if (!((bits >> (i - w * 64)) & 1)) logits[i] = ninf;
    }
  }
}

Status GrammarMatcher::Accept(int32_t token) {
  const TokenVocabulary& v = factory_->vocab();
  if (token < 0 || token >= v.size()) return InvalidArgument("token outside the vocabulary");
  if (v.is_eog(token)) {
    if (factory_->grammar().CanEnd(state_) || JsonGrammar::Complete(state_)) {
      state_.clear();
      return Status::Ok();
    }
    return FailedPrecondition("end of generation before the JSON value is complete");
  }
  GrammarState next = state_;
  if (!factory_->grammar().FeedAll(&next, v.piece(token))) {
    return FailedPrecondition("token " + std::to_string(token) + " does not fit the grammar");
  }
  state_ = std::move(next);
  return Status::Ok();
}

Result<std::shared_ptr<const ConstraintFactory>> ConstraintCache::Get(
    const std::string& schema_text) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = lru_.begin(); it != lru_.end(); ++it) {
      if (it->first == schema_text) {
        lru_.splice(lru_.begin(), lru_, it);
        return lru_.front().second;
      }
    }
  }
  ASSIGN_OR_RETURN(std::shared_ptr<const JsonGrammar> g, CompileJsonSchema(schema_text));
  auto f = std::make_shared<const ConstraintFactory>(std::move(g), vocab_);
  std::lock_guard<std::mutex> lock(mu_);
  lru_.emplace_front(schema_text, f);
  while (lru_.size() > capacity_) lru_.pop_back();
  return f;
}

}  // namespace kvrelay::engine::grammar
