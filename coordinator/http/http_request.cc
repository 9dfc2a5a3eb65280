#include "coordinator/http/http_request.h"

#include <boost/beast/core/string.hpp>
#include <boost/beast/http/error.hpp>
#include <string>

namespace kvrelay::coordinator {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

bool IEquals(std::string_view a, std::string_view b) {
  return beast::iequals(beast::string_view(a.data(), a.size()),
                        beast::string_view(b.data(), b.size()));
}

bool IsParseError(const beast::error_code& ec) {
  return ec.category() == http::make_error_code(http::error::bad_method).category() &&
         ec != http::error::end_of_stream && ec != http::error::partial_message;
}

}  // namespace

void ConfigureRequestParser(const RequestLimits& limits, RequestParser* parser) {
  parser->body_limit(limits.max_body_bytes);
  parser->header_limit(static_cast<uint32_t>(limits.max_header_bytes));
}

std::optional<HttpError> CheckRequestHeader(const RequestHeader& h) {
  // RFC 9112 §3.2: a 1.1 request has exactly one Host.
  const auto hosts = h.count(http::field::host);
  if (h.version() >= 11 && hosts != 1) {
    return MalformedRequest(hosts == 0 ? "missing Host header" : "more than one Host header");
  }
  // RFC 9112 §6.1: only "chunked" is understood here.
  const auto codings = h.count(http::field::transfer_encoding);
  if (codings > 0) {
    if (h.version() < 11) return MalformedRequest("Transfer-Encoding in an HTTP/1.0 request");
    if (codings > 1) return MalformedRequest("more than one Transfer-Encoding header");
    auto te = h.find(http::field::transfer_encoding);
    std::string_view v(te->value().data(), te->value().size());
    if (!IEquals(Trim(v), "chunked")) {
      return MalformedRequest("unsupported Transfer-Encoding '" + std::string(v) +
                              "': only 'chunked' is accepted");
    }
  }
  auto expect = h.find(http::field::expect);
  if (expect != h.end() && h.version() >= 11) {
    std::string_view v(expect->value().data(), expect->value().size());
    if (!IEquals(Trim(v), "100-continue")) {
      HttpError e;
      e.api.http_status = 417;
      e.api.message = "unsupported Expect: " + std::string(v);
      e.api.code = "expectation_failed";
      e.close = true;
      return e;
    }
  }
  return std::nullopt;
}

bool WantsContinue(const RequestHeader& h) {
  return h.version() >= 11 && h.find(http::field::expect) != h.end();
}

std::optional<HttpError> ReadError(const beast::error_code& ec, const RequestLimits& limits) {
  HttpError e;
  e.close = true;
  if (ec == http::error::body_limit) {
    e.api.http_status = 413;
    e.api.message = "request body exceeds " + std::to_string(limits.max_body_bytes) + " bytes";
    e.api.code = "request_too_large";
    return e;
  }
  if (ec == http::error::header_limit) {
    e.api.http_status = 431;
    e.api.message = "request headers exceed " + std::to_string(limits.max_header_bytes) + " bytes";
    e.api.code = "headers_too_large";
    return e;
  }
  if (IsParseError(ec)) return MalformedRequest("malformed HTTP request: " + ec.message());
  return std::nullopt;
}

std::string_view RequestPath(std::string_view target) {
  if (target.starts_with("http://") || target.starts_with("https://")) {
    size_t start = target.find("//") + 2;
    size_t slash = target.find('/', start);
    target = slash == std::string_view::npos ? std::string_view("/") : target.substr(slash);
  }
  if (size_t q = target.find('?'); q != std::string_view::npos) target = target.substr(0, q);
  return target;
}

std::optional<Endpoint> CompletionEndpoint(std::string_view path) {
  if (path == "/v1/chat/completions") return Endpoint::kChatCompletions;
  if (path == "/v1/completions") return Endpoint::kCompletions;
  return std::nullopt;
}

}  // namespace kvrelay::coordinator
