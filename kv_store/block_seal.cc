#include "kv_store/block_seal.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/kdf.h>
#include <openssl/rand.h>

#include <bit>
#include <climits>
#include <cstring>

namespace kvrelay::kv_store {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the seal header is written in host order and assumes little-endian hosts");

constexpr char kKeyInfo[] = "kvrelay kv_store block key v1";
constexpr size_t kAadPrefixBytes = 8;  // magic, version, flags

struct CipherCtx {
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  ~CipherCtx() { EVP_CIPHER_CTX_free(ctx); }
};

// The bytes authenticated beside the ciphertext: header prefix and tier key.
void MakeAad(const char* header, const BlockHash& key, uint8_t out[kAadPrefixBytes + 32]) {
  std::memcpy(out, header, kAadPrefixBytes);
  std::memcpy(out + kAadPrefixBytes, key.data(), key.size());
}

}  // namespace

BlockSealer::BlockSealer(std::string_view secret) : secret_(secret) {}

BlockSealer::~BlockSealer() {
  if (!secret_.empty()) OPENSSL_cleanse(secret_.data(), secret_.size());
  for (auto& [tenant, key] : keys_) OPENSSL_cleanse(key.data(), key.size());
  EVP_CIPHER_free(cipher_);
}

Result<std::shared_ptr<const BlockSealer>> BlockSealer::Create(std::string_view cluster_secret) {
  if (cluster_secret.empty()) {
    return InvalidArgument("BlockSealer: the cluster secret is empty (--cluster-key-file)");
  }
  std::shared_ptr<BlockSealer> sealer(new BlockSealer(cluster_secret));
  sealer->cipher_ = EVP_CIPHER_fetch(nullptr, "AES-256-GCM", nullptr);
  if (sealer->cipher_ == nullptr) {
    return Internal("BlockSealer: OpenSSL has no AES-256-GCM");
  }
  return std::shared_ptr<const BlockSealer>(std::move(sealer));
}

bool BlockSealer::TenantKey(const Sha256Digest& tenant_salt_hash, uint8_t out[32]) const {
  {
    std::lock_guard<std::mutex> lock(keys_mu_);
    auto it = keys_.find(tenant_salt_hash);
    if (it != keys_.end()) {
      std::memcpy(out, it->second.data(), 32);
      return true;
    }
  }
  EVP_PKEY_CTX* ctx = EVP_PKEY_CTX_new_id(EVP_PKEY_HKDF, nullptr);
  if (ctx == nullptr) return false;
  size_t len = 32;
  const bool ok =
      EVP_PKEY_derive_init(ctx) == 1 && EVP_PKEY_CTX_set_hkdf_md(ctx, EVP_sha256()) == 1 &&
      EVP_PKEY_CTX_set1_hkdf_salt(ctx, tenant_salt_hash.data(),
                                  static_cast<int>(tenant_salt_hash.size())) == 1 &&
      EVP_PKEY_CTX_set1_hkdf_key(ctx, reinterpret_cast<const unsigned char*>(secret_.data()),
                                 static_cast<int>(secret_.size())) == 1 &&
      EVP_PKEY_CTX_add1_hkdf_info(ctx, reinterpret_cast<const unsigned char*>(kKeyInfo),
                                  static_cast<int>(sizeof(kKeyInfo) - 1)) == 1 &&
      EVP_PKEY_derive(ctx, out, &len) == 1 && len == 32;
  EVP_PKEY_CTX_free(ctx);
  if (!ok) return false;
  std::lock_guard<std::mutex> lock(keys_mu_);
  if (keys_.size() >= kMaxTenantKeys) {
    for (auto& [tenant, key] : keys_) OPENSSL_cleanse(key.data(), key.size());
    keys_.clear();
  }
  std::memcpy(keys_[tenant_salt_hash].data(), out, 32);
  return true;
}

Result<std::string> BlockSealer::Seal(const BlockHash& key, const Sha256Digest& tenant_salt_hash,
                                      std::string_view encoded) const {
  if (encoded.size() > static_cast<size_t>(INT_MAX)) {
    return InvalidArgument("BlockSealer::Seal: block of " + std::to_string(encoded.size()) +
                           " bytes is too large");
  }
  std::string out(SealedBytes(encoded.size()), '\0');
  char* p = out.data();
  const uint32_t magic = kSealMagic;
  const uint16_t version = kSealVersion;
  const uint16_t flags = 0;
  std::memcpy(p, &magic, 4);
  std::memcpy(p + 4, &version, 2);
  std::memcpy(p + 6, &flags, 2);
  auto* nonce = reinterpret_cast<unsigned char*>(p + kAadPrefixBytes);
  if (RAND_bytes(nonce, static_cast<int>(kSealNonceBytes)) != 1) {
    return Internal("BlockSealer::Seal: RAND_bytes failed (no randomness for a nonce)");
  }
  uint8_t tenant_key[32];
  if (!TenantKey(tenant_salt_hash, tenant_key)) {
    return Internal("BlockSealer::Seal: HKDF-SHA256 failed");
  }
  uint8_t aad[kAadPrefixBytes + 32];
  MakeAad(p, key, aad);
  CipherCtx c;
  auto* ct = reinterpret_cast<unsigned char*>(p + kSealHeaderBytes);
  int n = 0, tail = 0;
  const bool ok =
      c.ctx != nullptr && EVP_EncryptInit_ex(c.ctx, cipher_, nullptr, tenant_key, nonce) == 1 &&
      EVP_EncryptUpdate(c.ctx, nullptr, &n, aad, sizeof(aad)) == 1 &&
      EVP_EncryptUpdate(c.ctx, ct, &n, reinterpret_cast<const unsigned char*>(encoded.data()),
                        static_cast<int>(encoded.size())) == 1 &&
      EVP_EncryptFinal_ex(c.ctx, ct + n, &tail) == 1 &&
      EVP_CIPHER_CTX_ctrl(c.ctx, EVP_CTRL_GCM_GET_TAG, static_cast<int>(kSealTagBytes),
                          p + kSealHeaderBytes + encoded.size()) == 1;
  OPENSSL_cleanse(tenant_key, sizeof(tenant_key));
  if (!ok) return Internal("BlockSealer::Seal: AES-256-GCM encryption failed");
  return out;
}

MissReason BlockSealer::CheckEnvelope(std::string_view sealed, size_t* plaintext_bytes) {
  *plaintext_bytes = 0;
  if (sealed.size() < 4) return MissReason::kTruncated;
  const char* p = sealed.data();
  uint32_t magic;
  std::memcpy(&magic, p, 4);
  if (magic == kBlockMagic) return MissReason::kUnsealed;
  if (magic != kSealMagic) return MissReason::kBadMagic;
  if (sealed.size() < kSealOverheadBytes) return MissReason::kTruncated;
  uint16_t version, flags;
  std::memcpy(&version, p + 4, 2);
  std::memcpy(&flags, p + 6, 2);
  if (version != kSealVersion || flags != 0) return MissReason::kBadVersion;
  const size_t ct_bytes = sealed.size() - kSealOverheadBytes;
  if (ct_bytes > static_cast<size_t>(INT_MAX)) return MissReason::kTruncated;
  *plaintext_bytes = ct_bytes;
  return MissReason::kNone;
}

MissReason BlockSealer::Open(const BlockHash& key, const Sha256Digest& tenant_salt_hash,
                             std::string_view sealed, std::string* encoded) const {
  encoded->clear();
  size_t bytes = 0;
  if (const MissReason r = CheckEnvelope(sealed, &bytes); r != MissReason::kNone) return r;
  std::string out(bytes, '\0');
  const auto whole = std::span<uint8_t>(reinterpret_cast<uint8_t*>(out.data()), out.size());
  if (const MissReason r = OpenInto(key, tenant_salt_hash, sealed, std::span(&whole, 1));
      r != MissReason::kNone) {
    return r;
  }
  *encoded = std::move(out);
  return MissReason::kNone;
}

MissReason BlockSealer::OpenInto(const BlockHash& key, const Sha256Digest& tenant_salt_hash,
                                 std::string_view sealed,
                                 std::span<const std::span<uint8_t>> out) const {
  size_t ct_bytes = 0;
  if (const MissReason r = CheckEnvelope(sealed, &ct_bytes); r != MissReason::kNone) return r;
  size_t out_bytes = 0;
  for (std::span<uint8_t> part : out) out_bytes += part.size();
  if (out_bytes != ct_bytes) return MissReason::kTruncated;
  const char* p = sealed.data();
  uint8_t tenant_key[32];
  if (!TenantKey(tenant_salt_hash, tenant_key)) return MissReason::kAuth;
  uint8_t aad[kAadPrefixBytes + 32];
  MakeAad(p, key, aad);
  // The GCM tag is set before the final call; OpenSSL takes a non-const pointer.
  unsigned char tag[kSealTagBytes];
  std::memcpy(tag, p + kSealHeaderBytes + ct_bytes, kSealTagBytes);
  unsigned char final_out[kSealTagBytes];  // GCM's final writes nothing
  CipherCtx c;
  int n = 0, tail = 0;
  bool ok = c.ctx != nullptr &&
            EVP_DecryptInit_ex(c.ctx, cipher_, nullptr, tenant_key,
                               reinterpret_cast<const unsigned char*>(p + kAadPrefixBytes)) == 1 &&
            EVP_DecryptUpdate(c.ctx, nullptr, &n, aad, sizeof(aad)) == 1;
  // GCM is a stream mode: each part's plaintext is exactly its ciphertext's length.
  const auto* ct = reinterpret_cast<const unsigned char*>(p + kSealHeaderBytes);
  for (size_t i = 0; ok && i < out.size(); ++i) {
    ok = EVP_DecryptUpdate(c.ctx, out[i].data(), &n, ct, static_cast<int>(out[i].size())) == 1 &&
         static_cast<size_t>(n) == out[i].size();
    ct += out[i].size();
  }
  ok =
      ok &&
      EVP_CIPHER_CTX_ctrl(c.ctx, EVP_CTRL_GCM_SET_TAG, static_cast<int>(kSealTagBytes), tag) == 1 &&
      EVP_DecryptFinal_ex(c.ctx, final_out, &tail) == 1;
  OPENSSL_cleanse(tenant_key, sizeof(tenant_key));
  if (!ok) {
    // Never hand out bytes that did not authenticate.
    for (std::span<uint8_t> part : out) OPENSSL_cleanse(part.data(), part.size());
    return MissReason::kAuth;
  }
  return MissReason::kNone;
}

}  // namespace kvrelay::kv_store
