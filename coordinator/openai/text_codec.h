// Text <-> token ids for the coordinator: tokenizer, chat template and an
// incremental, UTF-8 safe detokenizer. An interface so the HTTP layer can be
// tested with a trivial codec and served with the model's real tokenizer.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kvrelay::coordinator {

struct ChatMessage {
  std::string role;  // "system" | "user" | "assistant" | "tool" | "developer"
  std::string content;
};

// Turns a stream of token ids into text. Holds back bytes of an incomplete
// UTF-8 sequence until it completes. One per request; not thread-safe.
class StreamDecoder {
 public:
  virtual ~StreamDecoder() = default;
  // Text made complete by this token (possibly empty).
  virtual std::string Push(int32_t token) = 0;
  // Whatever is still held back at the end of the stream.
  virtual std::string Flush() = 0;
};

// Thread-safe: one codec serves all requests concurrently.
class TextCodec {
 public:
  virtual ~TextCodec() = default;
  // Tokenizes raw text; `add_special` adds BOS where the model wants it.
  virtual Result<std::vector<int32_t>> Encode(std::string_view text, bool add_special) const = 0;
  // Applies the model's chat template and tokenizes the result (special
  // tokens in the rendered template are parsed as such).
  virtual Result<std::vector<int32_t>> EncodeChat(
      const std::vector<ChatMessage>& messages) const = 0;
  // As EncodeChat, with or without the assistant turn's opening (for
  // /tokenize). The default renders only with it (EncodeChat).
  virtual Result<std::vector<int32_t>> EncodeChatTemplate(const std::vector<ChatMessage>& messages,
                                                          bool add_generation_prompt) const {
    if (!add_generation_prompt) {
      return InvalidArgument("this tokenizer cannot render a chat without the generation prompt");
    }
    return EncodeChat(messages);
  }
  virtual std::unique_ptr<StreamDecoder> NewDecoder() const = 0;
  // Token ids are [0, VocabSize()); 0 = unknown (ids are not checked here).
  virtual int64_t VocabSize() const { return 0; }
  // The text of a whole sequence of ids (ids must be in the vocabulary).
  virtual std::string Decode(std::span<const int32_t> ids) const {
    std::unique_ptr<StreamDecoder> d = NewDecoder();
    std::string s;
    for (int32_t id : ids) s += d->Push(id);
    return s + d->Flush();
  }
  // The bytes one token stands for (for logprobs); may be an incomplete UTF-8
  // sequence.
  virtual std::string TokenPiece(int32_t token) const {
    std::unique_ptr<StreamDecoder> d = NewDecoder();
    std::string s = d->Push(token);
    return s + d->Flush();
  }
};

}  // namespace kvrelay::coordinator
