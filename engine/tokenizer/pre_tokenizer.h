// Regex pre-tokenization of byte-level BPE vocabularies: the text is cut into
// "words" before merges, with the expressions llama.cpp uses for each
// tokenizer.ggml.pre value. Internal to kvrelay_tokenizer.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvrelay::engine {

class PreTokenizer {
 public:
  // kUnimplemented when `pre` names a pre-tokenizer this build does not know.
  static Result<std::unique_ptr<PreTokenizer>> Create(std::string_view pre);
  ~PreTokenizer();

  // Cuts `text` into consecutive, non-empty pieces that concatenate to `text`.
  // The expressions are applied in order, each to every piece of the previous
  // one; text between two matches stays a piece of its own. Invalid UTF-8 bytes
  // count as U+FFFD for matching and are kept as they are. Thread-safe.
  std::vector<std::string_view> Split(std::string_view text) const;

  // The pre-tokenizer's expressions (ICU syntax, after translation).
  const std::vector<std::string>& expressions() const { return expressions_; }
  // Whether a word that is itself a token skips merging (llama3).
  bool ignore_merges() const { return ignore_merges_; }

 private:
  PreTokenizer() = default;
  std::vector<std::string> expressions_;
  struct Patterns;  // the compiled ICU patterns (kept out of this header)
  std::unique_ptr<Patterns> patterns_;
  bool ignore_merges_ = false;
};

}  // namespace kvrelay::engine
