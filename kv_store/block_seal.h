// BlockSealer: encryption at rest of encoded KV blocks (block_codec.h) in the
// disk tier, so a copied or world-read store is useless without the cluster key.
//
// Sealed format (little-endian), seal version 1:
//   u32 magic 'KVRS' | u16 seal version | u16 flags (0) | u8[12] nonce
//   | ciphertext (exactly the encoded block's size) | u8[16] GCM tag
// Cipher: AES-256-GCM (OpenSSL EVP), a fresh random 96-bit nonce per Seal.
// Key: HKDF-SHA256(IKM = cluster secret, salt = SHA-256(tenant salt),
//                  info = "kvrelay kv_store block key v1"), one key per tenant.
// AAD: the first 8 header bytes (magic, version, flags) and the 32-byte tier
// key the block is stored under, so a block moved to another key, or a header
// rewritten to another version, fails authentication.
//
// The plaintext is the encoded block unchanged: its xxh3 checksum and every
// field check still run after Open (DecodeBlock). Open never returns bytes
// that did not authenticate: another cluster key, another tenant, a moved or
// tampered block is kAuth; a block written before sealing existed (magic
// 'KVRB') is kUnsealed; both are misses, never errors that stop serving.
//
// Thread-safety: const methods may be called concurrently.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>

#include "common/hash.h"
#include "common/status.h"
#include "kv_store/block_codec.h"

struct evp_cipher_st;  // OpenSSL's EVP_CIPHER

namespace kvrelay::kv_store {

inline constexpr uint32_t kSealMagic = 0x5352564B;  // "KVRS" in little-endian byte order
inline constexpr uint16_t kSealVersion = 1;
inline constexpr size_t kSealHeaderBytes = 20;  // magic, version, flags, nonce
inline constexpr size_t kSealNonceBytes = 12;
inline constexpr size_t kSealTagBytes = 16;
inline constexpr size_t kSealOverheadBytes = kSealHeaderBytes + kSealTagBytes;

class BlockSealer {
 public:
  // `cluster_secret` is the cluster key's bytes (protocols::ClusterKey::
  // secret()); InvalidArgument when empty. The secret is copied and wiped
  // when the sealer is destroyed.
  static Result<std::shared_ptr<const BlockSealer>> Create(std::string_view cluster_secret);
  ~BlockSealer();
  BlockSealer(const BlockSealer&) = delete;
  BlockSealer& operator=(const BlockSealer&) = delete;

  // Encrypts `encoded` (an encoded block of tenant `tenant_salt_hash`) for
  // storage under `key`. Internal only when OpenSSL fails (no randomness).
  Result<std::string> Seal(const BlockHash& key, const Sha256Digest& tenant_salt_hash,
                           std::string_view encoded) const;

  // Decrypts `sealed` read from under `key` for tenant `tenant_salt_hash`
  // into `*encoded` (replaced). kNone on success; otherwise the miss reason
  // (kTruncated, kUnsealed, kBadVersion, kAuth) and `*encoded` is empty.
  MissReason Open(const BlockHash& key, const Sha256Digest& tenant_salt_hash,
                  std::string_view sealed, std::string* encoded) const;

  // Open into the caller's memory: the plaintext goes to `out`'s parts in
  // order (e.g. a block's head, then the pool's layers it is restored into),
  // whose sizes must add up to the ciphertext's (else kTruncated, nothing
  // written). On any other miss every byte of `out` is wiped.
  MissReason OpenInto(const BlockHash& key, const Sha256Digest& tenant_salt_hash,
                      std::string_view sealed, std::span<const std::span<uint8_t>> out) const;

  static size_t SealedBytes(size_t encoded_bytes) { return encoded_bytes + kSealOverheadBytes; }

 private:
  explicit BlockSealer(std::string_view secret);
  // The envelope's checks that need no key: kNone and the plaintext's size,
  // or the miss reason.
  static MissReason CheckEnvelope(std::string_view sealed, size_t* plaintext_bytes);
  // The tenant's AES-256 key (HKDF-SHA256, derived once per tenant and kept);
  // false when OpenSSL fails.
  bool TenantKey(const Sha256Digest& tenant_salt_hash, uint8_t out[32]) const;

  std::string secret_;
  // AES-256-GCM, fetched once (OpenSSL 3 looks a cipher up by name at every
  // init otherwise: a lock and hash lookups per block).
  evp_cipher_st* cipher_ = nullptr;
  // Derived tenant keys (a restore opens ~200 blocks of one tenant; HKDF per
  // block cost more than decrypting some of them). At most kMaxTenantKeys,
  // then forgotten at once; wiped when dropped and at destruction.
  static constexpr size_t kMaxTenantKeys = 1024;
  mutable std::mutex keys_mu_;
  mutable std::map<Sha256Digest, std::array<uint8_t, 32>> keys_;
};

}  // namespace kvrelay::kv_store
