// Chat templates. Expected renderings are derived from the template text (what
// Jinja produces for it); for SmolLM2 they are jinja2's own renderings recorded in
// tests/data/llamacpp_reference.json by tools/reference/record_llamacpp.py.
#include "engine/tokenizer/chat_template.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

namespace kvrelay::engine {
namespace {

// Qwen2-Instruct's template (ChatML with a default system prompt).
constexpr const char* kQwen2 =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
    "'<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' "
    "+ "
    "message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if "
    "add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

// Plain ChatML, no default system prompt; "\n" escaped inside the literals.
constexpr const char* kChatMl =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' "
    "}}{% endif %}";

// Meta-Llama-3-8B-Instruct's template.
constexpr const char* kLlama3 =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim "
    "+ "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ "
    "content }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

// Llama-2-chat's template.
constexpr const char* kLlama2 =
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set "
    "system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set "
    "system_message = false %}{% endif %}{% for message in loop_messages %}{% if (message['role'] "
    "== "
    "'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and system_message != "
    "false %}{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + "
    "message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if "
    "message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif "
    "message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% "
    "endfor %}";

// Phi-3's turn markers: a family kvrelay does not render.
constexpr const char* kPhi3 =
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + "
    "'<|end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}";

// Gemma 3's template (text content), one line.
constexpr const char* kGemma3 =
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = "
    "messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}{%- "
    "set first_user_prefix = \"\" -%}{%- set loop_messages = messages -%}{%- endif -%}{%- for "
    "message in loop_messages -%}{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) "
    "-%}{{ raise_exception(\"Conversation roles must alternate "
    "user/assistant/user/assistant/...\") }}{%- endif -%}{%- if (message['role'] == 'assistant') "
    "-%}{%- set role = \"model\" -%}{%- else -%}{%- set role = message['role'] -%}{%- endif -%}{{ "
    "'<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}{{ "
    "message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}{%- if add_generation_prompt "
    "-%}{{'<start_of_turn>model\n'}}{%- endif -%}";

std::string RenderOrDie(const ChatTemplate& t, const std::vector<ChatMessage>& m, bool agp) {
  auto r = t.Render(m, agp);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? *r : "";
}

TEST(ChatTemplateTest, Qwen2DefaultSystemPrompt) {
  auto t = ChatTemplate::FromString(kQwen2);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->family(), ChatTemplateFamily::kChatMl);
  EXPECT_EQ(t->default_system(), "You are a helpful assistant.");
  EXPECT_EQ(RenderOrDie(*t, {{"user", "Hi"}}, true),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(RenderOrDie(*t, {{"system", "Be brief."}, {"user", "Hi"}}, false),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
}

TEST(ChatTemplateTest, PlainChatMlHasNoDefaultSystem) {
  auto t = ChatTemplate::FromString(kChatMl);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->default_system(), "");
  EXPECT_EQ(RenderOrDie(*t, {{"user", "a"}, {"assistant", "b"}, {"user", "c"}}, true),
            "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n"
            "<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ChatTemplateTest, Llama3HeadersTrimAndBos) {
  auto t = ChatTemplate::FromString(kLlama3);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->family(), ChatTemplateFamily::kLlama3);
  EXPECT_EQ(
      RenderOrDie(*t, {{"system", "You are terse."}, {"user", "  Hi there \n"}}, true),
      "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
      "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(RenderOrDie(*t, {{"user", "x"}}, false),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nx<|eot_id|>");
}

TEST(ChatTemplateTest, Llama31SystemHeader) {
  // The Llama-3.1 template always writes a system header with its knowledge cut-off
  // and date_string (a constant in this template).
  const std::string t31 =
      std::string(
          "{{- bos_token }}{%- if not date_string is defined %}{%- set date_string = \"26 Jul "
          "2024\" "
          "%}{%- endif %}{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}"
          "{{- \"Cutting Knowledge Date: December 2023\\n\" }}{{- \"Today Date: \" + date_string + "
          "\"\\n\\n\" }}{{- system_message }}{{- \"<|eot_id|>\" }}") +
      kLlama3;
  auto t = ChatTemplate::FromString(t31);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(RenderOrDie(*t, {{"system", " Be nice. "}, {"user", "Hi"}}, true),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
            "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe nice.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

TEST(ChatTemplateTest, Llama2InstWithSystem) {
  auto t = ChatTemplate::FromString(kLlama2);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->family(), ChatTemplateFamily::kLlama2);
  EXPECT_EQ(
      RenderOrDie(
          *t, {{"system", "Sys"}, {"user", "Hi "}, {"assistant", " Hello"}, {"user", "Bye"}}, true),
      "<s>[INST] <<SYS>>\nSys\n<</SYS>>\n\nHi [/INST] Hello </s><s>[INST] Bye [/INST]");
  EXPECT_EQ(RenderOrDie(*t, {{"user", "Q"}}, true), "<s>[INST] Q [/INST]");
}

TEST(ChatTemplateTest, Llama2RejectsNonAlternatingRoles) {
  auto t = ChatTemplate::FromString(kLlama2);
  ASSERT_TRUE(t.ok());
  auto r = t->Render({{"user", "a"}, {"user", "b"}}, true);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("alternate"), std::string::npos);
  EXPECT_FALSE(t->Render({{"assistant", "a"}}, true).ok());
}

TEST(ChatTemplateTest, UnknownTemplateIsUnimplemented) {
  auto t = ChatTemplate::FromString(kPhi3);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(t.status().message().find("not supported"), std::string::npos);
  EXPECT_FALSE(ChatTemplate::FromString("").ok());
}

TEST(ChatTemplateTest, EmptyConversationIsInvalid) {
  auto t = ChatTemplate::FromString(kQwen2);
  ASSERT_TRUE(t.ok());
  auto r = t->Render({}, true);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

TEST(ChatTemplateTest, SmolLm2MatchesJinja2Renderings) {
  const char* src = std::getenv("KVRELAY_SOURCE_DIR");
  ASSERT_NE(src, nullptr) << "run under ctest (KVRELAY_SOURCE_DIR)";
  std::ifstream in(std::string(src) + "/tests/data/llamacpp_reference.json");
  ASSERT_TRUE(in.good());
  const auto ref = nlohmann::json::parse(in);
  const auto& chat = ref.at("chat");
  auto t = ChatTemplate::FromString(chat.at("template").get<std::string>());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->default_system(),
            "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
  int n = 0;
  for (const auto& r : chat.at("renderings")) {
    std::vector<ChatMessage> msgs;
    for (const auto& m : r.at("messages")) msgs.push_back({m.at("role"), m.at("content")});
    EXPECT_EQ(RenderOrDie(*t, msgs, r.at("add_generation_prompt").get<bool>()),
              r.at("text").get<std::string>());
    ++n;
  }
  EXPECT_GE(n, 10);
}

// Expected texts: jinja2 3.1.6 renderings of kGemma3 with bos_token "<bos>".
TEST(ChatTemplateTest, Gemma3MatchesJinja2Renderings) {
  auto t = ChatTemplate::FromString(kGemma3, {"<bos>", "<eos>"});
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->family(), ChatTemplateFamily::kGemma);
  const std::vector<std::vector<ChatMessage>> convs = {
      {{"user", "Hi!"}},
      {{"system", "You are terse."}, {"user", "  Name three fruits. "}},
      {{"user", "What is 12 times 12?"}, {"assistant", " 144. "}, {"user", "And 13?"}}};
  const char* want[] = {
      "<bos><start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\n",
      "<bos><start_of_turn>user\nHi!<end_of_turn>\n",
      "<bos><start_of_turn>user\nYou are terse.\n\nName three "
      "fruits.<end_of_turn>\n<start_of_turn>model\n",
      "<bos><start_of_turn>user\nYou are terse.\n\nName three fruits.<end_of_turn>\n",
      "<bos><start_of_turn>user\nWhat is 12 times "
      "12?<end_of_turn>\n<start_of_turn>model\n144.<end_of_turn>\n<start_of_turn>user\nAnd "
      "13?<end_of_turn>\n<start_of_turn>model\n",
      "<bos><start_of_turn>user\nWhat is 12 times "
      "12?<end_of_turn>\n<start_of_turn>model\n144.<end_of_turn>\n<start_of_turn>user\nAnd "
      "13?<end_of_turn>\n"};
  int i = 0;
  for (const auto& c : convs) {
    for (bool agp : {true, false}) {
      EXPECT_EQ(RenderOrDie(*t, c, agp), want[i]) << i;
      ++i;
    }
  }
  auto bad = t->Render({{"user", "a"}, {"user", "b"}}, true);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("alternate"), std::string::npos);
}

}  // namespace
}  // namespace kvrelay::engine
