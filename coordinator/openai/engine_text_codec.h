// TextCodec over the engine's tokenizer and chat template (the real model's
// vocabulary), used by the coordinator in every deployment mode.
#pragma once

#include <memory>
#include <string>

#include "coordinator/openai/text_codec.h"
#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/tokenizer.h"

namespace kvrelay::engine {
class GgufFile;
}

namespace kvrelay::coordinator {

class EngineTextCodec : public TextCodec {
 public:
  // Reads tokenizer.* and tokenizer.chat_template from the model file (only
  // metadata; weights are not touched). The file need not outlive the codec.
  static Result<std::unique_ptr<EngineTextCodec>> FromGguf(const engine::GgufFile& gguf);
  static Result<std::unique_ptr<EngineTextCodec>> FromModelFile(const std::string& path);
  // Borrows a tokenizer and template owned elsewhere (e.g. by engine::Model);
  // they must outlive the codec. `chat_template` may be null (chat is then an error).
  EngineTextCodec(const engine::Tokenizer* tokenizer, const engine::ChatTemplate* chat_template);

  // Plain prompts: special-token text in user input is NOT parsed as special
  // tokens (so "<|im_end|>" in a prompt cannot forge a turn boundary).
  Result<std::vector<int32_t>> Encode(std::string_view text, bool add_special) const override;
  // Renders the chat template with the generation prompt and tokenizes the
  // result with special tokens parsed (the template's own markers).
  Result<std::vector<int32_t>> EncodeChat(const std::vector<ChatMessage>& messages) const override;
  Result<std::vector<int32_t>> EncodeChatTemplate(const std::vector<ChatMessage>& messages,
                                                  bool add_generation_prompt) const override;
  int64_t VocabSize() const override { return tokenizer_->vocab_size(); }
  std::string Decode(std::span<const int32_t> ids) const override;
  std::unique_ptr<StreamDecoder> NewDecoder() const override;
  std::string TokenPiece(int32_t token) const override;

  const engine::Tokenizer& tokenizer() const { return *tokenizer_; }

 private:
  EngineTextCodec() = default;

  std::unique_ptr<engine::Tokenizer> owned_tokenizer_;
  std::unique_ptr<engine::ChatTemplate> owned_template_;
  const engine::Tokenizer* tokenizer_ = nullptr;
  const engine::ChatTemplate* chat_template_ = nullptr;
};

}  // namespace kvrelay::coordinator
