#include "engine/tokenizer/tokenizer.h"
#include "engine/tokenizer/utf8.h"

namespace kvrelay::engine {

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tokenizer)
    : tokenizer_(tokenizer) {}

std::string IncrementalDetokenizer::Push(int32_t id) {
  std::string piece = tokenizer_.TokenToPiece(id);
  if (at_start_ && tokenizer_.token_type(id) != TokenType::kControl) {
    // Same rule as Tokenizer::Decode: drop the space the encoder put in front.
    if (tokenizer_.strips_leading_space() && !piece.empty() && piece[0] == ' ') piece.erase(0, 1);
    at_start_ = false;
  }
  pending_ += piece;
  std::string out;
  const size_t taken = utf8::TakeComplete(pending_, &out);
  pending_.erase(0, taken);
  return out;
}

std::string IncrementalDetokenizer::Flush() {
  // What is held back is always the valid start of one character (TakeComplete
  // emits everything else), so it becomes one replacement character.
  std::string out;
  if (!pending_.empty()) utf8::Append(utf8::kReplacement, &out);
  pending_.clear();
  at_start_ = true;
  return out;
}

}  // namespace kvrelay::engine
