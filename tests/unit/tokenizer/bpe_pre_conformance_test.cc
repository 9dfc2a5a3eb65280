// Byte-level BPE conformance with llama.cpp under each supported pre-tokenizer.
// tests/data/bpe_vocab.gguf holds the first 8000 tokens of SmolLM2's vocabulary
// (and the merges among them); llama.cpp tokenized the corpus with a copy of it
// for each tokenizer.ggml.pre value (tests/data/bpe_pre_reference.json, both
// written by tools/reference/record_bpe_pre_reference.py).
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "engine/gguf/gguf.h"
#include "engine/tokenizer/tokenizer.h"

namespace kvrelay::engine {
namespace {

class BpePreConformanceTest : public ::testing::TestWithParam<std::string> {};

TEST_P(BpePreConformanceTest, IdsMatchLlamaCpp) {
  const std::string pre = GetParam();
  const char* src = std::getenv("KVRELAY_SOURCE_DIR");
  ASSERT_NE(src, nullptr) << "run under ctest (KVRELAY_SOURCE_DIR)";
  std::ifstream in(std::string(src) + "/tests/data/bpe_pre_reference.json");
  ASSERT_TRUE(in.good());
  const auto ref = nlohmann::json::parse(in);
  auto g = GgufFile::Open(std::string(src) + "/tests/data/bpe_vocab.gguf");
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  auto vocab = Tokenizer::VocabFromGguf(**g);
  ASSERT_TRUE(vocab.ok()) << vocab.status().ToString();
  ASSERT_EQ(vocab->pre, "smollm");
  // The recorded files differed only in tokenizer.ggml.pre; llama.cpp's per-pre
  // default for adding BOS is what VocabFromGguf applies when the key is absent.
  vocab->pre = pre;
  vocab->add_bos = pre == "llama-bpe";
  auto tok = Tokenizer::Create(std::move(*vocab));
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();

  int checked = 0;
  for (const auto& e : ref.at(pre)) {
    const std::string text = e.at("text");
    const bool add_special = e.at("add_special");
    const bool parse_special = e.at("parse_special");
    const auto want = e.at("ids").get<std::vector<int32_t>>();
    EXPECT_EQ((*tok)->Encode(text, add_special, parse_special), want)
        << pre << ": text " << nlohmann::json(text).dump() << " add_special=" << add_special
        << " parse_special=" << parse_special;
    if (!add_special) {
      // Bytes without a token in the vocabulary are dropped (as llama.cpp).
      std::string representable;
      for (char c : text) {
        if (!(*tok)->Encode(std::string(1, c), false, false).empty()) representable.push_back(c);
      }
      EXPECT_EQ((*tok)->Decode(want), representable);
    }
    ++checked;
  }
  EXPECT_GE(checked, 100);
}

INSTANTIATE_TEST_SUITE_P(AllPre, BpePreConformanceTest,
                         ::testing::Values("gpt-2", "default", "llama-bpe", "qwen2", "smollm"),
                         [](const auto& info) {
                           std::string name = info.param;
                           for (char& c : name) {
                             if (c == '-') c = '_';
                           }
                           return name;
                         });

}  // namespace
}  // namespace kvrelay::engine
