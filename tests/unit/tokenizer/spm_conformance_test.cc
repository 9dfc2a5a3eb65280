// SentencePiece-BPE conformance with llama.cpp on a generated Llama-2-style
// vocabulary (tests/data/spm_vocab.gguf, ids in tests/data/spm_reference.json,
// both written by tools/reference/record_spm_reference.py).
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "engine/gguf/gguf.h"
#include "engine/tokenizer/tokenizer.h"

namespace kvrelay::engine {
namespace {

TEST(SpmConformanceTest, IdsMatchLlamaCppAndRoundTrip) {
  const char* src = std::getenv("KVRELAY_SOURCE_DIR");
  ASSERT_NE(src, nullptr) << "run under ctest (KVRELAY_SOURCE_DIR)";
  std::ifstream in(std::string(src) + "/tests/data/spm_reference.json");
  ASSERT_TRUE(in.good());
  const auto ref = nlohmann::json::parse(in);
  auto g = GgufFile::Open(std::string(src) + "/tests/data/spm_vocab.gguf");
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  auto tok = Tokenizer::FromGguf(**g);
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  EXPECT_EQ((*tok)->vocab_size(), ref.at("n_tokens").get<int>());

  int checked = 0;
  for (const auto& e : ref.at("tokenization")) {
    const std::string text = e.at("text");
    const bool add_special = e.at("add_special");
    const bool parse_special = e.at("parse_special");
    const auto want = e.at("ids").get<std::vector<int32_t>>();
    EXPECT_EQ((*tok)->Encode(text, add_special, parse_special), want)
        << "text " << nlohmann::json(text).dump() << " add_special=" << add_special
        << " parse_special=" << parse_special;
    if (!add_special && !parse_special) {
      EXPECT_EQ((*tok)->Decode(want), text);
      IncrementalDetokenizer d(**tok);
      std::string streamed;
      for (int32_t id : want) streamed += d.Push(id);
      EXPECT_EQ(streamed + d.Flush(), text);
    }
    ++checked;
  }
  EXPECT_GE(checked, 100);
}

}  // namespace
}  // namespace kvrelay::engine
