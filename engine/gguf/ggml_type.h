// Tensor element formats of GGUF files (the ggml type ids) and their exact
// dequantization. Quantized types are stored in blocks of `BlockElems(type)`
// elements taking `BlockBytes(type)` bytes; a row's length must be a multiple
// of the block size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "common/status.h"

namespace kvrelay::engine {

// Values are the on-disk ggml type ids.
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kBF16 = 30,
};

// nullopt for ids this build does not know.
std::optional<GgmlType> GgmlTypeFromId(uint32_t id);
std::string_view GgmlTypeName(GgmlType type);
// Elements per block (1 for F32/F16/BF16) and bytes per block.
int64_t BlockElems(GgmlType type);
int64_t BlockBytes(GgmlType type);
// Bytes of a row of `n` elements; error if n is not a multiple of the block size.
Result<int64_t> RowBytes(GgmlType type, int64_t n);
// True when DequantizeRow supports the type.
bool CanDequantize(GgmlType type);

// Writes n floats to dst from the encoded row at src. n must be a multiple of
// BlockElems(type) and src must hold RowBytes(type, n) bytes.
void DequantizeRow(GgmlType type, const void* src, float* dst, int64_t n);

// IEEE half and bfloat16 conversions (round to nearest even).
float Fp16ToFp32(uint16_t h);
uint16_t Fp32ToFp16(float f);
float Bf16ToFp32(uint16_t h);
uint16_t Fp32ToBf16(float f);

}  // namespace kvrelay::engine
