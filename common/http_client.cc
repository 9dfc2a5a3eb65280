#include "common/http_client.h"

#include <algorithm>
#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cctype>
#include <chrono>

namespace kvrelay {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

Status FromError(const beast::error_code& ec, const char* what) {
  if (ec == beast::error::timeout) return DeadlineExceeded(std::string(what) + ": timed out");
  return Unavailable(std::string(what) + ": " + ec.message());
}

}  // namespace

Result<HttpUrl> ParseHttpUrl(std::string_view url) {
  constexpr std::string_view kScheme = "http://";
  if (url.substr(0, kScheme.size()) != kScheme) {
    return InvalidArgument("url '" + std::string(url) + "' must start with http://");
  }
  url.remove_prefix(kScheme.size());
  HttpUrl out;
  size_t slash = url.find('/');
  std::string_view hostport = url.substr(0, slash);
  if (slash != std::string_view::npos) out.path = std::string(url.substr(slash));
  while (!out.path.empty() && out.path.back() == '/') out.path.pop_back();
  size_t colon = hostport.rfind(':');
  if (colon == std::string_view::npos) {
    out.host = std::string(hostport);
  } else {
    out.host = std::string(hostport.substr(0, colon));
    std::string port(hostport.substr(colon + 1));
    if (port.empty() || port.size() > 5 || !std::all_of(port.begin(), port.end(), ::isdigit) ||
        std::stoi(port) > 65535 || std::stoi(port) == 0) {
      return InvalidArgument("url has a bad port '" + port + "'");
    }
    out.port = static_cast<uint16_t>(std::stoi(port));
  }
  if (out.host.empty()) return InvalidArgument("url has no host");
  return out;
}

Result<HttpCallResult> HttpCall(const HttpCallSpec& spec,
                                const std::function<bool(std::string_view)>& on_body) {
  net::io_context ioc;
  beast::tcp_stream stream(ioc);
  stream.expires_after(std::chrono::milliseconds(spec.timeout_ms));
  beast::error_code ec;

  tcp::resolver resolver(ioc);
  auto endpoints = resolver.resolve(spec.host, std::to_string(spec.port), ec);
  if (ec) return Unavailable("resolving " + spec.host + ": " + ec.message());
  stream.async_connect(endpoints, [&](beast::error_code e, const tcp::endpoint&) { ec = e; });
  ioc.run();
  if (ec) return FromError(ec, "connect");

  http::request<http::string_body> req;
  req.method_string(spec.method);
  req.target(spec.target);
  req.version(11);
  req.set(http::field::host, spec.host + ":" + std::to_string(spec.port));
  req.set(http::field::user_agent, "kvrelay-client");
  for (const auto& [k, v] : spec.headers) req.set(k, v);
  req.keep_alive(false);
  if (!spec.body.empty() || spec.method == "POST") {
    req.body() = spec.body;
    req.prepare_payload();
  }
  ioc.restart();
  http::async_write(stream, req, [&](beast::error_code e, size_t) { ec = e; });
  ioc.run();
  if (ec) return FromError(ec, "sending the request");

  beast::flat_buffer buffer;
  http::response_parser<http::buffer_body> parser;
  parser.body_limit(spec.max_body_bytes);
  ioc.restart();
  http::async_read_header(stream, buffer, parser, [&](beast::error_code e, size_t) { ec = e; });
  ioc.run();
  if (ec) return FromError(ec, "reading the response header");

  HttpCallResult result;
  result.status = static_cast<int>(parser.get().result_int());
  for (const auto& field : parser.get()) {
    std::string name(field.name_string());
    std::transform(name.begin(), name.end(), name.begin(),
                   [](unsigned char c) { return std::tolower(c); });
    result.headers[name] = std::string(field.value());
  }
  char chunk[16384];
  while (!parser.is_done()) {
    parser.get().body().data = chunk;
    parser.get().body().size = sizeof(chunk);
    ioc.restart();
    // read_some: return as soon as any body bytes arrived (SSE timing).
    http::async_read_some(stream, buffer, parser, [&](beast::error_code e, size_t) { ec = e; });
    ioc.run();
    if (ec == http::error::need_buffer) ec = {};
    if (ec) return FromError(ec, "reading the response body");
    size_t n = sizeof(chunk) - parser.get().body().size;
    if (n == 0) continue;
    std::string_view bytes(chunk, n);
    if (on_body) {
      if (!on_body(bytes)) {
        stream.socket().shutdown(tcp::socket::shutdown_both, ec);
        stream.close();
        return Cancelled("aborted by the caller");
      }
    } else {
      result.body.append(bytes);
    }
  }
  stream.socket().shutdown(tcp::socket::shutdown_both, ec);
  return result;
}

}  // namespace kvrelay
