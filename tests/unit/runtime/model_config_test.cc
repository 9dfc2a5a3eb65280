#include "engine/runtime/model_config.h"

#include <gtest/gtest.h>

#include "engine/gguf/gguf.h"
#include "engine/runtime/model.h"
#include "kv_transfer/head_sharding.h"
#include "tests/testing/synthetic_model.h"

namespace kvrelay::engine {
namespace {

Result<ModelConfig> ConfigOf(const std::vector<uint8_t>& bytes) {
  auto f = GgufFile::FromMemory(bytes.data(), bytes.size());
  if (!f.ok()) return f.status();
  return ModelConfig::FromGguf(**f);
}

TEST(ModelConfigTest, ReadsLlamaShapes) {
  testing::SyntheticModelOptions o;
  o.layers = 3;
  o.d_model = 96;
  o.heads = 6;
  o.kv_heads = 2;
  o.ffn = 160;
  auto bytes = testing::BuildSyntheticModel(o);
  auto c = ConfigOf(bytes);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->arch, "llama");
  EXPECT_EQ(c->n_layers, 3);
  EXPECT_EQ(c->n_heads, 6);
  EXPECT_EQ(c->n_kv_heads, 2);
  EXPECT_EQ(c->head_dim, 16);
  EXPECT_EQ(c->rope_dim, 16);
  EXPECT_EQ(c->ffn_dim, 160);
  EXPECT_EQ(c->vocab, testing::SyntheticVocabSize());
  EXPECT_EQ(c->rope_layout, RopeLayout::kNormal);
  EXPECT_TRUE(c->tied_embeddings);
  EXPECT_FALSE(c->qkv_bias);
}

TEST(ModelConfigTest, Qwen2HasBiasesAndNeoxRope) {
  testing::SyntheticModelOptions o;
  o.arch = "qwen2";
  o.tied_embeddings = false;
  auto c = ConfigOf(testing::BuildSyntheticModel(o));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->rope_layout, RopeLayout::kNeox);
  EXPECT_TRUE(c->qkv_bias);
  EXPECT_FALSE(c->tied_embeddings);
}

TEST(ModelConfigTest, Gemma3FromMetadata) {
  testing::SyntheticModelOptions o;
  o.arch = "gemma3";
  o.layers = 4;
  o.sliding_window = 9;
  o.sliding_window_pattern = 2;
  o.rope_base_swa = 100.0f;
  auto c = ConfigOf(testing::BuildSyntheticModel(o));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->rope_layout, RopeLayout::kNeox);
  EXPECT_TRUE(c->gemma_norms);
  EXPECT_EQ(c->ffn_act, ModelConfig::FfnAct::kGeluTanh);
  EXPECT_EQ(c->embed_scale, 8.0f);  // sqrt(d_model = 64)
  EXPECT_EQ(c->q_scale, 0.25f);     // 1 / sqrt(head_dim = 16)
  for (int l = 0; l < 4; ++l) {     // pattern 2: odd layers global
    EXPECT_EQ(c->LayerWindow(l), l % 2 == 1 ? 0 : 9) << l;
    EXPECT_EQ(c->LayerRopeBase(l), l % 2 == 1 ? o.rope_base : 100.0f) << l;
  }
  EXPECT_FALSE(c->AllLayersFull());
  // Without the window key every layer is global.
  o.sliding_window = 0;
  auto full = ConfigOf(testing::BuildSyntheticModel(o));
  ASSERT_TRUE(full.ok()) << full.status().ToString();
  EXPECT_TRUE(full->AllLayersFull());
  EXPECT_TRUE(full->layer_sliding.empty());
  // llama keeps its old meaning: the window (if any) on every layer.
  testing::SyntheticModelOptions l;
  auto llama = ConfigOf(testing::BuildSyntheticModel(l));
  ASSERT_TRUE(llama.ok());
  EXPECT_FALSE(llama->gemma_norms);
  EXPECT_EQ(llama->q_scale, 0.0f);
  EXPECT_EQ(llama->LayerRopeBase(1), llama->rope_base);
}

// Rebuilds a synthetic model with one tensor renamed or one key changed.
std::vector<uint8_t> Mutate(const std::string& drop_tensor, const std::string& key,
                            GgufValue value) {
  auto bytes = testing::BuildSyntheticModel({});
  auto f = GgufFile::FromMemory(bytes.data(), bytes.size());
  EXPECT_TRUE(f.ok());
  GgufWriter w;
  for (const auto& [k, v] : (*f)->metadata()) w.Set(k, k == key ? value : v);
  for (const GgufTensor& t : (*f)->tensors()) {
    if (t.name == drop_tensor) continue;
    w.AddTensor(t.name, t.type, t.dims, std::vector<uint8_t>(t.data, t.data + t.nbytes));
  }
  return w.Build();
}

TEST(ModelConfigTest, ClearErrors) {
  auto missing = ConfigOf(Mutate("blk.1.ffn_up.weight", "", {}));
  EXPECT_EQ(missing.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("blk.1.ffn_up.weight"), std::string::npos);

  GgufValue arch{GgufValueType::kString, std::string("mamba")};
  auto bad_arch = ConfigOf(Mutate("", "general.architecture", arch));
  EXPECT_EQ(bad_arch.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(bad_arch.status().message().find("mamba"), std::string::npos);

  GgufValue heads{GgufValueType::kUint32, uint32_t{3}};  // 4 heads / 3 kv heads
  auto bad_kv = ConfigOf(Mutate("", "llama.attention.head_count_kv", heads));
  EXPECT_EQ(bad_kv.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_kv.status().message().find("head_count_kv"), std::string::npos);

  GgufValue width{GgufValueType::kUint32, uint32_t{80}};  // tensors stay 64 wide
  auto bad_dims = ConfigOf(Mutate("", "llama.embedding_length", width));
  EXPECT_FALSE(bad_dims.ok());
}

// Every valid attention-head shard: the query heads of all ranks cover each
// head once, a rank's query heads read only its KV heads, and its KV heads
// are the ones kv_transfer::ShardHeads routes to it (so a prefill worker sends
// each decode rank what its forward pass reads), replicated or not.
TEST(AttentionHeadShardTest, CoversQueryHeadsAndAgreesWithKvTransfer) {
  int replicated = 0;
  for (int n_kv = 1; n_kv <= 8; ++n_kv) {
    for (int group = 1; group <= 6; ++group) {
      const int n_heads = n_kv * group;
      for (int size = 1; size <= 16; ++size) {
        if (!ShardAttentionHeads(n_heads, n_kv, size, 0).ok()) {
          EXPECT_TRUE(size > n_kv) << n_heads << "/" << n_kv << " tp " << size;
          continue;
        }
        std::vector<int> q_seen(n_heads, 0);
        for (int r = 0; r < size; ++r) {
          auto s = ShardAttentionHeads(n_heads, n_kv, size, r);
          ASSERT_TRUE(s.ok()) << s.status().ToString();
          auto kv = kv_transfer::ShardHeads(n_kv, size, r);
          ASSERT_TRUE(kv.ok()) << kv.status().ToString();
          EXPECT_EQ(s->kv.begin, kv->begin);
          EXPECT_EQ(s->kv.end, kv->end);
          ASSERT_GT(s->q.size(), 0);
          for (int h = s->q.begin; h < s->q.end; ++h) {
            ++q_seen[h];
            EXPECT_GE(h / group, s->kv.begin);
            EXPECT_LT(h / group, s->kv.end);
          }
        }
        EXPECT_EQ(q_seen, std::vector<int>(n_heads, 1)) << n_heads << "/" << n_kv << " tp " << size;
        replicated += size > n_kv;
      }
    }
  }
  EXPECT_GT(replicated, 10);
  // Gemma 3 270M: 4 query heads, 1 KV head.
  auto r1 = ShardAttentionHeads(4, 1, 2, 1);
  ASSERT_TRUE(r1.ok());
  EXPECT_EQ(r1->q.begin, 2);
  EXPECT_EQ(r1->q.end, 4);
  EXPECT_EQ(r1->kv.begin, 0);
  EXPECT_EQ(r1->kv.end, 1);
  EXPECT_FALSE(ShardAttentionHeads(4, 1, 3, 0).ok());  // 4 query heads over 3 ranks
  EXPECT_FALSE(ShardAttentionHeads(4, 1, 2, 2).ok());  // rank outside the group
}

}  // namespace
}  // namespace kvrelay::engine
