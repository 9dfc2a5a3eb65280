// A tiny flag parser for subcommands and daemons: --name value, --name=value
// and bare --switch. Unknown flags are an error that names the flag.
//
// A FlagSpec describes a command (its flags, their defaults, how many
// positional arguments it takes); parsing against it also recognises --help
// and -h (help_requested()), and Flags::Usage renders the complete usage text
// from the same table, so the help can never omit a flag the parser accepts.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace kvrelay {

struct FlagDef {
  std::string name;           // without the leading "--"
  std::string default_value;  // as shown in the usage; empty = no default (or required)
  std::string help;           // one line
  bool is_switch = false;     // takes no value
};

struct FlagSpec {
  std::string program;        // "kvrelay generate", "kvrelay-coordinator"
  std::string summary;        // one line: what the command does
  std::string positional;     // usage name of the positional arguments ("FILE"); empty = none
  size_t max_positional = 0;  // more positional arguments than this are an error
  std::vector<FlagDef> flags;
};

// The known flag closest to `name` (edit distance, or one containing the
// other), empty when none is close: the "did you mean" of unknown flags.
std::string SuggestFlag(const std::string& name, const std::vector<std::string>& known);

class Flags {
 public:
  // `switches` are flags that take no value; `positional` receives the rest.
  // This form knows no help and accepts any positional arguments; prefer the
  // FlagSpec form.
  static Result<Flags> Parse(const std::vector<std::string>& args,
                             const std::vector<std::string>& known_values,
                             const std::vector<std::string>& known_switches);
  // Parses against `spec`. --help / -h anywhere sets help_requested() (and
  // nothing else is checked, so `cmd --bad --help` still prints help); more
  // positional arguments than spec.max_positional is an error naming the first.
  static Result<Flags> Parse(const std::vector<std::string>& args, const FlagSpec& spec);
  // The complete usage: synopsis, summary, every flag with its default.
  static std::string Usage(const FlagSpec& spec);

  bool help_requested() const { return help_; }
  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  std::string Get(const std::string& name, const std::string& fallback = "") const;
  Result<int64_t> GetInt(const std::string& name, int64_t fallback) const;
  Result<double> GetDouble(const std::string& name, double fallback) const;
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  std::map<std::string, std::string> values_;
  std::vector<std::string> positional_;
  bool help_ = false;
};

}  // namespace kvrelay
