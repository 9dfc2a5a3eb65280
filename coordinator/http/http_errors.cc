#include "coordinator/http/http_errors.h"

#include <algorithm>

namespace kvrelay::coordinator {

HttpError ErrorFromStatus(const Status& status, std::string message, int retry_after_seconds) {
  HttpError e;
  e.api.message = std::move(message);
  switch (status.code()) {
    case StatusCode::kInvalidArgument:
      e.api.http_status = 400;
      e.api.type = "invalid_request_error";
      break;
    case StatusCode::kResourceExhausted:
    case StatusCode::kUnavailable:
    case StatusCode::kAborted:  // a peer died under the request: retryable
      e.api.http_status = 503;
      e.api.type = "server_error";
      e.api.code = "no_capacity";
      e.headers.push_back({"Retry-After", std::to_string(std::max(1, retry_after_seconds))});
      break;
    case StatusCode::kDeadlineExceeded:
      e.api.http_status = 504;
      e.api.type = "server_error";
      e.api.code = "timeout";
      break;
    default:
      e.api.http_status = 500;
      e.api.type = "server_error";
  }
  return e;
}

HttpError MalformedRequest(std::string message) {
  HttpError e;
  e.api = BadRequest(std::move(message), "", "malformed_request");
  e.close = true;
  return e;
}

HttpError MethodNotAllowed(std::string_view method, std::string_view target, std::string allow) {
  HttpError e;
  e.api.http_status = 405;
  e.api.message = "method " + std::string(method) + " not allowed on " + std::string(target);
  e.api.code = "method_not_allowed";
  e.headers.push_back({"Allow", std::move(allow)});
  return e;
}

HttpError TooManyRequests(std::string code, std::string message, int retry_after_seconds) {
  HttpError e;
  e.api.http_status = 429;
  e.api.type = "rate_limit_exceeded";
  e.api.code = std::move(code);
  e.api.message = std::move(message);
  e.headers.push_back({"Retry-After", std::to_string(std::max(1, retry_after_seconds))});
  return e;
}

}  // namespace kvrelay::coordinator
