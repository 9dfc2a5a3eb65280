#include "engine/runtime/model.h"

#include <algorithm>
#include <cstring>

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

std::vector<float> SliceVector(const std::vector<float>& v, int64_t begin, int64_t end) {
  if (v.empty()) return v;
  return std::vector<float>(v.begin() + begin, v.begin() + end);
}

}  // namespace

UnitRange SplitUnits(int units, int size, int rank) {
  const int base = units / size, extra = units % size;
  UnitRange r;
  r.begin = rank * base + std::min(rank, extra);
  r.end = r.begin + base + (rank < extra ? 1 : 0);
  return r;
}

Result<AttentionHeadShard> ShardAttentionHeads(int n_heads, int n_kv_heads, int size, int rank) {
  if (size < 1 || rank < 0 || rank >= size) {
    return InvalidArgument("tensor-parallel rank " + std::to_string(rank) + " of size " +
                           std::to_string(size) + " is not a valid shard");
  }
  if (n_kv_heads < 1 || n_heads % n_kv_heads != 0) {
    return InvalidArgument(std::to_string(n_heads) + " query heads do not form groups over " +
                           std::to_string(n_kv_heads) + " KV heads");
  }
  const int group = n_heads / n_kv_heads;
  AttentionHeadShard s;
  if (size <= n_kv_heads) {
    s.kv = SplitUnits(n_kv_heads, size, rank);
    s.q = {s.kv.begin * group, s.kv.end * group};
    return s;
  }
  if (size % n_kv_heads != 0 || n_heads % size != 0) {
    return InvalidArgument("tensor-parallel size " + std::to_string(size) +
                           " exceeds the model's " + std::to_string(n_kv_heads) +
                           " KV heads; replicating them needs a size that is a multiple of the "
                           "KV heads and divides the " +
                           std::to_string(n_heads) + " query heads");
  }
  const int per_rank = n_heads / size;  // divides group: every rank's heads share one KV head
  s.q = {rank * per_rank, (rank + 1) * per_rank};
  s.kv = {s.q.begin / group, s.q.begin / group + 1};
  return s;
}

Status Model::ApplyShard() {
  const TensorParallelShard& sh = shard_;
  if (sh.size == 1 && sh.rank == 0) return Status::Ok();
  const ModelConfig& full = full_config_;
  ASSIGN_OR_RETURN(const AttentionHeadShard heads,
                   ShardAttentionHeads(full.n_heads, full.n_kv_heads, sh.size, sh.rank));
  const int hd = full.head_dim;
  kv_heads_ = heads.kv;
  q_heads_ = heads.q;
  const int64_t q0 = int64_t{q_heads_.begin} * hd, q1 = int64_t{q_heads_.end} * hd;
  const int64_t k0 = int64_t{kv_heads_.begin} * hd, k1 = int64_t{kv_heads_.end} * hd;

  // Output-row slice: a view into the mapping (rows are contiguous).
  auto rows = [&](const GgufTensor* t, int64_t r0, int64_t r1) -> Result<const GgufTensor*> {
    ASSIGN_OR_RETURN(int64_t row_bytes, RowBytes(t->type, t->Cols()));
    auto v = std::make_unique<GgufTensor>(*t);
    v->name += ".tp" + std::to_string(sh.rank);
    v->dims = {t->Cols(), r1 - r0};
    v->data = t->data + r0 * row_bytes;
    v->nbytes = static_cast<uint64_t>((r1 - r0) * row_bytes);
    shard_tensors_.push_back(std::move(v));
    return shard_tensors_.back().get();
  };
  // Input-column slice: every row's blocks [c0, c1) copied into owned memory.
  auto cols = [&](const GgufTensor* t, int64_t c0, int64_t c1) -> Result<const GgufTensor*> {
    const int64_t be = BlockElems(t->type);
    if (c0 % be != 0 || c1 % be != 0) {
      return Unimplemented("tensor-parallel split of " + t->name + " (" +
                           std::string(GgmlTypeName(t->type)) + ", blocks of " +
                           std::to_string(be) + ") at columns [" + std::to_string(c0) + ", " +
                           std::to_string(c1) + ") does not fall on block boundaries");
    }
    ASSIGN_OR_RETURN(int64_t row_bytes, RowBytes(t->type, t->Cols()));
    ASSIGN_OR_RETURN(int64_t off, RowBytes(t->type, c0));
    ASSIGN_OR_RETURN(int64_t n, RowBytes(t->type, c1 - c0));
    std::vector<uint8_t> bytes(static_cast<size_t>(n * t->Rows()));
    for (int64_t r = 0; r < t->Rows(); ++r) {
      std::memcpy(bytes.data() + r * n, t->data + r * row_bytes + off, static_cast<size_t>(n));
    }
    auto v = std::make_unique<GgufTensor>(*t);
    v->name += ".tp" + std::to_string(sh.rank);
    v->dims = {c1 - c0, t->Rows()};
    v->data = bytes.data();
    v->nbytes = bytes.size();
    shard_bytes_.push_back(std::move(bytes));
    shard_tensors_.push_back(std::move(v));
    return shard_tensors_.back().get();
  };

  // FFN columns in units of ffn_down's quantization block.
  const GgufTensor* down0 = layers_.empty() ? nullptr : layers_[0].ffn_down;
  const int64_t fu = down0 ? BlockElems(down0->type) : 1;
  if (full.ffn_dim % fu != 0) {
    return Unimplemented("ffn_dim " + std::to_string(full.ffn_dim) +
                         " is not a multiple of the ffn_down block size " + std::to_string(fu));
  }
  ffn_units_ = static_cast<int>(full.ffn_dim / fu);
  const UnitRange fr = SplitUnits(ffn_units_, sh.size, sh.rank);
  if (fr.size() == 0) {
    return InvalidArgument("tensor-parallel size " + std::to_string(sh.size) + " leaves rank " +
                           std::to_string(sh.rank) + " no FFN columns");
  }
  const int64_t f0 = fr.begin * fu, f1 = fr.end * fu;
  for (LayerWeights& w : layers_) {
    ASSIGN_OR_RETURN(w.wq, rows(w.wq, q0, q1));
    ASSIGN_OR_RETURN(w.wk, rows(w.wk, k0, k1));
    ASSIGN_OR_RETURN(w.wv, rows(w.wv, k0, k1));
    w.bq = SliceVector(w.bq, q0, q1);
    w.bk = SliceVector(w.bk, k0, k1);
    w.bv = SliceVector(w.bv, k0, k1);
    ASSIGN_OR_RETURN(w.ffn_gate, rows(w.ffn_gate, f0, f1));
    ASSIGN_OR_RETURN(w.ffn_up, rows(w.ffn_up, f0, f1));
    if (sh.mode == TpMode::kReduce) {
      ASSIGN_OR_RETURN(w.wo, cols(w.wo, q0, q1));
      ASSIGN_OR_RETURN(w.ffn_down, cols(w.ffn_down, f0, f1));
    }
  }
  ffn_ = {static_cast<int>(f0), static_cast<int>(f1)};
  config_.n_kv_heads = kv_heads_.size();
  config_.n_heads = q_heads_.size();
  config_.ffn_dim = static_cast<int>(f1 - f0);
  return Status::Ok();
}

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
    if (c.gemma_norms) {
      w.q_norm_w = ReadVector(*f.FindTensor(p + "attn_q_norm.weight"));
      w.k_norm_w = ReadVector(*f.FindTensor(p + "attn_k_norm.weight"));
      w.post_attn_norm_w = ReadVector(*f.FindTensor(p + "post_attention_norm.weight"));
      w.post_ffn_norm_w = ReadVector(*f.FindTensor(p + "post_ffw_norm.weight"));
    }
  }
  m->fingerprint_ = ComputeModelFingerprint(f);
  m->full_config_ = m->config_;
  m->shard_ = options.shard;
  m->kv_heads_ = {0, c.n_kv_heads};
  m->q_heads_ = {0, c.n_heads};
  m->ffn_ = {0, c.ffn_dim};
  m->ffn_units_ = 1;
  RETURN_IF_ERROR(m->ApplyShard());
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
