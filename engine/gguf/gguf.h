// GGUF model files (versions 2 and 3): metadata and memory-mapped tensors.
//
// GgufFile::Open validates everything before use: every count, string length,
// array length, tensor offset, size and type is checked against the file size
// and sane limits. A malformed, truncated or hostile file gets a Status naming
// what is wrong; it never crashes, reads out of bounds, or allocates memory
// out of proportion to the file.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "common/status.h"
#include "engine/gguf/ggml_type.h"

namespace kvrelay::engine {

// GGUF metadata value types, as on disk.
enum class GgufValueType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};

struct GgufArray;

// "u8", "i32", "string", "array", ...
std::string_view GgufValueTypeName(GgufValueType type);

// One metadata value. Integers of every width are kept in their own type.
struct GgufValue {
  GgufValueType type = GgufValueType::kUint32;
  std::variant<uint8_t, int8_t, uint16_t, int16_t, uint32_t, int32_t, float, bool, std::string,
               std::shared_ptr<GgufArray>, uint64_t, int64_t, double>
      value;
};

struct GgufArray {
  GgufValueType elem_type = GgufValueType::kUint8;
  std::vector<GgufValue> values;
};

// A tensor inside the mapped file. dims[0] is the fastest-varying (row length),
// as in ggml: a weight matrix of `rows` outputs and `cols` inputs has dims {cols, rows}.
struct GgufTensor {
  std::string name;
  GgmlType type = GgmlType::kF32;
  std::vector<int64_t> dims;
  uint64_t offset = 0;            // relative to the start of the tensor data section
  const uint8_t* data = nullptr;  // into the mapping; valid while the GgufFile lives
  uint64_t nbytes = 0;

  int64_t NumElements() const;
  int64_t Rows() const;  // product of dims[1..], 1 for a vector
  int64_t Cols() const { return dims.empty() ? 0 : dims[0]; }
};

class GgufFile {
 public:
  // Maps the file read-only and parses it. Thread-safe to use after Open.
  static Result<std::unique_ptr<GgufFile>> Open(const std::string& path);
  // Parses an in-memory image (for fuzzing and tests); `bytes` must outlive the result.
  static Result<std::unique_ptr<GgufFile>> FromMemory(const uint8_t* bytes, size_t size);
  ~GgufFile();

  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
  const std::vector<GgufTensor>& tensors() const { return tensors_; }

  const GgufValue* Find(const std::string& key) const;
  const GgufTensor* FindTensor(const std::string& name) const;

  // Typed getters: NotFound when absent, InvalidArgument when the type is wrong.
  // Integer getters accept any integer type whose value fits.
  Result<std::string> GetString(const std::string& key) const;
  Result<int64_t> GetInt(const std::string& key) const;
  Result<double> GetFloat(const std::string& key) const;  // float32 or float64
  Result<bool> GetBool(const std::string& key) const;
  Result<std::vector<std::string>> GetStringArray(const std::string& key) const;
  Result<std::vector<int64_t>> GetIntArray(const std::string& key) const;
  Result<std::vector<float>> GetFloatArray(const std::string& key) const;

 private:
  GgufFile() = default;
  Status Parse(const uint8_t* bytes, size_t size);

  void* mapping_ = nullptr;  // owned mmap region, or nullptr for FromMemory
  size_t mapping_size_ = 0;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  std::map<std::string, GgufValue> metadata_;
  std::vector<GgufTensor> tensors_;
  std::map<std::string, size_t> tensor_index_;
};

// Builds GGUF v3 images in memory: used by tests to write small synthetic models
// and by fuzz seeds. Tensors are laid out with the given alignment.
// Appends the on-disk encoding of `v` (without a type tag for the top-level value;
// arrays carry their element type and count) to `out`. Used by GgufWriter and the
// model fingerprint.
void EncodeGgufValue(const GgufValue& v, std::vector<uint8_t>* out);

class GgufWriter {
 public:
  void SetString(const std::string& key, const std::string& v);
  void SetUint32(const std::string& key, uint32_t v);
  void SetInt32(const std::string& key, int32_t v);
  void SetFloat32(const std::string& key, float v);
  void SetBool(const std::string& key, bool v);
  void SetStringArray(const std::string& key, const std::vector<std::string>& v);
  void SetInt32Array(const std::string& key, const std::vector<int32_t>& v);
  void SetFloat32Array(const std::string& key, const std::vector<float>& v);
  void Set(const std::string& key, GgufValue v);
  // `data` holds the encoded bytes (RowBytes(type, dims[0]) * rows).
  void AddTensor(const std::string& name, GgmlType type, std::vector<int64_t> dims,
                 std::vector<uint8_t> data);
  void SetAlignment(uint32_t alignment);

  std::vector<uint8_t> Build() const;
  Status WriteFile(const std::string& path) const;

 private:
  std::vector<std::pair<std::string, GgufValue>> kv_;
  struct Tensor {
    std::string name;
    GgmlType type;
    std::vector<int64_t> dims;
    std::vector<uint8_t> data;
  };
  std::vector<Tensor> tensors_;
  uint32_t alignment_ = 32;
};

}  // namespace kvrelay::engine
