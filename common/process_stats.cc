#include "common/process_stats.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace kvrelay {
namespace {

// The kernel's boot time (btime of /proc/stat), in seconds since the epoch.
double BootTimeSeconds() {
  std::ifstream in("/proc/stat");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("btime ", 0) == 0) return std::stod(line.substr(6));
  }
  return 0;
}

}  // namespace

ProcessStats ReadProcessStats() {
  ProcessStats out;
  std::ifstream in("/proc/self/stat");
  std::string stat;
  if (!std::getline(in, stat)) return out;
  // Field 2 (comm) is parenthesised and may hold spaces: parse after its ')'.
  const auto close = stat.rfind(')');
  if (close == std::string::npos) return out;
  std::istringstream fields(stat.substr(close + 2));
  // From field 3 (state) on; utime and stime are fields 14 and 15,
  // starttime 22, vsize 23, rss 24 (proc(5)).
  std::string f[22];
  for (std::string& s : f) {
    if (!(fields >> s)) return out;
  }
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  const int64_t page = sysconf(_SC_PAGESIZE);
  if (ticks <= 0 || page <= 0) return out;
  out.cpu_seconds = (std::stod(f[11]) + std::stod(f[12])) / ticks;
  out.start_time_seconds = BootTimeSeconds() + std::stod(f[19]) / ticks;
  out.virtual_bytes = std::stoll(f[20]);
  out.resident_bytes = std::stoll(f[21]) * page;
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator("/proc/self/fd", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++out.open_fds;
  }
  return out;
}

}  // namespace kvrelay
