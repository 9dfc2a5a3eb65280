// Pre-tokenizer splits, derived by hand from llama.cpp's expressions for each type.
#include "engine/tokenizer/pre_tokenizer.h"

#include <gtest/gtest.h>

namespace kvrelay::engine {
namespace {

std::vector<std::string> Split(std::string_view pre, std::string_view text) {
  auto p = PreTokenizer::Create(pre);
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  if (!p.ok()) return {};
  std::vector<std::string> out;
  for (std::string_view s : (*p)->Split(text)) out.emplace_back(s);
  return out;
}

using V = std::vector<std::string>;

TEST(PreTokenizerTest, Gpt2WordsSpacesAndPunctuation) {
  // " ?\p{L}+" keeps one leading space with a word; a run of spaces before a word
  // gives all but the last space to "\s+(?!\S)"; trailing spaces go together.
  EXPECT_EQ(Split("gpt2", "Hello  world!!  "), (V{"Hello", " ", " world", "!!", "  "}));
  EXPECT_EQ(Split("gpt2", "a\n\nb"), (V{"a", "\n", "\n", "b"}));
  EXPECT_EQ(Split("gpt2", "x = 12345;"), (V{"x", " =", " 12345", ";"}));
}

TEST(PreTokenizerTest, Gpt2ContractionsAreCaseSensitive) {
  EXPECT_EQ(Split("gpt2", "don't"), (V{"don", "'t"}));
  EXPECT_EQ(Split("gpt2", "I'M"), (V{"I", "'", "M"}));
}

TEST(PreTokenizerTest, SmollmSplitsEveryDigitFirst) {
  // "\p{N}" runs first: digits are single pieces, and the space before a number
  // is left on its own.
  EXPECT_EQ(Split("smollm", "Room 101!"), (V{"Room", " ", "1", "0", "1", "!"}));
  EXPECT_EQ(Split("smollm", "3.14"), (V{"3", ".", "1", "4"}));
}

TEST(PreTokenizerTest, Llama3GroupsDigitsByThreeAndNewlines) {
  EXPECT_EQ(Split("llama-bpe", "12345"), (V{"123", "45"}));
  EXPECT_EQ(Split("llama-bpe", "I'M here"), (V{"I", "'M", " here"}));
  EXPECT_EQ(Split("llama-bpe", "hello\n\nworld"), (V{"hello", "\n\n", "world"}));
  // A non-letter, non-newline character joins the following word.
  EXPECT_EQ(Split("llama3", "(abc) x"), (V{"(abc", ")", " x"}));
}

TEST(PreTokenizerTest, Qwen2SplitsSingleDigits) {
  EXPECT_EQ(Split("qwen2", "a 123"), (V{"a", " ", "1", "2", "3"}));
}

TEST(PreTokenizerTest, DefaultCutsPunctuationFirst) {
  // "[\p{P}\$\+<=>\^~\|]+" first: "<=>" and "," are pieces before the word rules run;
  // "\p{N}+" keeps 1234 whole, then "[0-9][0-9][0-9]" takes three digits.
  EXPECT_EQ(Split("default", "a<=>b, 1234"), (V{"a", "<=>", "b", ",", " ", "123", "4"}));
}

TEST(PreTokenizerTest, UnicodeClassesAndWhiteSpace) {
  // U+00A0 and U+3000 are White_Space; CJK and Cyrillic are letters.
  EXPECT_EQ(Split("gpt2", "\xe4\xbd\xa0\xe5\xa5\xbd \xd0\x9f\xd1\x80"),
            (V{"\xe4\xbd\xa0\xe5\xa5\xbd", " \xd0\x9f\xd1\x80"}));
  EXPECT_EQ(Split("gpt2",
                  "a\xc2\xa0"
                  "b"),
            (V{"a", "\xc2\xa0", "b"}));
}

TEST(PreTokenizerTest, InvalidUtf8IsKeptByteForByte) {
  const std::string text = "ab\xff\xfe cd";
  const V pieces = Split("gpt2", text);
  std::string joined;
  for (const auto& p : pieces) joined += p;
  EXPECT_EQ(joined, text);
  // The two invalid bytes are matched as U+FFFD (a symbol): one piece.
  EXPECT_EQ(pieces, (V{"ab", "\xff\xfe", " cd"}));
}

TEST(PreTokenizerTest, UnknownPreIsUnimplemented) {
  auto p = PreTokenizer::Create("no-such-pre");
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(p.status().message().find("no-such-pre"), std::string::npos);
}

}  // namespace
}  // namespace kvrelay::engine
