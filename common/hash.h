// Hashes used across kvrelay.
//   Sha256: collision-resistant; prefix-block chain hashes and model fingerprints.
//   Xxh3_64: fast, not adversarial; integrity checksums of KV payloads and frames.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace kvrelay {

using Sha256Digest = std::array<uint8_t, 32>;

// Incremental SHA-256 (OpenSSL libcrypto underneath).
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  void Update(const void* data, size_t size);
  void Update(std::string_view s) { Update(s.data(), s.size()); }
  template <typename T>
  void UpdatePod(const T& v) {
    Update(&v, sizeof(T));
  }
  Sha256Digest Finish();

  static Sha256Digest Of(const void* data, size_t size);

 private:
  void* ctx_;  // EVP_MD_CTX*, owned
};

std::string ToHex(std::span<const uint8_t> bytes);

uint64_t Xxh3_64(const void* data, size_t size, uint64_t seed = 0);

// Incremental Xxh3_64: the same value as Xxh3_64 over the concatenation of
// every Update, for data that is not contiguous (a block whose layers lie in
// separate slabs).
class Xxh3Stream {
 public:
  explicit Xxh3Stream(uint64_t seed = 0);
  ~Xxh3Stream();
  Xxh3Stream(const Xxh3Stream&) = delete;
  Xxh3Stream& operator=(const Xxh3Stream&) = delete;

  void Update(const void* data, size_t size);
  uint64_t Digest() const;

 private:
  void* state_;  // XXH3_state_t*, owned
};

}  // namespace kvrelay
