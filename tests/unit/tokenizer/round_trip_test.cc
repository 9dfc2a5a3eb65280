// Property: a byte-level BPE tokenizer is lossless up to the bytes its vocabulary
// has no token for (which Encode drops, as llama.cpp). For any byte string x
// (random bytes, random code points, whitespace runs) with y = x minus those
// bytes: Decode(Encode(x)) == y, every id is in range, and the incremental
// detokenizer streams valid UTF-8 chunks that add up to y whenever y is valid UTF-8.
#include <gtest/gtest.h>

#include <cstdlib>
#include <random>

#include "engine/gguf/gguf.h"
#include "engine/tokenizer/tokenizer.h"

namespace kvrelay::engine {
namespace {

bool ValidUtf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n;
    char32_t cp;
    if (c < 0x80) {
      n = 1, cp = c;
    } else if (c >= 0xC2 && c <= 0xDF) {
      n = 2, cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      n = 3, cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      n = 4, cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      if ((b & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (b & 0x3F);
    }
    if ((n == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) ||
        (n == 4 && (cp < 0x10000 || cp > 0x10FFFF))) {
      return false;
    }
    i += n;
  }
  return true;
}

void AppendCodePoint(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string RandomText(std::mt19937& rng, bool valid) {
  std::string s;
  const int n = std::uniform_int_distribution<int>(0, 40)(rng);
  for (int i = 0; i < n; ++i) {
    switch (std::uniform_int_distribution<int>(0, valid ? 3 : 4)(rng)) {
      case 0:  // ASCII letters, digits, punctuation
        s.push_back(static_cast<char>(std::uniform_int_distribution<int>(0x21, 0x7E)(rng)));
        break;
      case 1:  // whitespace
        s.push_back(" \t\n\r\v\f"[std::uniform_int_distribution<int>(0, 5)(rng)]);
        break;
      case 2: {  // BMP code point outside the surrogates
        char32_t cp = std::uniform_int_distribution<char32_t>(0x80, 0xFFFD)(rng);
        if (cp >= 0xD800 && cp <= 0xDFFF) cp = 0x4E2D;
        AppendCodePoint(cp, &s);
        break;
      }
      case 3:  // astral plane (emoji, ...)
        AppendCodePoint(std::uniform_int_distribution<char32_t>(0x1F300, 0x1FAFF)(rng), &s);
        break;
      default:  // any byte
        s.push_back(static_cast<char>(std::uniform_int_distribution<int>(0, 255)(rng)));
    }
  }
  return s;
}

class RoundTripTest : public ::testing::TestWithParam<std::string> {};

TEST_P(RoundTripTest, RandomTextIsLossless) {
  const char* src = std::getenv("KVRELAY_SOURCE_DIR");
  ASSERT_NE(src, nullptr) << "run under ctest (KVRELAY_SOURCE_DIR)";
  auto g = GgufFile::Open(std::string(src) + "/tests/data/bpe_vocab.gguf");
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  auto vocab = Tokenizer::VocabFromGguf(**g);
  ASSERT_TRUE(vocab.ok());
  vocab->pre = GetParam();
  auto tok = Tokenizer::Create(std::move(*vocab));
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();

  bool has_token[256];
  int missing = 0;
  for (int b = 0; b < 256; ++b) {
    has_token[b] = !(*tok)->Encode(std::string(1, static_cast<char>(b)), false, false).empty();
    missing += has_token[b] ? 0 : 1;
  }
  EXPECT_EQ(missing, 21);  // SmolLM2's vocabulary (see Tokenizer::Encode)

  std::mt19937 rng(12345);
  for (int i = 0; i < 400; ++i) {
    const bool valid = i % 2 == 0;
    const std::string text = RandomText(rng, valid);
    std::string expected;
    for (char c : text) {
      if (has_token[static_cast<unsigned char>(c)]) expected.push_back(c);
    }
    const auto ids = (*tok)->Encode(text, false, false);
    for (int32_t id : ids) ASSERT_TRUE(id >= 0 && id < (*tok)->vocab_size());
    ASSERT_EQ((*tok)->Decode(ids), expected) << "case " << i;
    IncrementalDetokenizer d(**tok);
    std::string streamed;
    for (int32_t id : ids) {
      const std::string chunk = d.Push(id);
      ASSERT_TRUE(ValidUtf8(chunk)) << "case " << i;
      streamed += chunk;
    }
    streamed += d.Flush();
    ASSERT_TRUE(ValidUtf8(streamed));
    if (ValidUtf8(expected)) {
      ASSERT_EQ(streamed, expected) << "case " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Pre, RoundTripTest,
                         ::testing::Values("smollm", "llama3", "qwen2", "default"));

}  // namespace
}  // namespace kvrelay::engine
