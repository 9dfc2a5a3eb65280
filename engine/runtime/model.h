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
  // config.gemma_norms only (else empty): per-head Q/K norms (head_dim) and the
  // norms of the attention and FFN outputs (d_model), as stored.
  std::vector<float> q_norm_w, k_norm_w, post_attn_norm_w, post_ffn_norm_w;
};

// Tensor-parallel slice of a model: rank `rank` of `size` keeps the attention
// heads ShardAttentionHeads gives it (a contiguous range of KV heads and the
// query heads of their GQA groups, or with fewer KV heads than ranks a range of
// query heads and their replicated KV head) and a range of FFN columns. Q/K/V and gate/up are split
// by output rows (views into the mapping). In kReduce mode attn_output and ffn_down are split by
// input columns (repacked copies, cut at quantization-block boundaries) and their per-rank partial
// outputs sum to the unsharded ones.
enum class TpMode : uint8_t {
  // Q/K/V, gate and up split by output rows; attn_output and ffn_down stay
  // whole on every rank and read the all-gathered head outputs / FFN
  // activations. Every rank computes exactly what one process computes, so
  // outputs are bit-identical to TP = 1 (costs the two output projections on
  // every rank: ~1/3 of this model's matmul work).
  kExact = 0,
  // Megatron-style: attn_output and ffn_down split by input columns and their
  // partial outputs all-reduced. Less work per rank, but float re-association
  // feeds the activation quantization of later layers, so logits drift from
  // TP = 1 (max ~1.5 logits on SmolLM2, measured in tensor_parallel_test).
  kReduce = 1,
};

struct TensorParallelShard {
  int rank = 0;
  int size = 1;
  TpMode mode = TpMode::kExact;
};

// Contiguous split of `units` over `size` ranks; the first units % size ranks
// get one more. The same rule as kv_transfer::ShardHeads (a test checks it).
struct UnitRange {
  int begin = 0;
  int end = 0;
  int size() const { return end - begin; }
};
UnitRange SplitUnits(int units, int size, int rank);

// The attention heads of tensor-parallel rank `rank` of `size`:
//   size <= n_kv_heads: a contiguous range of KV heads (SplitUnits) and the
//     query heads of their GQA groups;
//   size > n_kv_heads (as vLLM does when tp > num_kv_heads): the query heads
//     split evenly and each rank holds the one KV head its query heads share,
//     so every KV head is replicated on size / n_kv_heads ranks. Needs
//     size % n_kv_heads == 0 and n_heads % size == 0 (else InvalidArgument).
// The KV rule is kv_transfer::ShardHeads's, so a prefill worker sends each
// decode rank the head it holds (a test checks they agree).
struct AttentionHeadShard {
  UnitRange kv;  // of n_kv_heads
  UnitRange q;   // of n_heads
};
Result<AttentionHeadShard> ShardAttentionHeads(int n_heads, int n_kv_heads, int size, int rank);

struct ModelLoadOptions {
  // Load the tokenizer and chat template too (needed by Engine and the CLI).
  bool load_tokenizer = true;
  TensorParallelShard shard;  // {0, 1} = the whole model
};

class Model {
 public:
  static Result<std::unique_ptr<Model>> Load(const std::string& path,
                                             const ModelLoadOptions& options = {});
  // Takes ownership of an opened file (tests build models in memory).
  static Result<std::unique_ptr<Model>> FromGguf(std::unique_ptr<GgufFile> file,
                                                 const ModelLoadOptions& options = {});
  ~Model();

  // The shapes this instance computes: for a TP shard, n_heads, n_kv_heads and
  // ffn_dim are the local ones (everything else equals full_config()).
  const ModelConfig& config() const { return config_; }
  // The model as the file describes it.
  const ModelConfig& full_config() const { return full_config_; }
  const TensorParallelShard& shard() const { return shard_; }
  UnitRange kv_head_range() const { return kv_heads_; }  // of full_config().n_kv_heads
  UnitRange q_head_range() const { return q_heads_; }    // of full_config().n_heads
  UnitRange ffn_range() const { return ffn_; }           // columns of full_config().ffn_dim
  // FFN columns are split in units of ffn_dim / ffn_units() (a quantization block).
  int ffn_units() const { return ffn_units_; }
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
  // Slices a loaded whole model down to shard_ (FromGguf's last step).
  Status ApplyShard();

  ModelConfig config_;
  ModelConfig full_config_;
  TensorParallelShard shard_;
  UnitRange kv_heads_;
  UnitRange q_heads_;
  UnitRange ffn_;
  int ffn_units_ = 1;
  std::vector<LayerWeights> layers_;
  // Tensors made by ApplyShard (views or repacked) and the repacked bytes.
  std::vector<std::unique_ptr<GgufTensor>> shard_tensors_;
  std::vector<std::vector<uint8_t>> shard_bytes_;
  const GgufTensor* token_embd_ = nullptr;
  const GgufTensor* lm_head_ = nullptr;
  std::vector<float> output_norm_;
  ModelFingerprint fingerprint_{};
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<ChatTemplate> chat_template_;
};

}  // namespace kvrelay::engine
