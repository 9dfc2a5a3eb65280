// The symbol list both BPE flavours merge over (tokenizer_bpe.cc, byte-level
// BPE by merge rank; tokenizer_spm.cc, SentencePiece BPE by score): one symbol
// per UTF-8 character of a working string, doubly linked so a merge is O(1).
// Internal to engine/tokenizer.
#pragma once

#include <cstddef>
#include <string_view>
#include <vector>

namespace kvrelay::engine::merge {

struct Symbol {
  size_t start;  // byte offset into the working string
  size_t len;    // 0 once merged into its left neighbour
  int prev;      // -1 at the start
  int next;      // -1 at the end
};

// One symbol per UTF-8 character of `text` (a truncated sequence at the end
// is one symbol of the bytes left).
std::vector<Symbol> SplitChars(std::string_view text);

// Folds the right neighbour of symbols[left] into it. The caller has checked
// that both are alive (len > 0) and adjacent.
inline void MergeWithNext(std::vector<Symbol>& symbols, int left) {
  Symbol& l = symbols[left];
  Symbol& r = symbols[l.next];
  l.len += r.len;
  r.len = 0;
  l.next = r.next;
  if (l.next >= 0) symbols[l.next].prev = left;
}

}  // namespace kvrelay::engine::merge
