// The `kvrelay` command-line tool is a set of subcommands, each in its own
// `cli/<name>_cmd.cc` file that registers itself with KVRELAY_COMMAND. Two-word
// commands ("bench engine") are registered under the joined name.
#pragma once

#include <string>
#include <vector>

namespace kvrelay::cli {

// Arguments after the command name; returns the process exit status.
using CommandFn = int (*)(const std::vector<std::string>& args);

struct Command {
  std::string name;
  std::string usage;  // one line: "generate --model PATH --prompt TEXT ..."
  CommandFn run;
};

bool RegisterCommand(Command command);
const std::vector<Command>& Commands();

}  // namespace kvrelay::cli

#define KVRELAY_COMMAND(id, name, usage, fn) \
  static const bool kvrelay_command_##id = ::kvrelay::cli::RegisterCommand({name, usage, fn})

#include <cstdio>
#include <optional>

#include "common/flags.h"

namespace kvrelay::cli {

// Parses a command's arguments against its spec. Returns the flags when the
// command should run; otherwise sets *exit_code and returns nullopt: 0 after
// printing the complete usage to stdout for --help / -h, 2 after printing the
// error (and a pointer to --help) to stderr.
inline std::optional<Flags> ParseCommandFlags(const std::vector<std::string>& args,
                                              const FlagSpec& spec, int* exit_code) {
  auto flags = Flags::Parse(args, spec);
  if (!flags.ok()) {
    std::fprintf(stderr, "%s: %s\n", spec.program.c_str(), flags.status().ToString().c_str());
    *exit_code = 2;
    return std::nullopt;
  }
  if (flags->help_requested()) {
    std::fputs(Flags::Usage(spec).c_str(), stdout);
    *exit_code = 0;
    return std::nullopt;
  }
  return std::move(flags).value();
}

// For commands that still parse with the flag-list form: true (after
// printing `usage` to stdout) when --help or -h is among the arguments.
inline bool PrintHelpIfAsked(const std::vector<std::string>& args, const char* usage) {
  for (const std::string& a : args) {
    if (a == "--help" || a == "-h") {
      std::printf("usage: kvrelay %s [--help]\n", usage);
      return true;
    }
  }
  return false;
}

}  // namespace kvrelay::cli
