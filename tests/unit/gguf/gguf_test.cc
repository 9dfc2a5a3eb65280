// GgufFile on synthetic images: every value type, arrays, alignment, getters,
// and every kind of malformed input (each must give an error, never a crash).
#include "engine/gguf/gguf.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace kvrelay::engine {
namespace {

// Hand-assembles GGUF bytes (little-endian), for layouts GgufWriter will not produce.
class Bytes {
 public:
  Bytes& U8(uint8_t v) { return Raw(&v, 1); }
  Bytes& U32(uint32_t v) { return Raw(&v, 4); }
  Bytes& U64(uint64_t v) { return Raw(&v, 8); }
  Bytes& F32(float v) { return Raw(&v, 4); }
  Bytes& Str(const std::string& s) {
    U64(s.size());
    return Raw(s.data(), s.size());
  }
  Bytes& Header(uint64_t n_tensors, uint64_t n_kv, uint32_t version = 3) {
    return U32(0x46554747).U32(version).U64(n_tensors).U64(n_kv);
  }
  // One tensor info: name, dims, type, offset.
  Bytes& Tensor(const std::string& name, std::vector<uint64_t> dims, uint32_t type,
                uint64_t offset) {
    Str(name).U32(static_cast<uint32_t>(dims.size()));
    for (uint64_t d : dims) U64(d);
    return U32(type).U64(offset);
  }
  Bytes& PadTo(size_t alignment) {
    while (b_.size() % alignment) b_.push_back(0);
    return *this;
  }
  Bytes& Zeros(size_t n) {
    b_.resize(b_.size() + n, 0);
    return *this;
  }
  const std::vector<uint8_t>& get() const { return b_; }

 private:
  Bytes& Raw(const void* p, size_t n) {
    const auto* c = static_cast<const uint8_t*>(p);
    b_.insert(b_.end(), c, c + n);
    return *this;
  }
  std::vector<uint8_t> b_;
};

Result<std::unique_ptr<GgufFile>> Parse(const std::vector<uint8_t>& b) {
  return GgufFile::FromMemory(b.data(), b.size());
}

// Expects a parse error whose message contains `needle`.
void ExpectError(const std::vector<uint8_t>& b, const std::string& needle) {
  auto r = Parse(b);
  ASSERT_FALSE(r.ok()) << "expected an error mentioning '" << needle << "'";
  EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().ToString();
}

std::vector<uint8_t> F32Bytes(const std::vector<float>& v) {
  std::vector<uint8_t> out(v.size() * 4);
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

template <typename T>
GgufValue V(GgufValueType t, T v) {
  return GgufValue{t, v};
}

TEST(GgufFileTest, EveryValueTypeRoundTrips) {
  GgufWriter w;
  w.Set("u8", V<uint8_t>(GgufValueType::kUint8, 200));
  w.Set("i8", V<int8_t>(GgufValueType::kInt8, -100));
  w.Set("u16", V<uint16_t>(GgufValueType::kUint16, 60000));
  w.Set("i16", V<int16_t>(GgufValueType::kInt16, -30000));
  w.SetUint32("u32", 4000000000u);
  w.SetInt32("i32", -2000000000);
  w.SetFloat32("f32", 1.5f);
  w.SetBool("bool", true);
  w.SetString("str", std::string("h\0llo", 5));
  w.Set("u64", V<uint64_t>(GgufValueType::kUint64, 0xFFFFFFFFFFFFFFFFull));
  w.Set("i64", V<int64_t>(GgufValueType::kInt64, -5000000000ll));
  w.Set("f64", V<double>(GgufValueType::kFloat64, 1e300));
  w.SetStringArray("strs", {"a", "", "ccc"});
  w.SetInt32Array("ints", {1, -2, 3});
  w.SetFloat32Array("floats", {0.25f, -8.0f});
  // Nested: array of arrays of u16.
  auto inner = std::make_shared<GgufArray>();
  inner->elem_type = GgufValueType::kUint16;
  inner->values = {V<uint16_t>(GgufValueType::kUint16, 7)};
  auto outer = std::make_shared<GgufArray>();
  outer->elem_type = GgufValueType::kArray;
  outer->values = {GgufValue{GgufValueType::kArray, inner},
                   GgufValue{GgufValueType::kArray, inner}};
  w.Set("nested", GgufValue{GgufValueType::kArray, outer});

  const std::vector<uint8_t> image = w.Build();
  auto f = Parse(image);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  const GgufFile& g = **f;
  EXPECT_EQ(g.version(), 3u);
  EXPECT_EQ(g.metadata().size(), 16u);
  EXPECT_EQ(std::get<uint8_t>(g.Find("u8")->value), 200);
  EXPECT_EQ(g.Find("u8")->type, GgufValueType::kUint8);
  EXPECT_EQ(*g.GetInt("u8"), 200);
  EXPECT_EQ(*g.GetInt("i8"), -100);
  EXPECT_EQ(*g.GetInt("u16"), 60000);
  EXPECT_EQ(*g.GetInt("i16"), -30000);
  EXPECT_EQ(*g.GetInt("u32"), 4000000000ll);
  EXPECT_EQ(*g.GetInt("i32"), -2000000000);
  EXPECT_EQ(*g.GetFloat("f32"), 1.5);
  EXPECT_EQ(*g.GetBool("bool"), true);
  EXPECT_EQ(*g.GetString("str"), std::string("h\0llo", 5));
  EXPECT_EQ(std::get<uint64_t>(g.Find("u64")->value), 0xFFFFFFFFFFFFFFFFull);
  EXPECT_EQ(*g.GetInt("i64"), -5000000000ll);
  EXPECT_EQ(*g.GetFloat("f64"), 1e300);
  EXPECT_EQ(*g.GetStringArray("strs"), (std::vector<std::string>{"a", "", "ccc"}));
  EXPECT_EQ(*g.GetIntArray("ints"), (std::vector<int64_t>{1, -2, 3}));
  EXPECT_EQ(*g.GetFloatArray("floats"), (std::vector<float>{0.25f, -8.0f}));
  const auto& nested = std::get<std::shared_ptr<GgufArray>>(g.Find("nested")->value);
  ASSERT_EQ(nested->values.size(), 2u);
  const auto& in = std::get<std::shared_ptr<GgufArray>>(nested->values[1].value);
  EXPECT_EQ(in->elem_type, GgufValueType::kUint16);
  EXPECT_EQ(std::get<uint16_t>(in->values[0].value), 7);

  // Getter errors: NotFound when absent, InvalidArgument on a wrong type.
  EXPECT_EQ(g.GetInt("missing").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(g.GetString("u32").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g.GetInt("str").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g.GetInt("u64").status().code(), StatusCode::kInvalidArgument);  // over i64
  EXPECT_EQ(g.GetInt("f32").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g.GetBool("u8").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g.GetFloat("i32").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g.GetStringArray("ints").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g.GetIntArray("strs").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(g.GetFloatArray("ints").status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(g.tensors().empty());
}

TEST(GgufFileTest, Version2IsAccepted) {
  GgufWriter w;
  w.SetString("general.architecture", "llama");
  w.AddTensor("t", GgmlType::kF32, {4}, F32Bytes({1, 2, 3, 4}));
  std::vector<uint8_t> image = w.Build();
  image[4] = 2;  // v2 and v3 share the little-endian layout
  auto f = Parse(image);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ((*f)->version(), 2u);
  EXPECT_EQ(*(*f)->GetString("general.architecture"), "llama");
}

class AlignmentTest : public ::testing::TestWithParam<uint32_t> {};

TEST_P(AlignmentTest, TensorsAreAlignedAndReadBack) {
  const uint32_t alignment = GetParam();
  GgufWriter w;
  if (alignment != 32) w.SetAlignment(alignment);
  w.SetString("name", "x");  // odd-sized header so padding matters
  w.AddTensor("a", GgmlType::kF32, {3}, F32Bytes({1, 2, 3}));
  w.AddTensor("b", GgmlType::kF32, {2, 3}, F32Bytes({4, 5, 6, 7, 8, 9}));
  w.AddTensor("c", GgmlType::kF16, {5}, std::vector<uint8_t>(10, 0));
  const std::vector<uint8_t> image = w.Build();
  auto f = Parse(image);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  const GgufFile& g = **f;
  EXPECT_EQ(g.alignment(), alignment);
  ASSERT_EQ(g.tensors().size(), 3u);
  for (const GgufTensor& t : g.tensors()) {
    EXPECT_EQ(t.offset % alignment, 0u) << t.name;
    EXPECT_EQ(static_cast<size_t>(t.data - image.data()) % alignment, 0u) << t.name;
  }
  const GgufTensor* b = g.FindTensor("b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->dims, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(b->Cols(), 2);
  EXPECT_EQ(b->Rows(), 3);
  EXPECT_EQ(b->NumElements(), 6);
  EXPECT_EQ(b->nbytes, 24u);
  float vals[6];
  std::memcpy(vals, b->data, 24);
  EXPECT_EQ(vals[0], 4.0f);
  EXPECT_EQ(vals[5], 9.0f);
  EXPECT_EQ(g.FindTensor("c")->nbytes, 10u);
  EXPECT_EQ(g.FindTensor("zzz"), nullptr);
  // The data section starts at an aligned file offset after the header.
  EXPECT_EQ(static_cast<size_t>(g.FindTensor("a")->data - image.data()) % alignment, 0u);
}

INSTANTIATE_TEST_SUITE_P(Alignments, AlignmentTest, ::testing::Values(32u, 64u, 1u, 8u, 4096u));

TEST(GgufFileTest, OpenMapsAFileAndReportsMissingFiles) {
  GgufWriter w;
  w.SetString("general.architecture", "llama");
  w.AddTensor("w", GgmlType::kF32, {2}, F32Bytes({3, 4}));
  const std::string path =
      ::testing::TempDir() + "/gguf_open_test_" + std::to_string(::getpid()) + ".gguf";
  ASSERT_TRUE(w.WriteFile(path).ok());
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  float v[2];
  std::memcpy(v, (*f)->FindTensor("w")->data, 8);
  EXPECT_EQ(v[1], 4.0f);
  std::remove(path.c_str());
  auto missing = GgufFile::Open(path);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find(path), std::string::npos);
  auto dir = GgufFile::Open(::testing::TempDir());
  EXPECT_FALSE(dir.ok());
}

// ---- Malformed inputs ----

std::vector<uint8_t> SmallValidFile() {
  GgufWriter w;
  w.SetString("general.architecture", "llama");
  w.SetUint32("llama.block_count", 2);
  w.SetStringArray("tokenizer.ggml.tokens", {"a", "bb"});
  w.SetFloat32Array("scores", {1.0f, 2.0f});
  w.AddTensor("w0", GgmlType::kF32, {4, 2}, F32Bytes({1, 2, 3, 4, 5, 6, 7, 8}));
  w.AddTensor("w1", GgmlType::kQ8_0, {32}, std::vector<uint8_t>(34, 1));
  return w.Build();
}

TEST(GgufMalformedTest, EveryTruncationIsAnError) {
  const std::vector<uint8_t> image = SmallValidFile();
  auto full = Parse(image);
  ASSERT_TRUE(full.ok()) << full.status().ToString();
  // The last byte any tensor needs; bytes after it are alignment padding.
  size_t needed = 0;
  for (const GgufTensor& t : (*full)->tensors()) {
    needed = std::max(needed, static_cast<size_t>(t.data - image.data()) + t.nbytes);
  }
  for (size_t n = 0; n < image.size(); ++n) {
    std::vector<uint8_t> prefix(image.begin(), image.begin() + n);
    auto r = Parse(prefix);
    if (n < needed) {
      EXPECT_FALSE(r.ok()) << "truncated to " << n << " bytes";
    } else {
      EXPECT_TRUE(r.ok()) << "truncated to " << n << " bytes (only padding lost)";
    }
  }
  // The null image is an error too.
  EXPECT_FALSE(GgufFile::FromMemory(nullptr, 0).ok());
}

TEST(GgufMalformedTest, BadMagicAndVersion) {
  std::vector<uint8_t> image = SmallValidFile();
  std::vector<uint8_t> bad = image;
  bad[0] = 'X';
  ExpectError(bad, "magic");
  for (uint32_t v : {0u, 4u, 0xFFFFFFFFu}) {
    bad = image;
    std::memcpy(&bad[4], &v, 4);
    ExpectError(bad, "version");
  }
  bad = image;
  bad[4] = 1;
  EXPECT_EQ(Parse(bad).status().code(), StatusCode::kUnimplemented);
  bad = image;
  const uint32_t big_endian_3 = 0x03000000;
  std::memcpy(&bad[4], &big_endian_3, 4);
  ExpectError(bad, "big-endian");
}

TEST(GgufMalformedTest, HugeCounts) {
  ExpectError(Bytes().Header(0, uint64_t{1} << 60).get(), "metadata count");
  ExpectError(Bytes().Header(uint64_t{1} << 60, 0).get(), "tensor count");
  ExpectError(Bytes().Header(~uint64_t{0}, ~uint64_t{0}).get(), "count");
  // Counts the remaining bytes cannot hold, even if small in absolute terms.
  ExpectError(Bytes().Header(0, 3).Str("k").U32(4).U32(1).get(), "metadata count");
  // A string whose length runs past the end.
  ExpectError(Bytes().Header(0, 1).U64(uint64_t{1} << 63).Zeros(8).get(), "metadata key");
  ExpectError(Bytes().Header(0, 1).Str("k").U32(8).U64(1000).Str("abc").get(), "'k'");
  // Array lengths: 2^62 elements of u32, then a nested array claiming too much.
  ExpectError(Bytes().Header(0, 1).Str("arr").U32(9).U32(4).U64(uint64_t{1} << 62).get(), "'arr'");
  ExpectError(Bytes()
                  .Header(0, 1)
                  .Str("nest")
                  .U32(9)
                  .U32(9)
                  .U64(1)
                  .U32(0)
                  .U64(uint64_t{1} << 40)
                  .Zeros(16)
                  .get(),
              "'nest'");
  // Nesting deeper than the limit.
  Bytes deep;
  deep.Header(0, 1).Str("deep").U32(9);
  for (int i = 0; i < 64; ++i) deep.U32(9).U64(1);
  deep.U32(0).U64(0);
  ExpectError(deep.get(), "nested");
}

TEST(GgufMalformedTest, BadTypes) {
  ExpectError(Bytes().Header(0, 1).Str("k").U32(13).U32(0).get(), "bad value type 13");
  ExpectError(Bytes().Header(0, 1).Str("k").U32(9).U32(99).U64(0).get(), "element type");
  ExpectError(Bytes().Header(0, 1).Str("flag").U32(7).U8(2).get(), "bool");
  // ggml type 4 (removed Q4_2) and an unknown id.
  for (uint32_t t : {4u, 99u}) {
    ExpectError(Bytes().Header(1, 0).Tensor("bad_t", {32}, t, 0).PadTo(32).Zeros(64).get(),
                "bad_t");
  }
}

TEST(GgufMalformedTest, BadTensorShapes) {
  auto one = [](std::vector<uint64_t> dims, uint32_t type) {
    return Bytes().Header(1, 0).Tensor("shape", dims, type, 0).PadTo(32).Zeros(256).get();
  };
  ExpectError(one({}, 0), "n_dims");
  ExpectError(one({1, 1, 1, 1, 1}, 0), "n_dims");
  ExpectError(one({4, 0}, 0), "dimension");
  ExpectError(one({~uint64_t{0}}, 0), "dimension");
  ExpectError(one({uint64_t{1} << 32, uint64_t{1} << 32}, 0), "overflow");
  ExpectError(one({16}, 2), "multiple");  // Q4_0 row of 16
  // Product fits in i64 but the byte size is impossible for the file.
  ExpectError(one({uint64_t{1} << 30, uint64_t{1} << 30}, 0), "shape");
}

TEST(GgufMalformedTest, BadOffsets) {
  // Misaligned.
  ExpectError(Bytes().Header(1, 0).Tensor("mis", {4}, 0, 4).PadTo(32).Zeros(64).get(), "alignment");
  // Out of range: the data section holds 16 bytes, the tensor starts at 32.
  ExpectError(Bytes().Header(1, 0).Tensor("far", {4}, 0, 32).PadTo(32).Zeros(16).get(), "far");
  ExpectError(Bytes()
                  .Header(1, 0)
                  .Tensor("far", {4}, 0, ~uint64_t{0} & ~uint64_t{31})
                  .PadTo(32)
                  .Zeros(16)
                  .get(),
              "far");
  // Size runs past the end: 16 floats need 64 bytes, 32 present.
  ExpectError(Bytes().Header(1, 0).Tensor("long", {16}, 0, 0).PadTo(32).Zeros(32).get(), "long");
  // Overlap: "first" holds 64 bytes from 0, "second" starts at 32.
  ExpectError(Bytes()
                  .Header(2, 0)
                  .Tensor("first", {16}, 0, 0)
                  .Tensor("second", {8}, 0, 32)
                  .PadTo(32)
                  .Zeros(128)
                  .get(),
              "overlaps");
  // Data section past the end of the file (no padding written).
  ExpectError(Bytes().Header(1, 0).Tensor("t", {1}, 0, 0).get(), "past the end");
}

TEST(GgufMalformedTest, DuplicatesAndAlignmentKey) {
  ExpectError(Bytes().Header(0, 2).Str("dup").U32(4).U32(1).Str("dup").U32(4).U32(2).get(),
              "duplicate metadata key 'dup'");
  ExpectError(Bytes()
                  .Header(2, 0)
                  .Tensor("same", {8}, 0, 0)
                  .Tensor("same", {8}, 0, 32)
                  .PadTo(32)
                  .Zeros(64)
                  .get(),
              "duplicate tensor name 'same'");
  for (uint32_t al : {0u, 3u, 48u, 1u << 30}) {
    ExpectError(Bytes().Header(0, 1).Str("general.alignment").U32(4).U32(al).get(),
                "general.alignment");
  }
  ExpectError(Bytes().Header(0, 1).Str("general.alignment").U32(5).U32(32).get(),
              "general.alignment must be u32");
}

TEST(GgufMalformedTest, ValidHandBuiltFileParses) {
  // The hand assembler itself produces a file the loader accepts: guards the
  // malformed cases above against failing for an unrelated reason.
  auto f = Parse(Bytes()
                     .Header(2, 1)
                     .Str("general.alignment")
                     .U32(4)
                     .U32(64)
                     .Tensor("a", {16}, 0, 0)
                     .Tensor("b", {8}, 0, 64)
                     .PadTo(64)
                     .Zeros(96)
                     .get());
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ((*f)->alignment(), 64u);
  EXPECT_EQ((*f)->FindTensor("b")->nbytes, 32u);
}

}  // namespace
}  // namespace kvrelay::engine
