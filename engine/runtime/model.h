// A loaded model: the mapped GGUF file, its shape config, tokenizer, chat
// template, per-layer weight views and the model fingerprint.
//
// Immutable after Load and safe to share between threads and engines
// (std::shared_ptr<const Model>). Weight views point into the file mapping
// and live as long as the Model.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/gguf/gguf.h"
#include "engine/kv_cache/kv_cache.h"
#include "engine/runtime/model_config.h"

namespace kvrelay::engine {

class Tokenizer;
class ChatTemplate;

struct LayerWeights {
  const GgufTensor* attn_norm = nullptr;
  const GgufTensor* wq = nullptr;
  const GgufTensor* wk = nullptr;
  const GgufTensor* wv = nullptr;
  const GgufTensor* wo = nullptr;
  std::vector<float> bq, bk, bv;   // empty unless config.qkv_bias
  std::vector<float> attn_norm_w;  // dequantized norm weights
  const GgufTensor* ffn_norm = nullptr;
  std::vector<float> ffn_norm_w;
  const GgufTensor* ffn_gate = nullptr;
  const GgufTensor* ffn_up = nullptr;
  const GgufTensor* ffn_down = nullptr;
};

struct ModelLoadOptions {
  // Load the tokenizer and chat template too (needed by Engine and the CLI).
  bool load_tokenizer = true;
};

class Model {
 public:
  static Result<std::unique_ptr<Model>> Load(const std::string& path,
                                             const ModelLoadOptions& options = {});
  // Takes ownership of an opened file (tests build models in memory).
  static Result<std::unique_ptr<Model>> FromGguf(std::unique_ptr<GgufFile> file,
                                                 const ModelLoadOptions& options = {});
  ~Model();

  const ModelConfig& config() const { return config_; }
  const GgufFile& file() const { return *file_; }
  const std::vector<LayerWeights>& layers() const { return layers_; }
  const GgufTensor& token_embd() const { return *token_embd_; }
  const GgufTensor& lm_head() const { return *lm_head_; }  // output.weight or token_embd
  const std::vector<float>& output_norm() const { return output_norm_; }
  const ModelFingerprint& fingerprint() const { return fingerprint_; }
  // Null when loaded without the tokenizer.
  const Tokenizer* tokenizer() const { return tokenizer_.get(); }
  const ChatTemplate* chat_template() const { return chat_template_.get(); }

  // The KV layout of this model for a pool of the given dtype and block size.
  KvLayout MakeKvLayout(KvDtype dtype, int block_tokens) const;

 private:
  Model() = default;

  std::unique_ptr<GgufFile> file_;
  ModelConfig config_;
  std::vector<LayerWeights> layers_;
  const GgufTensor* token_embd_ = nullptr;
  const GgufTensor* lm_head_ = nullptr;
  std::vector<float> output_norm_;
  ModelFingerprint fingerprint_{};
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<ChatTemplate> chat_template_;
};

}  // namespace kvrelay::engine
