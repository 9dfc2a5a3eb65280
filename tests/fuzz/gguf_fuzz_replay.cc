// Runs the GGUF fuzz entry point over a deterministic corpus under the normal
// (gcc) build: a valid synthetic model with every value type and several
// tensor formats, every truncation of it, and ~20k copies with random byte
// flips (fixed seed). A crash or sanitizer report fails the ctest; so does a
// corpus whose valid seed no longer parses (the replay would test nothing).
//
//   gguf_fuzz_replay                 run the corpus
//   gguf_fuzz_replay --write DIR     also write seed files for libFuzzer into DIR
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "engine/gguf/gguf.h"
#include "engine/gguf/quantize.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

using namespace kvrelay::engine;

std::vector<uint8_t> Encode(GgmlType type, int64_t n, float scale) {
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) x[i] = scale * static_cast<float>((i * 37) % 19 - 9);
  return QuantizeRowForTest(type, x.data(), n);
}

std::vector<uint8_t> SeedModel(uint32_t alignment) {
  GgufWriter w;
  if (alignment != 32) w.SetAlignment(alignment);
  w.SetString("general.architecture", "llama");
  w.SetUint32("llama.block_count", 1);
  w.SetFloat32("llama.rope.freq_base", 10000.0f);
  w.SetBool("tokenizer.ggml.add_bos_token", true);
  w.SetInt32("i32", -5);
  w.Set("u8", GgufValue{GgufValueType::kUint8, uint8_t{9}});
  w.Set("i64", GgufValue{GgufValueType::kInt64, int64_t{-1}});
  w.Set("f64", GgufValue{GgufValueType::kFloat64, 2.5});
  w.SetStringArray("tokenizer.ggml.tokens", {"<s>", "a", "b", "ab"});
  w.SetFloat32Array("tokenizer.ggml.scores", {0, -1, -2, -3});
  w.SetInt32Array("tokenizer.ggml.token_type", {3, 1, 1, 1});
  auto inner = std::make_shared<GgufArray>();
  inner->elem_type = GgufValueType::kUint16;
  inner->values = {GgufValue{GgufValueType::kUint16, uint16_t{1}}};
  auto outer = std::make_shared<GgufArray>();
  outer->elem_type = GgufValueType::kArray;
  outer->values = {GgufValue{GgufValueType::kArray, inner}};
  w.Set("nested", GgufValue{GgufValueType::kArray, outer});
  w.AddTensor("f32", GgmlType::kF32, {4, 2}, Encode(GgmlType::kF32, 8, 0.5f));
  w.AddTensor("f16", GgmlType::kF16, {8}, Encode(GgmlType::kF16, 8, 0.25f));
  w.AddTensor("q4_0", GgmlType::kQ4_0, {32, 2}, Encode(GgmlType::kQ4_0, 64, 0.1f));
  w.AddTensor("q4_1", GgmlType::kQ4_1, {32}, Encode(GgmlType::kQ4_1, 32, 0.1f));
  w.AddTensor("q8_0", GgmlType::kQ8_0, {64}, Encode(GgmlType::kQ8_0, 64, 0.1f));
  // k-quant blocks with arbitrary bytes (every bit pattern is a valid block).
  std::vector<uint8_t> k(static_cast<size_t>(BlockBytes(GgmlType::kQ6_K)));
  for (size_t i = 0; i < k.size(); ++i) k[i] = static_cast<uint8_t>(i * 7);
  k[k.size() - 1] = 0x20;  // keep d a small finite fp16
  w.AddTensor("q6_k", GgmlType::kQ6_K, {256}, k);
  return w.Build();
}

}  // namespace

int main(int argc, char** argv) {
  std::string write_dir;
  if (argc == 3 && std::strcmp(argv[1], "--write") == 0) write_dir = argv[2];

  std::vector<std::vector<uint8_t>> seeds = {SeedModel(32), SeedModel(64)};
  for (const auto& s : seeds) {
    auto f = GgufFile::FromMemory(s.data(), s.size());
    if (!f.ok()) {
      std::fprintf(stderr, "seed model does not parse: %s\n", f.status().ToString().c_str());
      return 1;
    }
  }
  if (!write_dir.empty()) {
    for (size_t i = 0; i < seeds.size(); ++i) {
      std::ofstream out(write_dir + "/seed" + std::to_string(i) + ".gguf", std::ios::binary);
      out.write(reinterpret_cast<const char*>(seeds[i].data()),
                static_cast<std::streamsize>(seeds[i].size()));
    }
  }

  size_t cases = 0;
  for (const auto& s : seeds) {
    for (size_t n = 0; n <= s.size(); ++n, ++cases) LLVMFuzzerTestOneInput(s.data(), n);
  }
  std::mt19937_64 rng(20261129);
  std::vector<uint8_t> buf;
  for (int i = 0; i < 20000; ++i, ++cases) {
    const auto& s = seeds[i % seeds.size()];
    buf = s;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) {
      // Bias toward the header and tables, where the parser's decisions are.
      const size_t limit = (rng() % 4 == 0) ? buf.size() : std::min<size_t>(buf.size(), 600);
      const size_t at = rng() % limit;
      switch (rng() % 3) {
        case 0:
          buf[at] ^= static_cast<uint8_t>(1u << (rng() % 8));
          break;
        case 1:
          buf[at] = static_cast<uint8_t>(rng());
          break;
        default:
          buf[at] = (rng() % 2) ? 0xFF : 0x00;
          break;
      }
    }
    if (rng() % 8 == 0) buf.resize(rng() % (buf.size() + 1));
    LLVMFuzzerTestOneInput(buf.data(), buf.size());
  }
  std::printf("gguf_fuzz_replay: %zu cases, no crash\n", cases);
  return 0;
}
