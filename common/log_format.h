// The one-line log record of common/logging.h, as a pure function (tests).
#pragma once

#include <chrono>
#include <string>
#include <string_view>

#include "common/logging.h"

namespace kvrelay {

// The record LogLine writes, without the trailing newline.
std::string FormatLogLine(LogLevel level, std::chrono::system_clock::time_point when, long pid,
                          std::string_view tag, const char* file, int line,
                          std::string_view message);

}  // namespace kvrelay
