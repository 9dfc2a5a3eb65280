// The HTTP errors the coordinator answers, in one place: the single mapping
// from a backend's Status to an HTTP status and OpenAI error object, and the
// errors of the HTTP edge itself (framing, limits, routing, admission).
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"
#include "coordinator/openai/openai_api.h"

namespace kvrelay::coordinator {

using HttpHeaders = std::vector<std::pair<std::string, std::string>>;

// An error response: the body and status (ApiError) plus the headers that go
// with it (Retry-After, Allow, WWW-Authenticate) and whether the connection
// must close after it (the request's framing cannot be trusted).
struct HttpError {
  ApiError api;
  HttpHeaders headers;
  bool close = false;
};

// The one Status -> HTTP mapping for what a backend refuses or fails with:
//   InvalidArgument                 -> 400 invalid_request_error (the client's input)
//   ResourceExhausted, Unavailable  -> 503 server_error "no_capacity" + Retry-After
//   DeadlineExceeded                -> 504 server_error "timeout"
//   anything else                   -> 500 server_error
// `message` is the text the client sees.
HttpError ErrorFromStatus(const Status& status, std::string message, int retry_after_seconds);

// Malformed framing (bad Transfer-Encoding, missing Host, bad request line):
// 400 and the connection closes.
HttpError MalformedRequest(std::string message);
// 405 with Allow.
HttpError MethodNotAllowed(std::string_view method, std::string_view target, std::string allow);
// 429 from admission, with Retry-After.
HttpError TooManyRequests(std::string code, std::string message, int retry_after_seconds);

}  // namespace kvrelay::coordinator
