// Restart test with the real engine and model: process 1 generates from a
// prompt and spills its KV blocks to RocksDB through the pool's eviction hook,
// then exits; process 2 restores the prefix from the DB and generates; process
// 3 computes from scratch. Greedy tokens of all three must be identical, and
// process 2 must report the restored tokens as cached.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>

#include "tests/testing/skip.h"

#ifndef KVRELAY_RESTART_CHILD
#error "KVRELAY_RESTART_CHILD must name the child executable"
#endif

namespace {

namespace fs = std::filesystem;

struct Output {
  int exit_code = -1;
  std::string text;
};

Output RunChild(const std::string& args) {
  Output out;
  const std::string cmd = std::string(KVRELAY_RESTART_CHILD) + " " + args;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.text.append(buf, n);
  const int status = ::pclose(p);
  out.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

std::string Field(const std::string& text, const std::string& key) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + " ", 0) == 0 || line == key)
      return line.substr(std::min(line.size(), key.size() + 1));
  }
  return "<missing " + key + ">";
}

TEST(KvStoreRestartTest, RestoredPrefixGeneratesTheSameTokensAsAFreshComputation) {
  const char* src = std::getenv("KVRELAY_SOURCE_DIR");
  const fs::path model = fs::path(src ? src : ".") / "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!fs::exists(model)) KVRELAY_SKIP_OR_FAIL() << "model not found: " << model;
  const fs::path dir =
      fs::temp_directory_path() / ("kvstore_restart_" + std::to_string(::getpid()));
  fs::remove_all(dir);

  Output spill = RunChild("spill " + model.string() + " " + dir.string());
  ASSERT_EQ(spill.exit_code, 0) << spill.text;
  EXPECT_EQ(Field(spill.text, "spilled"), "4") << spill.text;  // 4 full prompt blocks (8 generated
                                                               // tokens do not fill a 5th)
  Output restore = RunChild("restore " + model.string() + " " + dir.string());
  ASSERT_EQ(restore.exit_code, 0) << restore.text;
  Output fresh = RunChild("fresh " + model.string());
  ASSERT_EQ(fresh.exit_code, 0) << fresh.text;

  EXPECT_EQ(Field(restore.text, "restored"), "64");
  EXPECT_EQ(Field(restore.text, "cached"), "64");
  EXPECT_EQ(Field(fresh.text, "cached"), "0");
  const std::string want = Field(fresh.text, "tokens");
  ASSERT_NE(want.find(' '), std::string::npos) << "fewer than 2 tokens: " << fresh.text;
  EXPECT_EQ(Field(spill.text, "tokens"), want);
  EXPECT_EQ(Field(restore.text, "tokens"), want);
  fs::remove_all(dir);
}

}  // namespace
