// Everything shape-related about a decoder-only transformer, read from GGUF
// metadata and checked against the tensor table. Supported architectures:
// `llama` (and llama-family files such as SmolLM), `qwen2` and `gemma3`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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

  // ---- Gemma 3 (all defaults are the llama/qwen2 behaviour) ----
  // Sandwich norms: post_attention_norm / post_ffw_norm on the block outputs
  // before the residual add, and RMSNorm of every Q and K head (attn_q_norm,
  // attn_k_norm) before RoPE. The GGUF norm weights already hold Gemma's
  // (1 + w) (llama.cpp's converter adds the 1), so they multiply as stored.
  bool gemma_norms = false;
  // Token embeddings are multiplied by this (gemma3: sqrtf(d_model)).
  float embed_scale = 1.0f;
  // FFN activation: SiLU(gate) * up, or tanh-approximate GELU(gate) * up.
  enum class FfnAct : uint8_t { kSilu = 0, kGeluTanh = 1 };
  FfnAct ffn_act = FfnAct::kSilu;
  // Multiplier of Q before the QK product; 0 means 1 / sqrt(head_dim) inside
  // the softmax (llama). gemma3 scales Q itself, as llama.cpp does.
  float q_scale = 0.0f;
  // Per layer: true when the layer attends within sliding_window only. Empty
  // means every layer uses sliding_window (0 = none), as before for llama.
  std::vector<bool> layer_sliding;
  // RoPE base of the sliding-window layers when layer_sliding is set
  // (gemma3.rope.freq_base_swa, default 10000 as llama.cpp).
  float rope_base_swa = 10000.0f;
  // 0 = none; else logits = c * tanh(logits / c) (final_logit_softcapping).
  float final_logit_softcap = 0.0f;

  // The window of layer `l` (0 = full attention) and its RoPE base.
  int LayerWindow(int l) const {
    if (layer_sliding.empty()) return sliding_window;
    return layer_sliding[static_cast<size_t>(l)] ? sliding_window : 0;
  }
  float LayerRopeBase(int l) const {
    if (layer_sliding.empty()) return rope_base;
    return layer_sliding[static_cast<size_t>(l)] ? rope_base_swa : rope_base;
  }
  // True when every layer attends to the whole context.
  bool AllLayersFull() const {
    for (int l = 0; l < n_layers; ++l) {
      if (LayerWindow(l) > 0) return false;
    }
    return true;
  }

  int q_dim() const { return n_heads * head_dim; }
  int kv_dim() const { return n_kv_heads * head_dim; }

  // Reads the metadata and validates every tensor the forward pass uses
  // (presence, dims, a type the kernels can read). Errors name the key or tensor.
  static Result<ModelConfig> FromGguf(const GgufFile& file);
  std::string DebugString() const;
};

}  // namespace kvrelay::engine
