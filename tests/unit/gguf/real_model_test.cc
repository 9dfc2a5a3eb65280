// Opens the real SmolLM2-135M model shipped in models/ and checks the shape
// facts published for it (skipped when the file is absent).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "engine/gguf/fingerprint.h"
#include "engine/gguf/gguf.h"
#include "tests/testing/skip.h"

namespace kvrelay::engine {
namespace {

std::string ModelPath() {
  const char* src = std::getenv("KVRELAY_SOURCE_DIR");
  return std::string(src ? src : ".") + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

class RealModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto f = GgufFile::Open(ModelPath());
    if (!f.ok() && f.status().code() == StatusCode::kNotFound) {
      KVRELAY_SKIP_OR_FAIL() << "model not present: " << ModelPath();
    }
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    file_ = std::move(f).value();
  }
  std::unique_ptr<GgufFile> file_;
};

TEST_F(RealModelTest, HyperparametersMatchSmolLM2) {
  const GgufFile& g = *file_;
  EXPECT_EQ(g.version(), 3u);
  EXPECT_EQ(*g.GetString("general.architecture"), "llama");
  EXPECT_EQ(*g.GetInt("llama.block_count"), 30);
  EXPECT_EQ(*g.GetInt("llama.embedding_length"), 576);
  EXPECT_EQ(*g.GetInt("llama.attention.head_count"), 9);
  EXPECT_EQ(*g.GetInt("llama.attention.head_count_kv"), 3);
  EXPECT_EQ(*g.GetInt("llama.feed_forward_length"), 1536);
  EXPECT_EQ(*g.GetInt("llama.rope.dimension_count"), 64);
  EXPECT_EQ(*g.GetFloat("llama.rope.freq_base"), 100000.0);
  EXPECT_NEAR(*g.GetFloat("llama.attention.layer_norm_rms_epsilon"), 1e-5, 1e-12);
  EXPECT_EQ(*g.GetString("tokenizer.ggml.model"), "gpt2");
  EXPECT_EQ(*g.GetString("tokenizer.ggml.pre"), "smollm");
  auto tokens = g.GetStringArray("tokenizer.ggml.tokens");
  ASSERT_TRUE(tokens.ok());
  EXPECT_EQ(tokens->size(), 49152u);
  EXPECT_NE(g.GetString("tokenizer.chat_template")->find("<|im_start|>"), std::string::npos);
}

TEST_F(RealModelTest, TensorTableMatchesTheArchitecture) {
  const GgufFile& g = *file_;
  // 30 layers x 9 tensors + token_embd + output_norm; tied embeddings: no output.weight.
  EXPECT_EQ(g.tensors().size(), 30u * 9 + 2);
  EXPECT_EQ(g.FindTensor("output.weight"), nullptr);
  const GgufTensor* emb = g.FindTensor("token_embd.weight");
  ASSERT_NE(emb, nullptr);
  EXPECT_EQ(emb->type, GgmlType::kQ8_0);
  EXPECT_EQ(emb->dims, (std::vector<int64_t>{576, 49152}));
  struct Want {
    const char* name;
    GgmlType type;
    std::vector<int64_t> dims;
  };
  const Want wants[] = {
      {"blk.0.attn_q.weight", GgmlType::kQ4_1, {576, 576}},
      {"blk.0.attn_k.weight", GgmlType::kQ4_1, {576, 192}},  // 3 kv heads x 64
      {"blk.0.attn_v.weight", GgmlType::kQ4_1, {576, 192}},
      {"blk.0.attn_output.weight", GgmlType::kQ4_1, {576, 576}},
      {"blk.29.ffn_gate.weight", GgmlType::kQ4_1, {576, 1536}},
      {"blk.29.ffn_up.weight", GgmlType::kQ4_1, {576, 1536}},
      {"blk.29.ffn_down.weight", GgmlType::kQ4_1, {1536, 576}},
      {"blk.29.attn_norm.weight", GgmlType::kF32, {576}},
      {"blk.29.ffn_norm.weight", GgmlType::kF32, {576}},
      {"output_norm.weight", GgmlType::kF32, {576}},
  };
  for (const Want& w : wants) {
    const GgufTensor* t = g.FindTensor(w.name);
    ASSERT_NE(t, nullptr) << w.name;
    EXPECT_EQ(t->type, w.type) << w.name;
    EXPECT_EQ(t->dims, w.dims) << w.name;
    EXPECT_EQ(static_cast<int64_t>(t->nbytes), *RowBytes(t->type, t->Cols()) * t->Rows());
  }
  // Dequantized weights are finite and of a plausible magnitude for a trained model.
  for (const char* name : {"token_embd.weight", "blk.0.attn_q.weight", "output_norm.weight"}) {
    const GgufTensor* t = g.FindTensor(name);
    std::vector<float> row(static_cast<size_t>(t->Cols()));
    const int64_t row_bytes = *RowBytes(t->type, t->Cols());
    double sum_abs = 0;
    for (int64_t r = 0; r < t->Rows(); r += std::max<int64_t>(1, t->Rows() / 64)) {
      DequantizeRow(t->type, t->data + r * row_bytes, row.data(), t->Cols());
      for (float v : row) {
        ASSERT_TRUE(std::isfinite(v)) << name;
        sum_abs += std::fabs(v);
      }
    }
    EXPECT_GT(sum_abs, 0.0) << name;
  }
}

TEST_F(RealModelTest, FingerprintIsStable) {
  const auto a = ComputeModelFingerprint(*file_);
  auto again = GgufFile::Open(ModelPath());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(ComputeModelFingerprint(**again), a);
}

}  // namespace
}  // namespace kvrelay::engine
