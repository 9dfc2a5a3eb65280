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

// Asked-for help goes to stdout (exit 0); usage after a mistake to stderr.
static void PrintUsage(std::FILE* out) {
  std::fprintf(out,
               "usage: kvrelay <command> [flags]   (kvrelay <command> --help: all its flags and "
               "defaults)\ncommands:\n");
  for (const auto& c : kvrelay::cli::Commands()) std::fprintf(out, "  %s\n", c.usage.c_str());
}

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) {
    PrintUsage(stderr);
    return 2;
  }
  if (args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    if (args[0] == "help" && args.size() > 1) {  // kvrelay help generate == kvrelay generate --help
      args.erase(args.begin());
      args.push_back("--help");
    } else {
      PrintUsage(stdout);
      return 0;
    }
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
  PrintUsage(stderr);
  return 2;
}
