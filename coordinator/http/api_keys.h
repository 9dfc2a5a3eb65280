// API keys: a file of "key tenant" lines ('#' comments and blank lines
// allowed). Each key authenticates one tenant; the tenant's name salts its
// prefix-cache block hashes so tenants never share cached blocks.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "common/status.h"

namespace kvrelay::coordinator {

class ApiKeys {
 public:
  // Parses file contents; errors name the line.
  static Result<ApiKeys> Parse(std::string_view text);
  static Result<ApiKeys> LoadFile(const std::string& path);

  bool empty() const { return tenants_.empty(); }
  size_t size() const { return tenants_.size(); }
  // Tenant of the key, if the key is known. Constant-time in the key bytes.
  std::optional<std::string> TenantOf(std::string_view key) const;
  void Add(std::string key, std::string tenant) { tenants_[std::move(key)] = std::move(tenant); }

 private:
  std::map<std::string, std::string> tenants_;  // key -> tenant
};

}  // namespace kvrelay::coordinator
