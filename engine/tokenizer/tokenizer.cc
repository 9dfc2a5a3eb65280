#include "engine/tokenizer/tokenizer.h"

#include <algorithm>
#include <array>

#include "engine/gguf/gguf.h"
#include "engine/tokenizer/pre_tokenizer.h"
#include "engine/tokenizer/utf8.h"

namespace kvrelay::engine {
namespace {

// Bounds that keep a hostile vocabulary from exhausting memory or time.
constexpr size_t kMaxVocab = 4u << 20;
constexpr size_t kMaxTokenBytes = 1u << 16;

// Names of control tokens that end a turn (as llama.cpp's EOG heuristics).
constexpr std::array<std::string_view, 9> kEogNames = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",      "<|endoftext|>",
    "<|eom_id|>", "<EOT>",      "_<EOT>",  "<|end▁of▁sentence|>"};

}  // namespace

Tokenizer::Tokenizer(VocabData vocab) : vocab_(std::move(vocab)) {}
Tokenizer::~Tokenizer() = default;

Result<std::unique_ptr<Tokenizer>> Tokenizer::Create(VocabData vocab) {
  std::unique_ptr<Tokenizer> t(new Tokenizer(std::move(vocab)));
  RETURN_IF_ERROR(t->Init());
  return t;
}

Status Tokenizer::Init() {
  const size_t n = vocab_.tokens.size();
  if (vocab_.model == "llama") {
    spm_ = true;
  } else if (vocab_.model != "gpt2") {
    return Unimplemented("tokenizer.ggml.model '" + vocab_.model +
                         "' is not supported (supported: gpt2, llama)");
  }
  if (n == 0) return InvalidArgument("tokenizer vocabulary is empty");
  if (n > kMaxVocab)
    return InvalidArgument("tokenizer vocabulary has " + std::to_string(n) +
                           " tokens, over the limit");
  if (vocab_.token_types.empty()) vocab_.token_types.assign(n, TokenType::kNormal);
  if (vocab_.scores.empty()) vocab_.scores.assign(n, 0.0f);
  if (vocab_.token_types.size() != n) {
    return InvalidArgument("tokenizer.ggml.token_type has " +
                           std::to_string(vocab_.token_types.size()) + " entries for " +
                           std::to_string(n) + " tokens");
  }
  if (vocab_.scores.size() != n) {
    return InvalidArgument("tokenizer.ggml.scores has " + std::to_string(vocab_.scores.size()) +
                           " entries for " + std::to_string(n) + " tokens");
  }
  for (auto [name, id] : {std::pair<const char*, int32_t*>{"bos", &vocab_.bos_id},
                          {"eos", &vocab_.eos_id},
                          {"eot", &vocab_.eot_id},
                          {"unknown", &vocab_.unk_id},
                          {"padding", &vocab_.pad_id}}) {
    if (*id < -1 || *id >= static_cast<int64_t>(n)) {
      return InvalidArgument(std::string("tokenizer ") + name + " token id " + std::to_string(*id) +
                             " is out of range (vocabulary of " + std::to_string(n) + ")");
    }
  }
  if (vocab_.add_bos && vocab_.bos_id < 0)
    return InvalidArgument("tokenizer adds BOS but has no bos token id");
  if (vocab_.add_eos && vocab_.eos_id < 0)
    return InvalidArgument("tokenizer adds EOS but has no eos token id");

  token_to_id_.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const std::string& text = vocab_.tokens[i];
    if (text.size() > kMaxTokenBytes)
      return InvalidArgument("token " + std::to_string(i) + " is too long");
    const auto type = static_cast<int32_t>(vocab_.token_types[i]);
    if (type < 0 || type > 6) {
      return InvalidArgument("token " + std::to_string(i) + " has unknown token type " +
                             std::to_string(type));
    }
    token_to_id_.emplace(text, static_cast<int32_t>(i));  // first id wins on duplicates
  }

  if (!spm_) {
    ASSIGN_OR_RETURN(pre_, PreTokenizer::Create(vocab_.pre));
    ignore_merges_ = pre_->ignore_merges();
    merge_rank_.reserve(vocab_.merges.size());
    for (size_t r = 0; r < vocab_.merges.size(); ++r) {
      const std::string& m = vocab_.merges[r];
      const size_t sp = m.find(' ', 1);
      if (sp == std::string::npos || sp + 1 >= m.size()) {
        return InvalidArgument("tokenizer.ggml.merges[" + std::to_string(r) + "] '" + m +
                               "' is not of the form 'left right'");
      }
      std::string key = m.substr(0, sp);
      key.push_back('\0');
      key.append(m, sp + 1);
      merge_rank_.emplace(std::move(key), static_cast<int32_t>(r));
    }
  }

  // Byte tokens: byte-level characters for gpt2, <0xNN> for llama.
  byte_to_id_.assign(256, -1);
  for (int b = 0; b < 256; ++b) {
    std::string text;
    if (spm_) {
      static const char* kHex = "0123456789ABCDEF";
      text = std::string("<0x") + kHex[b >> 4] + kHex[b & 15] + ">";
    } else {
      utf8::Append(ByteToUnicode(static_cast<uint8_t>(b)), &text);
    }
    const int32_t id = TextToId(text);
    if (id >= 0) byte_to_id_[b] = id;
  }

  for (size_t i = 0; i < n; ++i) {
    const TokenType type = vocab_.token_types[i];
    if ((type == TokenType::kControl || type == TokenType::kUserDefined ||
         type == TokenType::kUnknown) &&
        !vocab_.tokens[i].empty()) {
      special_ids_.push_back(static_cast<int32_t>(i));
    }
  }
  std::stable_sort(special_ids_.begin(), special_ids_.end(), [this](int32_t a, int32_t b) {
    return vocab_.tokens[a].size() > vocab_.tokens[b].size();
  });

  eog_.assign(n, false);
  if (vocab_.eos_id >= 0) eog_[vocab_.eos_id] = true;
  if (vocab_.eot_id >= 0) eog_[vocab_.eot_id] = true;
  for (std::string_view name : kEogNames) {
    const int32_t id = TextToId(name);
    if (id >= 0 && vocab_.token_types[id] == TokenType::kControl) eog_[id] = true;
  }
  return Status::Ok();
}

char32_t Tokenizer::ByteToUnicode(uint8_t b) {
  // GPT-2's reversible byte -> character map: printable Latin-1 bytes map to
  // themselves, the other 68 bytes to U+0100.. in byte order.
  if ((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE)) return b;
  int k = 0;
  for (int c = 0; c < b; ++c) {
    if (!((c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE))) ++k;
  }
  return 0x100 + k;
}

int Tokenizer::UnicodeToByte(char32_t cp) {
  static const std::array<int, 0x144> kTable = [] {
    std::array<int, 0x144> t{};
    t.fill(-1);
    for (int b = 0; b < 256; ++b) t[ByteToUnicode(static_cast<uint8_t>(b))] = b;
    return t;
  }();
  return cp < kTable.size() ? kTable[cp] : -1;
}

int32_t Tokenizer::TextToId(std::string_view text) const {
  auto it = token_to_id_.find(text);
  return it == token_to_id_.end() ? -1 : it->second;
}

TokenType Tokenizer::token_type(int32_t id) const {
  if (id < 0 || id >= vocab_size()) return TokenType::kUndefined;
  return vocab_.token_types[id];
}

const std::string& Tokenizer::token_text(int32_t id) const {
  static const std::string kEmpty;
  if (id < 0 || id >= vocab_size()) return kEmpty;
  return vocab_.tokens[id];
}

bool Tokenizer::IsEndOfGeneration(int32_t id) const {
  return id >= 0 && id < vocab_size() && eog_[id];
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text, bool add_special,
                                       bool parse_special) const {
  // Cut the text at special tokens (longest first), as llama.cpp's
  // tokenizer_st_partition: each fragment is either raw text or one token id.
  struct Fragment {
    std::string_view text;
    int32_t id;  // -1 for raw text
  };
  std::vector<Fragment> fragments;
  if (!text.empty()) fragments.push_back({text, -1});
  for (int32_t sid : special_ids_) {
    const TokenType type = vocab_.token_types[sid];
    if (!parse_special && (type == TokenType::kControl || type == TokenType::kUnknown)) continue;
    const std::string& st = vocab_.tokens[sid];
    std::vector<Fragment> next;
    next.reserve(fragments.size());
    for (const Fragment& f : fragments) {
      if (f.id >= 0) {
        next.push_back(f);
        continue;
      }
      size_t pos = 0;
      while (true) {
        const size_t hit = f.text.find(st, pos);
        if (hit == std::string_view::npos) break;
        if (hit > pos) next.push_back({f.text.substr(pos, hit - pos), -1});
        next.push_back({{}, sid});
        pos = hit + st.size();
      }
      if (pos < f.text.size()) next.push_back({f.text.substr(pos), -1});
    }
    fragments = std::move(next);
  }

  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  if (add_special && vocab_.add_bos && vocab_.bos_id >= 0) out.push_back(vocab_.bos_id);
  bool prev_special = true;  // "llama": a space prefix goes before text that starts a fragment run
  for (const Fragment& f : fragments) {
    if (f.id >= 0) {
      out.push_back(f.id);
      prev_special = true;
      continue;
    }
    if (spm_) {
      std::string s;
      if (vocab_.add_space_prefix && prev_special) s.push_back(' ');
      s.append(f.text);
      EncodeSpm(s, &out);
    } else {
      EncodeBpe(f.text, &out);
    }
    prev_special = false;
  }
  if (add_special && vocab_.add_eos && vocab_.eos_id >= 0) out.push_back(vocab_.eos_id);
  return out;
}

std::string Tokenizer::TokenToPiece(int32_t id) const {
  if (id < 0 || id >= vocab_size()) return {};
  const std::string& text = vocab_.tokens[id];
  const TokenType type = vocab_.token_types[id];
  if (type == TokenType::kControl || type == TokenType::kUserDefined) return text;
  if (spm_) {
    if (type == TokenType::kByte && text.size() == 6 && text.starts_with("<0x")) {
      const auto hex = [](char c) {
        return c >= '0' && c <= '9'   ? c - '0'
               : c >= 'A' && c <= 'F' ? c - 'A' + 10
               : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                      : -1;
      };
      const int hi = hex(text[3]), lo = hex(text[4]);
      if (hi >= 0 && lo >= 0) return std::string(1, static_cast<char>(hi * 16 + lo));
    }
    // "▁" (U+2581) stands for a space.
    std::string out;
    out.reserve(text.size());
    for (size_t i = 0; i < text.size();) {
      if (text.compare(i, 3, "\xE2\x96\x81") == 0) {
        out.push_back(' ');
        i += 3;
      } else {
        out.push_back(text[i++]);
      }
    }
    return out;
  }
  // Byte-level: every character stands for one byte.
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    size_t len = 0;
    const char32_t cp = utf8::Decode(text, i, &len);
    const int b = UnicodeToByte(cp);
    if (b >= 0) {
      out.push_back(static_cast<char>(b));
    } else {
      out.append(text, i, len);  // not a byte-level character: keep it as it is
    }
    i += len;
  }
  return out;
}

std::string Tokenizer::Decode(std::span<const int32_t> ids) const {
  std::string out;
  bool first_text = true;
  for (int32_t id : ids) {
    std::string piece = TokenToPiece(id);
    if (first_text && token_type(id) != TokenType::kControl) {
      if (strips_leading_space() && !piece.empty() && piece[0] == ' ') piece.erase(0, 1);
      first_text = false;
    }
    out += piece;
  }
  return out;
}

}  // namespace kvrelay::engine
