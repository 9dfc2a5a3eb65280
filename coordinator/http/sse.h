// Server-sent events (text/event-stream), as the OpenAI streaming API uses
// them: one "data: <json>\n\n" event per chunk, ending with "data: [DONE]\n\n".
#pragma once

#include <cstddef>
#include <deque>
#include <optional>
#include <string>
#include <string_view>

namespace kvrelay::coordinator {

// Frames one event; a payload with newlines becomes several "data:" lines
// (which a conforming parser joins back with '\n').
std::string SseEvent(std::string_view data);
inline constexpr std::string_view kSseDone = "data: [DONE]\n\n";

// Incremental parser for the client side (load generator, tests). Accepts LF,
// CRLF and CR line ends, ignores comments (":...") and fields other than
// "data". Not thread-safe.
class SseParser {
 public:
  // `max_event_bytes` bounds memory: a longer event makes Feed return false.
  explicit SseParser(size_t max_event_bytes = 1 << 20) : max_event_bytes_(max_event_bytes) {}

  // Appends bytes; false when an event exceeded the limit (the stream is bad).
  bool Feed(std::string_view bytes);
  // The data of the next complete event, if any.
  std::optional<std::string> Next();

 private:
  void ProcessLine(std::string_view line);

  size_t max_event_bytes_;
  std::string pending_;  // bytes not yet split into lines
  std::string data_;     // data lines of the event being built
  bool has_data_ = false;
  bool last_was_cr_ = false;
  std::deque<std::string> ready_;  // complete events, oldest first
};

}  // namespace kvrelay::coordinator
