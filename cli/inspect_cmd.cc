// `kvrelay inspect PATH`: prints a GGUF file's version, metadata (arrays
// abbreviated) and tensor table with totals. A file the loader rejects prints
// the error and exits 1.
#include <cinttypes>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "cli/command.h"
#include "common/flags.h"
#include "common/hash.h"
#include "engine/gguf/fingerprint.h"
#include "engine/gguf/gguf.h"

namespace kvrelay::cli {
namespace {

using engine::GgufArray;
using engine::GgufFile;
using engine::GgufTensor;
using engine::GgufValue;
using engine::GgufValueType;

// Quoted, with control and non-ASCII bytes escaped, cut after `max_chars`.
std::string Quote(const std::string& s, size_t max_chars) {
  std::string out = "\"";
  for (size_t i = 0; i < s.size() && i < max_chars; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c < 0x20 || c >= 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  out += '"';
  if (s.size() > max_chars) out += "... (" + std::to_string(s.size()) + " bytes)";
  return out;
}

std::string Format(const GgufValue& v, size_t max_elems) {
  return std::visit(
      [&](const auto& x) -> std::string {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, std::string>) {
          return Quote(x, 80);
        } else if constexpr (std::is_same_v<T, std::shared_ptr<GgufArray>>) {
          if (x == nullptr) return "[]";
          std::string out = "[";
          for (size_t i = 0; i < x->values.size() && i < max_elems; ++i) {
            if (i > 0) out += ", ";
            out += x->values[i].type == GgufValueType::kString
                       ? Quote(std::get<std::string>(x->values[i].value), 24)
                       : Format(x->values[i], max_elems);
          }
          if (x->values.size() > max_elems) out += ", ...";
          return out + "]";
        } else if constexpr (std::is_same_v<T, bool>) {
          return x ? "true" : "false";
        } else if constexpr (std::is_floating_point_v<T>) {
          char buf[48];
          std::snprintf(buf, sizeof(buf), "%.9g", static_cast<double>(x));
          return buf;
        } else {
          return std::to_string(x);
        }
      },
      v.value);
}

std::string TypeLabel(const GgufValue& v) {
  std::string label(engine::GgufValueTypeName(v.type));
  if (const auto* a = std::get_if<std::shared_ptr<GgufArray>>(&v.value); a && *a) {
    label += "[" + std::string(engine::GgufValueTypeName((*a)->elem_type)) + " x " +
             std::to_string((*a)->values.size()) + "]";
  }
  return label;
}

std::string Dims(const GgufTensor& t) {
  std::string out = "[";
  for (size_t i = 0; i < t.dims.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(t.dims[i]);
  }
  return out + "]";
}

const FlagSpec kSpec = {"kvrelay inspect",
                        "Metadata and tensors of a GGUF file.",
                        "PATH",
                        1,
                        {{"max-array", "5", "array elements shown per metadata key"},
                         {"no-tensors", "", "do not list the tensors", true},
                         {"fingerprint", "", "print a content fingerprint", true}}};

int RunInspect(const std::vector<std::string>& args) {
  int exit_code = 0;
  auto flags = ParseCommandFlags(args, kSpec, &exit_code);
  if (!flags) return exit_code;
  if (flags->positional().size() != 1) {
    std::fputs(Flags::Usage(kSpec).c_str(), stderr);
    return 2;
  }
  Result<int64_t> max_array = flags->GetInt("max-array", 5);
  if (!max_array.ok() || *max_array < 0) {
    std::fprintf(stderr, "inspect: --max-array must be a non-negative integer\n");
    return 2;
  }
  const std::string& path = flags->positional()[0];
  Result<std::unique_ptr<GgufFile>> file = GgufFile::Open(path);
  if (!file.ok()) {
    std::fprintf(stderr, "inspect: %s\n", file.status().ToString().c_str());
    return 1;
  }
  const GgufFile& g = **file;
  std::printf("%s: GGUF version %u, alignment %" PRIu64 ", %zu metadata entries, %zu tensors\n",
              path.c_str(), g.version(), g.alignment(), g.metadata().size(), g.tensors().size());

  std::printf("\nmetadata:\n");
  size_t key_width = 0;
  for (const auto& [key, value] : g.metadata()) key_width = std::max(key_width, key.size());
  for (const auto& [key, value] : g.metadata()) {
    std::printf("  %-*s  %-18s %s\n", static_cast<int>(key_width), key.c_str(),
                TypeLabel(value).c_str(), Format(value, static_cast<size_t>(*max_array)).c_str());
  }

  uint64_t total_bytes = 0;
  int64_t total_elems = 0;
  std::map<std::string, std::pair<int, uint64_t>> by_type;  // name -> (count, bytes)
  for (const GgufTensor& t : g.tensors()) {
    total_bytes += t.nbytes;
    total_elems += t.NumElements();
    auto& e = by_type[std::string(engine::GgmlTypeName(t.type))];
    ++e.first;
    e.second += t.nbytes;
  }
  if (!flags->Has("no-tensors")) {
    size_t name_width = 4;
    for (const GgufTensor& t : g.tensors()) name_width = std::max(name_width, t.name.size());
    std::printf("\ntensors:\n  %-*s  %-5s %-16s %12s %12s\n", static_cast<int>(name_width), "name",
                "type", "dims", "offset", "bytes");
    for (const GgufTensor& t : g.tensors()) {
      std::printf("  %-*s  %-5s %-16s %12" PRIu64 " %12" PRIu64 "\n", static_cast<int>(name_width),
                  t.name.c_str(), std::string(engine::GgmlTypeName(t.type)).c_str(),
                  Dims(t).c_str(), t.offset, t.nbytes);
    }
  }
  std::printf("\ntotals: %zu tensors, %" PRId64 " elements (%.1f M), %" PRIu64
              " bytes (%.1f MiB)\n",
              g.tensors().size(), total_elems, static_cast<double>(total_elems) / 1e6, total_bytes,
              static_cast<double>(total_bytes) / (1 << 20));
  for (const auto& [name, e] : by_type) {
    std::printf("  %-5s %4d tensors %12" PRIu64 " bytes\n", name.c_str(), e.first, e.second);
  }
  if (flags->Has("fingerprint")) {
    const auto fp = engine::ComputeModelFingerprint(g);
    std::printf("fingerprint: %s\n", ToHex(fp).c_str());
  }
  return 0;
}

}  // namespace

KVRELAY_COMMAND(inspect, "inspect",
                "inspect PATH [--max-array N] [--no-tensors] [--fingerprint]  (GGUF file summary)",
                RunInspect);

}  // namespace kvrelay::cli
