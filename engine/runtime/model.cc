#include "engine/runtime/model.h"

#include "engine/gguf/fingerprint.h"
#include "engine/kernels/matmul.h"
#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/tokenizer.h"

namespace kvrelay::engine {
namespace {

std::vector<float> ReadVector(const GgufTensor& t) {
  std::vector<float> v(t.Cols());
  GetRow(t, 0, v.data());
  return v;
}

}  // namespace

Model::~Model() = default;

Result<std::unique_ptr<Model>> Model::Load(const std::string& path,
                                           const ModelLoadOptions& options) {
  auto file = GgufFile::Open(path);
  if (!file.ok()) return file.status().WithContext("loading model '" + path + "'");
  auto model = FromGguf(std::move(file).value(), options);
  if (!model.ok()) return model.status().WithContext("loading model '" + path + "'");
  return model;
}

Result<std::unique_ptr<Model>> Model::FromGguf(std::unique_ptr<GgufFile> file,
                                               const ModelLoadOptions& options) {
  if (file == nullptr) return InvalidArgument("null GGUF file");
  std::unique_ptr<Model> m(new Model());
  m->file_ = std::move(file);
  const GgufFile& f = *m->file_;
  ASSIGN_OR_RETURN(m->config_, ModelConfig::FromGguf(f));
  const ModelConfig& c = m->config_;
  m->token_embd_ = f.FindTensor("token_embd.weight");
  m->lm_head_ = c.tied_embeddings ? m->token_embd_ : f.FindTensor("output.weight");
  m->output_norm_ = ReadVector(*f.FindTensor("output_norm.weight"));
  m->layers_.resize(c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    LayerWeights& w = m->layers_[l];
    w.attn_norm = f.FindTensor(p + "attn_norm.weight");
    w.attn_norm_w = ReadVector(*w.attn_norm);
    w.wq = f.FindTensor(p + "attn_q.weight");
    w.wk = f.FindTensor(p + "attn_k.weight");
    w.wv = f.FindTensor(p + "attn_v.weight");
    w.wo = f.FindTensor(p + "attn_output.weight");
    if (c.qkv_bias) {
      w.bq = ReadVector(*f.FindTensor(p + "attn_q.bias"));
      w.bk = ReadVector(*f.FindTensor(p + "attn_k.bias"));
      w.bv = ReadVector(*f.FindTensor(p + "attn_v.bias"));
    }
    w.ffn_norm = f.FindTensor(p + "ffn_norm.weight");
    w.ffn_norm_w = ReadVector(*w.ffn_norm);
    w.ffn_gate = f.FindTensor(p + "ffn_gate.weight");
    w.ffn_up = f.FindTensor(p + "ffn_up.weight");
    w.ffn_down = f.FindTensor(p + "ffn_down.weight");
  }
  m->fingerprint_ = ComputeModelFingerprint(f);
  if (options.load_tokenizer) {
    auto tok = Tokenizer::FromGguf(f);
    if (!tok.ok()) return tok.status().WithContext("tokenizer");
    m->tokenizer_ = std::move(tok).value();
    auto tmpl = ChatTemplate::FromGguf(f);
    if (tmpl.ok()) m->chat_template_ = std::make_unique<ChatTemplate>(std::move(tmpl).value());
  }
  return m;
}

KvLayout Model::MakeKvLayout(KvDtype dtype, int block_tokens) const {
  KvLayout l;
  l.layers = config_.n_layers;
  l.kv_heads = config_.n_kv_heads;
  l.head_dim = config_.head_dim;
  l.block_tokens = block_tokens;
  l.dtype = dtype;
  return l;
}

}  // namespace kvrelay::engine
