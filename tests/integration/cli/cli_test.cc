// The command line as a user meets it: every command and daemon answers
// --help / -h with its complete usage on stdout and exit 0 (and starts
// nothing), stray positional arguments are errors.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "tests/testing/run_command.h"
#include "tests/testing/skip.h"

namespace {

using kvrelay::testing::RunResult;
RunResult RunCmd(const std::string& command) { return kvrelay::testing::RunCmd(command, 60); }

const std::string kCli = KVRELAY_CLI_BIN;
const std::string kBinDir = KVRELAY_DAEMON_BIN_DIR;

const std::vector<std::string> kCommands = {
    "generate",     "launch",        "perplexity",   "tokenize",    "inspect",
    "bench engine", "bench kv",      "bench prefix", "bench serve", "bench transfer",
    "sim",          "sim calibrate", "sim validate", "plan"};

TEST(CliHelpTest, EveryCommandPrintsItsUsageOnStdoutAndExitsZero) {
  for (const std::string& c : kCommands) {
    for (const char* flag : {"--help", "-h"}) {
      RunResult r = RunCmd(kCli + " " + c + " " + flag);
      EXPECT_EQ(r.exit_code, 0) << c << " " << flag << "\n" << r.err;
      EXPECT_NE(r.out.find("usage: kvrelay " + c), std::string::npos) << c << ": " << r.out;
      EXPECT_NE(r.out.find("--help"), std::string::npos) << c;
      EXPECT_EQ(r.err, "") << c << " " << flag;
    }
  }
  // `kvrelay help CMD` is the same.
  RunResult r = RunCmd(kCli + " help generate");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("usage: kvrelay generate"), std::string::npos);
  r = RunCmd(kCli + " --help");
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.out.find("bench serve"), std::string::npos);
  EXPECT_EQ(RunCmd(kCli).exit_code, 2);  // no command at all is a mistake
}

// Every value flag is listed with a default where it has one: the ones a user
// most needs, checked literally.
TEST(CliHelpTest, UsageShowsDefaults) {
  RunResult g = RunCmd(kCli + " generate --help");
  EXPECT_NE(g.out.find("--max-tokens VALUE"), std::string::npos) << g.out;
  EXPECT_NE(g.out.find("(default: 128)"), std::string::npos) << g.out;
  EXPECT_NE(g.out.find("--json"), std::string::npos);
  RunResult l = RunCmd(kCli + " launch -h");
  EXPECT_NE(l.out.find("--port VALUE"), std::string::npos);
  EXPECT_NE(l.out.find("(default: 8080)"), std::string::npos) << l.out;
  EXPECT_NE(l.out.find("--no-kv-store"), std::string::npos);
}

TEST(CliHelpTest, DaemonsPrintTheirUsage) {
  for (const char* d :
       {"kvrelay-coordinator", "kvrelay-prefill", "kvrelay-decode", "kvrelay-worker"}) {
    for (const char* flag : {"--help", "-h"}) {
      RunResult r = RunCmd(kBinDir + "/" + d + " " + flag);
      EXPECT_EQ(r.exit_code, 0) << d << " " << flag << "\n" << r.err;
      // Each daemon names itself as its binary (kvrelay-worker, the colocated
      // role, once said kvrelay-colocated).
      EXPECT_EQ(r.out.rfind(std::string("usage: ") + d + " ", 0), 0u) << d << ": " << r.out;
      EXPECT_NE(r.out.find("(default: "), std::string::npos) << d;
    }
    // And so do its errors.
    RunResult bad = RunCmd(kBinDir + "/" + d + " --no-such-flag");
    EXPECT_NE(bad.exit_code, 0) << d;
    EXPECT_EQ(bad.err.rfind(std::string(d) + ": ", 0), 0u) << d << ": " << bad.err;
  }
  // The roles describe themselves (their --help once said the same thing).
  const std::string prefill = RunCmd(kBinDir + "/kvrelay-prefill --help").out;
  const std::string decode = RunCmd(kBinDir + "/kvrelay-decode --help").out;
  EXPECT_NE(prefill.find("A prefill worker"), std::string::npos) << prefill;
  EXPECT_NE(decode.find("A decode worker"), std::string::npos) << decode;
  RunResult c = RunCmd(kBinDir + "/kvrelay-coordinator --help");
  EXPECT_NE(c.out.find("--max-connections-per-client VALUE"), std::string::npos);
  EXPECT_NE(c.out.find("(default: 1024)"), std::string::npos);
}

TEST(CliArgsTest, StrayPositionalArgumentsAreErrors) {
  for (const std::string& c : {std::string("generate"), std::string("launch"),
                               std::string("bench serve"), std::string("perplexity")}) {
    RunResult r = RunCmd(kCli + " " + c + " stray");
    EXPECT_EQ(r.exit_code, 2) << c;
    EXPECT_NE(r.err.find("'stray'"), std::string::npos) << c << ": " << r.err;
  }
  RunResult i = RunCmd(kCli + " inspect a.gguf b.gguf");
  EXPECT_EQ(i.exit_code, 2);
  EXPECT_NE(i.err.find("'b.gguf'"), std::string::npos) << i.err;
  RunResult d = RunCmd(kBinDir + "/kvrelay-coordinator --model m.gguf stray");
  EXPECT_EQ(d.exit_code, 2);
  EXPECT_NE(d.err.find("'stray'"), std::string::npos) << d.err;
}

// sim calibrate refuses a probe round count outside [1, 16] before it loads
// the model or measures anything.
TEST(CliArgsTest, SimCalibrateRefusesBadProbeRounds) {
  for (const char* n : {"0", "17", "-1", "x"}) {
    RunResult r = RunCmd(kCli + " sim calibrate --model /nonexistent.gguf --probe-rounds " + n);
    EXPECT_EQ(r.exit_code, 2) << n << ": " << r.err;
    EXPECT_NE(r.err.find("probe-rounds"), std::string::npos) << n << ": " << r.err;
    EXPECT_EQ(r.out.find("calibrating"), std::string::npos) << n;
  }
}

// kvrelay launch refuses a busy port and a bad --model before it starts any
// process (ProcessGroup logs "started NAME" for each one).
TEST(CliLaunchTest, BusyPortFailsFastNamingThePort) {
  const std::string model =
      std::string(KVRELAY_CLI_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!std::ifstream(model)) KVRELAY_SKIP_OR_FAIL() << "no model at " << model;
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string port = std::to_string(ntohs(addr.sin_port));
  RunResult r =
      RunCmd(kCli + " launch --host 127.0.0.1 --port " + port + " --no-kv-store --model " + model);
  // The same port as the control port: the hint names the flag that moves it.
  RunResult c = RunCmd(kCli + " launch --host 127.0.0.1 --port 0 --control-port " + port +
                       " --no-kv-store --model " + model);
  close(fd);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("port " + port), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("in use"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("pick another --port)"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("started "), std::string::npos) << r.err;
  EXPECT_EQ(c.exit_code, 1) << c.err;
  EXPECT_NE(c.err.find("control port " + port), std::string::npos) << c.err;
  EXPECT_NE(c.err.find("pick another --control-port)"), std::string::npos) << c.err;
  EXPECT_EQ(c.err.find("started "), std::string::npos) << c.err;
}

TEST(CliLaunchTest, BadModelFailsBeforeAnyWorkerStarts) {
  const std::string bogus = ::testing::TempDir() + "/cli_test_not_a_model.gguf";
  { std::ofstream(bogus) << "this is not a GGUF file"; }
  for (const std::string& model : {std::string("/nonexistent/model.gguf"), bogus}) {
    RunResult r = RunCmd(kCli + " launch --port 0 --no-kv-store --model " + model);
    EXPECT_NE(r.exit_code, 0) << model;
    EXPECT_NE(r.err.find("--model " + model), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("started "), std::string::npos) << r.err;
  }
}

// An unknown --kv-dtype is refused before any process starts (it was accepted
// until the workers spawned and failed one by one).
TEST(CliLaunchTest, BadKvDtypeFailsBeforeAnyWorkerStarts) {
  RunResult r = RunCmd(kCli + " launch --port 0 --no-kv-store --kv-dtype fp8");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--kv-dtype"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("unknown KV dtype 'fp8'"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("started "), std::string::npos) << r.err;
}

std::string Model() {
  return std::string(KVRELAY_CLI_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

// Both streams into one pipe, as a terminal or `2>&1 | tee` shows them.
std::string RunMerged(const std::string& command) {
  std::string out;
  FILE* p = ::popen(("timeout -s KILL 120 " + command + " </dev/null 2>&1").c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  ::pclose(p);
  return out;
}

TEST(CliGenerateTest, StatisticsAreOnALineOfTheirOwn) {
  if (!std::ifstream(Model())) KVRELAY_SKIP_OR_FAIL() << "no model at " << Model();
  const std::string merged =
      RunMerged(kCli + " generate --model " + Model() + " --prompt Hello --max-tokens 8");
  const size_t stats = merged.find("[1 prompt tokens, 8 generated");
  ASSERT_NE(stats, std::string::npos) << merged;
  ASSERT_GT(stats, 0u);
  EXPECT_EQ(merged[stats - 1], '\n') << "statistics glued to the text: " << merged;
}

// #18: special-token text in a raw --prompt is parsed as llama.cpp does
// (<|im_start|> is one token), and --no-special keeps it text.
TEST(CliGenerateTest, RawPromptParsesSpecialTokensUnlessNoSpecial) {
  if (!std::ifstream(Model())) KVRELAY_SKIP_OR_FAIL() << "no model at " << Model();
  auto prompt_ids = [&](const std::string& flags) {
    RunResult r = RunCmd(kCli + " generate --model " + Model() +
                         " --prompt '<|im_start|>user' --max-tokens 1 --json " + flags);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
    EXPECT_FALSE(j.is_discarded()) << r.out;
    return j.is_discarded() ? nlohmann::json::array() : j["prompt_ids"];
  };
  const nlohmann::json special = prompt_ids("");
  const nlohmann::json text = prompt_ids("--no-special");
  ASSERT_FALSE(special.empty());
  // SmolLM2: <|im_start|> is id 1; as text it is several tokens.
  EXPECT_NE(std::find(special.begin(), special.end(), 1), special.end()) << special.dump();
  EXPECT_EQ(std::find(text.begin(), text.end(), 1), text.end()) << text.dump();
  EXPECT_GT(text.size(), special.size() + 2) << special.dump() << " vs " << text.dump();
  // With --chat --no-special the template's tokens stay special.
  const nlohmann::json chat = prompt_ids("--chat --no-special");
  // system (the default one), user and assistant turns; the user text adds none.
  EXPECT_EQ(std::count(chat.begin(), chat.end(), 1), 3) << chat.dump();
}

// The answer alone on stdout; every log line (the launcher's and its
// children's) on stderr.
TEST(CliLaunchTest, DemoPrintsTheAnswerOnStdoutAndLogsOnStderr) {
  if (!std::ifstream(Model())) KVRELAY_SKIP_OR_FAIL() << "no model at " << Model();
  // serve.sh's topology (a TP = 2 decode group) with the launcher's default
  // prefix store on (in a directory of the test's): its stop must be quiet
  // too, the store drained and private.
  const std::string store = ::testing::TempDir() + "/cli_demo_kvstore";
  std::filesystem::remove_all(store);
  RunResult r = RunCmd(kCli + " launch --demo 'Say hi' --max-tokens 8 --kv-store " + store +
                       " --tp 2 --model " + Model());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ASSERT_FALSE(r.out.empty());
  EXPECT_EQ(r.out.find("listening"), std::string::npos) << r.out;
  for (const char* level : {"Z I ", "Z W ", "Z E "}) {  // no log record on stdout
    EXPECT_EQ(r.out.find(level), std::string::npos) << r.out;
  }
  EXPECT_NE(r.err.find("started coordinator"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("kvrelay-coordinator listening"), std::string::npos) << r.err;
  // #18: a normal shutdown is quiet: workers told to stop say so
  // (WorkerLeaving) and nobody reports a peer as lost.
  size_t warnings = 0;
  for (const char* level : {"Z W ", "Z E "}) {
    for (size_t at = r.err.find(level); at != std::string::npos; at = r.err.find(level, at + 1)) {
      ++warnings;
    }
  }
  EXPECT_EQ(warnings, 0u) << r.err;
  // The store: one RocksDB per prefill worker (a decode worker keeps none),
  // the key beside them, nothing readable by another user.
  EXPECT_TRUE(std::filesystem::exists(store + "/prefill-0/CURRENT")) << store;
  EXPECT_FALSE(std::filesystem::exists(store + "/decode-0")) << store;
  for (const std::string& p : {store, store + "/prefill-0"}) {
    const auto perms = std::filesystem::status(p).permissions();
    EXPECT_EQ(perms & (std::filesystem::perms::group_all | std::filesystem::perms::others_all),
              std::filesystem::perms::none)
        << p << " is open to other users";
  }
  std::filesystem::remove_all(store);
}

// Ctrl-C or timeout(1) signals the launcher's whole process group: the
// children's exits during that shutdown are not failures, and the launcher
// must not restart them ("prefill-0 exited with status 0; restarting").
TEST(CliLaunchTest, ASignalToTheProcessGroupStopsWithoutRestarts) {
  if (!std::ifstream(Model())) KVRELAY_SKIP_OR_FAIL() << "no model at " << Model();
  const std::string dir = ::testing::TempDir();
  const std::string log = dir + "/cli_group_stop.log", script = dir + "/cli_group_stop.sh";
  {
    std::ofstream sh(script);
    sh << "L=" << log << "\n"
       << "setsid " << kCli << " launch --prefill 1 --decode 1 --port 0 --kv-store " << dir
       << "/cli_group_stop_kvstore --model " << Model() << " 2>$L & P=$!\n"
       << R"(for i in $(seq 600); do grep -q 'cluster ready on' $L && break; sleep 0.1; done
grep -q 'cluster ready on' $L || { kill -KILL -- -$P; echo "never ready" >&2; exit 1; }
kill -TERM -- -$P
for i in $(seq 300); do kill -0 $P 2>/dev/null || break; sleep 0.1; done
kill -0 $P 2>/dev/null && { kill -KILL -- -$P; echo "still running 30 s after SIGTERM" >&2; exit 1; }
cat $L >&2
)";
  }
  RunResult r = RunCmd("bash " + script);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("cluster ready on"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("restarting"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("restarted "), std::string::npos) << r.err;
}

// bench serve --trace replays a trace file (the simulator's format) against
// a real cluster: each request at its arrival time with its own prompt and
// output lengths, the report's per-request rows in trace order. A malformed
// trace is an error before anything is sent.
TEST(CliBenchServeTest, TraceReplaysArrivalsAndLengths) {
  if (!std::ifstream(Model())) KVRELAY_SKIP_OR_FAIL() << "no model at " << Model();
  const std::string dir = ::testing::TempDir();
  const std::string trace = dir + "/cli_trace.csv", report = dir + "/cli_trace.json";
  {
    std::ofstream f(trace);
    f << "arrival_s,prompt_tokens,output_tokens\n0,16,3\n0.3,24,1\n0.6,8,5\n";
  }
  // The cluster in the background, stopped when the script exits; bench
  // serve once it reports ready (a deadline of 30 s).
  const std::string log = dir + "/cli_trace_launch.log", script = dir + "/cli_trace.sh";
  {
    std::ofstream sh(script);
    sh << "L=" << log << "\n"
       << kCli << " launch --colocated 1 --prefill 0 --decode 0 --port 0 --no-kv-store --model "
       << Model() << " 2>$L & P=$!\n"
       << R"(trap 'kill $P; wait $P' EXIT
for i in $(seq 300); do grep -q 'cluster ready on' $L && break; sleep 0.1; done
U=$(grep -o 'cluster ready on http://[0-9.:]*' $L | cut -d' ' -f4)
test -n "$U" || { echo "no cluster ready line in $L" >&2; exit 1; }
)" << kCli
       << " bench serve --url $U --trace " << trace << " --json " << report << "\n";
  }
  RunResult r = RunCmd("bash " + script);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::ifstream f(report);
  const nlohmann::json j = nlohmann::json::parse(f, nullptr, false);
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["trace"], trace);
  ASSERT_EQ(j["requests"].size(), 3u);
  const double arrival[] = {0, 0.3, 0.6};
  const int prompt[] = {16, 24, 8}, output[] = {3, 1, 5};
  for (size_t i = 0; i < 3; ++i) {
    const nlohmann::json& q = j["requests"][i];
    EXPECT_TRUE(q["ok"].get<bool>()) << q.dump();
    EXPECT_EQ(q["prompt_tokens"].get<int>(), prompt[i]) << i;
    EXPECT_EQ(q["output_tokens"].get<int>(), output[i]) << i;
    EXPECT_GE(q["start_s"].get<double>(), arrival[i]) << i;
    EXPECT_LT(q["start_s"].get<double>(), arrival[i] + 0.25) << i;
  }
  {
    std::ofstream bad(trace);
    bad << "0,16,3\n-1,16,3\n";  // arrivals out of order
  }
  RunResult b = RunCmd(kCli + " bench serve --url http://127.0.0.1:9 --trace " + trace);
  EXPECT_EQ(b.exit_code, 2) << b.err;
  EXPECT_NE(b.err.find("--trace"), std::string::npos) << b.err;
  {
    std::ofstream huge(trace);
    huge << "0,16,3\n1,2000000,3\n";  // a prompt beyond --input-len's bound
  }
  b = RunCmd(kCli + " bench serve --url http://127.0.0.1:9 --trace " + trace);
  EXPECT_EQ(b.exit_code, 2) << b.err;
  EXPECT_NE(b.err.find("request 2: prompt and output tokens must be <= 1000000"), std::string::npos)
      << b.err;
}

// KIVI pools stage partial blocks in f32 carved from the pool; perplexity
// sizes the pool for that (before: "KV pool exhausted" for kivi4 and kivi2).
TEST(CliPerplexityTest, WorksWithEveryKvDtypeIncludingKivi) {
  if (!std::ifstream(Model())) KVRELAY_SKIP_OR_FAIL() << "no model at " << Model();
  const std::string text =
      std::string(KVRELAY_CLI_SOURCE_DIR) + "/tests/data/kjv_genesis_exodus.txt";
  double f32 = 0;
  for (const char* dtype : {"f32", "kivi4", "kivi2"}) {
    RunResult r = RunCmd(kCli + " perplexity --model " + Model() + " --file " + text +
                         " --ctx 128 --max-chunks 1 --threads 2 --kv-dtype " + dtype);
    ASSERT_EQ(r.exit_code, 0) << dtype << ": " << r.err;
    ASSERT_EQ(r.out.rfind("perplexity ", 0), 0u) << r.out;
    const double ppl = std::stod(r.out.substr(11));
    EXPECT_GT(ppl, 1.0) << dtype;
    if (std::string(dtype) == "f32") f32 = ppl;
    if (std::string(dtype) == "kivi4") {
      EXPECT_LT(ppl, f32 * 1.1) << "kivi4 far from f32";
    }
  }
}

}  // namespace
