#include "engine/runtime/model_config.h"

#include <cmath>
#include <sstream>

namespace kvrelay::engine {
namespace {

Result<int64_t> RequiredInt(const GgufFile& f, const std::string& key, int64_t lo, int64_t hi) {
  auto v = f.GetInt(key);
  if (!v.ok()) return v.status().WithContext("model metadata '" + key + "'");
  if (*v < lo || *v > hi) {
    return InvalidArgument("model metadata '" + key + "' = " + std::to_string(*v) +
                           " is out of range [" + std::to_string(lo) + ", " + std::to_string(hi) +
                           "]");
  }
  return *v;
}

Result<int64_t> OptionalInt(const GgufFile& f, const std::string& key, int64_t fallback, int64_t lo,
                            int64_t hi) {
  if (f.Find(key) == nullptr) return fallback;
  return RequiredInt(f, key, lo, hi);
}

Result<double> OptionalFloat(const GgufFile& f, const std::string& key, double fallback) {
  if (f.Find(key) == nullptr) return fallback;
  auto v = f.GetFloat(key);
  if (!v.ok()) return v.status().WithContext("model metadata '" + key + "'");
  return *v;
}

std::string DimsString(const std::vector<int64_t>& dims) {
  std::string s = "{";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "}";
}

// Checks that `name` exists with exactly `dims` and a readable type.
Status CheckTensor(const GgufFile& f, const std::string& name, std::vector<int64_t> dims) {
  const GgufTensor* t = f.FindTensor(name);
  if (t == nullptr) return InvalidArgument("model is missing tensor '" + name + "'");
  if (t->dims != dims) {
    return InvalidArgument("tensor '" + name + "' has dims " + DimsString(t->dims) + ", expected " +
                           DimsString(dims));
  }
  if (!CanDequantize(t->type)) {
    return Unimplemented("tensor '" + name + "' has type " + std::string(GgmlTypeName(t->type)) +
                         " which this build cannot read");
  }
  if (!RowBytes(t->type, dims[0]).ok()) {
    return InvalidArgument("tensor '" + name + "' row length " + std::to_string(dims[0]) +
                           " is not a multiple of the " + std::string(GgmlTypeName(t->type)) +
                           " block size");
  }
  return Status::Ok();
}

// Gemma 3 hyper-parameters, read as llama.cpp 0.3.36 reads them
// (src/models/gemma3.cpp, llama-hparams.cpp).
Status ReadGemma3(const GgufFile& f, const std::string& a, ModelConfig* c) {
  c->gemma_norms = true;
  c->ffn_act = ModelConfig::FfnAct::kGeluTanh;
  c->embed_scale = std::sqrt(static_cast<float>(c->d_model));
  // query_pre_attn_scalar is not stored in the GGUF; llama.cpp derives it as
  // head_dim, except for the 27B model (62 layers) where Gemma's config uses
  // d_model / n_heads. Q is multiplied by 1/sqrt of it before the QK product.
  const float qpa = c->n_layers == 62 ? static_cast<float>(c->d_model / c->n_heads)
                                      : static_cast<float>(c->head_dim);
  c->q_scale = 1.0f / std::sqrt(qpa);
  ASSIGN_OR_RETURN(double cap, OptionalFloat(f, a + "final_logit_softcapping", 0.0));
  if (!(cap >= 0.0)) return InvalidArgument("final_logit_softcapping must be >= 0");
  c->final_logit_softcap = static_cast<float>(cap);
  if (c->sliding_window <= 0) return Status::Ok();  // no SWA: every layer is global
  // Which layers slide: attention.sliding_window_pattern is either a bool per
  // layer or a period n (layer l slides unless l % n == n - 1); default 6.
  c->layer_sliding.assign(static_cast<size_t>(c->n_layers), false);
  const std::string pkey = a + "attention.sliding_window_pattern";
  const GgufValue* pv = f.Find(pkey);
  if (pv != nullptr && pv->type == GgufValueType::kArray) {
    const auto& arr = std::get<std::shared_ptr<GgufArray>>(pv->value);
    if (arr == nullptr || arr->elem_type != GgufValueType::kBool ||
        static_cast<int>(arr->values.size()) != c->n_layers) {
      return InvalidArgument("model metadata '" + pkey + "' must be " +
                             std::to_string(c->n_layers) + " bools (one per layer)");
    }
    for (int l = 0; l < c->n_layers; ++l) {
      c->layer_sliding[static_cast<size_t>(l)] = std::get<bool>(arr->values[l].value);
    }
  } else {
    ASSIGN_OR_RETURN(int64_t n, OptionalInt(f, pkey, 6, 0, 1 << 20));
    for (int l = 0; l < c->n_layers; ++l) {
      c->layer_sliding[static_cast<size_t>(l)] = n == 0 || (l % n < n - 1);
    }
  }
  ASSIGN_OR_RETURN(double base_swa, OptionalFloat(f, a + "rope.freq_base_swa", 10000.0));
  if (!(base_swa > 1.0)) return InvalidArgument("rope.freq_base_swa must be > 1");
  c->rope_base_swa = static_cast<float>(base_swa);
  return Status::Ok();
}

}  // namespace

Result<ModelConfig> ModelConfig::FromGguf(const GgufFile& f) {
  ModelConfig c;
  auto arch = f.GetString("general.architecture");
  if (!arch.ok()) return arch.status().WithContext("model metadata 'general.architecture'");
  c.arch = *arch;
  if (c.arch != "llama" && c.arch != "qwen2" && c.arch != "gemma3") {
    return Unimplemented("model architecture '" + c.arch +
                         "' is not supported (supported: llama, qwen2, gemma3)");
  }
  const bool gemma3 = c.arch == "gemma3";
  const std::string a = c.arch + ".";
  constexpr int64_t kMaxDim = 1 << 20;
  ASSIGN_OR_RETURN(int64_t layers, RequiredInt(f, a + "block_count", 1, 4096));
  ASSIGN_OR_RETURN(int64_t d_model, RequiredInt(f, a + "embedding_length", 1, kMaxDim));
  ASSIGN_OR_RETURN(int64_t heads, RequiredInt(f, a + "attention.head_count", 1, 4096));
  ASSIGN_OR_RETURN(int64_t kv_heads,
                   OptionalInt(f, a + "attention.head_count_kv", heads, 1, heads));
  ASSIGN_OR_RETURN(int64_t ffn, RequiredInt(f, a + "feed_forward_length", 1, kMaxDim));
  ASSIGN_OR_RETURN(int64_t ctx, OptionalInt(f, a + "context_length", 2048, 1, int64_t{1} << 24));
  c.n_layers = static_cast<int>(layers);
  c.d_model = static_cast<int>(d_model);
  c.n_heads = static_cast<int>(heads);
  c.n_kv_heads = static_cast<int>(kv_heads);
  c.ffn_dim = static_cast<int>(ffn);
  c.context_length = ctx;
  if (c.n_heads % c.n_kv_heads != 0) {
    return InvalidArgument("attention.head_count (" + std::to_string(c.n_heads) +
                           ") is not a multiple of attention.head_count_kv (" +
                           std::to_string(c.n_kv_heads) + ")");
  }
  if (f.Find(a + "attention.key_length") != nullptr) {
    ASSIGN_OR_RETURN(int64_t kl, RequiredInt(f, a + "attention.key_length", 2, 4096));
    ASSIGN_OR_RETURN(int64_t vl, OptionalInt(f, a + "attention.value_length", kl, 2, 4096));
    if (vl != kl) return Unimplemented("attention.value_length != key_length is not supported");
    c.head_dim = static_cast<int>(kl);
  } else {
    if (c.d_model % c.n_heads != 0) {
      return InvalidArgument("embedding_length (" + std::to_string(c.d_model) +
                             ") is not a multiple of attention.head_count (" +
                             std::to_string(c.n_heads) + ")");
    }
    c.head_dim = c.d_model / c.n_heads;
  }
  if (c.head_dim % 2 != 0) return InvalidArgument("head dimension must be even for RoPE");
  ASSIGN_OR_RETURN(int64_t rope_dim,
                   OptionalInt(f, a + "rope.dimension_count", c.head_dim, 2, c.head_dim));
  if (rope_dim % 2 != 0) return InvalidArgument("rope.dimension_count must be even");
  c.rope_dim = static_cast<int>(rope_dim);
  ASSIGN_OR_RETURN(double base, OptionalFloat(f, a + "rope.freq_base", 10000.0));
  if (!(base > 1.0)) return InvalidArgument("rope.freq_base must be > 1");
  c.rope_base = static_cast<float>(base);
  if (f.Find(a + "rope.scaling.type") != nullptr) {
    auto type = f.GetString(a + "rope.scaling.type");
    if (type.ok() && *type != "none") {
      return Unimplemented("rope.scaling.type '" + *type + "' is not supported");
    }
  }
  ASSIGN_OR_RETURN(double eps, OptionalFloat(f, a + "attention.layer_norm_rms_epsilon", 1e-5));
  if (!(eps > 0.0 && eps < 1.0)) {
    return InvalidArgument("attention.layer_norm_rms_epsilon must be in (0, 1)");
  }
  c.rms_eps = static_cast<float>(eps);
  ASSIGN_OR_RETURN(int64_t window, OptionalInt(f, a + "attention.sliding_window", 0, 0, ctx));
  c.sliding_window = static_cast<int>(window);
  // ggml's rope type per architecture (llama_model_rope_type): NeoX for qwen2 and gemma3.
  c.rope_layout = c.arch == "llama" ? RopeLayout::kNormal : RopeLayout::kNeox;
  if (gemma3) RETURN_IF_ERROR(ReadGemma3(f, a, &c));

  // Tensors.
  const GgufTensor* embd = f.FindTensor("token_embd.weight");
  if (embd == nullptr) return InvalidArgument("model is missing tensor 'token_embd.weight'");
  if (embd->dims.size() != 2 || embd->dims[0] != c.d_model || embd->dims[1] < 1) {
    return InvalidArgument("tensor 'token_embd.weight' has dims " + DimsString(embd->dims) +
                           ", expected {" + std::to_string(c.d_model) + ", vocab}");
  }
  c.vocab = static_cast<int>(embd->dims[1]);
  ASSIGN_OR_RETURN(int64_t vocab_meta, OptionalInt(f, a + "vocab_size", c.vocab, 1, 1 << 24));
  if (vocab_meta != c.vocab) {
    return InvalidArgument("vocab_size (" + std::to_string(vocab_meta) +
                           ") disagrees with token_embd.weight rows (" + std::to_string(c.vocab) +
                           ")");
  }
  RETURN_IF_ERROR(CheckTensor(f, "token_embd.weight", {c.d_model, c.vocab}));
  RETURN_IF_ERROR(CheckTensor(f, "output_norm.weight", {c.d_model}));
  c.tied_embeddings = f.FindTensor("output.weight") == nullptr;
  if (!c.tied_embeddings) RETURN_IF_ERROR(CheckTensor(f, "output.weight", {c.d_model, c.vocab}));
  c.qkv_bias = f.FindTensor("blk.0.attn_q.bias") != nullptr;
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    RETURN_IF_ERROR(CheckTensor(f, p + "attn_norm.weight", {c.d_model}));
    RETURN_IF_ERROR(CheckTensor(f, p + "attn_q.weight", {c.d_model, c.q_dim()}));
    RETURN_IF_ERROR(CheckTensor(f, p + "attn_k.weight", {c.d_model, c.kv_dim()}));
    RETURN_IF_ERROR(CheckTensor(f, p + "attn_v.weight", {c.d_model, c.kv_dim()}));
    RETURN_IF_ERROR(CheckTensor(f, p + "attn_output.weight", {c.q_dim(), c.d_model}));
    if (c.qkv_bias) {
      RETURN_IF_ERROR(CheckTensor(f, p + "attn_q.bias", {c.q_dim()}));
      RETURN_IF_ERROR(CheckTensor(f, p + "attn_k.bias", {c.kv_dim()}));
      RETURN_IF_ERROR(CheckTensor(f, p + "attn_v.bias", {c.kv_dim()}));
    }
    RETURN_IF_ERROR(CheckTensor(f, p + "ffn_norm.weight", {c.d_model}));
    RETURN_IF_ERROR(CheckTensor(f, p + "ffn_gate.weight", {c.d_model, c.ffn_dim}));
    RETURN_IF_ERROR(CheckTensor(f, p + "ffn_up.weight", {c.d_model, c.ffn_dim}));
    RETURN_IF_ERROR(CheckTensor(f, p + "ffn_down.weight", {c.ffn_dim, c.d_model}));
    if (c.gemma_norms) {
      RETURN_IF_ERROR(CheckTensor(f, p + "attn_q_norm.weight", {c.head_dim}));
      RETURN_IF_ERROR(CheckTensor(f, p + "attn_k_norm.weight", {c.head_dim}));
      RETURN_IF_ERROR(CheckTensor(f, p + "post_attention_norm.weight", {c.d_model}));
      RETURN_IF_ERROR(CheckTensor(f, p + "post_ffw_norm.weight", {c.d_model}));
    }
  }
  return c;
}

std::string ModelConfig::DebugString() const {
  std::ostringstream os;
  os << arch << ": layers=" << n_layers << " d_model=" << d_model << " heads=" << n_heads
     << " kv_heads=" << n_kv_heads << " head_dim=" << head_dim << " ffn=" << ffn_dim
     << " vocab=" << vocab << " ctx=" << context_length << " rope_base=" << rope_base
     << " rope_dim=" << rope_dim
     << " rope=" << (rope_layout == RopeLayout::kNeox ? "neox" : "normal") << " eps=" << rms_eps
     << (tied_embeddings ? " tied" : "") << (qkv_bias ? " qkv_bias" : "");
  if (sliding_window > 0) os << " window=" << sliding_window;
  if (!layer_sliding.empty()) {
    os << " sliding_layers=";
    for (bool b : layer_sliding) os << (b ? 'S' : 'G');
    os << " rope_base_swa=" << rope_base_swa;
  }
  if (gemma_norms) os << " gemma_norms";
  if (ffn_act == FfnAct::kGeluTanh) os << " geglu";
  if (embed_scale != 1.0f) os << " embed_scale=" << embed_scale;
  if (q_scale != 0.0f) os << " q_scale=" << q_scale;
  if (final_logit_softcap > 0.0f) os << " softcap=" << final_logit_softcap;
  return os.str();
}

}  // namespace kvrelay::engine
