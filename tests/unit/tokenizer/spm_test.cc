// SentencePiece-style BPE ("llama") on a hand-built vocabulary. Expected
// segmentations are derived by hand: pairs whose concatenation is a token merge,
// highest score first (leftmost on ties), and leftover characters become
// <0xNN> byte tokens.
#include <gtest/gtest.h>

#include "engine/tokenizer/tokenizer.h"

namespace kvrelay::engine {
namespace {

constexpr const char* kSp = "\xe2\x96\x81";  // "▁"

class SpmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    VocabData v;
    v.model = "llama";
    v.tokens = {"<unk>", "<s>", "</s>"};
    v.token_types = {TokenType::kUnknown, TokenType::kControl, TokenType::kControl};
    v.scores = {0, 0, 0};
    static const char* kHex = "0123456789ABCDEF";
    for (int b = 0; b < 256; ++b) {
      v.tokens.push_back(std::string("<0x") + kHex[b >> 4] + kHex[b & 15] + ">");
      v.token_types.push_back(TokenType::kByte);
      v.scores.push_back(0);
    }
    const std::string sp = kSp;
    const std::vector<std::pair<std::string, float>> pieces = {
        {sp, -1},          {"h", -2},      {"e", -3},           {"l", -4},       {"o", -5},
        {"w", -6},         {"r", -7},      {"d", -8},           {"he", -10},     {"ll", -5},
        {"hell", -20},     {"hello", -30}, {sp + "hello", -40}, {sp + "w", -15}, {"or", -12},
        {sp + "wor", -25}, {"a", -1},      {"aa", -3}};
    for (const auto& [text, score] : pieces) {
      v.tokens.push_back(text);
      v.token_types.push_back(TokenType::kNormal);
      v.scores.push_back(score);
    }
    v.unk_id = 0;
    v.bos_id = 1;
    v.eos_id = 2;
    v.add_bos = true;
    v.add_space_prefix = true;
    auto t = Tokenizer::Create(v);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    tok_ = std::move(*t);
  }
  int32_t Id(const std::string& text) const {
    const int32_t id = tok_->TextToId(text);
    EXPECT_GE(id, 0) << text;
    return id;
  }
  static int32_t Byte(unsigned char b) { return 3 + b; }
  std::unique_ptr<Tokenizer> tok_;
};

TEST_F(SpmTest, MergesByScore) {
  // "▁hello▁world": ll(-5), he(-10), or(-12), ▁w(-15), hell(-20), ▁wor(-25),
  // hello(-30), ▁hello(-40); "▁worl" is no token, so "l" and "d" stay.
  const std::string sp = kSp;
  EXPECT_EQ(tok_->Encode("hello world", false, false),
            (std::vector<int32_t>{Id(sp + "hello"), Id(sp + "wor"), Id("l"), Id("d")}));
}

TEST_F(SpmTest, AddSpecialAddsBos) {
  const std::string sp = kSp;
  EXPECT_EQ(tok_->Encode("hello", true, false), (std::vector<int32_t>{1, Id(sp + "hello")}));
  EXPECT_EQ(tok_->Encode("", true, false), (std::vector<int32_t>{1}));
}

TEST_F(SpmTest, ByteFallback) {
  const std::string sp = kSp;
  // "i" and "!" are not in the vocabulary.
  EXPECT_EQ(tok_->Encode("hi!", false, false),
            (std::vector<int32_t>{Id(sp), Id("h"), Byte('i'), Byte('!')}));
  // "é" = C3 A9.
  EXPECT_EQ(tok_->Encode("\xc3\xa9", false, false),
            (std::vector<int32_t>{Id(sp), Byte(0xC3), Byte(0xA9)}));
}

TEST_F(SpmTest, EqualScoresMergeLeftmostFirst) {
  const std::string sp = kSp;
  EXPECT_EQ(tok_->Encode("aaa", false, false), (std::vector<int32_t>{Id(sp), Id("aa"), Id("a")}));
}

TEST_F(SpmTest, SpecialTokensAndSpacePrefix) {
  const std::string sp = kSp;
  // Text after a special token gets the space prefix again.
  EXPECT_EQ(tok_->Encode("<s>hello", false, true), (std::vector<int32_t>{1, Id(sp + "hello")}));
  EXPECT_EQ(tok_->Encode("<s>hello", false, false),
            (std::vector<int32_t>{Id(sp), Byte('<'), Byte('s'), Byte('>'), Id("hello")}));
}

TEST_F(SpmTest, DecodeUndoesSpacePrefixAndBytes) {
  for (const std::string text : {"hello world", "hi!", "\xc3\xa9t\xc3\xa9", "a  b", " lead"}) {
    EXPECT_EQ(tok_->Decode(tok_->Encode(text, false, false)), text);
  }
  const std::string sp = kSp;
  EXPECT_EQ(tok_->TokenToPiece(Id(sp + "wor")), " wor");
  EXPECT_EQ(tok_->TokenToPiece(Byte(0x41)), "A");
  EXPECT_EQ(tok_->TokenToPiece(1), "<s>");
  // BOS first: the space is still dropped from the first text piece.
  EXPECT_EQ(tok_->Decode(tok_->Encode("hello", true, false)), "<s>hello");
}

}  // namespace
}  // namespace kvrelay::engine
