// Status and Result<T>: the one error model of kvrelay.
//
// Every fallible function returns Status or Result<T>. Errors from MPI, Asio,
// RocksDB, protobuf and the OS are converted to a Status at the adapter edge;
// no exception crosses a component boundary.
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace kvrelay {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // the caller's input is malformed (bad file, request, frame)
  kNotFound,         // a named thing does not exist (model, key, request)
  kAlreadyExists,
  kFailedPrecondition,  // the system is not in a state to do this (mismatched peer)
  kResourceExhausted,   // out of KV blocks, queue full, over a size limit
  kUnavailable,         // retryable: peer down, connection refused
  kDeadlineExceeded,    // a wait passed its deadline
  kCancelled,           // the request was cancelled by its owner
  kDataLoss,            // checksum mismatch, truncated data
  kUnimplemented,       // a format or feature this build does not support
  kInternal,            // a bug: an invariant did not hold
  // Abandoned while a lower layer still owns the caller's memory (an MPI
  // request to a dead peer can be neither completed nor cancelled): that
  // memory must never be reused or freed — the caller quarantines it.
  kAborted,
};

std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "INVALID_ARGUMENT: message"
  std::string ToString() const;

  // Prepends context: "reading tensor 'x': <message>".
  Status WithContext(std::string_view context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status InvalidArgument(std::string m) {
  return {StatusCode::kInvalidArgument, std::move(m)};
}
inline Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status AlreadyExists(std::string m) { return {StatusCode::kAlreadyExists, std::move(m)}; }
inline Status FailedPrecondition(std::string m) {
  return {StatusCode::kFailedPrecondition, std::move(m)};
}
inline Status ResourceExhausted(std::string m) {
  return {StatusCode::kResourceExhausted, std::move(m)};
}
inline Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
inline Status DeadlineExceeded(std::string m) {
  return {StatusCode::kDeadlineExceeded, std::move(m)};
}
inline Status Cancelled(std::string m) { return {StatusCode::kCancelled, std::move(m)}; }
inline Status DataLoss(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }
inline Status Unimplemented(std::string m) { return {StatusCode::kUnimplemented, std::move(m)}; }
inline Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
inline Status Aborted(std::string m) { return {StatusCode::kAborted, std::move(m)}; }

// Result<T> holds either a value or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}         // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT
    assert(!status_.ok() && "Result constructed from an OK Status without a value");
    if (status_.ok()) status_ = Internal("Result constructed from OK status without value");
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }

  T& value() & {
    assert(ok());
    return *value_;
  }
  const T& value() const& {
    assert(ok());
    return *value_;
  }
  T&& value() && {
    assert(ok());
    return std::move(*value_);
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace kvrelay

#define KVRELAY_CONCAT_INNER(a, b) a##b
#define KVRELAY_CONCAT(a, b) KVRELAY_CONCAT_INNER(a, b)

// Returns early from the enclosing function if `expr` (a Status) is not OK.
#define RETURN_IF_ERROR(expr)                          \
  do {                                                 \
    ::kvrelay::Status kvrelay_status_ = (expr);        \
    if (!kvrelay_status_.ok()) return kvrelay_status_; \
  } while (0)

// ASSIGN_OR_RETURN(auto x, MakeX()); declares x from a Result or returns its Status.
#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL(KVRELAY_CONCAT(kvrelay_result_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                          \
  if (!tmp.ok()) return tmp.status();         \
  lhs = std::move(tmp).value()
