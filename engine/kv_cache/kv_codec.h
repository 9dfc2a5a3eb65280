// Encoders and decoders of one KV slab (block_tokens x head_dim values of one
// (layer, K|V, head)) for every KvDtype. Internal to kvrelay_kv_cache, exposed
// for tests and for tools that read spilled blocks.
//
// Slab formats (T = block_tokens, D = head_dim, all little-endian):
//   f32   T*D float32, token-major ([t][d]).
//   f16   T*D IEEE binary16, round to nearest even. |err| <= 2^-11 |x| (normal range).
//   bf16  T*D bfloat16, round to nearest even.     |err| <= 2^-8 |x|.
//   int8  T*D int8 token-major, then T float32 scales (one per token of this head,
//         symmetric: scale = max|x| / 127, q = round(x / scale)). |err| <= scale / 2.
//   kivi4/kivi2  packed unsigned codes, token-major, low bits first within a byte
//         (T*D*bits/8 bytes), then the parameter area of max(4*D, 4*T*G) bytes
//         holding (lo, hi) binary16 pairs:
//           K slabs: per channel d (D pairs), over the block's tokens;
//           V slabs: per token t and group g of kKiviGroup channels (T*G pairs, [t][g]).
//         lo is min rounded down to binary16, hi is max rounded up, so the
//         interval covers every value; step = (hi - lo) / L with L = 2^bits - 1;
//         q = clamp(round((x - lo) / step), 0, L); decoded value lo + q * step.
//         |err| <= step / 2 = (hi - lo) / (2L): range/30 for 4 bits, range/6 for
//         2 bits, where hi - lo exceeds the true range max - min only by the
//         binary16 rounding of the two ends (<= 2^-10 (|min| + |max|)).
#pragma once

#include <cstdint>

#include "engine/kv_cache/kv_cache.h"

namespace kvrelay::engine::kvcodec {

// Channels per V quantization group (KIVI per-token groups).
constexpr int kKiviGroup = 32;

int KiviBits(KvDtype d);  // 4, 2, or 0 for non-KIVI dtypes
bool IsKivi(KvDtype d);
int64_t SlabBytes(KvDtype d, int block_tokens, int head_dim);

// IEEE binary16 / bfloat16 conversions, round to nearest even.
uint16_t FloatToHalf(float f);
float HalfToFloat(uint16_t h);
uint16_t FloatToBf16(float f);
float Bf16ToFloat(uint16_t h);

// Non-KIVI dtypes: encodes one token row (head_dim floats) into slot `t`.
void EncodeRow(KvDtype d, uint8_t* slab, int block_tokens, int head_dim, int t, const float* x);
// Any dtype: decodes rows [0, n) into out[n][head_dim]. For KIVI the slab must
// have been produced by QuantizeKivi.
void DecodeRows(KvDtype d, bool is_key, const uint8_t* slab, int block_tokens, int head_dim, int n,
                float* out);

// KIVI: quantizes rows [0, n) of src[block_tokens][head_dim] into the slab (rows
// >= n are encoded as zeros; for keys the per-channel range covers rows < n only).
void QuantizeKivi(KvDtype d, bool is_key, uint8_t* slab, int block_tokens, int head_dim, int n,
                  const float* src);

}  // namespace kvrelay::engine::kvcodec
