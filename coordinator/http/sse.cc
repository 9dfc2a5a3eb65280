#include "coordinator/http/sse.h"

namespace kvrelay::coordinator {

std::string SseEvent(std::string_view data) {
  std::string out;
  out.reserve(data.size() + 8);
  size_t start = 0;
  while (true) {
    size_t nl = data.find('\n', start);
    out += "data: ";
    out.append(
        data.substr(start, nl == std::string_view::npos ? std::string_view::npos : nl - start));
    out += '\n';
    if (nl == std::string_view::npos) break;
    start = nl + 1;
  }
  out += '\n';
  return out;
}

bool SseParser::Feed(std::string_view bytes) {
  for (char c : bytes) {
    if (last_was_cr_ && c == '\n') {  // CRLF: the CR already ended the line
      last_was_cr_ = false;
      continue;
    }
    last_was_cr_ = false;
    if (c == '\n' || c == '\r') {
      last_was_cr_ = c == '\r';
      ProcessLine(pending_);
      pending_.clear();
      continue;
    }
    pending_ += c;
    if (pending_.size() + data_.size() > max_event_bytes_) return false;
  }
  return true;
}

void SseParser::ProcessLine(std::string_view line) {
  if (line.empty()) {  // dispatch
    if (has_data_) {
      ready_.push_back(std::move(data_));
    }
    data_.clear();
    has_data_ = false;
    return;
  }
  if (line[0] == ':') return;  // comment
  std::string_view field = line;
  std::string_view value;
  if (size_t colon = line.find(':'); colon != std::string_view::npos) {
    field = line.substr(0, colon);
    value = line.substr(colon + 1);
    if (!value.empty() && value[0] == ' ') value.remove_prefix(1);
  }
  if (field != "data") return;
  if (has_data_) data_ += '\n';
  data_.append(value);
  has_data_ = true;
}

std::optional<std::string> SseParser::Next() {
  if (ready_.empty()) return std::nullopt;
  std::string out = std::move(ready_.front());
  ready_.pop_front();
  return out;
}

}  // namespace kvrelay::coordinator
