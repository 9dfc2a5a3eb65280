// kvrelay: one binary, many subcommands (see cli/command.h).
#include <cstdio>
#include <string>
#include <vector>

#include "cli/command.h"

namespace kvrelay::cli {

namespace {
std::vector<Command>& MutableCommands() {
  static std::vector<Command> commands;
  return commands;
}
}  // namespace

bool RegisterCommand(Command command) {
  MutableCommands().push_back(std::move(command));
  return true;
}

const std::vector<Command>& Commands() { return MutableCommands(); }

}  // namespace kvrelay::cli

static void PrintUsage() {
  std::fprintf(stderr, "usage: kvrelay <command> [flags]\ncommands:\n");
  for (const auto& c : kvrelay::cli::Commands()) std::fprintf(stderr, "  %s\n", c.usage.c_str());
}

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    PrintUsage();
    return args.empty() ? 2 : 0;
  }
  // Longest match first: "bench engine" before "bench".
  for (size_t words = std::min<size_t>(2, args.size()); words >= 1; --words) {
    std::string name = args[0];
    for (size_t i = 1; i < words; ++i) name += " " + args[i];
    for (const auto& c : kvrelay::cli::Commands()) {
      if (c.name == name) {
        std::vector<std::string> rest(args.begin() + static_cast<long>(words), args.end());
        return c.run(rest);
      }
    }
  }
  std::fprintf(stderr, "kvrelay: unknown command '%s'\n", args[0].c_str());
  PrintUsage();
  return 2;
}
