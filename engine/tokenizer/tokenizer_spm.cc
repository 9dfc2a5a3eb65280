// SentencePiece-style BPE ("llama" vocabularies, Llama-2 era): spaces become
// "▁", adjacent pieces merge while their concatenation is a token, highest
// score first, and characters without a token fall back to <0xNN> byte tokens.
// Mirrors llama.cpp's llm_tokenizer_spm_session.
#include <queue>

#include "engine/tokenizer/merge_symbols.h"
#include "engine/tokenizer/tokenizer.h"
#include "engine/tokenizer/utf8.h"

namespace kvrelay::engine {
namespace {

using merge::Symbol;

struct Bigram {
  float score;
  int left;
  size_t size;
};

struct BigramBefore {
  // Highest score first; on equal score, the leftmost pair.
  bool operator()(const Bigram& a, const Bigram& b) const {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  }
};

}  // namespace

void Tokenizer::EncodeSpm(std::string_view raw, std::vector<int32_t>* out) const {
  std::string text;
  text.reserve(raw.size() + 8);
  for (char c : raw) {
    if (c == ' ') {
      text += "\xE2\x96\x81";  // ▁
    } else {
      text.push_back(c);
    }
  }

  std::vector<Symbol> symbols = merge::SplitChars(text);
  auto text_of = [&](const Symbol& s) { return std::string_view(text).substr(s.start, s.len); };

  std::priority_queue<Bigram, std::vector<Bigram>, BigramBefore> queue;
  auto add_bigram = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    const std::string_view merged =
        std::string_view(text).substr(symbols[left].start, symbols[left].len + symbols[right].len);
    const int32_t id = TextToId(merged);
    if (id < 0) return;
    queue.push({vocab_.scores[id], left, merged.size()});
  };
  for (int i = 1; i < static_cast<int>(symbols.size()); ++i) add_bigram(i - 1, i);

  while (!queue.empty()) {
    const Bigram b = queue.top();
    queue.pop();
    Symbol& left = symbols[b.left];
    if (left.len == 0 || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    if (right.len == 0 || left.len + right.len != b.size) continue;
    merge::MergeWithNext(symbols, b.left);
    add_bigram(left.prev, b.left);
    add_bigram(b.left, left.next);
  }

  for (int i = symbols.empty() ? -1 : 0; i >= 0; i = symbols[i].next) {
    const std::string_view piece = text_of(symbols[i]);
    const int32_t id = TextToId(piece);
    if (id >= 0) {
      out->push_back(id);
      continue;
    }
    // Merges only ever form tokens, so this is a single character the vocabulary
    // lacks: spell it in byte tokens.
    for (char c : piece) {
      const int32_t bid = ByteId(static_cast<uint8_t>(c));
      if (bid >= 0) {
        out->push_back(bid);
      } else if (vocab_.unk_id >= 0) {
        out->push_back(vocab_.unk_id);
      }
    }
  }
}

}  // namespace kvrelay::engine
