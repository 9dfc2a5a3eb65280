// Byte-level BPE ("gpt2" vocabularies): pre-tokenize, map bytes to characters,
// merge adjacent pairs by rank. Mirrors llama.cpp's llm_tokenizer_bpe_session.
#include <queue>

#include "engine/tokenizer/merge_symbols.h"
#include "engine/tokenizer/pre_tokenizer.h"
#include "engine/tokenizer/tokenizer.h"
#include "engine/tokenizer/utf8.h"

namespace kvrelay::engine {
namespace {

using merge::Symbol;

struct Bigram {
  int32_t rank;
  int left;
  size_t size;  // byte length of the merged text, to detect stale entries
};

struct BigramAfter {
  // Lowest rank first; on equal rank, the leftmost pair.
  bool operator()(const Bigram& a, const Bigram& b) const {
    return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
  }
};

}  // namespace

int32_t Tokenizer::MergeRank(std::string_view left, std::string_view right) const {
  std::string key;
  key.reserve(left.size() + right.size() + 1);
  key.append(left);
  key.push_back('\0');
  key.append(right);
  auto it = merge_rank_.find(key);
  return it == merge_rank_.end() ? -1 : it->second;
}

int32_t Tokenizer::ByteId(uint8_t b) const { return byte_to_id_[b]; }

void Tokenizer::EncodeBpe(std::string_view text, std::vector<int32_t>* out) const {
  for (std::string_view word : pre_->Split(text)) BpeWord(word, out);
}

void Tokenizer::BpeWord(std::string_view word, std::vector<int32_t>* out) const {
  std::string enc;
  enc.reserve(word.size() * 2);
  for (char c : word) utf8::Append(ByteToUnicode(static_cast<uint8_t>(c)), &enc);

  if (ignore_merges_) {
    const int32_t id = TextToId(enc);
    if (id >= 0) {
      out->push_back(id);
      return;
    }
  }

  std::vector<Symbol> symbols = merge::SplitChars(enc);

  std::priority_queue<Bigram, std::vector<Bigram>, BigramAfter> queue;
  auto text_of = [&](const Symbol& s) { return std::string_view(enc).substr(s.start, s.len); };
  auto add_bigram = [&](int left, int right) {
    if (left < 0 || right < 0) return;
    const int32_t rank = MergeRank(text_of(symbols[left]), text_of(symbols[right]));
    if (rank < 0) return;
    queue.push({rank, left, symbols[left].len + symbols[right].len});
  };
  for (int i = 1; i < static_cast<int>(symbols.size()); ++i) add_bigram(i - 1, i);

  while (!queue.empty()) {
    const Bigram b = queue.top();
    queue.pop();
    Symbol& left = symbols[b.left];
    if (left.len == 0 || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    // Stale: either side changed since the pair was queued.
    if (right.len == 0 || left.len + right.len != b.size ||
        MergeRank(text_of(left), text_of(right)) != b.rank) {
      continue;
    }
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
    // Not a token (a vocabulary without every merge result): one token per
    // character. A byte the vocabulary has no token for is dropped, as llama.cpp
    // does (SmolLM2, for one, has none for bytes that never occur in valid UTF-8
    // and for a few control characters; its "unknown" id is <|endoftext|>, which
    // must not appear in a prompt).
    for (size_t pos = 0; pos < piece.size();) {
      const size_t len = std::min(piece.size() - pos,
                                  utf8::SequenceLength(static_cast<unsigned char>(piece[pos])));
      const int32_t cid = TextToId(piece.substr(pos, len));
      if (cid >= 0) out->push_back(cid);
      pos += len;
    }
  }
}

}  // namespace kvrelay::engine
