// Tiny random models in GGUF form for tests: a llama- or qwen2-shaped
// transformer with random weights and a small byte-level BPE vocabulary
// (256 byte tokens, a few merges, ChatML control tokens), so the tokenizer,
// chat template and the whole engine load it like a real model.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/gguf/ggml_type.h"

namespace kvrelay::testing {

struct SyntheticModelOptions {
  // "llama", "qwen2" (adds Q/K/V biases, NeoX RoPE) or "gemma3" (adds Q/K norms and
  // post-norms; sliding_window on every layer but the last of each
  // sliding_window_pattern layers, local RoPE base rope_base_swa).
  std::string arch = "llama";
  int sliding_window = 0;  // gemma3 only: attention.sliding_window (0 = key absent)
  int sliding_window_pattern = 2;
  float rope_base_swa = 100.0f;
  int layers = 2;
  int d_model = 64;
  int heads = 4;
  int kv_heads = 2;
  int ffn = 128;
  int context_length = 512;
  float rope_base = 10000.0f;
  float rms_eps = 1e-5f;
  // Type of the 2-D weight matrices (F32, F16, Q8_0, Q4_0, Q4_1); norms stay F32.
  engine::GgmlType matrix_type = engine::GgmlType::kF32;
  engine::GgmlType embedding_type = engine::GgmlType::kF32;
  bool tied_embeddings = true;  // false: write a separate output.weight
  uint64_t seed = 1;
};

// Token ids of the synthetic vocabulary (stable across options).
struct SyntheticVocab {
  static constexpr int32_t kEndOfText = 256;  // <|endoftext|> (EOS)
  static constexpr int32_t kImStart = 257;    // <|im_start|>
  static constexpr int32_t kImEnd = 258;      // <|im_end|>
};

// The vocabulary size every synthetic model has.
int SyntheticVocabSize();

// The GGUF image of a model.
std::vector<uint8_t> BuildSyntheticModel(const SyntheticModelOptions& options);
// Writes it to `path`.
Status WriteSyntheticModel(const std::string& path, const SyntheticModelOptions& options);
// Writes it to a fresh file under the temp directory and returns its path.
Result<std::string> WriteTempSyntheticModel(const SyntheticModelOptions& options);

}  // namespace kvrelay::testing
