#include "protocols/tls.h"

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <sys/stat.h>

#include <boost/asio/ssl/context.hpp>

namespace kvrelay::protocols {
namespace asio = boost::asio;

namespace {

Status BadFile(const char* flag, const std::string& path, const std::string& why) {
  return InvalidArgument(std::string("--") + flag + " " + path + ": " + why);
}

}  // namespace

TlsContext::TlsContext()
    : context_(std::make_unique<asio::ssl::context>(asio::ssl::context::tls)) {}

TlsContext::~TlsContext() = default;

Result<std::shared_ptr<TlsContext>> TlsContext::Create(const TlsOptions& options) {
  if (options.cert_file.empty() || options.key_file.empty() || options.ca_file.empty()) {
    return InvalidArgument(std::string("control-plane TLS needs all of --") + kControlTlsCertFlag +
                           ", --" + kControlTlsKeyFlag + " and --" + kControlTlsCaFlag +
                           " (scripts/make-cluster-certs.sh makes them)");
  }
  struct stat st {};
  if (::stat(options.key_file.c_str(), &st) == 0 && (st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%03o", static_cast<unsigned>(st.st_mode & 0777));
    return BadFile(
        kControlTlsKeyFlag, options.key_file,
        std::string("the private key is readable by others (mode ") + mode + "); chmod 600 it");
  }
  std::shared_ptr<TlsContext> t(new TlsContext());
  asio::ssl::context& ctx = *t->context_;
  SSL_CTX* native = ctx.native_handle();
  // TLS 1.3 only: every peer is ours, so there is no old client to serve.
  if (SSL_CTX_set_min_proto_version(native, TLS1_3_VERSION) != 1) {
    return Internal("TLS: cannot require TLS 1.3");
  }
  ctx.set_options(asio::ssl::context::default_workarounds | asio::ssl::context::no_compression |
                  asio::ssl::context::single_dh_use);
  boost::system::error_code ec;
  ctx.use_certificate_chain_file(options.cert_file, ec);
  if (ec) return BadFile(kControlTlsCertFlag, options.cert_file, ec.message());
  ctx.use_private_key_file(options.key_file, asio::ssl::context::pem, ec);
  if (ec) return BadFile(kControlTlsKeyFlag, options.key_file, ec.message());
  if (SSL_CTX_check_private_key(native) != 1) {
    ERR_clear_error();
    return BadFile(kControlTlsKeyFlag, options.key_file,
                   "does not match the certificate in " + options.cert_file);
  }
  ctx.load_verify_file(options.ca_file, ec);
  if (ec) return BadFile(kControlTlsCaFlag, options.ca_file, ec.message());
  // Both sides must present a certificate the CA signed (mutual TLS); on the
  // client side verify_fail_if_no_peer_cert is ignored (a server always sends one).
  ctx.set_verify_mode(asio::ssl::verify_peer | asio::ssl::verify_fail_if_no_peer_cert, ec);
  if (ec) return Internal("TLS: set_verify_mode: " + ec.message());
  return t;
}

}  // namespace kvrelay::protocols
