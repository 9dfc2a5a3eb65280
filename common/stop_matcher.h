// Stop strings over a stream of text pieces. Text that could be the start of
// a stop string is held back until it is known not to be one, so a stop
// string is never streamed to the client, even when split across tokens.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace kvrelay {

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);

  struct Output {
    std::string text;      // safe to emit now
    bool stopped = false;  // a stop string matched; `text` ends right before it
  };
  // Feeds the next piece. After a stop, further calls return nothing.
  Output Push(std::string_view piece);
  // End of stream without a stop: releases the held-back text.
  std::string Flush();

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
};

}  // namespace kvrelay
