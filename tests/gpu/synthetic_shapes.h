// Synthetic GGUF models with the shapes of real ones, for the GPU check and
// the gpu tests: random weights quantized by the project's reference
// quantizers (engine/gguf/quantize.h) and written with GgufWriter, any
// vocabulary size, no tokenizer (load them with load_tokenizer = false).
// Rows are generated and quantized on several threads, so a 7B-shaped file
// (~3.8 GB of Q4_0) takes seconds on a 16-core machine.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"
#include "engine/gguf/ggml_type.h"

namespace kvrelay::gpucheck {

struct ShapeOptions {
  std::string name;
  std::string arch = "llama";  // or "gemma3" (the fields below marked gemma3)
  int layers = 0;
  int d_model = 0;
  int heads = 0;
  int kv_heads = 0;
  int ffn = 0;
  int vocab = 0;
  int context_length = 4096;
  float rope_base = 10000.0f;
  float rms_eps = 1e-5f;
  engine::GgmlType matrix_type = engine::GgmlType::kQ4_0;
  engine::GgmlType embedding_type = engine::GgmlType::kQ8_0;
  bool tied_embeddings = true;
  engine::GgmlType output_type = engine::GgmlType::kQ8_0;  // when untied
  uint64_t seed = 1;
  // gemma3: head size (0: d_model / heads), sliding window and its period
  // (every layer but the last of each period slides), local RoPE base,
  // final-logit soft-capping (0: none).
  int head_dim = 0;
  int sliding_window = 0;
  int sliding_window_pattern = 6;
  float rope_base_swa = 10000.0f;
  float final_logit_softcap = 0.0f;
};

// SmolLM2-135M-Instruct.Q4_1 (the default model): 30 layers, d 576, 9 heads /
// 3 KV heads, FFN 1536, vocab 49152, Q4_1 matrices, tied Q8_0 embeddings.
ShapeOptions DefaultModelShape();
// Llama-2-7B: 32 layers, d 4096, 32 heads (MHA), FFN 11008, vocab 32000,
// Q4_0 matrices and embeddings, untied Q8_0 output.
ShapeOptions Llama7BShape();
// Gemma 3 270M's shape with Gemma 2's final soft-capping added (so the check
// covers every Gemma piece): 18 layers, d 640, 4 heads / 1 KV head of 256,
// FFN 2048, vocab 262144, Q8_0 matrices, tied Q8_0 embeddings, a 64-token
// window (not 512: the check's contexts are about 100 tokens) on 5 of
// every 6 layers, RoPE bases 1e6 / 1e4.
ShapeOptions Gemma3Shape();
// "default" / "smol", "7b", "gemma3"; `layers` > 0 overrides the layer count.
Result<ShapeOptions> ShapeByName(const std::string& name, int layers);

Status WriteShapeModel(const std::string& path, const ShapeOptions& shape, int threads);

}  // namespace kvrelay::gpucheck
