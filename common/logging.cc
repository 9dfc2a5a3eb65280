#include "common/logging.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <string>

#include "common/log_format.h"

namespace kvrelay {
namespace {

LogLevel InitialLevel() {
  const char* env = std::getenv("KVRELAY_LOG_LEVEL");
  if (env == nullptr) return LogLevel::kInfo;
  if (std::strcmp(env, "debug") == 0) return LogLevel::kDebug;
  if (std::strcmp(env, "warning") == 0) return LogLevel::kWarning;
  if (std::strcmp(env, "error") == 0) return LogLevel::kError;
  return LogLevel::kInfo;
}

std::mutex g_mutex;
LogLevel g_level = InitialLevel();
std::string g_tag = "kvrelay";  // guarded by g_mutex

}  // namespace

void SetLogLevel(LogLevel level) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_level = level;
}

LogLevel GetLogLevel() { return g_level; }

void SetLogTag(std::string_view tag) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_tag = std::string(tag);
}

std::string FormatLogLine(LogLevel level, std::chrono::system_clock::time_point when, long pid,
                          std::string_view tag, const char* file, int line,
                          std::string_view message) {
  static const char* kNames[] = {"D", "I", "W", "E"};
  const char* base = std::strrchr(file, '/');
  base = base ? base + 1 : file;
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(when.time_since_epoch());
  const std::time_t secs = static_cast<std::time_t>(ms.count() / 1000);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char stamp[48];
  std::snprintf(stamp, sizeof stamp, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900,
                tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                static_cast<int>(ms.count() % 1000));
  std::string out;
  out.reserve(64 + tag.size() + message.size());
  out += stamp;
  out += ' ';
  out += kNames[static_cast<int>(level)];
  out += ' ';
  out += std::to_string(pid);
  out += ' ';
  out += tag;
  out += ' ';
  out += base;
  out += ':';
  out += std::to_string(line);
  out += "] ";
  for (char c : message) {
    if (c == '\n') {
      out += "\\n";
    } else if (c != '\r') {
      out += c;
    }
  }
  return out;
}

void LogLine(LogLevel level, const char* file, int line, std::string_view message) {
  const auto now = std::chrono::system_clock::now();
  const long pid = static_cast<long>(::getpid());  // per call: right in a fork()ed child too
  std::lock_guard<std::mutex> lock(g_mutex);
  const std::string record = FormatLogLine(level, now, pid, g_tag, file, line, message);
  std::fprintf(stderr, "%s\n", record.c_str());
}

}  // namespace kvrelay
