// The JSON-schema automaton and its token masks (engine/grammar/), without a
// model: byte-level acceptance, refusals naming the keyword, and random walks
// through the mask of a toy vocabulary that always end in valid JSON.
#include "engine/grammar/json_grammar.h"

#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <random>

namespace kvrelay::engine::grammar {
namespace {

using nlohmann::json;

std::shared_ptr<const JsonGrammar> Compile(const std::string& schema) {
  auto g = CompileJsonSchema(schema);
  EXPECT_TRUE(g.ok()) << schema << ": " << g.status().ToString();
  return g.ok() ? *g : nullptr;
}

// True when `text` is accepted as a complete value.
bool Accepts(const JsonGrammar& g, const std::string& text) {
  GrammarState st = g.Start();
  return g.FeedAll(&st, text) && (JsonGrammar::Complete(st) || g.CanEnd(st));
}

TEST(JsonGrammarTest, ObjectsWithRequiredAndOptionalPropertiesInOrder) {
  auto g = Compile(R"({"type":"object","properties":{
      "name":{"type":"string"},"age":{"type":"integer"},"tags":{"type":"array","items":{"type":"string"}}},
      "required":["name","tags"]})");
  ASSERT_NE(g, nullptr);
  EXPECT_TRUE(Accepts(*g, R"({"name":"Ann","age":31,"tags":["a","b"]})"));
  EXPECT_TRUE(Accepts(*g, R"({"name":"Ann","tags":[]})"));   // optional age left out
  EXPECT_FALSE(Accepts(*g, R"({"name":"Ann"})"));            // tags required
  EXPECT_FALSE(Accepts(*g, R"({"tags":[],"name":"Ann"})"));  // schema order
  EXPECT_FALSE(Accepts(*g, R"({"name":"Ann","age":3.5,"tags":[]})"));
  EXPECT_FALSE(Accepts(*g, R"({"name":"Ann","extra":1,"tags":[]})"));
  EXPECT_FALSE(Accepts(*g, R"({"name": "Ann","tags":[]})"));  // compact: no whitespace
  // Complete means nothing more: the closing brace ends the value.
  GrammarState st = g->Start();
  ASSERT_TRUE(g->FeedAll(&st, R"({"name":"x","tags":[]})"));
  EXPECT_TRUE(JsonGrammar::Complete(st));
  EXPECT_FALSE(g->Feed(&st, ' '));
}

TEST(JsonGrammarTest, ScalarsEnumsConstsAndUnions) {
  auto num = Compile(R"({"type":"number"})");
  for (const char* ok : {"0", "-1", "3.25", "1e5", "-0.5E-3", "12"}) {
    EXPECT_TRUE(Accepts(*num, ok)) << ok;
  }
  for (const char* bad : {"01", "-", "1.", ".5", "1e", "+1"})
    EXPECT_FALSE(Accepts(*num, bad)) << bad;
  auto integer = Compile(R"({"type":"integer"})");
  EXPECT_TRUE(Accepts(*integer, "-42"));
  EXPECT_FALSE(Accepts(*integer, "4.0"));
  auto e = Compile(R"({"enum":["red","green",1,12,null]})");
  for (const char* ok : {R"("red")", R"("green")", "1", "12", "null"}) EXPECT_TRUE(Accepts(*e, ok));
  EXPECT_FALSE(Accepts(*e, R"("blue")"));
  EXPECT_FALSE(Accepts(*e, "2"));
  auto c = Compile(R"({"const":{"a":[1,true]}})");
  EXPECT_TRUE(Accepts(*c, R"({"a":[1,true]})"));
  auto u = Compile(R"({"type":["string","null"],"maxLength":3})");
  EXPECT_TRUE(Accepts(*u, "null"));
  EXPECT_TRUE(Accepts(*u, R"("abc")"));
  EXPECT_FALSE(Accepts(*u, R"("abcd")"));
  auto s = Compile(R"({"type":"string","minLength":2})");
  EXPECT_FALSE(Accepts(*s, R"("a")"));
  EXPECT_TRUE(Accepts(*s, R"("a\n")"));
  EXPECT_TRUE(Accepts(*s, "\"\xC3\xA9t\xC3\xA9\""));
  EXPECT_FALSE(Accepts(*s, "\"\xC3(\""));  // broken UTF-8
  auto b = Compile(R"({"type":"boolean"})");
  EXPECT_TRUE(Accepts(*b, "false"));
  EXPECT_FALSE(Accepts(*b, "null"));
  auto arr = Compile(R"({"type":"array","items":{"type":"integer"},"minItems":1,"maxItems":2})");
  EXPECT_FALSE(Accepts(*arr, "[]"));
  EXPECT_TRUE(Accepts(*arr, "[1,2]"));
  EXPECT_FALSE(Accepts(*arr, "[1,2,3]"));
  auto any = Compile(R"({"type":"object"})");  // json_object mode
  EXPECT_TRUE(Accepts(*any, R"({"a":[1,{"b":null}],"c":"d"})"));
  EXPECT_FALSE(Accepts(*any, "[1]"));
}

TEST(JsonGrammarTest, UnsupportedKeywordsAreRefusedByName) {
  struct Case {
    const char* schema;
    const char* needle;
  };
  for (const Case& c : std::vector<Case>{
           {R"({"type":"string","pattern":"a+"})", "'pattern'"},
           {R"({"type":"string","format":"date"})", "'format'"},
           {R"({"type":"number","minimum":0})", "'minimum'"},
           {R"({"anyOf":[{"type":"string"}]})", "'anyOf'"},
           {R"({"$ref":"#/x"})", "'$ref'"},
           {R"({"type":"object","properties":{"a":{"type":"string","oneOf":[]}}})", "'oneOf'"},
           {R"({"type":"object","properties":{"a":{}},"required":["b"]})", "'b'"},
           {R"({"type":"string","items":{}})", "'items'"},
           {R"({"type":"frob"})", "'frob'"},
           {R"({"type":"integer","enum":[1.5]})", "1.5"},
           {"[1", "not valid JSON"},
       }) {
    auto g = CompileJsonSchema(c.schema);
    ASSERT_FALSE(g.ok()) << c.schema;
    EXPECT_NE(g.status().message().find(c.needle), std::string::npos)
        << c.schema << " -> " << g.status().message();
  }
  // The nested path is named.
  auto g = CompileJsonSchema(R"({"properties":{"a":{"items":{"pattern":"x"}}}})");
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().message().find("schema.properties.a.items"), std::string::npos)
      << g.status().message();
}

// A toy vocabulary of single bytes and some multi-byte tokens; random walks
// through the masks always end in a complete value that parses.
TEST(JsonGrammarTest, RandomWalksThroughTheMaskEndInValidJson) {
  std::vector<std::string> pieces = {"<eos>"};
  for (int c = 0x20; c < 0x7F; ++c) pieces.push_back(std::string(1, static_cast<char>(c)));
  for (const char* t : {"{\"", "\":", "\",\"", "true", "null", "12", "\"}", "],", "ab", "name",
                        "\xC3\xA9", "\xC3", "\xA9", "\\u00e9", ", ", "}}", "[\""}) {
    pieces.push_back(t);
  }
  std::vector<bool> usable(pieces.size(), true);
  usable[0] = false;
  auto vocab = TokenVocabulary::Build(pieces, usable, {0});
  const std::vector<std::string> schemas = {
      R"({"type":"object","properties":{"name":{"type":"string","maxLength":5},"n":{"type":"integer"},
          "ok":{"type":"boolean"}},"required":["name","ok"]})",
      R"({"type":"array","items":{"enum":["a","b",3]},"maxItems":3})",
      R"({"type":"object","properties":{"x":{"type":"array","maxItems":2,"items":{
          "type":"object","properties":{"y":{"type":["number","null"]}},"required":["y"]}}},
          "required":["x"]})",
      R"({"type":"number"})",
  };
  for (const std::string& schema : schemas) {
    auto g = Compile(schema);
    ASSERT_NE(g, nullptr);
    auto factory = std::make_shared<ConstraintFactory>(g, vocab);
    for (uint64_t seed = 1; seed <= 40; ++seed) {
      std::mt19937_64 rng(seed);
      GrammarMatcher m(factory);
      std::string text;
      bool ended = false;
      for (int step = 0; step < 400 && !ended && !m.Complete(); ++step) {
        std::vector<float> logits(pieces.size(), 0.0f);
        m.Mask(logits.data(), static_cast<int64_t>(logits.size()));
        std::vector<int32_t> allowed;
        for (size_t i = 0; i < logits.size(); ++i) {
          if (std::isfinite(logits[i])) allowed.push_back(static_cast<int32_t>(i));
        }
        ASSERT_FALSE(allowed.empty()) << schema << " after " << text;
        // Prefer ending/closing a little so that walks finish.
        int32_t t = allowed[rng() % allowed.size()];
        if (step > 60) {
          for (int32_t a : allowed) {
            if (a == 0 || pieces[a] == "}" || pieces[a] == "]" || pieces[a] == "\"") t = a;
          }
        }
        ASSERT_TRUE(m.Accept(t).ok()) << pieces[t];
        if (t == 0) {
          ended = true;
        } else {
          text += pieces[t];
        }
      }
      ASSERT_TRUE(ended || m.Complete()) << schema << " seed " << seed << ": " << text;
      json parsed = json::parse(text, nullptr, false);
      EXPECT_FALSE(parsed.is_discarded()) << schema << " seed " << seed << ": " << text;
    }
    EXPECT_GT(factory->stats().hits, 0);
  }
}

}  // namespace
}  // namespace kvrelay::engine::grammar
