#include "coordinator/http/api_keys.h"

#include <fstream>
#include <sstream>

namespace kvrelay::coordinator {
namespace {

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

Result<ApiKeys> ApiKeys::Parse(std::string_view text) {
  ApiKeys keys;
  std::istringstream in{std::string(text)};
  std::string line;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    std::istringstream fields(line);
    std::string key, tenant, extra;
    fields >> key;
    if (key.empty() || key[0] == '#') continue;
    fields >> tenant >> extra;
    if (tenant.empty() || !extra.empty()) {
      return InvalidArgument("api keys line " + std::to_string(line_no) +
                             ": expected 'KEY TENANT' (two fields)");
    }
    if (keys.tenants_.count(key)) {
      return InvalidArgument("api keys line " + std::to_string(line_no) + ": duplicate key");
    }
    keys.tenants_[key] = tenant;
  }
  return keys;
}

Result<ApiKeys> ApiKeys::LoadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return NotFound("cannot open api keys file '" + path + "'");
  std::ostringstream ss;
  ss << f.rdbuf();
  if (ss.str().size() > (16u << 20))
    return InvalidArgument("api keys file '" + path + "' is larger than 16 MiB");
  auto keys = Parse(ss.str());
  if (!keys.ok()) return keys.status().WithContext(path);
  return keys;
}

std::optional<std::string> ApiKeys::TenantOf(std::string_view key) const {
  std::optional<std::string> found;
  for (const auto& [k, tenant] : tenants_) {  // no early exit: time does not depend on position
    if (ConstantTimeEquals(k, key)) found = tenant;
  }
  return found;
}

}  // namespace kvrelay::coordinator
