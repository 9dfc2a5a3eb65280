// `kvrelay tokenize --model PATH (--text TEXT | --file PATH) [...]`: prints the
// token ids of a text with the model's tokenizer, optionally after applying the
// chat template, and how fast it tokenized (--repeat N runs the encoder N times).
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "cli/command.h"
#include "common/flags.h"
#include "engine/gguf/gguf.h"
#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/tokenizer.h"

namespace kvrelay::cli {
namespace {

int Fail(const Status& s) {
  std::fprintf(stderr, "tokenize: %s\n", s.ToString().c_str());
  return 1;
}

const FlagSpec kSpec = {
    "kvrelay tokenize",
    "Token ids of --text or --file with the model's tokenizer.",
    "",
    0,
    {{"model", "", "GGUF model path (required)"},
     {"text", "", "text to tokenize (this or --file)"},
     {"file", "", "file to tokenize"},
     {"repeat", "1", "tokenize this many times (timing)"},
     {"add-special", "", "add BOS/EOS as the model does", true},
     {"parse-special", "", "parse special tokens such as <|im_start|>", true},
     {"chat", "", "render the text as a user turn with the chat template", true},
     {"decode", "", "decode the ids back and print the text", true},
     {"quiet", "", "do not print the ids", true}}};

int RunTokenize(const std::vector<std::string>& args) {
  int exit_code = 0;
  auto flags = ParseCommandFlags(args, kSpec, &exit_code);
  if (!flags) return exit_code;
  if (!flags->Has("model")) return Fail(InvalidArgument("--model PATH is required"));
  std::string text;
  if (flags->Has("file")) {
    std::ifstream in(flags->Get("file"), std::ios::binary);
    if (!in) return Fail(NotFound("cannot read --file " + flags->Get("file")));
    std::ostringstream ss;
    ss << in.rdbuf();
    text = ss.str();
  } else if (flags->Has("text")) {
    text = flags->Get("text");
  } else {
    return Fail(InvalidArgument("one of --text TEXT or --file PATH is required"));
  }
  auto repeat = flags->GetInt("repeat", 1);
  if (!repeat.ok()) return Fail(repeat.status());
  if (*repeat < 1) return Fail(InvalidArgument("--repeat must be >= 1"));

  auto gguf = engine::GgufFile::Open(flags->Get("model"));
  if (!gguf.ok()) return Fail(gguf.status());
  auto tok = engine::Tokenizer::FromGguf(**gguf);
  if (!tok.ok()) return Fail(tok.status());

  bool parse_special = flags->Has("parse-special");
  if (flags->Has("chat")) {
    auto tmpl = engine::ChatTemplate::FromGguf(**gguf);
    if (!tmpl.ok()) return Fail(tmpl.status());
    auto rendered = tmpl->Render({{"user", text}}, /*add_generation_prompt=*/true);
    if (!rendered.ok()) return Fail(rendered.status());
    text = *rendered;
    parse_special = true;
  }

  std::vector<int32_t> ids;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < *repeat; ++i)
    ids = (*tok)->Encode(text, flags->Has("add-special"), parse_special);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  if (!flags->Has("quiet")) {
    for (size_t i = 0; i < ids.size(); ++i) std::printf("%s%d", i ? " " : "", ids[i]);
    std::printf("\n");
  }
  if (flags->Has("decode")) std::printf("%s\n", (*tok)->Decode(ids).c_str());
  const double mb = static_cast<double>(text.size()) * static_cast<double>(*repeat) / 1e6;
  std::fprintf(stderr, "%zu tokens from %zu bytes; %.3f ms per encode, %.2f MB/s, %.0f tokens/s\n",
               ids.size(), text.size(), secs * 1e3 / static_cast<double>(*repeat), mb / secs,
               static_cast<double>(ids.size()) * static_cast<double>(*repeat) / secs);
  return 0;
}

}  // namespace

KVRELAY_COMMAND(
    tokenize, "tokenize",
    "tokenize --model PATH (--text TEXT | --file PATH) [--add-special] [--parse-special] "
    "[--chat] [--decode] [--repeat N] [--quiet]  (token ids and tokenizer speed)",
    RunTokenize);

}  // namespace kvrelay::cli
