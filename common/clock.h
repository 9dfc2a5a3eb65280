// Clocks and deadlines. Every blocking wait in kvrelay takes a Deadline.
#pragma once

#include <chrono>

namespace kvrelay {

using Clock = std::chrono::steady_clock;
using TimePoint = Clock::time_point;

struct Deadline {
  TimePoint at;
  static Deadline After(std::chrono::nanoseconds d) { return {Clock::now() + d}; }
  static Deadline AfterMs(int64_t ms) { return After(std::chrono::milliseconds(ms)); }
  bool Expired() const { return Clock::now() >= at; }
  std::chrono::nanoseconds Remaining() const {
    auto r = at - Clock::now();
    return r.count() > 0 ? std::chrono::duration_cast<std::chrono::nanoseconds>(r)
                         : std::chrono::nanoseconds(0);
  }
};

inline double SecondsSince(TimePoint t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace kvrelay
