// Minimal leveled logging to stderr. Thread-safe; one line per call:
//
//   2026-12-01T10:05:03.123Z I 12345 coordinator server.cc:88] message
//
// UTC time (ISO 8601, milliseconds), level (D/I/W/E), process id, tag (the
// role: "launch", "coordinator", a worker id), source location, message. A
// newline inside the message is written as the two characters \n, so one
// record is always one line (common/log_format.h formats it).
#pragma once

#include <sstream>
#include <string_view>

namespace kvrelay {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// Messages below this level are dropped. Default kInfo; KVRELAY_LOG_LEVEL=debug|info|warning|error.
void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();
// Tag printed in every line (e.g. "coordinator", "decode[1]").
void SetLogTag(std::string_view tag);

void LogLine(LogLevel level, const char* file, int line, std::string_view message);

class LogMessage {
 public:
  LogMessage(LogLevel level, const char* file, int line)
      : level_(level), file_(file), line_(line) {}
  ~LogMessage() { LogLine(level_, file_, line_, stream_.str()); }
  std::ostringstream& stream() { return stream_; }

 private:
  LogLevel level_;
  const char* file_;
  int line_;
  std::ostringstream stream_;
};

// Safe in an unbraced if/else: KVRELAY_LOG expands to one expression.
struct LogVoidify {
  void operator&(std::ostream&) {}
};

}  // namespace kvrelay

#define KVRELAY_LOG(level)                                  \
  !(::kvrelay::LogLevel::level >= ::kvrelay::GetLogLevel()) \
      ? (void)0                                             \
      : ::kvrelay::LogVoidify() &                           \
            ::kvrelay::LogMessage(::kvrelay::LogLevel::level, __FILE__, __LINE__).stream()

#define LOG_DEBUG KVRELAY_LOG(kDebug)
#define LOG_INFO KVRELAY_LOG(kInfo)
#define LOG_WARNING KVRELAY_LOG(kWarning)
#define LOG_ERROR KVRELAY_LOG(kError)
