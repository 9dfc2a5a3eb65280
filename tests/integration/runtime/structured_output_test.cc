// #18: structured output on the real model. Many schemas x seeds (greedy and
// sampled) through the engine with response grammars; every output must
// parse and validate, checked by an independent validator (Python
// `jsonschema`, from the system or a venv in the build tree).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "engine/runtime/engine.h"
#include "engine/runtime/model.h"
#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/tokenizer.h"
#include "tests/testing/skip.h"
#include "tests/testing/test_env.h"

namespace kvrelay::engine {
namespace {

using json = nlohmann::ordered_json;
namespace fs = std::filesystem;

struct SchemaCase {
  const char* label;
  const char* prompt;
  const char* schema;
};

// Bounded (maxLength / maxItems) so that sampled outputs end well inside
// max_tokens on any machine.
const SchemaCase kCases[] = {
    {"person", "Describe a fictional person as JSON.",
     R"({"type":"object","properties":{"name":{"type":"string","maxLength":24},
        "age":{"type":"integer"},"email":{"type":"string","maxLength":32}},
        "required":["name","age"]})"},
    {"weather", "Give the weather in Paris as JSON.",
     R"({"type":"object","properties":{"city":{"type":"string","maxLength":20},
        "temperature":{"type":"number"},"unit":{"enum":["celsius","fahrenheit"]},
        "sunny":{"type":"boolean"}},"required":["city","temperature","unit","sunny"],
        "additionalProperties":false})"},
    {"list", "List three fruits as a JSON array.",
     R"({"type":"array","items":{"type":"string","maxLength":16},"minItems":1,"maxItems":4})"},
    {"nested", "Describe a book and its author as JSON.",
     R"({"type":"object","properties":{"title":{"type":"string","maxLength":30},
        "author":{"type":"object","properties":{"name":{"type":"string","maxLength":20},
        "born":{"type":["integer","null"]}},"required":["name","born"]},
        "tags":{"type":"array","items":{"type":"string","maxLength":10},"maxItems":3}},
        "required":["title","author","tags"]})"},
    {"const", "Answer with JSON.",
     R"({"type":"object","properties":{"version":{"const":2},"ok":{"type":"boolean"},
        "note":{"type":["string","null"],"maxLength":12}},"required":["version","ok","note"]})"},
    {"numbers", "Give three measurements as JSON.",
     R"({"type":"object","properties":{"values":{"type":"array","items":{"type":"number"},
        "minItems":3,"maxItems":3},"count":{"type":"integer"}},"required":["values","count"]})"},
    {"enum", "Pick a colour.", R"({"enum":["red","green","blue"]})"},
    {"scalar", "How many legs does a spider have? Answer with a JSON number.",
     R"({"type":"integer"})"},
    {"object_of_flags", "Give some feature flags as JSON.",
     R"({"type":"object","properties":{"a":{"type":"boolean"},"b":{"type":"boolean"},
        "c":{"type":"null"},"d":{"type":"string","minLength":1,"maxLength":3}},"required":["d"]})"},
};

std::string PythonWithJsonschema(std::string* why) {
  std::string out;
  if (testing::RunCommand("python3 -c 'import jsonschema' 2>&1", &out) == 0) return "python3";
  const std::string venv = testing::BinaryDir() + "/jsonschema-venv";
  if (!fs::exists(venv + "/bin/python")) {
    if (testing::RunCommand("python3 -m venv '" + venv + "' 2>&1 && '" + venv +
                                "/bin/pip' install -q jsonschema 2>&1",
                            &out) != 0) {
      *why = out;
      return "";
    }
  }
  return venv + "/bin/python";
}

TEST(StructuredOutputTest, EveryOutputParsesAndValidatesAcrossSchemasAndSeeds) {
  const std::string path = testing::SourceDir() + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!fs::exists(path))
    KVRELAY_SKIP_OR_FAIL() << "model file not present (run scripts/fetch-model.sh)";
  auto model = Model::Load(path);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  std::shared_ptr<const Model> m(std::move(*model));
  ASSERT_NE(m->chat_template(), nullptr);
  EngineOptions eo;
  eo.kv_dtype = KvDtype::kF16;
  eo.kv_capacity_bytes = 256 << 20;
  eo.max_running = 64;
  auto engine = Engine::Create(eo, m);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();

  struct Run {
    std::string label;
    std::string schema;
    std::string text;
    FinishReason finish = FinishReason::kNone;
  };
  std::map<RequestId, Run> runs;
  RequestId next = 1;
  for (const SchemaCase& c : kCases) {
    auto rendered = m->chat_template()->Render({{"user", c.prompt}}, true);
    ASSERT_TRUE(rendered.ok());
    std::vector<int32_t> prompt = m->tokenizer()->Encode(*rendered, false, true);
    // Greedy plus sampled seeds, sampled hot to stress the mask.
    for (int k = 0; k < 4; ++k) {
      RequestSpec spec;
      spec.id = next++;
      spec.prompt = prompt;
      spec.sampling.temperature = k == 0 ? 0.0f : 1.0f;
      spec.sampling.seed = 1000 + k;
      spec.sampling.max_tokens = 200;
      spec.sampling.json_schema = json::parse(c.schema).dump();
      ASSERT_TRUE((*engine)->Submit(spec).ok());
      runs[spec.id] = {std::string(c.label) + "/seed" + std::to_string(k),
                       spec.sampling.json_schema, "", FinishReason::kNone};
    }
  }
  while ((*engine)->HasWork()) {
    auto events = (*engine)->Step();
    ASSERT_TRUE(events.ok()) << events.status().ToString();
    for (const TokenEvent& e : *events) {
      Run& r = runs[e.id];
      r.text += e.text;
      if (e.finished) r.finish = e.finish_reason;
    }
  }
  json cases = json::array();
  for (const auto& [id, r] : runs) {
    // Ended by the grammar (complete JSON), not by max_tokens.
    EXPECT_EQ(r.finish, FinishReason::kStop) << r.label << ": " << r.text;
    EXPECT_FALSE(json::parse(r.text, nullptr, false).is_discarded()) << r.label << ": " << r.text;
    cases.push_back({{"label", r.label}, {"schema", json::parse(r.schema)}, {"output", r.text}});
  }
  const std::string file = testing::BinaryDir() + "/structured_output_cases.json";
  std::ofstream(file) << cases.dump(2);
  std::string why;
  const std::string python = PythonWithJsonschema(&why);
  if (python.empty()) KVRELAY_SKIP_OR_FAIL() << "no Python jsonschema package: " << why;
  std::string out;
  const int rc = testing::RunCommand(python + " '" + testing::SourceDir() +
                                         "/tests/integration/runtime/validate_json_schema.py' '" +
                                         file + "' 2>&1",
                                     &out);
  if (rc == 3) KVRELAY_SKIP_OR_FAIL() << out;
  EXPECT_EQ(rc, 0) << out;
  std::printf("%s", out.c_str());
}

// A schema the grammar does not support is refused at Submit, by name.
TEST(StructuredOutputTest, UnsupportedSchemaIsRefusedAtSubmit) {
  const std::string path = testing::SourceDir() + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!fs::exists(path))
    KVRELAY_SKIP_OR_FAIL() << "model file not present (run scripts/fetch-model.sh)";
  EngineOptions eo;
  eo.model_path = path;
  eo.kv_capacity_bytes = 16 << 20;
  auto engine = Engine::Create(eo);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  RequestSpec spec;
  spec.id = 1;
  spec.prompt = {1, 2, 3};
  spec.sampling.json_schema = R"({"type":"string","pattern":"^a"})";
  Status st = (*engine)->Submit(spec);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("'pattern'"), std::string::npos) << st.ToString();
}

}  // namespace
}  // namespace kvrelay::engine
