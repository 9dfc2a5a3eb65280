// The cluster secret and the mutual challenge-response every internal port
// (control plane, KV data plane, TP link) runs before anything else is said.
//
// Protocol (one round trip and a half, both sides prove knowledge of the key):
//   initiator -> responder  AuthHello{version, channel, peer_name, nonce_i}
//   responder -> initiator  AuthChallenge{nonce_r}
//   initiator -> responder  AuthProof{mac_i = HMAC(key, "client" | channel | peer_name | nonce_i |
//   nonce_r)} responder -> initiator  AuthProof{mac_r = HMAC(key, "server" | channel | peer_name |
//   nonce_i | nonce_r)}
//                           or AuthProof{error} and a close.
// Both nonces are fresh 32-byte RAND_bytes, so a recorded proof never verifies
// again; the role label keeps a responder's proof from being reflected as an
// initiator's; the channel label keeps a control-plane proof off the KV port.
// The responder reveals nothing (not even a MAC) before the initiator proved
// itself, and an initiator trusts nothing the responder says before mac_r
// verified. MACs are compared in constant time (CRYPTO_memcmp).
//
// The state machines below do no I/O, so the coordinator's event-driven
// control server, the blocking worker client, the KV data plane's raw reader
// and the TP link all run the same code (and it can be fuzzed alone).
// Thread-compatible: one object per connection.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"
#include "protocols/frame_codec.h"

namespace kvrelay::protocols {

inline constexpr uint32_t kAuthVersion = 1;
inline constexpr size_t kAuthNonceBytes = 32;
inline constexpr size_t kMinClusterKeyBytes = 32;
// Frames a connection may receive before it authenticated are at most this
// large (the auth messages are < 200 bytes): an unauthenticated sender can
// never make a receiver buffer more.
inline constexpr uint32_t kMaxUnauthenticatedPayload = 1024;

inline constexpr std::string_view kAuthChannelControl = "control";
inline constexpr std::string_view kAuthChannelKv = "kv";
inline constexpr std::string_view kAuthChannelTp = "tp";

// The shared cluster secret. Copyable; never logged.
class ClusterKey {
 public:
  ClusterKey() = default;
  // Reads a key file: its bytes with surrounding whitespace trimmed, at least
  // kMinClusterKeyBytes of them. Refuses a file others can read or write
  // (mode & 007), naming the path and the mode to set.
  static Result<ClusterKey> LoadFile(const std::string& path);
  // A secret given directly (tests, Kubernetes env); at least kMinClusterKeyBytes.
  static Result<ClusterKey> FromSecret(std::string secret);
  // 32 random bytes, hex encoded (64 characters).
  static Result<ClusterKey> Generate();
  // Writes a fresh key (Generate) to `path`, created with mode 0600; refuses
  // to overwrite an existing file.
  static Status GenerateFile(const std::string& path);

  bool empty() const { return secret_.empty(); }
  const std::string& secret() const { return secret_; }

 private:
  explicit ClusterKey(std::string secret) : secret_(std::move(secret)) {}
  std::string secret_;
};

// The side that connects.
class AuthInitiator {
 public:
  AuthInitiator(const ClusterKey& key, std::string_view channel, std::string peer_name);
  // The AuthHello payload (frame type kAuthHello). Internal if no randomness.
  Result<std::string> Hello();
  // Takes the responder's kAuthChallenge frame; returns the kAuthProof payload to send.
  Result<std::string> OnChallenge(const Frame& frame);
  // Takes the responder's kAuthProof frame. Ok once the responder proved the
  // key; FailedPrecondition ("authentication failed: ...") naming the likely
  // cause otherwise.
  Status OnResult(const Frame& frame);
  bool authenticated() const { return state_ == State::kDone; }

 private:
  enum class State { kStart, kSentHello, kSentProof, kDone, kFailed };
  Status Fail(Status s);
  std::string key_;
  std::string channel_;
  std::string name_;
  std::string nonce_i_, nonce_r_;
  State state_ = State::kStart;
};

// The side that accepts.
class AuthResponder {
 public:
  AuthResponder(const ClusterKey& key, std::string_view channel);
  // Takes the initiator's kAuthHello frame; returns the kAuthChallenge payload.
  Result<std::string> OnHello(const Frame& frame);
  // Takes the initiator's kAuthProof frame. On success returns this side's
  // kAuthProof payload (send it; the peer is then authenticated as
  // peer_name()). On failure returns FailedPrecondition; RefusalPayload() is
  // the kAuthProof to send before closing.
  Result<std::string> OnProof(const Frame& frame);
  static std::string RefusalPayload(std::string_view why);
  bool authenticated() const { return state_ == State::kDone; }
  // The name the initiator proved under the key (valid once authenticated).
  const std::string& peer_name() const { return name_; }

 private:
  enum class State { kStart, kSentChallenge, kDone, kFailed };
  Status Fail(Status s);
  std::string key_;
  std::string channel_;
  std::string name_;
  std::string nonce_i_, nonce_r_;
  State state_ = State::kStart;
};

// HMAC-SHA256(key, role | channel | name | nonce_i | nonce_r), each field
// length-prefixed. Exposed for tests.
std::string AuthMac(std::string_view key, std::string_view role, std::string_view channel,
                    std::string_view name, std::string_view nonce_i, std::string_view nonce_r);

}  // namespace kvrelay::protocols
