// Conformance with llama.cpp on the real model: every string of the recorded
// corpus (tests/data/llamacpp_reference.json, written by
// tools/reference/record_llamacpp.py) must give exactly llama.cpp's ids, decode
// back to itself, and stream through the incremental detokenizer unchanged.
// Skipped when the model file is absent (scripts/fetch-model.sh).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "engine/gguf/gguf.h"
#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/tokenizer.h"
#include "tests/testing/skip.h"

namespace kvrelay::engine {
namespace {

std::string SourceDir() {
  const char* s = std::getenv("KVRELAY_SOURCE_DIR");
  return s != nullptr ? s : ".";
}

class ConformanceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::ifstream in(SourceDir() + "/tests/data/llamacpp_reference.json");
    if (in.good()) ref_ = new nlohmann::json(nlohmann::json::parse(in));
    const std::string model = SourceDir() + "/models/" +
                              (ref_ != nullptr ? ref_->at("model").get<std::string>()
                                               : "SmolLM2-135M-Instruct.Q4_1.gguf");
    if (!std::filesystem::exists(model)) return;
    auto g = GgufFile::Open(model);
    if (!g.ok()) {
      open_error_ = new std::string(g.status().ToString());
      return;
    }
    gguf_ = g->release();
  }
  static void TearDownTestSuite() {
    delete gguf_;
    delete ref_;
    delete open_error_;
    gguf_ = nullptr;
    ref_ = nullptr;
    open_error_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(ref_, nullptr) << "tests/data/llamacpp_reference.json is missing";
    ASSERT_EQ(open_error_, nullptr) << *open_error_;
    if (gguf_ == nullptr) KVRELAY_SKIP_OR_FAIL() << "model file absent (scripts/fetch-model.sh)";
    auto t = Tokenizer::FromGguf(*gguf_);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    tok_ = std::move(*t);
  }

  // `text` without the bytes the vocabulary has no token for (Encode drops them,
  // as llama.cpp does): what Decode(Encode(text)) gives back.
  std::string Representable(const std::string& text) const {
    std::string out;
    for (char c : text) {
      if (!tok_->Encode(std::string(1, c), false, false).empty()) out.push_back(c);
    }
    return out;
  }

  static inline GgufFile* gguf_ = nullptr;
  static inline nlohmann::json* ref_ = nullptr;
  static inline std::string* open_error_ = nullptr;
  std::unique_ptr<Tokenizer> tok_;
};

TEST_F(ConformanceTest, IdsMatchLlamaCppOnTheWholeCorpus) {
  int checked = 0, mismatched = 0;
  for (const auto& e : ref_->at("tokenization")) {
    const std::string text = e.at("text");
    const bool add_special = e.at("add_special");
    const bool parse_special = e.at("parse_special");
    const auto want = e.at("ids").get<std::vector<int32_t>>();
    const auto got = tok_->Encode(text, add_special, parse_special);
    ++checked;
    if (got != want) {
      ++mismatched;
      ADD_FAILURE() << "text " << nlohmann::json(text).dump() << " add_special=" << add_special
                    << " parse_special=" << parse_special
                    << "\n  llama.cpp: " << nlohmann::json(want).dump()
                    << "\n  kvrelay:   " << nlohmann::json(got).dump();
    }
  }
  EXPECT_GE(checked, 100);
  EXPECT_EQ(mismatched, 0);
}

TEST_F(ConformanceTest, PromptIdsOfTheLogitsPromptsMatch) {
  // The runtime's reference prompts were tokenized by llama.cpp with
  // add_special=false, parse_special=true.
  for (const auto& p : ref_->at("greedy")) {
    EXPECT_EQ(tok_->Encode(p.at("text").get<std::string>(), false, true),
              p.at("prompt_ids").get<std::vector<int32_t>>());
  }
}

TEST_F(ConformanceTest, DecodeRoundTrips) {
  for (const auto& e : ref_->at("tokenization")) {
    const std::string text = e.at("text");
    EXPECT_EQ(tok_->Decode(tok_->Encode(text, false, false)), Representable(text));
    EXPECT_EQ(tok_->Decode(tok_->Encode(text, true, true)), Representable(text));
  }
}

TEST_F(ConformanceTest, IncrementalDetokenizerStreamsTheSameText) {
  for (const auto& e : ref_->at("tokenization")) {
    const std::string text = e.at("text");
    IncrementalDetokenizer d(*tok_);
    std::string streamed;
    for (int32_t id : tok_->Encode(text, false, false)) streamed += d.Push(id);
    streamed += d.Flush();
    EXPECT_EQ(streamed, Representable(text));
  }
}

TEST_F(ConformanceTest, MetadataAsLlamaCpp) {
  EXPECT_EQ(tok_->vocab_size(), 49152);
  EXPECT_EQ(tok_->bos(), 1);
  EXPECT_EQ(tok_->eos(), 2);
  // llama.cpp's end-of-generation set for this model includes <|endoftext|> and <|im_end|>.
  EXPECT_TRUE(tok_->IsEndOfGeneration(0));
  EXPECT_TRUE(tok_->IsEndOfGeneration(2));
  EXPECT_FALSE(tok_->IsEndOfGeneration(1));
}

TEST_F(ConformanceTest, ChatTemplateFromGgufMatchesJinja2) {
  auto t = ChatTemplate::FromGguf(*gguf_);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  for (const auto& r : ref_->at("chat").at("renderings")) {
    std::vector<ChatMessage> msgs;
    for (const auto& m : r.at("messages")) msgs.push_back({m.at("role"), m.at("content")});
    auto out = t->Render(msgs, r.at("add_generation_prompt").get<bool>());
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    EXPECT_EQ(*out, r.at("text").get<std::string>());
  }
}

}  // namespace
}  // namespace kvrelay::engine

namespace kvrelay::engine {
namespace {

TEST_F(ConformanceTest, ConcurrentEncodeGivesTheSameIds) {
  // Encode is const and documented thread-safe: two threads over the corpus must
  // reproduce the serial results exactly.
  std::vector<std::string> texts;
  std::vector<std::vector<int32_t>> want;
  for (const auto& e : ref_->at("tokenization")) {
    texts.push_back(e.at("text"));
    want.push_back(tok_->Encode(texts.back(), false, true));
  }
  std::vector<std::vector<std::vector<int32_t>>> got(
      2, std::vector<std::vector<int32_t>>(texts.size()));
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = 0; i < texts.size(); ++i) got[t][i] = tok_->Encode(texts[i], false, true);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(got[0], want);
  EXPECT_EQ(got[1], want);
}

}  // namespace
}  // namespace kvrelay::engine
