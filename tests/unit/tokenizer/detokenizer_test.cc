// Incremental detokenization never emits a broken UTF-8 sequence.
#include <gtest/gtest.h>

#include "engine/tokenizer/tokenizer.h"

namespace kvrelay::engine {
namespace {

// A byte-level vocabulary with one token per byte plus a few multi-byte pieces,
// so characters can be split across tokens at every byte boundary.
std::unique_ptr<Tokenizer> ByteVocab() {
  VocabData v;
  v.model = "gpt2";
  v.pre = "gpt2";
  int next = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const char32_t cp = printable ? b : 0x100 + next++;
    std::string t;
    if (cp < 0x80) {
      t.push_back(static_cast<char>(cp));
    } else {
      t.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      t.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    v.tokens.push_back(t);
  }
  v.merges = {"a b"};
  v.tokens.push_back("ab");
  auto t = Tokenizer::Create(v);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(*t) : nullptr;
}

TEST(IncrementalDetokenizerTest, EmojiSplitAcrossByteTokens) {
  auto tok = ByteVocab();
  ASSERT_NE(tok, nullptr);
  IncrementalDetokenizer d(*tok);
  const std::string emoji = "\xf0\x9f\x98\x80";  // U+1F600
  std::vector<std::string> outs;
  for (unsigned char b : emoji) outs.push_back(d.Push(b));  // id == byte in this vocabulary
  EXPECT_EQ(outs, (std::vector<std::string>{"", "", "", emoji}));
  EXPECT_EQ(d.Flush(), "");
}

TEST(IncrementalDetokenizerTest, StreamEqualsDecodeForMixedScripts) {
  auto tok = ByteVocab();
  ASSERT_NE(tok, nullptr);
  // CJK, ZWJ family, flag, accented Latin, ASCII.
  const std::string text =
      "ab \xe4\xbd\xa0\xe5\xa5\xbd \xf0\x9f\x91\xa8\xe2\x80\x8d\xf0\x9f\x91\xa9 "
      "\xf0\x9f\x87\xab\xf0\x9f\x87\xb7 caf\xc3\xa9";
  const auto ids = tok->Encode(text, false, false);
  IncrementalDetokenizer d(*tok);
  std::string streamed;
  for (int32_t id : ids) {
    const std::string out = d.Push(id);
    // Every chunk on its own is valid UTF-8: decoding it gives no replacement.
    for (size_t i = 0; i < out.size();) {
      const auto c = static_cast<unsigned char>(out[i]);
      const size_t n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
      ASSERT_LE(i + n, out.size()) << "chunk ends inside a character";
      for (size_t k = 1; k < n; ++k) ASSERT_EQ(static_cast<unsigned char>(out[i + k]) & 0xC0, 0x80);
      i += n;
    }
    streamed += out;
  }
  streamed += d.Flush();
  EXPECT_EQ(streamed, text);
  EXPECT_EQ(tok->Decode(ids), text);
}

TEST(IncrementalDetokenizerTest, InvalidBytesBecomeReplacementCharacters) {
  auto tok = ByteVocab();
  ASSERT_NE(tok, nullptr);
  IncrementalDetokenizer d(*tok);
  // A stray continuation byte can never start a character: replaced at once.
  EXPECT_EQ(d.Push(0x80), "\xef\xbf\xbd");
  // A lead byte followed by ASCII: the lead byte is replaced, the ASCII kept.
  EXPECT_EQ(d.Push(0xE4), "");
  EXPECT_EQ(d.Push('x'),
            "\xef\xbf\xbd"
            "x");
  // An incomplete character at the end is flushed as one U+FFFD.
  EXPECT_EQ(d.Push(0xF0), "");
  EXPECT_EQ(d.Push(0x9F), "");
  EXPECT_EQ(d.Flush(), "\xef\xbf\xbd");
  EXPECT_EQ(d.Flush(), "");
}

}  // namespace
}  // namespace kvrelay::engine
