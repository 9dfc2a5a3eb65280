#include "engine/runtime/text_stream.h"

namespace kvrelay::engine {

TextStream::TextStream(const Tokenizer* tokenizer, std::vector<std::string> stops)
    : stop_(std::move(stops)) {
  if (tokenizer != nullptr) detok_ = std::make_unique<IncrementalDetokenizer>(*tokenizer);
}

std::string TextStream::Push(int32_t token, bool* stopped) {
  *stopped = false;
  if (detok_ == nullptr) return "";
  StopMatcher::Output out = stop_.Push(detok_->Push(token));
  *stopped = out.stopped;
  return std::move(out.text);
}

std::string TextStream::Flush() {
  if (detok_ == nullptr) return stop_.Flush();
  StopMatcher::Output out = stop_.Push(detok_->Flush());
  if (!out.stopped) out.text += stop_.Flush();
  return std::move(out.text);
}

}  // namespace kvrelay::engine
