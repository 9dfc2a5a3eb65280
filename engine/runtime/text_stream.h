// Per-request output text: incremental UTF-8-safe detokenization followed by
// stop-string matching (text that could still become a stop string is held back).
// Not thread-safe; one per request. The Tokenizer must outlive it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/stop_matcher.h"
#include "engine/runtime/sampler.h"
#include "engine/tokenizer/tokenizer.h"

namespace kvrelay::engine {

class TextStream {
 public:
  // `tokenizer` may be null (no text is produced then).
  TextStream(const Tokenizer* tokenizer, std::vector<std::string> stops);

  // Text released by `token`. *stopped is set when a stop string completed;
  // the returned text then ends right before it.
  std::string Push(int32_t token, bool* stopped);
  // Everything still held back (end of generation).
  std::string Flush();

 private:
  std::unique_ptr<IncrementalDetokenizer> detok_;
  StopMatcher stop_;
};

}  // namespace kvrelay::engine
