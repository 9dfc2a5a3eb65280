// Byte-level BPE on a small hand-built vocabulary: segmentations derived by hand
// from the merge ranks.
#include <gtest/gtest.h>

#include <algorithm>

#include "engine/tokenizer/tokenizer.h"

namespace kvrelay::engine {
namespace {

// GPT-2 byte-level character of a printable ASCII byte is the byte itself, and
// ' ' is U+0120 "Ġ", '\n' is U+010A "Ċ".
class BpeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    VocabData v;
    v.model = "gpt2";
    v.pre = "gpt2";
    // ids 0..2: specials; then one token per byte (byte-level characters).
    v.tokens = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
    v.token_types = {TokenType::kControl, TokenType::kControl, TokenType::kControl};
    int next = 0;
    for (int b = 0; b < 256; ++b) {
      std::string t;
      // Same map as the tokenizer, written out independently: printable Latin-1
      // maps to itself, the rest to U+0100 + n in byte order.
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      const char32_t cp = printable ? b : 0x100 + next++;
      if (cp < 0x80) {
        t.push_back(static_cast<char>(cp));
      } else {
        t.push_back(static_cast<char>(0xC0 | (cp >> 6)));
        t.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
      }
      v.tokens.push_back(t);
      v.token_types.push_back(TokenType::kNormal);
    }
    // Merged tokens, in merge-rank order.
    v.merges = {"l l", "h e",          "he ll", "hell o", "\xc4\xa0 w",
                "o r", "\xc4\xa0w or", "a b",   "b c",    "a a"};
    for (const char* t :
         {"ll", "he", "hell", "hello", "\xc4\xa0w", "or", "\xc4\xa0wor", "ab", "bc", "aa"}) {
      v.tokens.push_back(t);
      v.token_types.push_back(TokenType::kNormal);
    }
    v.bos_id = 0;
    v.eos_id = 2;
    auto t = Tokenizer::Create(v);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    tok_ = std::move(*t);
  }
  int32_t Id(const std::string& text) const { return tok_->TextToId(text); }
  int32_t Byte(char c) const { return 3 + static_cast<unsigned char>(c); }
  std::unique_ptr<Tokenizer> tok_;
};

TEST_F(BpeTest, MergesFollowRanks) {
  // "hello": l+l (rank 0), h+e (1), he+ll (2), hell+o (3).
  EXPECT_EQ(tok_->Encode("hello", false, false), (std::vector<int32_t>{Id("hello")}));
  // " world": Ġ+w (4), o+r (5), Ġw+or (6); "l", "d" stay single bytes.
  EXPECT_EQ(tok_->Encode("hello world", false, false),
            (std::vector<int32_t>{Id("hello"), Id("\xc4\xa0wor"), Byte('l'), Byte('d')}));
}

TEST_F(BpeTest, LowerRankWinsOverPosition) {
  // "abc": "a b" (rank 7) beats "b c" (rank 8).
  EXPECT_EQ(tok_->Encode("abc", false, false), (std::vector<int32_t>{Id("ab"), Byte('c')}));
  // "bab": b+a has no merge, a+b does.
  EXPECT_EQ(tok_->Encode("bab", false, false), (std::vector<int32_t>{Byte('b'), Id("ab")}));
  // "aaa": equal ranks, the leftmost pair merges first.
  EXPECT_EQ(tok_->Encode("aaa", false, false), (std::vector<int32_t>{Id("aa"), Byte('a')}));
}

TEST_F(BpeTest, BytesAndInvalidUtf8RoundTrip) {
  const std::string s("\xff\x00z\n\xe2\x82", 6);  // invalid, NUL, newline, truncated
  const auto ids = tok_->Encode(s, false, false);
  EXPECT_EQ(ids, (std::vector<int32_t>{Byte('\xff'), Byte('\0'), Byte('z'), Byte('\n'),
                                       Byte('\xe2'), Byte('\x82')}));
  EXPECT_EQ(tok_->Decode(ids), s);
}

TEST_F(BpeTest, SpecialTokensOnlyWhenParsed) {
  const std::string text = "<|im_start|>he<|im_end|>";
  EXPECT_EQ(tok_->Encode(text, false, true), (std::vector<int32_t>{1, Id("he"), 2}));
  const auto plain = tok_->Encode(text, false, false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 1), 0);
  EXPECT_EQ(tok_->Decode(plain), text);
  EXPECT_EQ(tok_->Decode(tok_->Encode(text, false, true)), text);
}

TEST_F(BpeTest, AddSpecialFollowsVocabularyFlags) {
  // add_bos is false in this vocabulary: add_special adds nothing.
  EXPECT_EQ(tok_->Encode("he", true, false), (std::vector<int32_t>{Id("he")}));
  EXPECT_TRUE(tok_->Encode("", true, true).empty());
}

TEST_F(BpeTest, EndOfGeneration) {
  EXPECT_TRUE(tok_->IsEndOfGeneration(2));   // eos
  EXPECT_TRUE(tok_->IsEndOfGeneration(0));   // "<|endoftext|>" control token
  EXPECT_FALSE(tok_->IsEndOfGeneration(1));  // <|im_start|>
  EXPECT_FALSE(tok_->IsEndOfGeneration(Id("hello")));
  EXPECT_FALSE(tok_->IsEndOfGeneration(-1));
  EXPECT_FALSE(tok_->IsEndOfGeneration(1 << 30));
  EXPECT_EQ(tok_->TokenToPiece(1 << 30), "");
}

TEST(BpeCreateTest, RejectsBadVocabularies) {
  VocabData v;
  v.tokens = {"a", "b", "ab"};
  v.merges = {"a b"};
  v.token_types = {TokenType::kNormal};  // wrong length
  auto t = Tokenizer::Create(v);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(t.status().message().find("token_type"), std::string::npos);

  v.token_types.clear();
  v.merges = {"ab"};  // no space
  t = Tokenizer::Create(v);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("merges[0]"), std::string::npos);

  v.merges = {"a b"};
  v.eos_id = 7;
  t = Tokenizer::Create(v);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("eos"), std::string::npos);

  v.eos_id = -1;
  v.model = "bert";
  t = Tokenizer::Create(v);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kUnimplemented);

  v.model = "gpt2";
  v.tokens.clear();
  EXPECT_FALSE(Tokenizer::Create(v).ok());
}

}  // namespace
}  // namespace kvrelay::engine
