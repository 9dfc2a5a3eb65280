#include "tests/testing/synthetic_model.h"

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>

#include "engine/gguf/gguf.h"
#include "engine/gguf/quantize.h"

namespace kvrelay::testing {
namespace {

using engine::GgmlType;
using engine::GgufWriter;

// GPT-2 byte-to-unicode table: printable bytes map to themselves, the others
// to U+0100 and up, in byte order.
std::vector<std::string> ByteTokens() {
  std::vector<int> cps(256, -1);
  auto printable = [](int b) {
    return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
  };
  int next = 256;
  for (int b = 0; b < 256; ++b) cps[b] = printable(b) ? b : next++;
  std::vector<std::string> out(256);
  for (int b = 0; b < 256; ++b) {
    const int cp = cps[b];
    std::string s;
    if (cp < 0x80) {
      s.push_back(static_cast<char>(cp));
    } else {
      s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    out[b] = s;
  }
  return out;
}

// Merges of two single-byte tokens ("Ġ" is the space byte).
const char* const kMerges[][2] = {
    {"t", "h"}, {"Ġ", "t"}, {"h", "e"}, {"i", "n"}, {"e", "r"}, {"a", "n"}, {"Ġ", "a"}, {"o", "n"},
    {"r", "e"}, {"Ġ", "s"}, {"e", "n"}, {"a", "t"}, {"o", "r"}, {"Ġ", "w"}, {"e", "s"}, {"Ġ", "c"},
    {"i", "s"}, {"i", "t"}, {"a", "r"}, {"Ġ", "o"}, {"Ġ", "b"}, {"e", "d"}, {"Ġ", "f"}, {"Ġ", "p"},
    {"o", "u"}, {"Ġ", "m"}, {"l", "e"}, {"Ġ", "i"}, {"a", "l"}, {"Ġ", "h"}, {"r", "o"}, {"n", "d"},
    {"Ġ", "d"}, {"i", "c"}, {"s", "t"}, {"Ġ", "l"}, {"l", "o"}, {"Ġ", "n"}, {"o", "f"}, {"Ġ", "e"},
};

struct Vocab {
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  std::vector<std::string> merges;
};

Vocab MakeVocab() {
  Vocab v;
  v.tokens = ByteTokens();
  v.types.assign(256, 1);
  for (const char* s : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}) {
    v.tokens.push_back(s);
    v.types.push_back(3);  // control
  }
  for (const auto& m : kMerges) {
    v.merges.push_back(std::string(m[0]) + " " + m[1]);
    v.tokens.push_back(std::string(m[0]) + m[1]);
    v.types.push_back(1);
  }
  return v;
}

constexpr const char* kChatMlTemplate =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}";

class Builder {
 public:
  Builder(const SyntheticModelOptions& o) : o_(o), rng_(o.seed) {}

  // A matrix of `rows` outputs x `cols` inputs, uniform in +-scale.
  void Matrix(GgufWriter& w, const std::string& name, int cols, int rows, float scale,
              GgmlType type) {
    std::uniform_real_distribution<float> dist(-scale, scale);
    std::vector<float> data(static_cast<size_t>(cols) * rows);
    for (float& x : data) x = dist(rng_);
    std::vector<uint8_t> bytes;
    for (int r = 0; r < rows; ++r) {
      std::vector<uint8_t> row =
          engine::QuantizeRowForTest(type, data.data() + static_cast<size_t>(r) * cols, cols);
      bytes.insert(bytes.end(), row.begin(), row.end());
    }
    w.AddTensor(name, type, {cols, rows}, std::move(bytes));
  }

  void Vector(GgufWriter& w, const std::string& name, int n, float center, float spread) {
    std::uniform_real_distribution<float> dist(center - spread, center + spread);
    std::vector<float> data(n);
    for (float& x : data) x = dist(rng_);
    std::vector<uint8_t> bytes(n * sizeof(float));
    std::memcpy(bytes.data(), data.data(), bytes.size());
    w.AddTensor(name, GgmlType::kF32, {n}, std::move(bytes));
  }

 private:
  const SyntheticModelOptions& o_;
  std::mt19937_64 rng_;
};

}  // namespace

int SyntheticVocabSize() { return static_cast<int>(MakeVocab().tokens.size()); }

std::vector<uint8_t> BuildSyntheticModel(const SyntheticModelOptions& o) {
  GgufWriter w;
  const std::string a = o.arch + ".";
  const int head_dim = o.d_model / o.heads;
  Vocab vocab = MakeVocab();
  const int n_vocab = static_cast<int>(vocab.tokens.size());
  w.SetString("general.architecture", o.arch);
  w.SetString("general.name", "kvrelay-synthetic");
  w.SetUint32(a + "block_count", o.layers);
  w.SetUint32(a + "context_length", o.context_length);
  w.SetUint32(a + "embedding_length", o.d_model);
  w.SetUint32(a + "feed_forward_length", o.ffn);
  w.SetUint32(a + "attention.head_count", o.heads);
  w.SetUint32(a + "attention.head_count_kv", o.kv_heads);
  w.SetFloat32(a + "rope.freq_base", o.rope_base);
  w.SetUint32(a + "rope.dimension_count", head_dim);
  w.SetFloat32(a + "attention.layer_norm_rms_epsilon", o.rms_eps);
  w.SetUint32(a + "vocab_size", n_vocab);
  if (o.arch == "gemma3" && o.sliding_window > 0) {
    w.SetUint32(a + "attention.sliding_window", o.sliding_window);
    w.SetUint32(a + "attention.sliding_window_pattern", o.sliding_window_pattern);
    w.SetFloat32(a + "rope.freq_base_swa", o.rope_base_swa);
  }
  w.SetString("tokenizer.ggml.model", "gpt2");
  w.SetString("tokenizer.ggml.pre", "gpt2");
  w.SetStringArray("tokenizer.ggml.tokens", vocab.tokens);
  w.SetInt32Array("tokenizer.ggml.token_type", vocab.types);
  w.SetStringArray("tokenizer.ggml.merges", vocab.merges);
  w.SetUint32("tokenizer.ggml.bos_token_id", SyntheticVocab::kImStart);
  w.SetUint32("tokenizer.ggml.eos_token_id", SyntheticVocab::kImEnd);
  w.SetUint32("tokenizer.ggml.unknown_token_id", SyntheticVocab::kEndOfText);
  w.SetUint32("tokenizer.ggml.padding_token_id", SyntheticVocab::kEndOfText);
  w.SetBool("tokenizer.ggml.add_bos_token", false);
  w.SetString("tokenizer.chat_template", kChatMlTemplate);

  Builder b(o);
  const float in_scale = 1.0f / std::sqrt(static_cast<float>(o.d_model));
  b.Matrix(w, "token_embd.weight", o.d_model, n_vocab, 1.0f, o.embedding_type);
  b.Vector(w, "output_norm.weight", o.d_model, 1.0f, 0.2f);
  if (!o.tied_embeddings) {
    b.Matrix(w, "output.weight", o.d_model, n_vocab, in_scale, o.matrix_type);
  }
  for (int l = 0; l < o.layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    b.Vector(w, p + "attn_norm.weight", o.d_model, 1.0f, 0.2f);
    // Q/K a bit larger than 1/sqrt(d) so attention is not uniform.
    b.Matrix(w, p + "attn_q.weight", o.d_model, o.heads * head_dim, 2 * in_scale, o.matrix_type);
    b.Matrix(w, p + "attn_k.weight", o.d_model, o.kv_heads * head_dim, 2 * in_scale, o.matrix_type);
    b.Matrix(w, p + "attn_v.weight", o.d_model, o.kv_heads * head_dim, in_scale, o.matrix_type);
    if (o.arch == "qwen2") {
      b.Vector(w, p + "attn_q.bias", o.heads * head_dim, 0.0f, 0.3f);
      b.Vector(w, p + "attn_k.bias", o.kv_heads * head_dim, 0.0f, 0.3f);
      b.Vector(w, p + "attn_v.bias", o.kv_heads * head_dim, 0.0f, 0.3f);
    }
    b.Matrix(w, p + "attn_output.weight", o.heads * head_dim, o.d_model, in_scale, o.matrix_type);
    b.Vector(w, p + "ffn_norm.weight", o.d_model, 1.0f, 0.2f);
    b.Matrix(w, p + "ffn_gate.weight", o.d_model, o.ffn, in_scale, o.matrix_type);
    b.Matrix(w, p + "ffn_up.weight", o.d_model, o.ffn, in_scale, o.matrix_type);
    b.Matrix(w, p + "ffn_down.weight", o.ffn, o.d_model,
             1.0f / std::sqrt(static_cast<float>(o.ffn)), o.matrix_type);
    if (o.arch == "gemma3") {
      b.Vector(w, p + "attn_q_norm.weight", head_dim, 1.0f, 0.2f);
      b.Vector(w, p + "attn_k_norm.weight", head_dim, 1.0f, 0.2f);
      b.Vector(w, p + "post_attention_norm.weight", o.d_model, 1.0f, 0.2f);
      b.Vector(w, p + "post_ffw_norm.weight", o.d_model, 1.0f, 0.2f);
    }
  }
  return w.Build();
}

Status WriteSyntheticModel(const std::string& path, const SyntheticModelOptions& options) {
  std::vector<uint8_t> bytes = BuildSyntheticModel(options);
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return Unavailable("cannot create '" + path + "'");
  const size_t n = std::fwrite(bytes.data(), 1, bytes.size(), f);
  const bool ok = n == bytes.size() && std::fclose(f) == 0;
  if (!ok) return Unavailable("cannot write '" + path + "'");
  return Status::Ok();
}

Result<std::string> WriteTempSyntheticModel(const SyntheticModelOptions& options) {
  static std::atomic<int> counter{0};
  std::error_code ec;
  const std::filesystem::path dir = std::filesystem::temp_directory_path(ec);
  if (ec) return Unavailable("no temp directory: " + ec.message());
  const std::string path = (dir / ("kvrelay_synthetic_" + std::to_string(getpid()) + "_" +
                                   std::to_string(counter++) + ".gguf"))
                               .string();
  RETURN_IF_ERROR(WriteSyntheticModel(path, options));
  return path;
}

}  // namespace kvrelay::testing
