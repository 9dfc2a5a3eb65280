#include "common/flags.h"

#include <gtest/gtest.h>

namespace kvrelay {
namespace {

FlagSpec Spec(size_t max_positional = 0) {
  FlagSpec s;
  s.program = "kvrelay demo";
  s.summary = "a test command";
  s.positional = max_positional ? "FILE" : "";
  s.max_positional = max_positional;
  s.flags = {{"model", "", "GGUF model path (required)"},
             {"max-tokens", "128", "tokens to generate"},
             {"json", "", "print JSON", true}};
  return s;
}

TEST(FlagsTest, HelpIsRecognisedAnywhereButNotAsAValue) {
  for (const std::vector<std::string>& args : {std::vector<std::string>{"--help"},
                                               {"-h"},
                                               {"--model", "m", "-h"},
                                               {"--unknown", "--help"},
                                               {"extra", "-h"}}) {
    auto f = Flags::Parse(args, Spec());
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    EXPECT_TRUE(f->help_requested());
  }
  auto f = Flags::Parse({"--model", "-h"}, Spec());
  ASSERT_TRUE(f.ok());
  EXPECT_FALSE(f->help_requested());
  EXPECT_EQ(f->Get("model"), "-h");
}

TEST(FlagsTest, UsageListsEveryFlagWithItsDefault) {
  const std::string u = Flags::Usage(Spec(1));
  EXPECT_NE(u.find("usage: kvrelay demo [flags] FILE"), std::string::npos) << u;
  EXPECT_NE(u.find("a test command"), std::string::npos);
  EXPECT_NE(u.find("--max-tokens VALUE"), std::string::npos) << u;
  EXPECT_NE(u.find("(default: 128)"), std::string::npos) << u;
  EXPECT_NE(u.find("--model VALUE"), std::string::npos);
  EXPECT_NE(u.find("--json "), std::string::npos);
  EXPECT_NE(u.find("--help"), std::string::npos);
}

TEST(FlagsTest, UnexpectedPositionalIsAnError) {
  auto f = Flags::Parse({"--model", "m", "stray"}, Spec());
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(f.status().message().find("'stray'"), std::string::npos) << f.status().ToString();
  auto one = Flags::Parse({"a.gguf"}, Spec(1));
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->positional().size(), 1u);
  EXPECT_FALSE(Flags::Parse({"a.gguf", "b.gguf"}, Spec(1)).ok());
}

TEST(FlagsTest, ValuesSwitchesAndErrors) {
  auto f = Flags::Parse({"--model=m.gguf", "--max-tokens", "7", "--json"}, Spec());
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->Get("model"), "m.gguf");
  EXPECT_EQ(*f->GetInt("max-tokens", 128), 7);
  EXPECT_TRUE(f->Has("json"));
  EXPECT_FALSE(Flags::Parse({"--nope"}, Spec()).ok());
  EXPECT_FALSE(Flags::Parse({"--json=1"}, Spec()).ok());
  EXPECT_FALSE(Flags::Parse({"--model"}, Spec()).ok());
}

// An unknown flag names the closest known one (issue #42: no "did you mean").
TEST(FlagsTest, UnknownFlagSuggestsTheClosest) {
  const FlagSpec spec = {"kvrelay launch",
                         "",
                         "",
                         0,
                         {{"kv-store", "kvstore", "store dir"},
                          {"control-port", "0", "control port"},
                          {"max-tokens", "16", "tokens"},
                          {"no-kv-store", "", "off", true}}};
  auto err = [&](const std::string& flag) {
    auto r = Flags::Parse({flag, "x"}, spec);
    EXPECT_FALSE(r.ok()) << flag;
    return r.ok() ? std::string() : r.status().message();
  };
  EXPECT_NE(err("--kv-store-path").find("did you mean --kv-store?"), std::string::npos)
      << err("--kv-store-path");
  EXPECT_NE(err("--max-token").find("did you mean --max-tokens?"), std::string::npos);
  EXPECT_NE(err("--contrl-port").find("did you mean --control-port?"), std::string::npos);
  // Nothing close: no guess.
  EXPECT_EQ(err("--temperature").find("did you mean"), std::string::npos) << err("--temperature");
  EXPECT_EQ(SuggestFlag("zz", {"kv-store", "control-port"}), "");
}

}  // namespace
}  // namespace kvrelay
