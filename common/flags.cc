#include "common/flags.h"

#include <algorithm>
#include <cstdlib>

namespace kvrelay {

Result<Flags> Flags::Parse(const std::vector<std::string>& args,
                           const std::vector<std::string>& known_values,
                           const std::vector<std::string>& known_switches) {
  auto contains = [](const std::vector<std::string>& v, const std::string& s) {
    return std::find(v.begin(), v.end(), s) != v.end();
  };
  Flags flags;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.rfind("--", 0) != 0 || a.size() == 2) {
      flags.positional_.push_back(a);
      continue;
    }
    std::string name = a.substr(2);
    std::string value;
    bool has_inline = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_inline = true;
    }
    if (contains(known_switches, name)) {
      if (has_inline) return InvalidArgument("flag --" + name + " takes no value");
      flags.values_[name] = "1";
    } else if (contains(known_values, name)) {
      if (!has_inline) {
        if (i + 1 >= args.size()) return InvalidArgument("flag --" + name + " needs a value");
        value = args[++i];
      }
      flags.values_[name] = value;
    } else {
      return InvalidArgument("unknown flag --" + name);
    }
  }
  return flags;
}

std::string Flags::Get(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

Result<int64_t> Flags::GetInt(const std::string& name, int64_t fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  char* end = nullptr;
  long long v = std::strtoll(it->second.c_str(), &end, 10);
  if (it->second.empty() || *end != '\0') {
    return InvalidArgument("flag --" + name + " expects an integer, got '" + it->second + "'");
  }
  return static_cast<int64_t>(v);
}

Result<double> Flags::GetDouble(const std::string& name, double fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  char* end = nullptr;
  double v = std::strtod(it->second.c_str(), &end);
  if (it->second.empty() || *end != '\0') {
    return InvalidArgument("flag --" + name + " expects a number, got '" + it->second + "'");
  }
  return v;
}

}  // namespace kvrelay
