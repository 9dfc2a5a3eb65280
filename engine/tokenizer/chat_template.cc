#include "engine/tokenizer/chat_template.h"

#include <ctime>

#include "engine/gguf/gguf.h"
#include "engine/tokenizer/utf8.h"

namespace kvrelay::engine {
namespace {

bool Contains(const std::string& s, std::string_view what) {
  return s.find(what) != std::string::npos;
}

bool IsPythonSpace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

// Python's str.strip() (Jinja's trim filter): removes leading and trailing whitespace.
std::string Strip(std::string_view s) {
  size_t begin = 0;
  while (begin < s.size()) {
    size_t len = 0;
    if (!IsPythonSpace(utf8::Decode(s, begin, &len))) break;
    begin += len;
  }
  size_t end = begin;  // one past the last non-space character
  for (size_t pos = begin; pos < s.size();) {
    size_t len = 0;
    const bool space = IsPythonSpace(utf8::Decode(s, pos, &len));
    pos += len;
    if (!space) end = pos;
  }
  return std::string(s.substr(begin, end - begin));
}

// Unescapes the body of a Jinja string literal (\n, \t, \\, \', \").
std::string UnescapeLiteral(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 1 < s.size()) {
      const char c = s[++i];
      out.push_back(c == 'n' ? '\n' : c == 't' ? '\t' : c == 'r' ? '\r' : c);
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

// A ChatML default system prompt is a constant inside one string literal:
// '<|im_start|>system\n...<|im_end|>' with no quote in between (a quote means the
// text is concatenated with a variable, i.e. the user's system message).
std::string FindChatMlDefaultSystem(const std::string& t) {
  static constexpr std::string_view kOpen = "<|im_start|>system";
  for (size_t pos = t.find(kOpen); pos != std::string::npos; pos = t.find(kOpen, pos + 1)) {
    size_t body = pos + kOpen.size();
    if (t.compare(body, 2, "\\n") == 0) {
      body += 2;
    } else if (body < t.size() && t[body] == '\n') {
      body += 1;
    } else {
      continue;
    }
    const size_t end = t.find("<|im_end|>", body);
    if (end == std::string::npos) break;
    const std::string_view between(t.data() + body, end - body);
    if (between.find_first_of("'\"{}") != std::string_view::npos) continue;
    return UnescapeLiteral(between);
  }
  return "";
}

// The value of `set date_string = "..."` in a Llama-3.1 template, if constant.
std::string FindDateString(const std::string& t) {
  const size_t pos = t.find("set date_string = \"");
  if (pos == std::string::npos) return "";
  const size_t begin = pos + 19;
  const size_t end = t.find('"', begin);
  return end == std::string::npos ? "" : t.substr(begin, end - begin);
}

std::string Today() {
  // Templates that call strftime_now("%d %b %Y") render the current date.
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%d %b %Y", &tm);
  return buf;
}

}  // namespace

Result<ChatTemplate> ChatTemplate::FromString(std::string jinja, ChatTemplateOptions options) {
  ChatTemplate t;
  t.options_ = std::move(options);
  const std::string& s = jinja;
  if (Contains(s, "<|im_start|>")) {
    t.family_ = ChatTemplateFamily::kChatMl;
    t.default_system_ = FindChatMlDefaultSystem(s);
  } else if (Contains(s, "<|start_header_id|>") && Contains(s, "<|end_header_id|>")) {
    t.family_ = ChatTemplateFamily::kLlama3;
    if (t.options_.bos_token.empty()) t.options_.bos_token = "<|begin_of_text|>";
    if (Contains(s, "Cutting Knowledge Date")) {
      t.llama31_system_ = true;
      t.date_string_ = FindDateString(s);
      if (t.date_string_.empty()) t.date_string_ = Today();
    }
  } else if (Contains(s, "[INST]") && Contains(s, "<<SYS>>")) {
    t.family_ = ChatTemplateFamily::kLlama2;
    if (t.options_.bos_token.empty()) t.options_.bos_token = "<s>";
    if (t.options_.eos_token.empty()) t.options_.eos_token = "</s>";
  } else if (Contains(s, "<start_of_turn>") && Contains(s, "<end_of_turn>")) {
    t.family_ = ChatTemplateFamily::kGemma;
    t.writes_bos_ = Contains(s, "bos_token");
    if (t.options_.bos_token.empty()) t.options_.bos_token = "<bos>";
  } else {
    return Unimplemented(
        "chat template is not supported (not ChatML, Llama-3, Llama-2 [INST] or Gemma style): '" +
        s.substr(0, 80) + (s.size() > 80 ? "...'" : "'"));
  }
  t.source_ = std::move(jinja);
  return t;
}

Result<ChatTemplate> ChatTemplate::FromGguf(const GgufFile& gguf) {
  if (gguf.Find("tokenizer.chat_template") == nullptr) {
    return NotFound("the model has no tokenizer.chat_template");
  }
  ASSIGN_OR_RETURN(std::string jinja, gguf.GetString("tokenizer.chat_template"));
  ChatTemplateOptions options;
  if (gguf.Find("tokenizer.ggml.tokens") != nullptr) {
    ASSIGN_OR_RETURN(std::vector<std::string> tokens, gguf.GetStringArray("tokenizer.ggml.tokens"));
    auto text_of = [&](const char* key, std::string* out) {
      Result<int64_t> id = gguf.GetInt(key);
      if (id.ok() && *id >= 0 && *id < static_cast<int64_t>(tokens.size())) *out = tokens[*id];
    };
    text_of("tokenizer.ggml.bos_token_id", &options.bos_token);
    text_of("tokenizer.ggml.eos_token_id", &options.eos_token);
  }
  return FromString(std::move(jinja), std::move(options));
}

Result<std::string> ChatTemplate::Render(const std::vector<ChatMessage>& messages,
                                         bool add_generation_prompt) const {
  if (messages.empty()) return InvalidArgument("chat template: the conversation has no messages");
  std::string out;
  switch (family_) {
    case ChatTemplateFamily::kChatMl: {
      if (messages[0].role != "system" && !default_system_.empty()) {
        out += "<|im_start|>system\n" + default_system_ + "<|im_end|>\n";
      }
      for (const ChatMessage& m : messages) {
        out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
      }
      if (add_generation_prompt) out += "<|im_start|>assistant\n";
      break;
    }
    case ChatTemplateFamily::kLlama3: {
      out += options_.bos_token;
      size_t first = 0;
      if (llama31_system_) {
        std::string system;
        if (messages[0].role == "system") {
          system = Strip(messages[0].content);
          first = 1;
        }
        out +=
            "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n";
        out += "Today Date: " + date_string_ + "\n\n" + system + "<|eot_id|>";
      }
      for (size_t i = first; i < messages.size(); ++i) {
        out += "<|start_header_id|>" + messages[i].role + "<|end_header_id|>\n\n" +
               Strip(messages[i].content) + "<|eot_id|>";
      }
      if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      break;
    }
    case ChatTemplateFamily::kLlama2: {
      size_t first = 0;
      std::string system;
      bool has_system = false;
      if (messages[0].role == "system") {
        system = messages[0].content;
        has_system = true;
        first = 1;
      }
      for (size_t i = first; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
        const bool expect_user = (i - first) % 2 == 0;
        if ((m.role == "user") != expect_user || (m.role != "user" && m.role != "assistant")) {
          return InvalidArgument(
              "chat template: conversation roles must alternate "
              "user/assistant/user/... (message " +
              std::to_string(i) + " has role '" + m.role + "')");
        }
        std::string content = m.content;
        if (i == first && has_system) content = "<<SYS>>\n" + system + "\n<</SYS>>\n\n" + content;
        if (m.role == "user") {
          out += options_.bos_token + "[INST] " + Strip(content) + " [/INST]";
        } else {
          out += " " + Strip(content) + " " + options_.eos_token;
        }
      }
      break;  // the Llama-2 template has no generation prompt
    }
    case ChatTemplateFamily::kGemma: {
      if (writes_bos_) out += options_.bos_token;
      size_t first = 0;
      std::string prefix;
      if (messages[0].role == "system") {
        prefix = messages[0].content + "\n\n";  // untrimmed, as the Gemma 3 template
        first = 1;
      }
      for (size_t i = first; i < messages.size(); ++i) {
        const ChatMessage& m = messages[i];
        const bool expect_user = (i - first) % 2 == 0;
        if ((m.role == "user") != expect_user || (m.role != "user" && m.role != "assistant")) {
          return InvalidArgument(
              "chat template: conversation roles must alternate "
              "user/assistant/user/... (message " +
              std::to_string(i) + " has role '" + m.role + "')");
        }
        out += "<start_of_turn>" + std::string(m.role == "assistant" ? "model" : "user") + "\n";
        if (i == first) out += prefix;
        out += Strip(m.content) + "<end_of_turn>\n";
      }
      if (add_generation_prompt) out += "<start_of_turn>model\n";
      break;
    }
  }
  return out;
}

}  // namespace kvrelay::engine
