// Optional TLS for the control plane (links that cross machines).
//
// Mutual TLS 1.3 over Boost.Asio SSL (OpenSSL): each side presents the
// certificate in `cert_file` (with its private key `key_file`) and verifies
// the peer's against the cluster CA in `ca_file`; a peer without a
// certificate, or with one the CA did not sign, fails the handshake. Host
// names are not checked: the CA is the cluster's own (scripts/make-cluster-
// certs.sh makes one), so any certificate it signed is a cluster member, and
// the cluster-key challenge-response (protocols/cluster_auth.h) still runs
// inside the TLS session (defence in depth: a leaked certificate alone does
// not let anyone join, nor does a leaked key alone on a TLS port).
//
// TLS protects the bytes on the wire (confidentiality and integrity); the
// HMAC handshake alone only authenticates. A FramedConnection with
// ConnectionOptions::tls set runs the TLS handshake before its first frame.
#pragma once

#include <memory>
#include <string>

#include "common/status.h"

namespace boost::asio::ssl {
class context;
}

namespace kvrelay::protocols {

struct TlsOptions {
  std::string cert_file;  // PEM certificate chain this side presents
  std::string key_file;   // PEM private key of cert_file
  std::string ca_file;    // PEM CA certificate(s) the peer's certificate must chain to
  // All three set: TLS on. None set: TLS off. Anything else is refused by Create.
  bool enabled() const { return !cert_file.empty() || !key_file.empty() || !ca_file.empty(); }
};

// An OpenSSL context shared by every connection of one side (thread-safe
// once created: OpenSSL's SSL_CTX may be used by many SSL objects at once).
class TlsContext {
 public:
  // Loads and checks the files (the key must match the certificate); TLS 1.3
  // only, peer verification required. InvalidArgument naming the flag and the
  // file when one is missing, unreadable or does not parse.
  static Result<std::shared_ptr<TlsContext>> Create(const TlsOptions& options);
  ~TlsContext();
  TlsContext(const TlsContext&) = delete;
  TlsContext& operator=(const TlsContext&) = delete;

  boost::asio::ssl::context& context() { return *context_; }

 private:
  TlsContext();
  std::unique_ptr<boost::asio::ssl::context> context_;
};

// The TLS flags' names, shared by every binary that takes them.
inline constexpr const char* kControlTlsCertFlag = "control-tls-cert";
inline constexpr const char* kControlTlsKeyFlag = "control-tls-key";
inline constexpr const char* kControlTlsCaFlag = "control-tls-ca";

}  // namespace kvrelay::protocols
