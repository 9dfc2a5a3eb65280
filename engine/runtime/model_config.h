// Everything shape-related about a decoder-only transformer, read from GGUF
// metadata and checked against the tensor table. Supported architectures:
// `llama` (and llama-family files such as SmolLM) and `qwen2`.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"
#include "engine/gguf/gguf.h"

namespace kvrelay::engine {

// How RoPE pairs the dimensions of a head.
enum class RopeLayout : uint8_t {
  kNormal = 0,  // adjacent pairs (2i, 2i+1): ggml rope mode 0, GGUF llama
  kNeox = 2,    // halves (i, i + rope_dim/2): ggml mode 2, qwen2
};

struct ModelConfig {
  std::string arch;
  int n_layers = 0;
  int d_model = 0;
  int n_heads = 0;
  int n_kv_heads = 0;  // < n_heads: grouped-query attention; 1: multi-query
  int head_dim = 0;    // key_length when given, else d_model / n_heads
  int ffn_dim = 0;
  int vocab = 0;
  int64_t context_length = 0;
  int rope_dim = 0;  // rotated dimensions per head (<= head_dim)
  float rope_base = 10000.0f;
  RopeLayout rope_layout = RopeLayout::kNormal;
  float rms_eps = 1e-5f;
  int sliding_window = 0;        // 0 = full attention
  bool tied_embeddings = false;  // no output.weight: the LM head is token_embd
  bool qkv_bias = false;         // qwen2: attn_{q,k,v}.bias

  int q_dim() const { return n_heads * head_dim; }
  int kv_dim() const { return n_kv_heads * head_dim; }

  // Reads the metadata and validates every tensor the forward pass uses
  // (presence, dims, a type the kernels can read). Errors name the key or tensor.
  static Result<ModelConfig> FromGguf(const GgufFile& file);
  std::string DebugString() const;
};

}  // namespace kvrelay::engine
