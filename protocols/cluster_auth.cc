#include "protocols/cluster_auth.h"

#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "common/hash.h"
#include "protocols/control.pb.h"
#include "protocols/messages.h"

namespace kvrelay::protocols {
namespace {

constexpr std::string_view kMacDomain = "kvrelay-cluster-auth/1";
constexpr std::string_view kRoleInitiator = "client";
constexpr std::string_view kRoleResponder = "server";
constexpr size_t kMacBytes = 32;
constexpr size_t kMaxPeerName = 256;

Status AuthFailed(const std::string& why) {
  return FailedPrecondition("authentication failed: " + why);
}

Result<std::string> Nonce() {
  std::string n(kAuthNonceBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(n.data()), static_cast<int>(n.size())) != 1) {
    return Internal("RAND_bytes failed: no randomness for an authentication nonce");
  }
  return n;
}

void AppendField(std::string* out, std::string_view field) {
  const uint32_t n = static_cast<uint32_t>(field.size());
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>(n >> (8 * i)));
  out->append(field);
}

bool MacEqual(std::string_view got, const std::string& want) {
  return got.size() == want.size() && CRYPTO_memcmp(got.data(), want.data(), want.size()) == 0;
}

std::string Trim(std::string s) {
  const char* ws = " \t\r\n";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string::npos) return {};
  const size_t e = s.find_last_not_of(ws);
  return s.substr(b, e - b + 1);
}

template <typename Message>
std::string Serialize(const Message& m) {
  std::string out;
  m.SerializeToString(&out);
  return out;
}

}  // namespace

std::string AuthMac(std::string_view key, std::string_view role, std::string_view channel,
                    std::string_view name, std::string_view nonce_i, std::string_view nonce_r) {
  std::string msg;
  AppendField(&msg, kMacDomain);
  AppendField(&msg, role);
  AppendField(&msg, channel);
  AppendField(&msg, name);
  AppendField(&msg, nonce_i);
  AppendField(&msg, nonce_r);
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), mac, &len);
  OPENSSL_cleanse(msg.data(), msg.size());
  return std::string(reinterpret_cast<const char*>(mac), len);
}

// --- ClusterKey ----------------------------------------------------------------

Result<ClusterKey> ClusterKey::FromSecret(std::string secret) {
  if (secret.size() < kMinClusterKeyBytes) {
    return InvalidArgument("cluster key has " + std::to_string(secret.size()) +
                           " bytes, needs at least " + std::to_string(kMinClusterKeyBytes) +
                           " (generate one with: openssl rand -hex 32)");
  }
  return ClusterKey(std::move(secret));
}

Result<ClusterKey> ClusterKey::LoadFile(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return NotFound("cluster key file '" + path + "': " + std::strerror(errno));
  }
  if (!S_ISREG(st.st_mode)) {
    return InvalidArgument("cluster key file '" + path + "' is not a regular file");
  }
  if ((st.st_mode & 007) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%03o", static_cast<unsigned>(st.st_mode & 0777));
    return FailedPrecondition("cluster key file '" + path + "' has mode " + mode +
                              ": other users can read or write it (chmod 600 '" + path + "')");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound("cannot open cluster key file '" + path + "'");
  std::ostringstream buf;
  buf << in.rdbuf();
  auto key = FromSecret(Trim(buf.str()));
  if (!key.ok()) return key.status().WithContext("cluster key file '" + path + "'");
  return key;
}

Result<ClusterKey> ClusterKey::Generate() {
  ASSIGN_OR_RETURN(std::string raw, Nonce());
  std::string hex =
      ToHex(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(raw.data()), raw.size()));
  OPENSSL_cleanse(raw.data(), raw.size());
  return ClusterKey(std::move(hex));
}

Status ClusterKey::GenerateFile(const std::string& path) {
  ASSIGN_OR_RETURN(ClusterKey key, Generate());
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    return Unavailable("cannot create cluster key file '" + path + "': " + std::strerror(errno));
  }
  const std::string line = key.secret() + "\n";
  const ssize_t n = ::write(fd, line.data(), line.size());
  const bool ok = n == static_cast<ssize_t>(line.size()) && ::fsync(fd) == 0;
  ::close(fd);
  if (!ok) return Unavailable("writing cluster key file '" + path + "' failed");
  return Status::Ok();
}

// --- AuthInitiator -------------------------------------------------------------

AuthInitiator::AuthInitiator(const ClusterKey& key, std::string_view channel, std::string peer_name)
    : key_(key.secret()), channel_(channel), name_(std::move(peer_name)) {}

Status AuthInitiator::Fail(Status s) {
  state_ = State::kFailed;
  return s;
}

Result<std::string> AuthInitiator::Hello() {
  if (state_ != State::kStart) return Fail(Internal("AuthInitiator::Hello called twice"));
  if (key_.empty()) return Fail(FailedPrecondition("no cluster key configured"));
  ASSIGN_OR_RETURN(nonce_i_, Nonce());
  proto::AuthHello hello;
  hello.set_version(kAuthVersion);
  hello.set_channel(channel_);
  hello.set_peer_name(name_);
  hello.set_nonce(nonce_i_);
  state_ = State::kSentHello;
  return Serialize(hello);
}

Result<std::string> AuthInitiator::OnChallenge(const Frame& frame) {
  if (state_ != State::kSentHello) return Fail(Internal("unexpected authentication challenge"));
  if (frame.type == static_cast<uint16_t>(MessageType::kAuthProof)) {
    // Refused before the challenge (e.g. bad hello, wrong channel).
    proto::AuthProof refusal;
    (void)refusal.ParseFromString(frame.payload);
    return Fail(AuthFailed("peer refused the hello: " + refusal.error()));
  }
  proto::AuthChallenge challenge;
  Status s = DecodeMessage(frame, MessageType::kAuthChallenge, &challenge);
  if (!s.ok()) {
    return Fail(AuthFailed("expected an authentication challenge (is the peer a kvrelay " +
                           channel_ + " port of a build with cluster keys?): " + s.message()));
  }
  if (challenge.nonce().size() != kAuthNonceBytes) {
    return Fail(AuthFailed("challenge nonce has " + std::to_string(challenge.nonce().size()) +
                           " bytes, expected " + std::to_string(kAuthNonceBytes)));
  }
  nonce_r_ = challenge.nonce();
  proto::AuthProof proof;
  proof.set_mac(AuthMac(key_, kRoleInitiator, channel_, name_, nonce_i_, nonce_r_));
  state_ = State::kSentProof;
  return Serialize(proof);
}

Status AuthInitiator::OnResult(const Frame& frame) {
  if (state_ != State::kSentProof) return Fail(Internal("unexpected authentication result"));
  proto::AuthProof proof;
  Status s = DecodeMessage(frame, MessageType::kAuthProof, &proof);
  if (!s.ok()) return Fail(AuthFailed("expected the peer's proof: " + s.message()));
  if (proof.mac().empty()) {
    return Fail(AuthFailed("the peer refused our proof (" + proof.error() +
                           "): is --cluster-key-file the same file the peer uses?"));
  }
  const std::string want = AuthMac(key_, kRoleResponder, channel_, name_, nonce_i_, nonce_r_);
  if (!MacEqual(proof.mac(), want)) {
    return Fail(
        AuthFailed("the peer's proof does not match our cluster key: it holds a "
                   "different key, or is not a cluster member"));
  }
  state_ = State::kDone;
  return Status::Ok();
}

// --- AuthResponder -------------------------------------------------------------

AuthResponder::AuthResponder(const ClusterKey& key, std::string_view channel)
    : key_(key.secret()), channel_(channel) {}

Status AuthResponder::Fail(Status s) {
  state_ = State::kFailed;
  return s;
}

std::string AuthResponder::RefusalPayload(std::string_view why) {
  proto::AuthProof refusal;
  refusal.set_error(std::string(why));
  return Serialize(refusal);
}

Result<std::string> AuthResponder::OnHello(const Frame& frame) {
  if (state_ != State::kStart) return Fail(AuthFailed("a second hello"));
  if (key_.empty()) return Fail(FailedPrecondition("no cluster key configured"));
  proto::AuthHello hello;
  Status s = DecodeMessage(frame, MessageType::kAuthHello, &hello);
  if (!s.ok())
    return Fail(AuthFailed("first frame is not an authentication hello: " + s.message()));
  if (hello.version() != kAuthVersion) {
    return Fail(AuthFailed("authentication version " + std::to_string(hello.version()) +
                           ", this build speaks " + std::to_string(kAuthVersion)));
  }
  if (hello.channel() != channel_) {
    return Fail(AuthFailed("hello for channel '" + hello.channel().substr(0, 32) + "' on the " +
                           channel_ + " port"));
  }
  if (hello.nonce().size() != kAuthNonceBytes) {
    return Fail(AuthFailed("hello nonce has " + std::to_string(hello.nonce().size()) + " bytes"));
  }
  if (hello.peer_name().size() > kMaxPeerName) return Fail(AuthFailed("peer name too long"));
  name_ = hello.peer_name();
  nonce_i_ = hello.nonce();
  ASSIGN_OR_RETURN(nonce_r_, Nonce());
  proto::AuthChallenge challenge;
  challenge.set_nonce(nonce_r_);
  state_ = State::kSentChallenge;
  return Serialize(challenge);
}

Result<std::string> AuthResponder::OnProof(const Frame& frame) {
  if (state_ != State::kSentChallenge) return Fail(AuthFailed("proof out of order"));
  proto::AuthProof proof;
  Status s = DecodeMessage(frame, MessageType::kAuthProof, &proof);
  if (!s.ok()) return Fail(AuthFailed("expected the peer's proof: " + s.message()));
  const std::string want = AuthMac(key_, kRoleInitiator, channel_, name_, nonce_i_, nonce_r_);
  if (!MacEqual(proof.mac(), want)) {
    return Fail(AuthFailed("peer '" + name_.substr(0, 64) +
                           "' does not hold the cluster key (proof mismatch)"));
  }
  proto::AuthProof mine;
  mine.set_mac(AuthMac(key_, kRoleResponder, channel_, name_, nonce_i_, nonce_r_));
  state_ = State::kDone;
  return Serialize(mine);
}

}  // namespace kvrelay::protocols
