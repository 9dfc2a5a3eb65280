#include "tests/gpu/synthetic_shapes.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "engine/gguf/gguf.h"
#include "engine/gguf/quantize.h"

namespace kvrelay::gpucheck {
namespace {

using engine::GgmlType;

uint64_t SplitMix(uint64_t* s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// rows x cols uniform in +-scale, quantized row by row on `threads` threads;
// row r's values depend only on (seed, r), so the bytes do not depend on the
// thread count.
std::vector<uint8_t> RandomMatrix(int64_t rows, int64_t cols, float scale, GgmlType type,
                                  uint64_t seed, int threads) {
  const int64_t row_bytes = *engine::RowBytes(type, cols);
  std::vector<uint8_t> out(static_cast<size_t>(rows * row_bytes));
  auto work = [&](int64_t r0, int64_t r1) {
    std::vector<float> x(cols);
    for (int64_t r = r0; r < r1; ++r) {
      uint64_t s = seed * 0x100000001B3ull + static_cast<uint64_t>(r);
      for (int64_t c = 0; c < cols; ++c) {
        const double u = static_cast<double>(SplitMix(&s) >> 11) * (1.0 / 9007199254740992.0);
        x[c] = static_cast<float>((2.0 * u - 1.0) * scale);
      }
      std::vector<uint8_t> q = engine::QuantizeRowForTest(type, x.data(), cols);
      std::memcpy(out.data() + r * row_bytes, q.data(), q.size());
    }
  };
  std::vector<std::thread> pool;
  const int n = std::max(1, threads);
  const int64_t per = (rows + n - 1) / n;
  for (int t = 0; t < n; ++t) {
    const int64_t r0 = t * per, r1 = std::min(rows, r0 + per);
    if (r0 < r1) pool.emplace_back(work, r0, r1);
  }
  for (std::thread& t : pool) t.join();
  return out;
}

std::vector<uint8_t> RandomVector(int n, float center, float spread, uint64_t seed) {
  std::vector<float> v(n);
  uint64_t s = seed;
  for (float& x : v) {
    const double u = static_cast<double>(SplitMix(&s) >> 11) * (1.0 / 9007199254740992.0);
    x = static_cast<float>(center + (2.0 * u - 1.0) * spread);
  }
  std::vector<uint8_t> b(n * sizeof(float));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

}  // namespace

ShapeOptions DefaultModelShape() {
  ShapeOptions s;
  s.name = "SmolLM2-135M shape (Q4_1)";
  s.layers = 30;
  s.d_model = 576;
  s.heads = 9;
  s.kv_heads = 3;
  s.ffn = 1536;
  s.vocab = 49152;
  s.context_length = 8192;
  s.rope_base = 100000.0f;
  s.matrix_type = GgmlType::kQ4_1;
  s.embedding_type = GgmlType::kQ8_0;
  s.tied_embeddings = true;
  return s;
}

ShapeOptions Llama7BShape() {
  ShapeOptions s;
  s.name = "Llama-2-7B shape (Q4_0)";
  s.layers = 32;
  s.d_model = 4096;
  s.heads = 32;
  s.kv_heads = 32;
  s.ffn = 11008;
  s.vocab = 32000;
  s.context_length = 4096;
  s.matrix_type = GgmlType::kQ4_0;
  s.embedding_type = GgmlType::kQ4_0;
  s.tied_embeddings = false;
  s.output_type = GgmlType::kQ8_0;
  return s;
}

ShapeOptions Gemma3Shape() {
  ShapeOptions s;
  s.name = "Gemma-3-270M shape (Q8_0)";
  s.arch = "gemma3";
  s.layers = 18;
  s.d_model = 640;
  s.heads = 4;
  s.kv_heads = 1;
  s.head_dim = 256;
  s.ffn = 2048;
  s.vocab = 262144;
  s.context_length = 32768;
  s.rope_base = 1000000.0f;
  s.rope_base_swa = 10000.0f;
  s.rms_eps = 1e-6f;
  s.sliding_window = 64;
  s.sliding_window_pattern = 6;
  s.final_logit_softcap = 30.0f;
  s.matrix_type = GgmlType::kQ8_0;
  s.embedding_type = GgmlType::kQ8_0;
  s.tied_embeddings = true;
  return s;
}

Result<ShapeOptions> ShapeByName(const std::string& name, int layers) {
  ShapeOptions s;
  if (name == "default" || name == "smol") {
    s = DefaultModelShape();
  } else if (name == "7b") {
    s = Llama7BShape();
  } else if (name == "gemma3") {
    s = Gemma3Shape();
  } else {
    return InvalidArgument("unknown shape '" + name + "' (default, smol, 7b, gemma3)");
  }
  if (layers > 0) {
    s.layers = layers;
    s.name += ", " + std::to_string(layers) + " layers";
  }
  return s;
}

Status WriteShapeModel(const std::string& path, const ShapeOptions& o, int threads) {
  if ((o.head_dim == 0 && o.d_model % o.heads != 0) || o.heads % o.kv_heads != 0) {
    return InvalidArgument("shape " + o.name + ": heads do not divide d_model / kv heads");
  }
  if (o.arch != "llama" && o.arch != "gemma3") {
    return InvalidArgument("shape " + o.name + ": arch must be llama or gemma3");
  }
  const bool gemma3 = o.arch == "gemma3";
  engine::GgufWriter w;
  const std::string a = o.arch + ".";
  const int head_dim = o.head_dim > 0 ? o.head_dim : o.d_model / o.heads;
  w.SetString("general.architecture", o.arch);
  w.SetString("general.name", "kvrelay-synthetic-" + o.name);
  w.SetUint32(a + "block_count", o.layers);
  w.SetUint32(a + "context_length", o.context_length);
  w.SetUint32(a + "embedding_length", o.d_model);
  w.SetUint32(a + "feed_forward_length", o.ffn);
  w.SetUint32(a + "attention.head_count", o.heads);
  w.SetUint32(a + "attention.head_count_kv", o.kv_heads);
  w.SetFloat32(a + "rope.freq_base", o.rope_base);
  w.SetUint32(a + "rope.dimension_count", head_dim);
  w.SetFloat32(a + "attention.layer_norm_rms_epsilon", o.rms_eps);
  w.SetUint32(a + "vocab_size", o.vocab);
  if (gemma3) {
    w.SetUint32(a + "attention.key_length", head_dim);
    w.SetUint32(a + "attention.value_length", head_dim);
    if (o.sliding_window > 0) {
      w.SetUint32(a + "attention.sliding_window", o.sliding_window);
      w.SetUint32(a + "attention.sliding_window_pattern", o.sliding_window_pattern);
      w.SetFloat32(a + "rope.freq_base_swa", o.rope_base_swa);
    }
    if (o.final_logit_softcap > 0) {
      w.SetFloat32(a + "final_logit_softcapping", o.final_logit_softcap);
    }
  }
  const float in_scale = 1.0f / std::sqrt(static_cast<float>(o.d_model));
  uint64_t seed = o.seed;
  auto matrix = [&](const std::string& name, int cols, int rows, float scale, GgmlType type) {
    w.AddTensor(name, type, {cols, rows}, RandomMatrix(rows, cols, scale, type, ++seed, threads));
  };
  matrix("token_embd.weight", o.d_model, o.vocab, 1.0f, o.embedding_type);
  w.AddTensor("output_norm.weight", GgmlType::kF32, {o.d_model},
              RandomVector(o.d_model, 1.0f, 0.2f, ++seed));
  if (!o.tied_embeddings) matrix("output.weight", o.d_model, o.vocab, in_scale, o.output_type);
  for (int l = 0; l < o.layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    w.AddTensor(p + "attn_norm.weight", GgmlType::kF32, {o.d_model},
                RandomVector(o.d_model, 1.0f, 0.2f, ++seed));
    // Q/K larger than 1/sqrt(d) so attention is not uniform (as synthetic_model.cc).
    matrix(p + "attn_q.weight", o.d_model, o.heads * head_dim, 2 * in_scale, o.matrix_type);
    matrix(p + "attn_k.weight", o.d_model, o.kv_heads * head_dim, 2 * in_scale, o.matrix_type);
    matrix(p + "attn_v.weight", o.d_model, o.kv_heads * head_dim, in_scale, o.matrix_type);
    matrix(p + "attn_output.weight", o.heads * head_dim, o.d_model, in_scale, o.matrix_type);
    w.AddTensor(p + "ffn_norm.weight", GgmlType::kF32, {o.d_model},
                RandomVector(o.d_model, 1.0f, 0.2f, ++seed));
    matrix(p + "ffn_gate.weight", o.d_model, o.ffn, in_scale, o.matrix_type);
    matrix(p + "ffn_up.weight", o.d_model, o.ffn, in_scale, o.matrix_type);
    matrix(p + "ffn_down.weight", o.ffn, o.d_model, 1.0f / std::sqrt(static_cast<float>(o.ffn)),
           o.matrix_type);
    if (gemma3) {
      for (const char* norm : {"attn_q_norm.weight", "attn_k_norm.weight"}) {
        w.AddTensor(p + norm, GgmlType::kF32, {head_dim},
                    RandomVector(head_dim, 1.0f, 0.2f, ++seed));
      }
      for (const char* norm : {"post_attention_norm.weight", "post_ffw_norm.weight"}) {
        w.AddTensor(p + norm, GgmlType::kF32, {o.d_model},
                    RandomVector(o.d_model, 1.0f, 0.2f, ++seed));
      }
    }
  }
  return w.WriteFile(path);
}

}  // namespace kvrelay::gpucheck
