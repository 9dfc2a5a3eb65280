// Small UTF-8 helpers shared by the tokenizer sources. Internal to kvrelay_tokenizer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kvrelay::engine::utf8 {

inline constexpr char32_t kReplacement = 0xFFFD;

// Decodes one code point at s[pos]. On success sets *len to its byte length and
// returns it. An invalid or truncated sequence (overlong, surrogate, > U+10FFFF,
// bad continuation) yields kReplacement with *len = 1, so callers always advance.
char32_t Decode(std::string_view s, size_t pos, size_t* len);

// Appends the UTF-8 encoding of `cp` (must be a valid scalar value).
void Append(char32_t cp, std::string* out);

// Length in bytes of the character that starts with lead byte `c`, from the lead
// byte alone (1 for ASCII and for bytes that cannot start a character).
size_t SequenceLength(unsigned char c);

// Splits `bytes` into a valid prefix and the rest: returns how many leading bytes
// form complete characters, where invalid sequences are counted as complete (the
// caller replaces them) but an incomplete valid prefix at the very end is not.
// Writes the valid text, with invalid bytes replaced by U+FFFD, to *out.
size_t TakeComplete(std::string_view bytes, std::string* out);

}  // namespace kvrelay::engine::utf8
