// A tiny flag parser for subcommands: --name value, --name=value and bare --switch.
// Unknown flags are an error that names the flag.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace kvrelay {

class Flags {
 public:
  // `switches` are flags that take no value; `positional` receives the rest.
  static Result<Flags> Parse(const std::vector<std::string>& args,
                             const std::vector<std::string>& known_values,
                             const std::vector<std::string>& known_switches);

  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  std::string Get(const std::string& name, const std::string& fallback = "") const;
  Result<int64_t> GetInt(const std::string& name, int64_t fallback) const;
  Result<double> GetDouble(const std::string& name, double fallback) const;
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  std::map<std::string, std::string> values_;
  std::vector<std::string> positional_;
};

}  // namespace kvrelay
