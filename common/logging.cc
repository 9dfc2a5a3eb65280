#include "common/logging.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

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

void LogLine(LogLevel level, const char* file, int line, std::string_view message) {
  static const char* kNames[] = {"D", "I", "W", "E"};
  const char* base = std::strrchr(file, '/');
  base = base ? base + 1 : file;
  auto now = std::chrono::system_clock::now().time_since_epoch();
  double secs = std::chrono::duration<double>(now).count();
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fprintf(stderr, "%s %.3f %s %s:%d] %.*s\n", kNames[static_cast<int>(level)], secs,
               g_tag.c_str(), base, line, static_cast<int>(message.size()), message.data());
}

}  // namespace kvrelay
