// Tokenizer::FromGguf and ChatTemplate::FromGguf on small in-memory GGUF images.
#include <gtest/gtest.h>

#include "engine/gguf/gguf.h"
#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/tokenizer.h"

namespace kvrelay::engine {
namespace {

// A SentencePiece vocabulary: <unk> <s> </s>, byte tokens for 'a'/'b', "▁", "a", "▁a".
GgufWriter SpmWriter() {
  GgufWriter w;
  w.SetString("general.architecture", "llama");
  w.SetString("tokenizer.ggml.model", "llama");
  w.SetStringArray("tokenizer.ggml.tokens", {"<unk>", "<s>", "</s>", "<0x62>", "\xe2\x96\x81", "a",
                                             "\xe2\x96\x81"
                                             "a"});
  w.SetInt32Array("tokenizer.ggml.token_type", {2, 3, 3, 6, 1, 1, 1});
  w.SetFloat32Array("tokenizer.ggml.scores", {0, 0, 0, 0, -1, -2, -3});
  w.SetUint32("tokenizer.ggml.bos_token_id", 1);
  w.SetUint32("tokenizer.ggml.eos_token_id", 2);
  return w;
}

TEST(TokenizerGgufTest, SpmDefaultsAndMetadata) {
  const auto bytes = SpmWriter().Build();
  auto g = GgufFile::FromMemory(bytes.data(), bytes.size());
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  auto t = Tokenizer::FromGguf(**g);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  // llama.cpp defaults for "llama": add BOS and a space prefix.
  // "ab" -> "▁ab": ▁+a merges (score -3), "b" falls back to <0x62>.
  EXPECT_EQ((*t)->Encode("ab", true, false), (std::vector<int32_t>{1, 6, 3}));
  EXPECT_EQ((*t)->Decode((*t)->Encode("ab", false, false)), "ab");
  EXPECT_EQ((*t)->bos(), 1);
  EXPECT_EQ((*t)->eos(), 2);
  EXPECT_TRUE((*t)->IsEndOfGeneration(2));
  EXPECT_EQ((*t)->vocab_size(), 7);
}

TEST(TokenizerGgufTest, MetadataOverridesDefaults) {
  GgufWriter w = SpmWriter();
  w.SetBool("tokenizer.ggml.add_bos_token", false);
  w.SetBool("tokenizer.ggml.add_space_prefix", false);
  const auto bytes = w.Build();
  auto g = GgufFile::FromMemory(bytes.data(), bytes.size());
  ASSERT_TRUE(g.ok());
  auto t = Tokenizer::FromGguf(**g);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->Encode("ab", true, false), (std::vector<int32_t>{5, 3}));
}

TEST(TokenizerGgufTest, BadMetadataIsAClearError) {
  {
    GgufWriter w = SpmWriter();
    w.SetInt32Array("tokenizer.ggml.token_type", {2, 3, 3, 6, 1, 1, 9});
    const auto bytes = w.Build();
    auto g = GgufFile::FromMemory(bytes.data(), bytes.size());
    ASSERT_TRUE(g.ok());
    auto t = Tokenizer::FromGguf(**g);
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find("token_type"), std::string::npos);
  }
  {
    GgufWriter w = SpmWriter();
    w.SetFloat32Array("tokenizer.ggml.scores", {0, 0});
    const auto bytes = w.Build();
    auto g = GgufFile::FromMemory(bytes.data(), bytes.size());
    ASSERT_TRUE(g.ok());
    auto t = Tokenizer::FromGguf(**g);
    ASSERT_FALSE(t.ok());
    EXPECT_NE(t.status().message().find("scores"), std::string::npos);
  }
  {
    GgufWriter w = SpmWriter();
    w.SetString("tokenizer.ggml.model", "gpt2");  // byte-level without merges
    const auto bytes = w.Build();
    auto g = GgufFile::FromMemory(bytes.data(), bytes.size());
    ASSERT_TRUE(g.ok());
    auto t = Tokenizer::FromGguf(**g);
    ASSERT_FALSE(t.ok());
    EXPECT_NE(t.status().message().find("merges"), std::string::npos);
  }
  {
    GgufWriter w;
    w.SetString("general.architecture", "llama");
    const auto bytes = w.Build();
    auto g = GgufFile::FromMemory(bytes.data(), bytes.size());
    ASSERT_TRUE(g.ok());
    auto t = Tokenizer::FromGguf(**g);
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), StatusCode::kNotFound);
    auto c = ChatTemplate::FromGguf(**g);
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), StatusCode::kNotFound);
  }
}

TEST(TokenizerGgufTest, ChatTemplateUsesTheVocabularysBosText) {
  GgufWriter w = SpmWriter();
  w.SetString("tokenizer.chat_template",
              "{{ bos_token }}{% for m in messages %}<<SYS>>[INST]{{ m['content'] }}{% endfor %}");
  const auto bytes = w.Build();
  auto g = GgufFile::FromMemory(bytes.data(), bytes.size());
  ASSERT_TRUE(g.ok());
  auto c = ChatTemplate::FromGguf(**g);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->family(), ChatTemplateFamily::kLlama2);
  auto r = c->Render({{"user", "q"}, {"assistant", "a"}}, true);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, "<s>[INST] q [/INST] a </s>");
}

}  // namespace
}  // namespace kvrelay::engine
