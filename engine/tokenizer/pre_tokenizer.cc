#include "engine/tokenizer/pre_tokenizer.h"

#include <unicode/regex.h>
#include <unicode/unistr.h>

#include "engine/tokenizer/utf8.h"

namespace kvrelay::engine {
namespace {

// The expressions of llama.cpp (llama-vocab.cpp, llm_tokenizer_bpe) per pre type.
constexpr const char* kGpt2 =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)";
constexpr const char* kLlama3 =
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
    "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
constexpr const char* kQwen2 =
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
    "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

struct PreConfig {
  std::vector<std::string> expressions;
  bool ignore_merges = false;
};

bool LookupPre(std::string_view pre, PreConfig* config) {
  if (pre == "default" || pre.empty()) {
    config->expressions = {"[\\p{P}\\$\\+<=>\\^~\\|]+", kGpt2, "\\p{N}+", "[0-9][0-9][0-9]"};
  } else if (pre == "gpt2" || pre == "gpt-2" || pre == "mpt" || pre == "olmo" || pre == "jais") {
    config->expressions = {kGpt2};
  } else if (pre == "smollm" || pre == "starcoder" || pre == "refact" || pre == "command-r" ||
             pre == "codeshell" || pre == "exaone" || pre == "minerva-7b") {
    config->expressions = {"\\p{N}", kGpt2};
  } else if (pre == "llama3" || pre == "llama-v3" || pre == "llama-bpe" || pre == "falcon3" ||
             pre == "pixtral") {
    config->expressions = {kLlama3};
    config->ignore_merges = true;
  } else if (pre == "dbrx" || pre == "smaug-bpe") {
    config->expressions = {kLlama3};
  } else if (pre == "qwen2" || pre == "stablelm2" || pre == "deepseek-r1-qwen" ||
             pre == "hunyuan") {
    config->expressions = {kQwen2};
  } else {
    return false;
  }
  return true;
}

// llama.cpp matches the gpt2 expression with a hand-written splitter that also
// takes whitespace the lookahead branch leaves over (as the original GPT-2
// expression's trailing "|\s+" does); a plain regex engine needs it spelled out.
// \s and \S mean the Unicode White_Space property there, as in llama.cpp's tables
// (ICU's \s would miss U+000B and U+0085).
std::string Translate(const std::string& expr) {
  std::string e = expr;
  if (e == kGpt2) e += "|\\s+";
  std::string out;
  for (size_t i = 0; i < e.size(); ++i) {
    if (e[i] == '\\' && i + 1 < e.size()) {
      if (e[i + 1] == 's') {
        out += "\\p{White_Space}";
        ++i;
        continue;
      }
      if (e[i + 1] == 'S') {
        out += "\\P{White_Space}";
        ++i;
        continue;
      }
      out += e.substr(i, 2);
      ++i;
      continue;
    }
    out.push_back(e[i]);
  }
  return out;
}

}  // namespace

// icu::RegexPattern is immutable after compile and safe to share between threads;
// each Split makes its own RegexMatcher.
struct PreTokenizer::Patterns {
  std::vector<std::unique_ptr<icu::RegexPattern>> list;
};

PreTokenizer::~PreTokenizer() = default;

Result<std::unique_ptr<PreTokenizer>> PreTokenizer::Create(std::string_view pre) {
  PreConfig config;
  if (!LookupPre(pre, &config)) {
    return Unimplemented("tokenizer.ggml.pre '" + std::string(pre) +
                         "' is not supported (known: default, gpt2, smollm, llama-bpe/llama3, "
                         "qwen2, starcoder, dbrx, ...)");
  }
  std::unique_ptr<PreTokenizer> p(new PreTokenizer());
  p->ignore_merges_ = config.ignore_merges;
  p->patterns_ = std::make_unique<Patterns>();
  for (const std::string& expr : config.expressions) {
    std::string translated = Translate(expr);
    UErrorCode status = U_ZERO_ERROR;
    UParseError parse_error;
    std::unique_ptr<icu::RegexPattern> pattern(icu::RegexPattern::compile(
        icu::UnicodeString::fromUTF8(translated), 0, parse_error, status));
    if (U_FAILURE(status) || pattern == nullptr) {
      return Internal("pre-tokenizer expression does not compile (" +
                      std::string(u_errorName(status)) + "): " + translated);
    }
    p->expressions_.push_back(std::move(translated));
    p->patterns_->list.push_back(std::move(pattern));
  }
  return p;
}

std::vector<std::string_view> PreTokenizer::Split(std::string_view text) const {
  std::vector<std::string_view> pieces;
  if (text.empty()) return pieces;
  pieces.push_back(text);
  for (const auto& pattern : patterns_->list) {
    UErrorCode status = U_ZERO_ERROR;
    // One matcher per expression and call, reset to each piece.
    std::unique_ptr<icu::RegexMatcher> matcher(pattern->matcher(status));
    if (U_FAILURE(status) || matcher == nullptr) continue;  // cannot happen for a compiled pattern
    std::vector<std::string_view> next;
    next.reserve(pieces.size() * 2);
    icu::UnicodeString u;
    std::vector<size_t> byte_at;
    for (std::string_view piece : pieces) {
      // UTF-16 copy of the piece plus, per UTF-16 unit, the byte offset it came from.
      u.remove();
      byte_at.clear();
      for (size_t pos = 0; pos < piece.size();) {
        size_t len = 0;
        const char32_t cp = utf8::Decode(piece, pos, &len);
        const int32_t before = u.length();
        u.append(static_cast<UChar32>(cp));
        for (int32_t k = before; k < u.length(); ++k) byte_at.push_back(pos);
        pos += len;
      }
      byte_at.push_back(piece.size());

      // A piece whose matching fails (ICU's backtracking limits) stays whole.
      status = U_ZERO_ERROR;
      matcher->reset(u);
      size_t prev = 0;
      while (matcher->find(status) && U_SUCCESS(status)) {
        const size_t start = byte_at[matcher->start(status)];
        const size_t end = byte_at[matcher->end(status)];
        if (end <= start) continue;
        if (start > prev) next.push_back(piece.substr(prev, start - prev));
        next.push_back(piece.substr(start, end - start));
        prev = end;
      }
      if (prev < piece.size()) next.push_back(piece.substr(prev));
    }
    pieces = std::move(next);
  }
  return pieces;
}

}  // namespace kvrelay::engine
