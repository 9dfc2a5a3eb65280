// Chat templates: messages -> the prompt text a model was trained on.
//
// Models ship a Jinja template (tokenizer.chat_template). kvrelay does not run
// Jinja; it recognises the template families real models ship by inspecting the
// template text and renders them natively:
//   kChatMl  <|im_start|>role\ncontent<|im_end|>\n (SmolLM2, Qwen2), including a
//            default system prompt written in the template, used when the first
//            message is not a system message;
//   kLlama3  <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>, with the
//            Llama-3.1+ system header ("Cutting Knowledge Date") when the template has it;
//   kLlama2  <s>[INST] <<SYS>>\nsystem\n<</SYS>>\n\nuser [/INST] answer </s>;
//   kGemma   [bos]<start_of_turn>user\ncontent<end_of_turn>\n ... <start_of_turn>model\n
//            (Gemma 2 / 3: "assistant" is written "model", a system message is
//            prefixed to the first user turn with "\n\n", contents trimmed, roles
//            must alternate user/model; BOS text only where the template writes bos_token).
// Anything else is rejected with kUnimplemented when the template is loaded.
//
// The rendered text contains special-token text (and the BOS text where the
// template writes bos_token): tokenize it with add_special=false, parse_special=true.
// A ChatTemplate is immutable; Render is thread-safe.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace kvrelay::engine {

class GgufFile;

struct ChatMessage {
  std::string role;  // "system" | "user" | "assistant" (ChatML and Llama-3 accept any role)
  std::string content;
};

enum class ChatTemplateFamily { kChatMl, kLlama3, kLlama2, kGemma };

// Values the template refers to by name.
struct ChatTemplateOptions {
  std::string bos_token;  // "" = the family's usual text (<|begin_of_text|>, <s>)
  std::string eos_token;  // "" = the family's usual text (</s> for Llama-2)
};

class ChatTemplate {
 public:
  // Reads tokenizer.chat_template (NotFound when absent) and the BOS/EOS token texts.
  static Result<ChatTemplate> FromGguf(const GgufFile& gguf);
  // kUnimplemented naming the template as unsupported when no family matches.
  static Result<ChatTemplate> FromString(std::string jinja, ChatTemplateOptions options = {});

  // kInvalidArgument for an empty conversation, or (Llama-2) roles that do not
  // alternate user/assistant after an optional leading system message.
  Result<std::string> Render(const std::vector<ChatMessage>& messages,
                             bool add_generation_prompt) const;

  ChatTemplateFamily family() const { return family_; }
  // The default system prompt found in the template ("" when none).
  const std::string& default_system() const { return default_system_; }
  const std::string& source() const { return source_; }

 private:
  ChatTemplate() = default;

  std::string source_;
  ChatTemplateFamily family_ = ChatTemplateFamily::kChatMl;
  ChatTemplateOptions options_;
  std::string default_system_;   // ChatML
  bool llama31_system_ = false;  // Llama-3.1+ always writes a system header
  std::string date_string_;      // its "Today Date"
  bool writes_bos_ = false;      // Gemma: the template starts with {{ bos_token }}
};

}  // namespace kvrelay::engine
