// Tokenizers for GGUF models: byte-level BPE ("gpt2") and SentencePiece-style
// BPE ("llama"), matching llama.cpp's segmentation id for id.
//
//   ASSIGN_OR_RETURN(auto tok, Tokenizer::FromGguf(gguf));
//   std::vector<int32_t> ids = tok->Encode(prompt, /*add_special=*/false, /*parse_special=*/true);
//   IncrementalDetokenizer detok(*tok);
//   for (int32_t id : generated) stream << detok.Push(id);
//   stream << detok.Flush();
//
// The core takes a plain VocabData, so it is testable without a GGUF file.
// A Tokenizer is immutable after creation; every const method is thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"

namespace kvrelay::engine {

class GgufFile;
class PreTokenizer;

// tokenizer.ggml.token_type values, as on disk.
enum class TokenType : int32_t {
  kUndefined = 0,
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,      // <s>, <|im_start|>: matched as a whole only when parse_special
  kUserDefined = 4,  // added tokens: always matched as a whole
  kUnused = 5,
  kByte = 6,  // <0xNN> byte-fallback tokens of SentencePiece vocabularies
};

// Everything a tokenizer needs, as stored under tokenizer.ggml.* in GGUF.
struct VocabData {
  std::string model = "gpt2";  // "gpt2" (byte-level BPE) | "llama" (SentencePiece BPE)
  std::string pre =
      "default";  // gpt2 pre-tokenizer: default, gpt2, smollm, llama3 (llama-bpe), qwen2, ...
  std::vector<std::string>
      tokens;  // id -> text (byte-level encoded for gpt2, "▁" spaces for llama)
  std::vector<TokenType> token_types;  // empty: all kNormal
  std::vector<float> scores;           // empty: all 0 (only "llama" uses scores)
  std::vector<std::string> merges;     // "left right", highest priority first (gpt2 only)
  int32_t bos_id = -1;
  int32_t eos_id = -1;
  int32_t eot_id = -1;
  int32_t unk_id = -1;
  int32_t pad_id = -1;
  bool add_bos = false;
  bool add_eos = false;
  bool add_space_prefix = false;  // "llama": prefix the text with a space (as "▁")
};

class Tokenizer {
 public:
  // Validates `vocab` (ids in range, array lengths agree, merges name known tokens,
  // known model and pre-tokenizer) and builds the lookup tables.
  // kUnimplemented for a model or pre-tokenizer this build does not support.
  static Result<std::unique_ptr<Tokenizer>> Create(VocabData vocab);
  // Reads tokenizer.ggml.* from a GGUF file (which need not outlive the result).
  static Result<std::unique_ptr<Tokenizer>> FromGguf(const GgufFile& gguf);
  // Only the VocabData part of FromGguf.
  static Result<VocabData> VocabFromGguf(const GgufFile& gguf);

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Text -> ids, as llama_tokenize(text, add_special, parse_special):
  //  add_special: add BOS (and EOS) when the vocabulary asks for it (add_bos/add_eos).
  //  parse_special: control tokens written in the text ("<|im_start|>") become their
  //  ids; otherwise they are tokenized as plain text. User-defined tokens always match.
  // Any byte string is accepted: invalid UTF-8 is encoded byte by byte, and a
  // byte-level vocabulary that lacks a byte's token drops that byte (as llama.cpp;
  // SmolLM2 has no token for 0x04 0x06 0x13 0x14 0x16 0x1D 0xC0 0xC1 0xF1 0xF2 0xF5-0xFF).
  std::vector<int32_t> Encode(std::string_view text, bool add_special, bool parse_special) const;

  // The raw bytes a token stands for (a piece may be an incomplete UTF-8 sequence).
  // Control and user-defined tokens render as their text ("<|im_end|>").
  // Out-of-range ids render as "".
  std::string TokenToPiece(int32_t id) const;
  // Concatenated pieces; for "llama" vocabularies with add_space_prefix the space the
  // encoder added in front of the text is removed again, so Decode(Encode(x)) == x.
  std::string Decode(std::span<const int32_t> ids) const;

  int32_t bos() const { return vocab_.bos_id; }
  int32_t eos() const { return vocab_.eos_id; }
  // EOS, EOT, and control tokens that end a turn by name (<|im_end|>, <|eot_id|>,
  // <|endoftext|>, <end_of_turn>, <|end|>, <|eom_id|>, ...).
  bool IsEndOfGeneration(int32_t id) const;
  int32_t vocab_size() const { return static_cast<int32_t>(vocab_.tokens.size()); }
  TokenType token_type(int32_t id) const;
  // The token's text as stored in the vocabulary ("" when out of range).
  const std::string& token_text(int32_t id) const;
  // -1 when the text is not a token.
  int32_t TextToId(std::string_view text) const;
  const VocabData& vocab() const { return vocab_; }
  // True for "llama" vocabularies with add_space_prefix (Decode drops the leading space).
  bool strips_leading_space() const { return spm_ && vocab_.add_space_prefix; }

 private:
  explicit Tokenizer(VocabData vocab);
  Status Init();

  // Appends the ids of `text` (no special-token handling) to `out`.
  void EncodeBpe(std::string_view text, std::vector<int32_t>* out) const;
  void EncodeSpm(std::string_view text, std::vector<int32_t>* out) const;
  void BpeWord(std::string_view word, std::vector<int32_t>* out) const;
  int32_t MergeRank(std::string_view left, std::string_view right) const;
  // The id of the token for one raw byte (-1 when the vocabulary has none).
  int32_t ByteId(uint8_t b) const;
  // GPT-2's reversible byte <-> character map of byte-level vocabularies.
  static char32_t ByteToUnicode(uint8_t b);
  static int UnicodeToByte(char32_t cp);  // -1 when cp is not in the map

  // Hash that lets string-keyed maps be searched with a string_view (no copy).
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  using StringMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

  VocabData vocab_;
  bool spm_ = false;            // model == "llama"
  bool ignore_merges_ = false;  // llama3: a word that is a token is taken whole
  StringMap token_to_id_;
  StringMap merge_rank_;               // "left\0right" -> rank
  std::vector<int32_t> special_ids_;   // control/user-defined/unknown, longest text first
  std::vector<int32_t> byte_to_id_;    // 256 entries; -1 where the vocabulary lacks one
  std::vector<bool> eog_;              // per id
  std::unique_ptr<PreTokenizer> pre_;  // gpt2 only
};

// Turns a stream of token ids into text without ever emitting a broken UTF-8
// sequence: bytes of a character split across tokens are held back until the
// character is complete. Not thread-safe; one per stream. The Tokenizer must
// outlive it.
class IncrementalDetokenizer {
 public:
  explicit IncrementalDetokenizer(const Tokenizer& tokenizer);

  // Returns the newly completed text (possibly empty).
  std::string Push(int32_t id);
  // Returns what is still held back; bytes that can never become valid UTF-8
  // are replaced by U+FFFD. The detokenizer can be reused afterwards.
  std::string Flush();

 private:
  const Tokenizer& tokenizer_;
  std::string pending_;   // bytes of an incomplete trailing character
  bool at_start_ = true;  // no text emitted yet (for the leading-space rule)
};

}  // namespace kvrelay::engine
