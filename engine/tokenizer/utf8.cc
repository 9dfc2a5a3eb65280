#include "engine/tokenizer/utf8.h"

namespace kvrelay::engine::utf8 {

size_t SequenceLength(unsigned char c) {
  if (c < 0x80) return 1;
  if ((c & 0xE0) == 0xC0) return 2;
  if ((c & 0xF0) == 0xE0) return 3;
  if ((c & 0xF8) == 0xF0) return 4;
  return 1;
}

namespace {

// Number of bytes of s[pos..] that are a valid prefix of a UTF-8 character, and
// whether the character is complete. Returns false when s[pos..] cannot start a
// valid character at all.
bool ValidPrefix(std::string_view s, size_t pos, size_t* have, size_t* need) {
  const auto c = static_cast<unsigned char>(s[pos]);
  size_t n;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c < 0x80) {
    *have = *need = 1;
    return true;
  } else if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;  // no overlongs
    if (c == 0xED) hi = 0x9F;  // no surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;  // <= U+10FFFF
  } else {
    return false;
  }
  size_t i = 1;
  for (; i < n && pos + i < s.size(); ++i) {
    const auto b = static_cast<unsigned char>(s[pos + i]);
    const unsigned char l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xBF;
    if (b < l || b > h) return false;
  }
  *have = i;
  *need = n;
  return true;
}

}  // namespace

char32_t Decode(std::string_view s, size_t pos, size_t* len) {
  size_t have = 0, need = 0;
  if (!ValidPrefix(s, pos, &have, &need) || have < need) {
    *len = 1;
    return kReplacement;
  }
  *len = need;
  const auto c = static_cast<unsigned char>(s[pos]);
  if (need == 1) return c;
  char32_t cp = need == 2 ? (c & 0x1F) : need == 3 ? (c & 0x0F) : (c & 0x07);
  for (size_t i = 1; i < need; ++i)
    cp = (cp << 6) | (static_cast<unsigned char>(s[pos + i]) & 0x3F);
  return cp;
}

void Append(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

size_t TakeComplete(std::string_view bytes, std::string* out) {
  size_t pos = 0;
  while (pos < bytes.size()) {
    size_t have = 0, need = 0;
    if (!ValidPrefix(bytes, pos, &have, &need)) {
      Append(kReplacement, out);
      pos += 1;
      continue;
    }
    if (have < need) {
      if (pos + have == bytes.size()) break;  // incomplete at the end: hold back
      Append(kReplacement, out);              // truncated in the middle
      pos += 1;
      continue;
    }
    out->append(bytes.substr(pos, need));
    pos += need;
  }
  return pos;
}

}  // namespace kvrelay::engine::utf8
