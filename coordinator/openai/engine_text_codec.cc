#include "coordinator/openai/engine_text_codec.h"

#include "engine/gguf/gguf.h"

namespace kvrelay::coordinator {
namespace {

class EngineDecoder : public StreamDecoder {
 public:
  explicit EngineDecoder(const engine::Tokenizer& tokenizer) : detok_(tokenizer) {}
  std::string Push(int32_t token) override { return detok_.Push(token); }
  std::string Flush() override { return detok_.Flush(); }

 private:
  engine::IncrementalDetokenizer detok_;
};

}  // namespace

Result<std::unique_ptr<EngineTextCodec>> EngineTextCodec::FromGguf(const engine::GgufFile& gguf) {
  std::unique_ptr<EngineTextCodec> codec(new EngineTextCodec());
  ASSIGN_OR_RETURN(codec->owned_tokenizer_, engine::Tokenizer::FromGguf(gguf));
  codec->tokenizer_ = codec->owned_tokenizer_.get();
  auto tmpl = engine::ChatTemplate::FromGguf(gguf);
  if (tmpl.ok()) {
    codec->owned_template_ = std::make_unique<engine::ChatTemplate>(std::move(*tmpl));
    codec->chat_template_ = codec->owned_template_.get();
  } else if (tmpl.status().code() != StatusCode::kNotFound) {
    return tmpl.status().WithContext("loading the chat template");
  }
  return codec;
}

Result<std::unique_ptr<EngineTextCodec>> EngineTextCodec::FromModelFile(const std::string& path) {
  ASSIGN_OR_RETURN(auto gguf, engine::GgufFile::Open(path));
  auto codec = FromGguf(*gguf);
  if (!codec.ok()) return codec.status().WithContext(path);
  return codec;
}

EngineTextCodec::EngineTextCodec(const engine::Tokenizer* tokenizer,
                                 const engine::ChatTemplate* chat_template)
    : tokenizer_(tokenizer), chat_template_(chat_template) {}

Result<std::vector<int32_t>> EngineTextCodec::Encode(std::string_view text,
                                                     bool add_special) const {
  return tokenizer_->Encode(text, add_special, /*parse_special=*/false);
}

Result<std::vector<int32_t>> EngineTextCodec::EncodeChat(
    const std::vector<ChatMessage>& messages) const {
  return EncodeChatTemplate(messages, /*add_generation_prompt=*/true);
}

Result<std::vector<int32_t>> EngineTextCodec::EncodeChatTemplate(
    const std::vector<ChatMessage>& messages, bool add_generation_prompt) const {
  if (chat_template_ == nullptr) {
    return FailedPrecondition("the model has no chat template; use /v1/completions");
  }
  std::vector<engine::ChatMessage> converted;
  converted.reserve(messages.size());
  for (const auto& m : messages) converted.push_back({m.role, m.content});
  ASSIGN_OR_RETURN(std::string rendered, chat_template_->Render(converted, add_generation_prompt));
  return tokenizer_->Encode(rendered, /*add_special=*/false, /*parse_special=*/true);
}

std::string EngineTextCodec::TokenPiece(int32_t token) const {
  return tokenizer_->TokenToPiece(token);
}

std::string EngineTextCodec::Decode(std::span<const int32_t> ids) const {
  return tokenizer_->Decode(ids);
}

std::unique_ptr<StreamDecoder> EngineTextCodec::NewDecoder() const {
  return std::make_unique<EngineDecoder>(*tokenizer_);
}

}  // namespace kvrelay::coordinator
