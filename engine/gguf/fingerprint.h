// Model fingerprint: identifies the exact weights and architecture of a GGUF
// model, so KV blocks computed by one model are never reused by another.
#pragma once

#include <array>
#include <cstdint>

#include "engine/gguf/gguf.h"

namespace kvrelay::engine {

// SHA-256 over, in this order: a version tag; general.architecture and every
// metadata entry whose key starts with "<architecture>." (key, type and encoded
// value, in key order); the tensor table sorted by name (name, ggml type id,
// dims); and every tensor's bytes in the same order. Tokenizer and descriptive
// metadata (general.name, license, ...) do not take part: they do not change
// the KV values a token sequence produces. Independent of the order of
// metadata entries and tensors in the file and of the alignment padding.
// Reads every tensor byte (about 0.3 s per 100 MB). Thread-safe.
std::array<uint8_t, 32> ComputeModelFingerprint(const GgufFile& file);

}  // namespace kvrelay::engine
