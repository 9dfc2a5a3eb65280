// GgufWriter: GGUF v3 images for tests and fuzz seeds.
#include <fstream>

#include "engine/gguf/gguf.h"

namespace kvrelay::engine {
namespace {

template <typename T>
void Put(std::vector<uint8_t>* out, T v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  out->insert(out->end(), p, p + sizeof(T));
}

void PutString(std::vector<uint8_t>* out, const std::string& s) {
  Put<uint64_t>(out, s.size());
  out->insert(out->end(), s.begin(), s.end());
}

void PadTo(std::vector<uint8_t>* out, uint64_t alignment) {
  while (out->size() % alignment != 0) out->push_back(0);
}

}  // namespace

void EncodeGgufValue(const GgufValue& v, std::vector<uint8_t>* out) {
  std::visit(
      [out](const auto& x) {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, std::string>) {
          PutString(out, x);
        } else if constexpr (std::is_same_v<T, std::shared_ptr<GgufArray>>) {
          if (x == nullptr) {
            Put<uint32_t>(out, static_cast<uint32_t>(GgufValueType::kUint8));
            Put<uint64_t>(out, 0);
            return;
          }
          Put<uint32_t>(out, static_cast<uint32_t>(x->elem_type));
          Put<uint64_t>(out, x->values.size());
          for (const GgufValue& e : x->values) EncodeGgufValue(e, out);
        } else if constexpr (std::is_same_v<T, bool>) {
          Put<uint8_t>(out, x ? 1 : 0);
        } else {
          Put<T>(out, x);
        }
      },
      v.value);
}

void GgufWriter::Set(const std::string& key, GgufValue v) {
  for (auto& kv : kv_) {
    if (kv.first == key) {
      kv.second = std::move(v);
      return;
    }
  }
  kv_.emplace_back(key, std::move(v));
}

void GgufWriter::SetString(const std::string& key, const std::string& v) {
  Set(key, GgufValue{GgufValueType::kString, v});
}
void GgufWriter::SetUint32(const std::string& key, uint32_t v) {
  Set(key, GgufValue{GgufValueType::kUint32, v});
}
void GgufWriter::SetInt32(const std::string& key, int32_t v) {
  Set(key, GgufValue{GgufValueType::kInt32, v});
}
void GgufWriter::SetFloat32(const std::string& key, float v) {
  Set(key, GgufValue{GgufValueType::kFloat32, v});
}
void GgufWriter::SetBool(const std::string& key, bool v) {
  Set(key, GgufValue{GgufValueType::kBool, v});
}

void GgufWriter::SetStringArray(const std::string& key, const std::vector<std::string>& v) {
  auto arr = std::make_shared<GgufArray>();
  arr->elem_type = GgufValueType::kString;
  for (const std::string& s : v) arr->values.push_back(GgufValue{GgufValueType::kString, s});
  Set(key, GgufValue{GgufValueType::kArray, std::move(arr)});
}

void GgufWriter::SetInt32Array(const std::string& key, const std::vector<int32_t>& v) {
  auto arr = std::make_shared<GgufArray>();
  arr->elem_type = GgufValueType::kInt32;
  for (int32_t x : v) arr->values.push_back(GgufValue{GgufValueType::kInt32, x});
  Set(key, GgufValue{GgufValueType::kArray, std::move(arr)});
}

void GgufWriter::SetFloat32Array(const std::string& key, const std::vector<float>& v) {
  auto arr = std::make_shared<GgufArray>();
  arr->elem_type = GgufValueType::kFloat32;
  for (float x : v) arr->values.push_back(GgufValue{GgufValueType::kFloat32, x});
  Set(key, GgufValue{GgufValueType::kArray, std::move(arr)});
}

void GgufWriter::AddTensor(const std::string& name, GgmlType type, std::vector<int64_t> dims,
                           std::vector<uint8_t> data) {
  tensors_.push_back(Tensor{name, type, std::move(dims), std::move(data)});
}

void GgufWriter::SetAlignment(uint32_t alignment) {
  alignment_ = alignment == 0 ? 1 : alignment;
  SetUint32("general.alignment", alignment);
}

std::vector<uint8_t> GgufWriter::Build() const {
  std::vector<uint8_t> out;
  Put<uint32_t>(&out, 0x46554747);  // "GGUF"
  Put<uint32_t>(&out, 3);
  Put<uint64_t>(&out, tensors_.size());
  Put<uint64_t>(&out, kv_.size());
  for (const auto& [key, value] : kv_) {
    PutString(&out, key);
    Put<uint32_t>(&out, static_cast<uint32_t>(value.type));
    EncodeGgufValue(value, &out);
  }
  uint64_t offset = 0;
  for (const Tensor& t : tensors_) {
    PutString(&out, t.name);
    Put<uint32_t>(&out, static_cast<uint32_t>(t.dims.size()));
    for (int64_t d : t.dims) Put<uint64_t>(&out, static_cast<uint64_t>(d));
    Put<uint32_t>(&out, static_cast<uint32_t>(t.type));
    Put<uint64_t>(&out, offset);
    offset += (t.data.size() + alignment_ - 1) / alignment_ * alignment_;
  }
  PadTo(&out, alignment_);
  for (const Tensor& t : tensors_) {
    out.insert(out.end(), t.data.begin(), t.data.end());
    PadTo(&out, alignment_);
  }
  return out;
}

Status GgufWriter::WriteFile(const std::string& path) const {
  const std::vector<uint8_t> bytes = Build();
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return InvalidArgument("cannot create '" + path + "'");
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  f.close();
  if (!f) return DataLoss("short write to '" + path + "'");
  return Status::Ok();
}

}  // namespace kvrelay::engine
