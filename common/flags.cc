#include "common/flags.h"

#include <algorithm>
#include <cstdlib>

namespace kvrelay {
namespace {

// Levenshtein distance, for "did you mean" (flag names are short).
size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

}  // namespace

std::string SuggestFlag(const std::string& name, const std::vector<std::string>& known) {
  std::string best;
  size_t best_d = std::max<size_t>(2, name.size() / 3) + 1;  // farther than this: no guess
  for (const std::string& k : known) {
    size_t d = EditDistance(name, k);
    // A known flag that the typed one is a prefix or suffix of (--kv-store-path
    // for --kv-store, --port for --control-port) is a near miss too.
    if (k.size() >= 3 && (name.find(k) != std::string::npos || k.find(name) != std::string::npos)) {
      d = std::min<size_t>(d, 1 + (name.size() > k.size() ? 0 : 1));
    }
    if (d < best_d) {
      best_d = d;
      best = k;
    }
  }
  return best;
}

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
      std::vector<std::string> known = known_values;
      known.insert(known.end(), known_switches.begin(), known_switches.end());
      const std::string guess = SuggestFlag(name, known);
      return InvalidArgument("unknown flag --" + name +
                             (guess.empty() ? "" : " (did you mean --" + guess + "?)"));
    }
  }
  return flags;
}

Result<Flags> Flags::Parse(const std::vector<std::string>& args, const FlagSpec& spec) {
  std::vector<std::string> values, switches;
  for (const FlagDef& d : spec.flags) (d.is_switch ? switches : values).push_back(d.name);
  // --help / -h wins over everything else, wherever it appears (but not as the
  // value of a flag: `--prompt -h` is a prompt).
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      Flags flags;
      flags.help_ = true;
      return flags;
    }
    if (a.rfind("--", 0) == 0 && a.find('=') == std::string::npos &&
        std::find(values.begin(), values.end(), a.substr(2)) != values.end()) {
      ++i;  // skip the value
    }
  }
  ASSIGN_OR_RETURN(Flags flags, Parse(args, values, switches));
  if (flags.positional_.size() > spec.max_positional) {
    const std::string& extra = flags.positional_[spec.max_positional];
    return InvalidArgument("unexpected argument '" + extra + "'" +
                           (spec.max_positional == 0 ? " (this command takes only --flags)" : "") +
                           "; see " + spec.program + " --help");
  }
  return flags;
}

std::string Flags::Usage(const FlagSpec& spec) {
  std::string out = "usage: " + spec.program + " [flags]";
  if (!spec.positional.empty()) out += " " + spec.positional;
  out += "\n";
  if (!spec.summary.empty()) out += "\n" + spec.summary + "\n";
  out += "\nflags:\n";
  size_t width = 6;  // "--help"
  auto label = [](const FlagDef& d) { return "--" + d.name + (d.is_switch ? "" : " VALUE"); };
  for (const FlagDef& d : spec.flags) width = std::max(width, label(d).size());
  for (const FlagDef& d : spec.flags) {
    std::string l = label(d);
    out += "  " + l + std::string(width - l.size() + 2, ' ') + d.help;
    if (!d.is_switch) {
      if (!d.default_value.empty()) out += " (default: " + d.default_value + ")";
    }
    out += "\n";
  }
  out += "  --help" + std::string(width - 6 + 2, ' ') + "print this help and exit (also -h)\n";
  return out;
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
