// The request side of the coordinator's HTTP edge: the limits its parser
// enforces, the framing checks RFC 9112 asks of a server once the header is
// in, the answer to a failed read, and the routing of a request target.
// Session (session.cc) reads requests with these; the fuzz target
// tests/fuzz/http_request_fuzz.cc runs the same functions over the same
// Beast parser, so what it finds is the server's behaviour, not a copy's.
//
// Pure functions; no I/O, thread-safe.
#pragma once

#include <boost/beast/core/error.hpp>
#include <boost/beast/http/message.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/string_body.hpp>
#include <cstddef>
#include <optional>
#include <string_view>

#include "coordinator/http/http_errors.h"
#include "coordinator/openai/openai_api.h"

namespace kvrelay::coordinator {

// The parser of one request (a fresh one per request on a connection).
using RequestParser = boost::beast::http::request_parser<boost::beast::http::string_body>;
using RequestHeader = boost::beast::http::request_header<>;

struct RequestLimits {
  size_t max_body_bytes = 1 << 20;     // a larger body fails the read with body_limit (413)
  size_t max_header_bytes = 16 << 10;  // larger headers fail it with header_limit (431)
};

// Sets the limits on a fresh parser (before any byte is put into it).
void ConfigureRequestParser(const RequestLimits& limits, RequestParser* parser);

// The header's checks, in the order the server answers them: one Host in a
// 1.1 request; Transfer-Encoding only in 1.1, at most once and exactly
// "chunked" (anything else leaves the body's length unknown, and reading on
// would parse the body as the next request); Expect only "100-continue".
// Returns the error to answer (and close after), or nullopt to read the body.
std::optional<HttpError> CheckRequestHeader(const RequestHeader& header);

// Whether the client waits for "100 Continue" before sending the body
// (RFC 9110 §10.1.1); only asked after CheckRequestHeader passed.
bool WantsContinue(const RequestHeader& header);

// The answer to a read that failed with `ec` (non-zero): 413 past the body
// limit, 431 past the header limit, 400 for a malformed request, each
// closing the connection; nullopt when the read just ends the connection
// (end of stream, timeout, reset) and nothing is answered.
std::optional<HttpError> ReadError(const boost::beast::error_code& ec, const RequestLimits& limits);

// The path of a request target: origin-form "/p?q" or absolute-form
// "http://host/p?q" (RFC 9112 §3.2.2: a server must accept both).
std::string_view RequestPath(std::string_view target);

// The generation endpoint a path names, or nullopt for any other path.
std::optional<Endpoint> CompletionEndpoint(std::string_view path);

}  // namespace kvrelay::coordinator
