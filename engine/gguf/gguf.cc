// GGUF v2/v3 parser. Layout (all little-endian):
//   "GGUF" u32 version, u64 tensor_count, u64 kv_count,
//   kv_count x { string key, u32 value_type, value },
//   tensor_count x { string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset },
//   padding to general.alignment (default 32), tensor data section.
// A string is u64 length + bytes; an array is u32 elem_type, u64 count, count values.
#include "engine/gguf/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>

namespace kvrelay::engine {
namespace {

constexpr uint32_t kMagic = 0x46554747;              // "GGUF" read as a little-endian u32
constexpr uint64_t kMaxEntries = uint64_t{1} << 24;  // metadata entries / tensors
// Metadata values including array elements (about 50 bytes each in memory);
// a 256k-token tokenizer with its merges needs about 1.5M.
constexpr uint64_t kMaxTotalValues = uint64_t{1} << 23;
constexpr uint64_t kMaxNameLength = uint64_t{1} << 16;  // keys and tensor names
constexpr int kMaxArrayDepth = 8;
constexpr uint32_t kMaxDims = 4;
constexpr uint64_t kMaxAlignment = uint64_t{1} << 20;
// Smallest encoding of a kv entry (8-byte key length + 4-byte type + 1-byte value)
// and of a tensor info (8 name length + 4 n_dims + 8 one dim + 4 type + 8 offset).
constexpr uint64_t kMinKvBytes = 13;
constexpr uint64_t kMinTensorInfoBytes = 32;

std::string Hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

// Smallest number of bytes one value of `type` takes on disk.
uint64_t MinValueBytes(GgufValueType type) {
  switch (type) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kBool:
      return 1;
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
      return 2;
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kFloat32:
      return 4;
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
    case GgufValueType::kFloat64:
    case GgufValueType::kString:
      return 8;
    case GgufValueType::kArray:
      return 12;
  }
  return 1;
}

bool ValidValueType(uint32_t t) { return t <= static_cast<uint32_t>(GgufValueType::kFloat64); }

// Bounds-checked little-endian cursor over the image.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }

  template <typename T>
  Status Read(T* out, const char* what) {
    if (remaining() < sizeof(T)) {
      return InvalidArgument(std::string("truncated file: ") + what + " at offset " +
                             std::to_string(pos_) + " needs " + std::to_string(sizeof(T)) +
                             " bytes, " + std::to_string(remaining()) + " left");
    }
    std::memcpy(out, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return Status::Ok();
  }

  Status ReadString(std::string* out, uint64_t max_len, const char* what) {
    const size_t at = pos_;
    uint64_t len = 0;
    RETURN_IF_ERROR(Read(&len, what));
    if (len > max_len) {
      return InvalidArgument(std::string(what) + " at offset " + std::to_string(at) +
                             " has length " + std::to_string(len) + " over the limit " +
                             std::to_string(max_len));
    }
    if (len > remaining()) {
      return InvalidArgument(std::string("truncated file: ") + what + " at offset " +
                             std::to_string(at) + " has length " + std::to_string(len) + ", " +
                             std::to_string(remaining()) + " bytes left");
    }
    out->assign(reinterpret_cast<const char*>(data_ + pos_), static_cast<size_t>(len));
    pos_ += static_cast<size_t>(len);
    return Status::Ok();
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

class MetadataParser {
 public:
  explicit MetadataParser(Reader* r) : r_(r) {}

  Status ReadValue(GgufValueType type, int depth, GgufValue* out) {
    if (++total_values_ > kMaxTotalValues) {
      return ResourceExhausted("more than " + std::to_string(kMaxTotalValues) + " metadata values");
    }
    out->type = type;
    switch (type) {
      case GgufValueType::kUint8:
        return ReadPod<uint8_t>(out);
      case GgufValueType::kInt8:
        return ReadPod<int8_t>(out);
      case GgufValueType::kUint16:
        return ReadPod<uint16_t>(out);
      case GgufValueType::kInt16:
        return ReadPod<int16_t>(out);
      case GgufValueType::kUint32:
        return ReadPod<uint32_t>(out);
      case GgufValueType::kInt32:
        return ReadPod<int32_t>(out);
      case GgufValueType::kFloat32:
        return ReadPod<float>(out);
      case GgufValueType::kUint64:
        return ReadPod<uint64_t>(out);
      case GgufValueType::kInt64:
        return ReadPod<int64_t>(out);
      case GgufValueType::kFloat64:
        return ReadPod<double>(out);
      case GgufValueType::kBool: {
        const size_t at = r_->pos();
        uint8_t b = 0;
        RETURN_IF_ERROR(r_->Read(&b, "bool value"));
        if (b > 1) {
          return InvalidArgument("bool value " + std::to_string(b) + " at offset " +
                                 std::to_string(at) + " is not 0 or 1");
        }
        out->value = b != 0;
        return Status::Ok();
      }
      case GgufValueType::kString: {
        std::string s;
        RETURN_IF_ERROR(r_->ReadString(&s, std::numeric_limits<uint64_t>::max(), "string value"));
        out->value = std::move(s);
        return Status::Ok();
      }
      case GgufValueType::kArray:
        return ReadArray(depth, out);
    }
    return InvalidArgument("bad value type");
  }

 private:
  template <typename T>
  Status ReadPod(GgufValue* out) {
    T v{};
    RETURN_IF_ERROR(r_->Read(&v, "value"));
    out->value = v;
    return Status::Ok();
  }

  Status ReadArray(int depth, GgufValue* out) {
    if (depth >= kMaxArrayDepth) {
      return InvalidArgument("arrays nested deeper than " + std::to_string(kMaxArrayDepth) +
                             " at offset " + std::to_string(r_->pos()));
    }
    const size_t at = r_->pos();
    uint32_t elem_type = 0;
    RETURN_IF_ERROR(r_->Read(&elem_type, "array element type"));
    if (!ValidValueType(elem_type)) {
      return InvalidArgument("array at offset " + std::to_string(at) + " has bad element type " +
                             std::to_string(elem_type));
    }
    uint64_t count = 0;
    RETURN_IF_ERROR(r_->Read(&count, "array length"));
    const auto et = static_cast<GgufValueType>(elem_type);
    // The count cannot exceed what the rest of the file could encode.
    if (count > r_->remaining() / MinValueBytes(et)) {
      return InvalidArgument("array at offset " + std::to_string(at) + " claims " +
                             std::to_string(count) + " elements but only " +
                             std::to_string(r_->remaining()) + " bytes remain");
    }
    if (count > kMaxTotalValues) {
      return ResourceExhausted("array at offset " + std::to_string(at) + " has " +
                               std::to_string(count) + " elements, over the limit");
    }
    auto arr = std::make_shared<GgufArray>();
    arr->elem_type = et;
    arr->values.reserve(static_cast<size_t>(count));
    for (uint64_t i = 0; i < count; ++i) {
      GgufValue v;
      Status s = ReadValue(et, depth + 1, &v);
      if (!s.ok()) return s.WithContext("array element " + std::to_string(i));
      arr->values.push_back(std::move(v));
    }
    out->value = std::move(arr);
    return Status::Ok();
  }

  Reader* r_;
  uint64_t total_values_ = 0;
};

template <typename T>
std::optional<int64_t> AsInt64(const GgufValue& v) {
  if (!std::holds_alternative<T>(v.value)) return std::nullopt;
  const T x = std::get<T>(v.value);
  if constexpr (std::is_same_v<T, uint64_t>) {
    if (x > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
  }
  return static_cast<int64_t>(x);
}

std::optional<int64_t> IntOf(const GgufValue& v) {
  switch (v.type) {
    case GgufValueType::kUint8:
      return AsInt64<uint8_t>(v);
    case GgufValueType::kInt8:
      return AsInt64<int8_t>(v);
    case GgufValueType::kUint16:
      return AsInt64<uint16_t>(v);
    case GgufValueType::kInt16:
      return AsInt64<int16_t>(v);
    case GgufValueType::kUint32:
      return AsInt64<uint32_t>(v);
    case GgufValueType::kInt32:
      return AsInt64<int32_t>(v);
    case GgufValueType::kUint64:
      return AsInt64<uint64_t>(v);
    case GgufValueType::kInt64:
      return AsInt64<int64_t>(v);
    default:
      return std::nullopt;
  }
}

std::optional<double> FloatOf(const GgufValue& v) {
  if (v.type == GgufValueType::kFloat32 && std::holds_alternative<float>(v.value)) {
    return std::get<float>(v.value);
  }
  if (v.type == GgufValueType::kFloat64 && std::holds_alternative<double>(v.value)) {
    return std::get<double>(v.value);
  }
  return std::nullopt;
}

const GgufArray* ArrayOf(const GgufValue& v) {
  if (v.type != GgufValueType::kArray) return nullptr;
  const auto* p = std::get_if<std::shared_ptr<GgufArray>>(&v.value);
  return p != nullptr ? p->get() : nullptr;
}

}  // namespace

std::string_view GgufValueTypeName(GgufValueType type) {
  switch (type) {
    case GgufValueType::kUint8:
      return "u8";
    case GgufValueType::kInt8:
      return "i8";
    case GgufValueType::kUint16:
      return "u16";
    case GgufValueType::kInt16:
      return "i16";
    case GgufValueType::kUint32:
      return "u32";
    case GgufValueType::kInt32:
      return "i32";
    case GgufValueType::kFloat32:
      return "f32";
    case GgufValueType::kBool:
      return "bool";
    case GgufValueType::kString:
      return "string";
    case GgufValueType::kArray:
      return "array";
    case GgufValueType::kUint64:
      return "u64";
    case GgufValueType::kInt64:
      return "i64";
    case GgufValueType::kFloat64:
      return "f64";
  }
  return "unknown";
}

int64_t GgufTensor::NumElements() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return dims.empty() ? 0 : n;
}

int64_t GgufTensor::Rows() const {
  int64_t n = 1;
  for (size_t i = 1; i < dims.size(); ++i) n *= dims[i];
  return n;
}

Result<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    Status s(err == ENOENT ? StatusCode::kNotFound : StatusCode::kInvalidArgument,
             "cannot open '" + path + "': " + std::strerror(err));
    return s;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return InvalidArgument("cannot stat '" + path + "': " + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return InvalidArgument("'" + path + "' is not a regular file");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size == 0) {
    ::close(fd);
    return InvalidArgument("'" + path + "' is empty, not a GGUF file");
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);  // the mapping keeps the file referenced
  if (map == MAP_FAILED) {
    return InvalidArgument("cannot mmap '" + path + "': " + std::strerror(map_err));
  }
  std::unique_ptr<GgufFile> file(new GgufFile());
  file->mapping_ = map;
  file->mapping_size_ = size;
  Status s = file->Parse(static_cast<const uint8_t*>(map), size);
  if (!s.ok()) return s.WithContext("'" + path + "'");
  return file;
}

Result<std::unique_ptr<GgufFile>> GgufFile::FromMemory(const uint8_t* bytes, size_t size) {
  std::unique_ptr<GgufFile> file(new GgufFile());
  if (bytes == nullptr && size != 0) return InvalidArgument("null image");
  RETURN_IF_ERROR(file->Parse(bytes, size));
  return file;
}

GgufFile::~GgufFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_size_);
}

Status GgufFile::Parse(const uint8_t* bytes, size_t size) {
  Reader r(bytes, size);
  uint32_t magic = 0;
  if (size < 4) return InvalidArgument("file of " + std::to_string(size) + " bytes is not GGUF");
  RETURN_IF_ERROR(r.Read(&magic, "magic"));
  if (magic != kMagic) {
    return InvalidArgument("bad magic " + Hex(magic) + " (expected \"GGUF\")");
  }
  RETURN_IF_ERROR(r.Read(&version_, "version"));
  if (version_ == 1) return Unimplemented("GGUF version 1 is not supported (need 2 or 3)");
  if (version_ != 2 && version_ != 3) {
    if ((version_ & 0xFFFF) == 0 && (version_ >> 24) <= 3 && (version_ >> 24) >= 1) {
      return Unimplemented("big-endian GGUF files are not supported");
    }
    return InvalidArgument("unsupported GGUF version " + std::to_string(version_));
  }
  uint64_t tensor_count = 0, kv_count = 0;
  RETURN_IF_ERROR(r.Read(&tensor_count, "tensor count"));
  RETURN_IF_ERROR(r.Read(&kv_count, "metadata count"));
  if (kv_count > kMaxEntries || kv_count > r.remaining() / kMinKvBytes) {
    return InvalidArgument("metadata count " + std::to_string(kv_count) +
                           " is impossible for a file of " + std::to_string(size) + " bytes");
  }
  if (tensor_count > kMaxEntries ||
      tensor_count > (r.remaining() - kv_count * kMinKvBytes) / kMinTensorInfoBytes) {
    return InvalidArgument("tensor count " + std::to_string(tensor_count) +
                           " is impossible for a file of " + std::to_string(size) + " bytes");
  }

  MetadataParser mp(&r);
  for (uint64_t i = 0; i < kv_count; ++i) {
    const size_t at = r.pos();
    std::string key;
    Status s = r.ReadString(&key, kMaxNameLength, "metadata key");
    if (!s.ok()) return s.WithContext("metadata entry " + std::to_string(i));
    if (metadata_.count(key) != 0) {
      return InvalidArgument("duplicate metadata key '" + key + "' at offset " +
                             std::to_string(at));
    }
    uint32_t type = 0;
    s = r.Read(&type, "value type");
    if (s.ok() && !ValidValueType(type)) {
      s = InvalidArgument("bad value type " + std::to_string(type));
    }
    GgufValue value;
    if (s.ok()) s = mp.ReadValue(static_cast<GgufValueType>(type), 0, &value);
    if (!s.ok()) return s.WithContext("metadata key '" + key + "'");
    metadata_.emplace(std::move(key), std::move(value));
  }

  if (const GgufValue* a = Find("general.alignment")) {
    if (a->type != GgufValueType::kUint32) {
      return InvalidArgument("general.alignment must be u32, got " +
                             std::string(GgufValueTypeName(a->type)));
    }
    const uint32_t al = std::get<uint32_t>(a->value);
    if (al == 0 || (al & (al - 1)) != 0 || al > kMaxAlignment) {
      return InvalidArgument("general.alignment " + std::to_string(al) +
                             " is not a power of two in [1, " + std::to_string(kMaxAlignment) +
                             "]");
    }
    alignment_ = al;
  }

  tensors_.reserve(static_cast<size_t>(tensor_count));
  for (uint64_t i = 0; i < tensor_count; ++i) {
    GgufTensor t;
    Status s = r.ReadString(&t.name, kMaxNameLength, "tensor name");
    if (!s.ok()) return s.WithContext("tensor " + std::to_string(i));
    auto ctx = [&](const Status& st) {
      return st.WithContext("tensor " + std::to_string(i) + " '" + t.name + "'");
    };
    if (tensor_index_.count(t.name) != 0) {
      return InvalidArgument("duplicate tensor name '" + t.name + "'");
    }
    uint32_t n_dims = 0;
    s = r.Read(&n_dims, "n_dims");
    if (!s.ok()) return ctx(s);
    if (n_dims == 0 || n_dims > kMaxDims) {
      return ctx(InvalidArgument("n_dims " + std::to_string(n_dims) + " not in [1, 4]"));
    }
    int64_t elems = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      uint64_t dim = 0;
      s = r.Read(&dim, "dimension");
      if (!s.ok()) return ctx(s);
      if (dim == 0 || dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return ctx(InvalidArgument("dimension " + std::to_string(d) + " is " + std::to_string(dim) +
                                   " (must be > 0)"));
      }
      if (static_cast<int64_t>(dim) > std::numeric_limits<int64_t>::max() / elems) {
        return ctx(InvalidArgument("element count overflows"));
      }
      elems *= static_cast<int64_t>(dim);
      t.dims.push_back(static_cast<int64_t>(dim));
    }
    uint32_t type_id = 0;
    s = r.Read(&type_id, "tensor type");
    if (!s.ok()) return ctx(s);
    const std::optional<GgmlType> type = GgmlTypeFromId(type_id);
    if (!type) return ctx(Unimplemented("unknown ggml type id " + std::to_string(type_id)));
    t.type = *type;
    s = r.Read(&t.offset, "tensor offset");
    if (!s.ok()) return ctx(s);
    if (t.offset % alignment_ != 0) {
      return ctx(InvalidArgument("offset " + std::to_string(t.offset) +
                                 " is not a multiple of the alignment " +
                                 std::to_string(alignment_)));
    }
    Result<int64_t> row_bytes = RowBytes(t.type, t.dims[0]);
    if (!row_bytes.ok()) return ctx(row_bytes.status());
    const int64_t rows = elems / t.dims[0];
    if (*row_bytes != 0 && rows > std::numeric_limits<int64_t>::max() / *row_bytes) {
      return ctx(InvalidArgument("byte size overflows"));
    }
    t.nbytes = static_cast<uint64_t>(*row_bytes * rows);
    tensor_index_.emplace(t.name, tensors_.size());
    tensors_.push_back(std::move(t));
  }

  // The data section starts at the next multiple of the alignment after the header.
  const uint64_t header_end = r.pos();
  const uint64_t data_start = (header_end + alignment_ - 1) / alignment_ * alignment_;
  if (tensors_.empty()) return Status::Ok();
  if (data_start > size) {
    return InvalidArgument("tensor data section at offset " + std::to_string(data_start) +
                           " starts past the end of the file (" + std::to_string(size) + " bytes)");
  }
  const uint64_t data_size = size - data_start;
  for (GgufTensor& t : tensors_) {
    if (t.offset > data_size || t.nbytes > data_size - t.offset) {
      return InvalidArgument("tensor '" + t.name + "' at data offset " + std::to_string(t.offset) +
                             " with " + std::to_string(t.nbytes) +
                             " bytes runs past the end of the data section (" +
                             std::to_string(data_size) + " bytes)");
    }
    t.data = bytes + data_start + t.offset;
  }
  // No two tensors may share bytes.
  std::vector<const GgufTensor*> by_offset;
  by_offset.reserve(tensors_.size());
  for (const GgufTensor& t : tensors_) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const GgufTensor* a, const GgufTensor* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const GgufTensor* prev = by_offset[i - 1];
    const GgufTensor* cur = by_offset[i];
    if (prev->offset + prev->nbytes > cur->offset) {
      return InvalidArgument("tensor '" + prev->name + "' (offset " + std::to_string(prev->offset) +
                             ", " + std::to_string(prev->nbytes) + " bytes) overlaps tensor '" +
                             cur->name + "' at offset " + std::to_string(cur->offset));
    }
  }
  return Status::Ok();
}

const GgufValue* GgufFile::Find(const std::string& key) const {
  auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

const GgufTensor* GgufFile::FindTensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

namespace {
Status WrongType(const std::string& key, const GgufValue& v, const char* want) {
  return InvalidArgument("metadata key '" + key + "' is " + std::string(GgufValueTypeName(v.type)) +
                         ", expected " + want);
}
Status Missing(const std::string& key) { return NotFound("metadata key '" + key + "' not found"); }
}  // namespace

Result<std::string> GgufFile::GetString(const std::string& key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return Missing(key);
  if (v->type != GgufValueType::kString) return WrongType(key, *v, "string");
  return std::get<std::string>(v->value);
}

Result<int64_t> GgufFile::GetInt(const std::string& key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return Missing(key);
  std::optional<int64_t> i = IntOf(*v);
  if (!i) return WrongType(key, *v, "an integer that fits in i64");
  return *i;
}

Result<double> GgufFile::GetFloat(const std::string& key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return Missing(key);
  std::optional<double> f = FloatOf(*v);
  if (!f) return WrongType(key, *v, "f32 or f64");
  return *f;
}

Result<bool> GgufFile::GetBool(const std::string& key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return Missing(key);
  if (v->type != GgufValueType::kBool) return WrongType(key, *v, "bool");
  return std::get<bool>(v->value);
}

Result<std::vector<std::string>> GgufFile::GetStringArray(const std::string& key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return Missing(key);
  const GgufArray* a = ArrayOf(*v);
  if (a == nullptr || a->elem_type != GgufValueType::kString) {
    return WrongType(key, *v, "array of string");
  }
  std::vector<std::string> out;
  out.reserve(a->values.size());
  for (const GgufValue& e : a->values) out.push_back(std::get<std::string>(e.value));
  return out;
}

Result<std::vector<int64_t>> GgufFile::GetIntArray(const std::string& key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return Missing(key);
  const GgufArray* a = ArrayOf(*v);
  if (a == nullptr) return WrongType(key, *v, "array of integers");
  std::vector<int64_t> out;
  out.reserve(a->values.size());
  for (size_t i = 0; i < a->values.size(); ++i) {
    std::optional<int64_t> x = IntOf(a->values[i]);
    if (!x) {
      return InvalidArgument("metadata key '" + key + "' element " + std::to_string(i) +
                             " is not an integer that fits in i64");
    }
    out.push_back(*x);
  }
  return out;
}

Result<std::vector<float>> GgufFile::GetFloatArray(const std::string& key) const {
  const GgufValue* v = Find(key);
  if (v == nullptr) return Missing(key);
  const GgufArray* a = ArrayOf(*v);
  if (a == nullptr ||
      (a->elem_type != GgufValueType::kFloat32 && a->elem_type != GgufValueType::kFloat64)) {
    return WrongType(key, *v, "array of f32");
  }
  std::vector<float> out;
  out.reserve(a->values.size());
  for (const GgufValue& e : a->values) out.push_back(static_cast<float>(*FloatOf(e)));
  return out;
}

}  // namespace kvrelay::engine
