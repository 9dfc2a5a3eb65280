#include "engine/tokenizer/merge_symbols.h"

#include <algorithm>

#include "engine/tokenizer/utf8.h"

namespace kvrelay::engine::merge {

std::vector<Symbol> SplitChars(std::string_view text) {
  std::vector<Symbol> symbols;
  symbols.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) {
    const size_t len =
        std::min(text.size() - pos, utf8::SequenceLength(static_cast<unsigned char>(text[pos])));
    const int idx = static_cast<int>(symbols.size());
    symbols.push_back({pos, len, idx - 1, pos + len == text.size() ? -1 : idx + 1});
    pos += len;
  }
  return symbols;
}

}  // namespace kvrelay::engine::merge
