// libFuzzer entry point for the GGUF loader: parse an arbitrary image, then
// touch every metadata value and every tensor byte (dequantizing each row), so
// the sanitizers see any read the loader's validation failed to bound.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "engine/gguf/fingerprint.h"
#include "engine/gguf/gguf.h"

namespace {

using kvrelay::engine::GgufArray;
using kvrelay::engine::GgufValue;

uint64_t Touch(const GgufValue& v) {
  uint64_t acc = static_cast<uint64_t>(v.type);
  if (const auto* s = std::get_if<std::string>(&v.value)) {
    for (char c : *s) acc += static_cast<uint8_t>(c);
  } else if (const auto* a = std::get_if<std::shared_ptr<GgufArray>>(&v.value)) {
    if (*a != nullptr) {
      for (const GgufValue& e : (*a)->values) acc += Touch(e);
    }
  } else {
    acc += v.value.index();
  }
  return acc;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvrelay::engine;
  auto file = GgufFile::FromMemory(data, size);
  if (!file.ok()) return 0;
  const GgufFile& g = **file;
  volatile uint64_t sink = 0;
  for (const auto& [key, value] : g.metadata()) {
    sink = sink + Touch(value) + key.size();
    // Every typed getter must answer (value or error) for every key.
    sink = sink + g.GetString(key).ok() + g.GetInt(key).ok() + g.GetFloat(key).ok() +
           g.GetBool(key).ok() + g.GetStringArray(key).ok() + g.GetIntArray(key).ok() +
           g.GetFloatArray(key).ok();
  }
  std::vector<float> row;
  for (const GgufTensor& t : g.tensors()) {
    for (uint64_t i = 0; i < t.nbytes; ++i) sink = sink + t.data[i];
    if (!CanDequantize(t.type)) continue;
    auto row_bytes = RowBytes(t.type, t.Cols());
    if (!row_bytes.ok()) __builtin_trap();  // the loader accepted an invalid row
    row.resize(static_cast<size_t>(t.Cols()));
    for (int64_t r = 0; r < t.Rows(); ++r) {
      DequantizeRow(t.type, t.data + r * *row_bytes, row.data(), t.Cols());
      sink = sink + static_cast<uint64_t>(row[0] == row[0]);
    }
  }
  const auto fp = ComputeModelFingerprint(g);
  sink = sink + fp[0];
  return 0;
}
