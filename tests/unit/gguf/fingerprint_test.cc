// ComputeModelFingerprint: stable for the same model, different whenever the
// weights, the tensor table or the architecture hyperparameters differ.
#include "engine/gguf/fingerprint.h"

#include <gtest/gtest.h>

#include <vector>

#include "engine/gguf/gguf.h"

namespace kvrelay::engine {
namespace {

struct ModelSpec {
  uint32_t alignment = 32;
  bool swap_tensor_order = false;
  bool swap_key_order = false;
  uint32_t block_count = 2;
  std::string model_name = "tiny";
  std::vector<uint8_t> w0 = std::vector<uint8_t>(64, 7);
  GgmlType w1_type = GgmlType::kF32;
  std::vector<int64_t> w1_dims = {4, 2};
  std::string w1_name = "w1";
};

std::array<uint8_t, 32> Fingerprint(const ModelSpec& s) {
  GgufWriter w;
  if (s.alignment != 32) w.SetAlignment(s.alignment);
  auto keys = [&] {
    w.SetString("general.architecture", "llama");
    w.SetUint32("llama.block_count", s.block_count);
  };
  if (s.swap_key_order) {
    w.SetFloat32("llama.rope.freq_base", 10000.0f);
    keys();
  } else {
    keys();
    w.SetFloat32("llama.rope.freq_base", 10000.0f);
  }
  w.SetString("general.name", s.model_name);
  auto t0 = [&] { w.AddTensor("w0", GgmlType::kF32, {16}, s.w0); };
  auto t1 = [&] { w.AddTensor(s.w1_name, s.w1_type, s.w1_dims, std::vector<uint8_t>(32, 3)); };
  if (s.swap_tensor_order) {
    t1();
    t0();
  } else {
    t0();
    t1();
  }
  const std::vector<uint8_t> image = w.Build();
  auto f = GgufFile::FromMemory(image.data(), image.size());
  EXPECT_TRUE(f.ok()) << f.status().ToString();
  return ComputeModelFingerprint(**f);
}

TEST(FingerprintTest, SameModelSameFingerprint) {
  const auto base = Fingerprint(ModelSpec{});
  EXPECT_EQ(Fingerprint(ModelSpec{}), base);
  // Layout-only differences do not change the model.
  ModelSpec s;
  s.alignment = 64;
  EXPECT_EQ(Fingerprint(s), base);
  s = ModelSpec{};
  s.swap_tensor_order = true;
  EXPECT_EQ(Fingerprint(s), base);
  s = ModelSpec{};
  s.swap_key_order = true;
  EXPECT_EQ(Fingerprint(s), base);
  // Descriptive metadata is not part of the fingerprint.
  s = ModelSpec{};
  s.model_name = "renamed";
  EXPECT_EQ(Fingerprint(s), base);
}

TEST(FingerprintTest, AnyModelChangeChangesIt) {
  const auto base = Fingerprint(ModelSpec{});
  std::vector<ModelSpec> variants(5);
  variants[0].w0[63] ^= 1;  // one bit of one weight
  variants[1].block_count = 3;
  variants[2].w1_type = GgmlType::kF16;  // same bytes, other type: {16, 1} F16 = 32 bytes
  variants[2].w1_dims = {16};
  variants[3].w1_dims = {2, 4};  // same bytes, transposed shape
  variants[4].w1_name = "w2";
  for (size_t i = 0; i < variants.size(); ++i) {
    EXPECT_NE(Fingerprint(variants[i]), base) << "variant " << i;
  }
}

}  // namespace
}  // namespace kvrelay::engine
