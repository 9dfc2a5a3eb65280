// kvrelay launch --coordinator-arg: each value reaches the coordinator's
// command line as is (an API key file is enforced, a served model name is
// served), and a flag the launcher sets itself is refused before anything
// starts. Spawns the built binaries on 127.0.0.1 and stops them.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "tests/testing/run_command.h"

namespace {

using kvrelay::testing::RunResult;
RunResult RunCmd(const std::string& command) { return kvrelay::testing::RunCmd(command, 120); }

const std::string kCli = KVRELAY_CLI_BIN;

std::string Model() {
  return std::string(KVRELAY_CLI_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

// One colocated worker: the smallest cluster, fastest to start.
std::string Launch(const std::string& extra) {
  return kCli + " launch --colocated 1 --prefill 0 --decode 0 --no-kv-store --model " + Model() +
         " " + extra;
}

std::string WriteKeys() {
  const std::string path = ::testing::TempDir() + "/launch_passthrough_keys.txt";
  std::ofstream(path) << "# key tenant\nsk-passthrough-test tenant-a\n";
  return path;
}

TEST(LaunchPassthroughTest, LauncherOwnedFlagsAreRefusedNamingTheLaunchFlag) {
  // Refused in argument parsing: no model is opened, nothing is spawned.
  RunResult r = RunCmd(kCli + " launch --model /nonexistent.gguf --coordinator-arg=--port=9");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("use kvrelay launch --port"), std::string::npos) << r.err;
  r = RunCmd(kCli + " launch --model /nonexistent.gguf --coordinator-arg --cluster-key-file " +
             "--coordinator-arg /tmp/k");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("use kvrelay launch --cluster-key-file"), std::string::npos) << r.err;
  r = RunCmd(kCli + " launch --model /nonexistent.gguf --coordinator-arg");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--coordinator-arg needs a value"), std::string::npos) << r.err;
  r = RunCmd(kCli + " launch --help");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("--coordinator-arg"), std::string::npos) << r.out;
}

// --api-keys and --model-name passed through: the API answers 401 without a
// key and serves the given name with it; /health (the readiness the launcher
// waits on) stays open.
TEST(LaunchPassthroughTest, CoordinatorGetsApiKeysAndModelName) {
  if (!std::ifstream(Model())) GTEST_SKIP() << "no model at " << Model();
  const std::string dir = ::testing::TempDir();
  const std::string keys = WriteKeys();
  const std::string log = dir + "/launch_passthrough.log", script = dir + "/launch_passthrough.sh";
  {
    std::ofstream sh(script);
    sh << "L=" << log << "\n"
       << Launch("--port 0 --coordinator-arg=--api-keys=" + keys +
                 " --coordinator-arg --model-name --coordinator-arg served-by-test")
       << " 2>$L & P=$!\n"
       << R"SH(trap 'kill $P; wait $P' EXIT
for i in $(seq 600); do grep -q 'cluster ready on' $L && break; sleep 0.1; done
U=$(grep -o 'cluster ready on http://[0-9.:]*' $L | cut -d' ' -f4)
test -n "$U" || { echo "no cluster ready line in $L" >&2; cat $L >&2; exit 1; }
echo "health $(curl -s -o /dev/null -w '%{http_code}' $U/health)"
echo "nokey $(curl -s -o /dev/null -w '%{http_code}' $U/v1/models)"
echo "badkey $(curl -s -o /dev/null -w '%{http_code}' -H 'Authorization: Bearer nope' $U/v1/models)"
echo "key $(curl -s -H 'Authorization: Bearer sk-passthrough-test' $U/v1/models)"
)SH";
  }
  RunResult r = RunCmd("bash " + script);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("health 200\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("nokey 401\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("badkey 401\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("key {"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"id\":\"served-by-test\""), std::string::npos) << r.out;
}

// --demo against a coordinator that wants a key: it fails with the 401
// without $KVRELAY_API_KEY and answers with it.
TEST(LaunchPassthroughTest, DemoSendsKvrelayApiKey) {
  if (!std::ifstream(Model())) GTEST_SKIP() << "no model at " << Model();
  const std::string args =
      "--demo 'Say hi' --max-tokens 4 --coordinator-arg=--api-keys=" + WriteKeys();
  RunResult no_key = RunCmd("env -u KVRELAY_API_KEY " + Launch(args));
  EXPECT_EQ(no_key.exit_code, 1) << no_key.err;
  EXPECT_NE(no_key.err.find("HTTP 401"), std::string::npos) << no_key.err;
  RunResult with_key = RunCmd("env KVRELAY_API_KEY=sk-passthrough-test " + Launch(args));
  EXPECT_EQ(with_key.exit_code, 0) << with_key.err;
  EXPECT_GT(with_key.out.size(), 1u) << with_key.err;  // the answer and a newline
}

}  // namespace
