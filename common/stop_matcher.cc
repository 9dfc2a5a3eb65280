#include "common/stop_matcher.h"

#include <algorithm>

namespace kvrelay {

StopMatcher::StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  stops_.erase(std::remove(stops_.begin(), stops_.end(), std::string()), stops_.end());
}

StopMatcher::Output StopMatcher::Push(std::string_view piece) {
  Output out;
  if (stopped_) return out;
  held_.append(piece);
  if (stops_.empty()) {
    out.text = std::move(held_);
    held_.clear();
    return out;
  }
  // Earliest full match of any stop string.
  size_t best = std::string::npos;
  for (const auto& s : stops_) {
    size_t pos = held_.find(s);
    if (pos < best) best = pos;
  }
  if (best != std::string::npos) {
    out.text = held_.substr(0, best);
    out.stopped = true;
    stopped_ = true;
    held_.clear();
    return out;
  }
  // Keep the longest suffix of held_ that is a proper prefix of a stop string.
  size_t keep = 0;
  for (const auto& s : stops_) {
    size_t max_len = std::min(s.size() - 1, held_.size());
    for (size_t len = max_len; len > keep; --len) {
      if (held_.compare(held_.size() - len, len, s, 0, len) == 0) {
        keep = len;
        break;
      }
    }
  }
  out.text = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopMatcher::Flush() {
  if (stopped_) return "";
  std::string out = std::move(held_);
  held_.clear();
  return out;
}

}  // namespace kvrelay
