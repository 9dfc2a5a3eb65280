// A small blocking HTTP/1.1 client (Boost.Beast) for the load generator and
// tests: one request per connection, deadline on the whole exchange, body
// delivered incrementally (chunked encoding decoded) so SSE can be timed.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvrelay {

struct HttpUrl {
  std::string host;
  uint16_t port = 80;
  std::string path;  // without a trailing '/', "" for the root
};
// "http://host:port[/path]"; https is not supported (InvalidArgument).
Result<HttpUrl> ParseHttpUrl(std::string_view url);

struct HttpCallSpec {
  std::string method = "GET";
  std::string host = "127.0.0.1";
  uint16_t port = 80;
  std::string target = "/";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
  int timeout_ms = 60'000;  // connect + request + whole response
  size_t max_body_bytes = 64 << 20;
};

struct HttpCallResult {
  int status = 0;
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string body;                            // empty when on_body consumed it
};

// Runs one request. `on_body` (optional) receives body bytes as they arrive and
// may return false to abort (the connection is closed; the call returns
// Cancelled); without it the body is collected in the result.
Result<HttpCallResult> HttpCall(const HttpCallSpec& spec,
                                const std::function<bool(std::string_view)>& on_body = {});

}  // namespace kvrelay
