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
