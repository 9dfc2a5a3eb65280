#include "engine/runtime/text_stream.h"

namespace kvrelay::engine {

TextStream::TextStream(const Tokenizer* tokenizer, std::vector<std::string> stops)
    : stop_(std::move(stops)) {
  if (tokenizer != nullptr) detok_ = std::make_unique<IncrementalDetokenizer>(*tokenizer);
}

std::string TextStream::Push(int32_t token, bool* stopped) {
  *stopped = false;
  if (detok_ == nullptr) return "";
  return stop_.Push(detok_->Push(token), stopped);
}

std::string TextStream::Flush() {
  if (detok_ == nullptr) return stop_.Flush();
  bool stopped = false;
  std::string out = stop_.Push(detok_->Flush(), &stopped);
  if (!stopped) out += stop_.Flush();
  return out;
}

}  // namespace kvrelay::engine
