// The cluster end to end: a coordinator in cluster mode plus prefill, decode
// and colocated worker processes (LocalLauncher, and mpirun through
// deploy/mpirun/launch.sh), driven over HTTP and compared with the
// single-process engine (engine::Engine in this process, same KV dtype).
//
// Skips when the real model file is absent. Every wait is bounded by a
// deadline; polling loops re-check a condition until it holds or the deadline
// passes.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "common/http_client.h"
#include "coordinator/http/sse.h"
#include "coordinator/openai/engine_text_codec.h"
#include "deploy/local_launcher.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/model.h"
#include "tests/testing/openai_client_report.h"
#include "tests/testing/skip.h"
#include "tests/testing/test_env.h"
#include "tests/testing/worker_metrics.h"

namespace kvrelay {
namespace {

using testing::WorkerGauge;

using nlohmann::json;
namespace fs = std::filesystem;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

std::string SourceDir() { return KVRELAY_CLUSTER_SOURCE_DIR; }
std::string BinDir() { return KVRELAY_CLUSTER_BIN_DIR; }
std::string ModelPath() { return SourceDir() + "/models/SmolLM2-135M-Instruct.Q4_1.gguf"; }
std::string BuildDir() {
  const char* d = std::getenv("KVRELAY_BINARY_DIR");
  return d ? d : fs::path(BinDir()).parent_path().string();
}

constexpr const char* kKvDtype = "f32";

// ---------------------------------------------------------------- reference

// The model, codec and a reference engine shared by every test.
struct Reference {
  std::shared_ptr<const engine::Model> model;
  std::unique_ptr<coordinator::EngineTextCodec> codec;
  std::unique_ptr<engine::Engine> engine;
  int next_id = 0;

  // Greedy tokens of `prompt`, the request alone in the engine.
  std::vector<int32_t> Greedy(const std::vector<int32_t>& prompt, int max_tokens,
                              float presence_penalty = 0, float frequency_penalty = 0) {
    engine::RequestSpec spec;
    spec.id = static_cast<engine::RequestId>(++next_id);
    spec.prompt = prompt;
    spec.sampling.temperature = 0;
    spec.sampling.presence_penalty = presence_penalty;
    spec.sampling.frequency_penalty = frequency_penalty;
    spec.sampling.max_tokens = max_tokens;
    spec.sampling.ignore_eos = true;
    EXPECT_TRUE(engine->Submit(spec).ok());
    std::vector<int32_t> out;
    while (engine->HasWork()) {
      auto events = engine->Step();
      EXPECT_TRUE(events.ok()) << events.status().ToString();
      if (!events.ok()) break;
      for (const auto& e : *events) {
        if (e.token >= 0) out.push_back(e.token);
        if (e.finished) {
          EXPECT_NE(e.finish_reason, engine::FinishReason::kError) << e.error.ToString();
        }
      }
    }
    return out;
  }
  // Greedy tokens and their logprobs (`top` alternatives) with `bias`.
  std::vector<std::pair<int32_t, engine::TokenLogprobs>> GreedyWithLogprobs(
      const std::vector<int32_t>& prompt, int max_tokens, int top,
      const std::vector<std::pair<int32_t, float>>& bias = {}) {
    engine::RequestSpec spec;
    spec.id = static_cast<engine::RequestId>(++next_id);
    spec.prompt = prompt;
    spec.sampling.temperature = 0;
    spec.sampling.max_tokens = max_tokens;
    spec.sampling.ignore_eos = true;
    spec.sampling.logprobs = top;
    spec.sampling.logit_bias = bias;
    EXPECT_TRUE(engine->Submit(spec).ok());
    std::vector<std::pair<int32_t, engine::TokenLogprobs>> out;
    while (engine->HasWork()) {
      auto events = engine->Step();
      EXPECT_TRUE(events.ok()) << events.status().ToString();
      if (!events.ok()) break;
      for (const auto& e : *events) {
        if (e.token >= 0) {
          EXPECT_TRUE(e.has_logprobs);
          out.emplace_back(e.token, e.logprobs);
        }
      }
    }
    return out;
  }
  std::string Text(const std::vector<int32_t>& tokens) const {
    auto d = codec->NewDecoder();
    std::string s;
    for (int32_t t : tokens) s += d->Push(t);
    return s + d->Flush();
  }
  std::vector<int32_t> Encode(const std::string& text) const {
    auto r = codec->Encode(text, true);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : std::vector<int32_t>{};
  }
};

// Reference engines by KV dtype name ("f32" for most tests), all over one
// loaded model. Created on first use and kept for the whole binary.
std::map<std::string, Reference*>& References() {
  static auto* refs = new std::map<std::string, Reference*>();
  return *refs;
}

// The reference engine whose KV cache has dtype `kv_dtype` (a name as
// --kv-dtype takes it); null when the model file is absent.
Reference* GetReference(const std::string& kv_dtype = kKvDtype) {
  auto& refs = References();
  if (auto it = refs.find(kv_dtype); it != refs.end()) return it->second;
  if (!fs::exists(ModelPath())) return nullptr;
  std::shared_ptr<const engine::Model> model;
  if (!refs.empty()) {
    model = refs.begin()->second->model;
  } else {
    auto loaded = engine::Model::Load(ModelPath());
    if (!loaded.ok()) {
      ADD_FAILURE() << loaded.status().ToString();
      return nullptr;
    }
    model = std::shared_ptr<const engine::Model>(std::move(*loaded));
  }
  auto dtype = engine::ParseKvDtype(kv_dtype);
  if (!dtype.ok()) {
    ADD_FAILURE() << kv_dtype << ": " << dtype.status().ToString();
    return nullptr;
  }
  auto ref = std::make_unique<Reference>();
  ref->model = std::move(model);
  ref->codec = std::make_unique<coordinator::EngineTextCodec>(ref->model->tokenizer(),
                                                              ref->model->chat_template());
  engine::EngineOptions eo;
  eo.model_path = ModelPath();
  eo.kv_dtype = *dtype;
  eo.kv_capacity_bytes = 128 << 20;
  eo.threads = 1;
  auto eng = engine::Engine::Create(eo, ref->model);
  if (!eng.ok()) {
    ADD_FAILURE() << eng.status().ToString();
    return nullptr;
  }
  ref->engine = std::move(*eng);
  return refs[kv_dtype] = ref.release();
}

// Prompts: short, > 16 tokens (more than one KV block), > 300 tokens.
std::vector<std::string> GreedyPrompts() {
  std::string long_prompt = "Here are some notes about the history of several European cities. ";
  const char* cities[] = {"Paris",  "Berlin", "Madrid", "Rome", "Vienna",   "Prague",   "Lisbon",
                          "Warsaw", "Dublin", "Athens", "Oslo", "Helsinki", "Brussels", "Bern"};
  for (int round = 0; round < 3; ++round) {
    for (const char* c : cities) {
      long_prompt += std::string(c) + " grew around its river and market in century " +
                     std::to_string(10 + round) + ". ";
    }
  }
  long_prompt += "In summary, the oldest of these cities is";
  return {"The capital of France is",
          "Write a short poem about the sea, the wind and the small boats that sail out every "
          "morning before the sun rises over the hills:",
          "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", long_prompt};
}

// ---------------------------------------------------------------- HTTP helpers

HttpCallSpec Post(uint16_t port, const std::string& target, const json& body,
                  int timeout_ms = 300'000) {
  HttpCallSpec spec;
  spec.method = "POST";
  spec.port = port;
  spec.target = target;
  spec.body = body.dump();
  spec.headers = {{"Content-Type", "application/json"}};
  spec.timeout_ms = timeout_ms;
  return spec;
}

json CompletionBody(const std::vector<int32_t>& prompt, int max_tokens, bool stream) {
  return {{"model", fs::path(ModelPath()).stem().string()},
          {"prompt", prompt},
          {"max_tokens", max_tokens},
          {"temperature", 0},
          {"ignore_eos", true},
          {"stream", stream}};
}

struct CompletionOutcome {
  int http_status = 0;
  std::string text;
  int completion_tokens = -1;
  int cached_tokens = 0;  // usage.prompt_tokens_details.cached_tokens
  std::string finish_reason;
  std::string error;  // transport error or an error event / error body
};

// Non-streaming /v1/completions.
CompletionOutcome Complete(uint16_t port, const std::vector<int32_t>& prompt, int max_tokens,
                           const json& extra = json::object()) {
  CompletionOutcome out;
  json body = CompletionBody(prompt, max_tokens, false);
  body.update(extra);
  auto r = HttpCall(Post(port, "/v1/completions", body));
  if (!r.ok()) {
    out.error = r.status().ToString();
    return out;
  }
  out.http_status = r->status;
  json j = json::parse(r->body, nullptr, false);
  if (r->status != 200 || j.is_discarded()) {
    out.error = r->body;
    return out;
  }
  out.text = j["choices"][0]["text"];
  out.finish_reason = j["choices"][0]["finish_reason"];
  out.completion_tokens = j["usage"]["completion_tokens"];
  out.cached_tokens =
      j["usage"].value("prompt_tokens_details", json::object()).value("cached_tokens", 0);
  return out;
}

struct StreamOutcome {
  int http_status = 0;
  std::string text;
  int chunks = 0;  // events with text
  bool done = false;
  std::string error;  // an error event, or the transport status
  Clock::time_point ended;
};

// Streaming /v1/completions. `keep_going` is asked after every body piece;
// false closes the connection (the client goes away).
StreamOutcome Stream(uint16_t port, const std::vector<int32_t>& prompt, int max_tokens,
                     const std::function<bool(const StreamOutcome&)>& keep_going = {},
                     int timeout_ms = 300'000) {
  StreamOutcome out;
  coordinator::SseParser parser;
  json body = CompletionBody(prompt, max_tokens, true);
  auto r = HttpCall(Post(port, "/v1/completions", body, timeout_ms), [&](std::string_view piece) {
    if (!parser.Feed(piece)) return false;
    while (auto e = parser.Next()) {
      if (*e == "[DONE]") {
        out.done = true;
        continue;
      }
      json j = json::parse(*e, nullptr, false);
      if (j.is_discarded()) continue;
      if (j.contains("error")) out.error = j["error"].dump();
      if (j.contains("choices") && !j["choices"].empty() && j["choices"][0].contains("text")) {
        std::string t = j["choices"][0]["text"];
        if (!t.empty()) {
          out.text += t;
          ++out.chunks;
        }
      }
    }
    return !keep_going || keep_going(out);
  });
  out.ended = Clock::now();
  if (!r.ok()) {
    if (out.error.empty()) out.error = r.status().ToString();
  } else {
    out.http_status = r->status;
    if (r->status != 200 && out.error.empty()) out.error = r->body;
  }
  return out;
}

// Polls `cond` until it holds or `timeout` passes.
// True when the coordinator's /health lists worker `id`.
bool Registered(uint16_t port, const std::string& id) {
  HttpCallSpec spec;
  spec.port = port;
  spec.target = "/health";
  spec.timeout_ms = 1000;
  auto r = HttpCall(spec);
  if (!r.ok()) return false;
  json j = json::parse(r->body, nullptr, false);
  if (!j.is_object()) return false;
  for (const auto& w : j["workers"]) {
    if (w["id"] == id) return true;
  }
  return false;
}

bool WaitFor(const std::function<bool()>& cond, milliseconds timeout) {
  Deadline deadline = Deadline::After(timeout);
  while (!deadline.Expired()) {
    if (cond()) return true;
    std::this_thread::sleep_for(milliseconds(50));
  }
  return cond();
}

// utime + stime of `pid` in seconds, from /proc/<pid>/stat.
double CpuSeconds(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  auto rp = s.rfind(')');
  if (rp == std::string::npos) return 0;
  std::istringstream in(s.substr(rp + 2));
  std::string field;
  long long utime = 0, stime = 0;
  // Fields after the command: state(3) ... utime(14) stime(15).
  for (int i = 3; i <= 15 && in >> field; ++i) {
    if (i == 14) utime = std::atoll(field.c_str());
    if (i == 15) stime = std::atoll(field.c_str());
  }
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// The options every test's cluster starts from: loopback, free ports, one
// engine thread per worker, f32 KV, no prefix store.
deploy::LaunchOptions ClusterOptions(int prefill, int decode, int colocated) {
  deploy::LaunchOptions o;
  o.model_path = ModelPath();
  o.port = 0;
  o.control_port = 0;
  o.prefill = prefill;
  o.decode = decode;
  o.colocated = colocated;
  o.threads_per_worker = 1;
  o.kv_dtype = kKvDtype;
  o.kv_capacity_mb = 128;
  o.bin_dir = BinDir();
  // Bursts of concurrent requests here check outputs, not admission: no
  // early shedding (tested in coordinator_test and bench/overload.sh).
  o.coordinator_max_queue_delay_ms = 0;
  return o;
}

std::unique_ptr<deploy::LocalLauncher> StartCluster(const deploy::LaunchOptions& o) {
  auto l = std::make_unique<deploy::LocalLauncher>(o);
  Status st = l->Start();
  EXPECT_TRUE(st.ok()) << st.ToString();
  if (!st.ok()) return nullptr;
  return l;
}

std::unique_ptr<deploy::LocalLauncher> StartCluster(int prefill, int decode, int colocated,
                                                    const std::string& router = "prefix_aware",
                                                    int tp = 1,
                                                    const std::string& kv_store_dir = "",
                                                    const std::string& model_path = ModelPath()) {
  deploy::LaunchOptions o = ClusterOptions(prefill, decode, colocated);
  o.model_path = model_path;
  o.tp = tp;
  o.router = router;
  o.kv_store_dir = kv_store_dir;
  return StartCluster(o);
}

// ---------------------------------------------------------------- fixtures

class ClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ref_ = GetReference();
    if (ref_ == nullptr)
      KVRELAY_SKIP_OR_FAIL() << "model file not present (run scripts/fetch-model.sh)";
  }

  // Every GreedyPrompts() output through the cluster equals the engine's.
  void ExpectGreedyMatchesEngine(uint16_t port) {
    constexpr int kTokens = 24;
    for (const std::string& p : GreedyPrompts()) {
      std::vector<int32_t> prompt = ref_->Encode(p);
      std::vector<int32_t> expected = ref_->Greedy(prompt, kTokens);
      ASSERT_EQ(expected.size(), static_cast<size_t>(kTokens));
      CompletionOutcome got = Complete(port, prompt, kTokens);
      ASSERT_EQ(got.http_status, 200) << got.error;
      EXPECT_EQ(got.completion_tokens, kTokens) << "prompt of " << prompt.size() << " tokens";
      EXPECT_EQ(got.finish_reason, "length");
      EXPECT_EQ(got.text, ref_->Text(expected)) << "prompt of " << prompt.size() << " tokens";
      // Streaming returns the same text.
      StreamOutcome s = Stream(port, prompt, kTokens);
      EXPECT_TRUE(s.done) << s.error;
      EXPECT_TRUE(s.error.empty()) << s.error;
      EXPECT_EQ(s.text, got.text);
    }
  }

  // #18: structured output through the cluster: the grammar masks the first
  // token (sampled by the prefill worker) and every decode step; the JSON
  // equals the engine's under the same grammar and parses.
  void ExpectStructuredOutputMatchesEngine(uint16_t port) {
    const std::string schema =
        R"({"type":"object","properties":{"city":{"type":"string","maxLength":20},)"
        R"("population":{"type":"integer"},"capital":{"type":"boolean"}},)"
        R"("required":["city","population","capital"]})";
    auto prompt = ref_->codec->EncodeChat({{"user", "Describe Paris as JSON."}});
    ASSERT_TRUE(prompt.ok());
    engine::RequestSpec spec;
    spec.id = static_cast<engine::RequestId>(++ref_->next_id);
    spec.prompt = *prompt;
    spec.sampling.temperature = 0;
    spec.sampling.max_tokens = 64;
    spec.sampling.json_schema = schema;
    ASSERT_TRUE(ref_->engine->Submit(spec).ok());
    std::string want;
    while (ref_->engine->HasWork()) {
      auto events = ref_->engine->Step();
      ASSERT_TRUE(events.ok());
      for (const auto& e : *events) want += e.text;
    }
    json body = {{"model", fs::path(ModelPath()).stem().string()},
                 {"messages", {{{"role", "user"}, {"content", "Describe Paris as JSON."}}}},
                 {"max_tokens", 64},
                 {"temperature", 0}};
    HttpCallSpec call = Post(port, "/v1/chat/completions", body);
    // The schema as written (json would sort its keys, and the output writes
    // properties in schema order).
    call.body.pop_back();
    call.body += R"(,"response_format":{"type":"json_schema","json_schema":{"name":"city",)"
                 R"("strict":true,"schema":)" +
                 schema + "}}}";
    auto r = HttpCall(call);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ(r->status, 200) << r->body;
    json j = json::parse(r->body);
    const std::string text = j["choices"][0]["message"]["content"];
    EXPECT_EQ(j["choices"][0]["finish_reason"], "stop") << text;
    EXPECT_EQ(text, want);
    json value = json::parse(text, nullptr, false);
    ASSERT_FALSE(value.is_discarded()) << text;
    EXPECT_TRUE(value["city"].is_string()) << text;
    EXPECT_TRUE(value["population"].is_number_integer()) << text;
    EXPECT_TRUE(value["capital"].is_boolean()) << text;
  }

  // #18: logprobs (the first token's sampled on the prefill side, the rest on
  // the decode side) and logit_bias through the cluster equal the engine's,
  // streamed and not.
  void ExpectLogprobsAndBiasMatchEngine(uint16_t port) {
    constexpr int kTokens = 6;
    constexpr int kTop = 3;
    const std::vector<int32_t> prompt = ref_->Encode("The capital of France is");
    auto want = ref_->GreedyWithLogprobs(prompt, kTokens, kTop);
    ASSERT_EQ(want.size(), static_cast<size_t>(kTokens));
    auto check = [&](const json& lp, size_t from, const char* what) {
      ASSERT_EQ(lp["token_logprobs"].size(), lp["top_logprobs"].size()) << what;
      for (size_t i = 0; i < lp["token_logprobs"].size(); ++i) {
        const auto& w = want[from + i].second;
        EXPECT_NEAR(lp["token_logprobs"][i].get<double>(), w.logprob, 2e-3) << what << " " << i;
        EXPECT_EQ(lp["tokens"][i], ref_->codec->TokenPiece(want[from + i].first)) << what;
        ASSERT_LE(lp["top_logprobs"][i].size(), static_cast<size_t>(kTop)) << what;
        EXPECT_GE(lp["top_logprobs"][i].size(), 1u) << what;
        const std::string best = ref_->codec->TokenPiece(w.top[0].first);
        ASSERT_TRUE(lp["top_logprobs"][i].contains(best)) << what << " " << lp.dump();
        EXPECT_NEAR(lp["top_logprobs"][i][best].get<double>(), w.top[0].second, 2e-3) << what;
      }
    };
    json body = CompletionBody(prompt, kTokens, false);
    body["logprobs"] = kTop;
    auto r = HttpCall(Post(port, "/v1/completions", body));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ(r->status, 200) << r->body;
    json j = json::parse(r->body);
    ASSERT_EQ(j["choices"][0]["logprobs"]["tokens"].size(), static_cast<size_t>(kTokens))
        << r->body;
    check(j["choices"][0]["logprobs"], 0, "non-streamed");
    // Streamed: every chunk carries the logprobs of the tokens it releases.
    body["stream"] = true;
    size_t seen = 0;
    coordinator::SseParser parser;
    auto sr = HttpCall(Post(port, "/v1/completions", body), [&](std::string_view piece) {
      if (!parser.Feed(piece)) return false;
      while (auto e = parser.Next()) {
        if (*e == "[DONE]") continue;
        json c = json::parse(*e, nullptr, false);
        if (c.is_discarded() || !c.contains("choices") || c["choices"].empty()) continue;
        const json& lp = c["choices"][0]["logprobs"];
        if (lp.is_null()) continue;
        check(lp, seen, "streamed");
        seen += lp["tokens"].size();
      }
      return true;
    });
    ASSERT_TRUE(sr.ok()) << sr.status().ToString();
    EXPECT_EQ(seen, static_cast<size_t>(kTokens));
    // logit_bias bans the greedy first token (sampled on the prefill side) and
    // the second one (decode side): the output is the engine's with that bias.
    const std::vector<std::pair<int32_t, float>> bias = {{want[0].first, -100.0f},
                                                         {want[1].first, -100.0f}};
    auto biased = ref_->GreedyWithLogprobs(prompt, kTokens, 0, bias);
    ASSERT_NE(biased[0].first, want[0].first);
    std::vector<int32_t> biased_tokens;
    for (const auto& [t, lp] : biased) biased_tokens.push_back(t);
    json lb = json::object();
    for (const auto& [t, b] : bias) lb[std::to_string(t)] = b;
    CompletionOutcome got = Complete(port, prompt, kTokens, {{"logit_bias", lb}});
    ASSERT_EQ(got.http_status, 200) << got.error;
    EXPECT_EQ(got.text, ref_->Text(biased_tokens));
  }

  Reference* ref_ = nullptr;
};

TEST_F(ClusterTest, PromptsCoverMultipleBlocksAndLongContext) {
  std::vector<std::string> prompts = GreedyPrompts();
  size_t longest = 0, over16 = 0;
  for (const auto& p : prompts) {
    size_t n = ref_->Encode(p).size();
    longest = std::max(longest, n);
    if (n > 16) ++over16;
  }
  EXPECT_GT(longest, 300u);
  EXPECT_GE(over16, 2u);
}

TEST_F(ClusterTest, ColocatedGreedyMatchesEngine) {
  auto cluster = StartCluster(0, 0, 1);
  ASSERT_NE(cluster, nullptr);
  ExpectGreedyMatchesEngine(cluster->http_port());
  ExpectLogprobsAndBiasMatchEngine(cluster->http_port());
  ExpectStructuredOutputMatchesEngine(cluster->http_port());
}

// One disaggregated cluster (1 prefill, 2 decode) shared by the tests below.
class DisaggregatedTest : public ClusterTest {
 protected:
  static void TearDownTestSuite() { cluster_.reset(); }
  void SetUp() override {
    ClusterTest::SetUp();
    if (IsSkipped()) return;
    if (cluster_ == nullptr) cluster_ = StartCluster(1, 2, 0);
    ASSERT_NE(cluster_, nullptr);
    port_ = cluster_->http_port();
  }
  static inline std::unique_ptr<deploy::LocalLauncher> cluster_;
  uint16_t port_ = 0;
};

TEST_F(DisaggregatedTest, IdleClusterDoesNotSpin) {
  // Let start-up work settle: the workers have registered (health is ok) and
  // no request is running; then measure all processes over a 5 s window.
  std::vector<pid_t> pids = cluster_->processes().LivePids();
  ASSERT_EQ(pids.size(), 4u);
  auto total = [&] {
    double s = 0;
    for (pid_t p : pids) s += CpuSeconds(p);
    return s;
  };
  // Start-up work ends on its own: each worker faults its KV pool in behind
  // it (kv_storage.cc, ~0.3 CPU-seconds for the three pools here). Wait, up
  // to 30 s, for one quiet second; a process that spins is never quiet, and
  // the window below then measures it.
  const auto settle_by = Clock::now() + std::chrono::seconds(30);
  while (Clock::now() < settle_by) {
    const double a = total();
    std::this_thread::sleep_for(std::chrono::seconds(1));  // one sample window
    if (total() - a < 0.05) break;
  }
  double before = total();
  auto t0 = Clock::now();
  std::this_thread::sleep_for(std::chrono::seconds(5));  // the measurement window
  double after = total();
  double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  double cores = (after - before) / wall;
  std::printf("idle cluster: %.4f CPU-seconds over %.2f s = %.2f%% of one core\n", after - before,
              wall, 100 * cores);
  EXPECT_LT(cores, 0.05);
}

TEST_F(DisaggregatedTest, GreedyMatchesEngine) { ExpectGreedyMatchesEngine(port_); }

TEST_F(DisaggregatedTest, LogprobsAndLogitBiasMatchEngine) {
  ExpectLogprobsAndBiasMatchEngine(port_);
}

TEST_F(DisaggregatedTest, StructuredOutputMatchesEngine) {
  ExpectStructuredOutputMatchesEngine(port_);
}

// A chat answer that ends by itself: finish_reason "stop", and the model's
// end-of-generation token (<|im_end|>) is not part of the text.
TEST_F(DisaggregatedTest, EndOfGenerationTokenIsNotText) {
  json body = {{"model", fs::path(ModelPath()).stem().string()},
               {"messages", {{{"role", "user"}, {"content", "Say hello."}}}},
               {"max_tokens", 96},
               {"temperature", 0}};
  auto r = HttpCall(Post(port_, "/v1/chat/completions", body));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->status, 200) << r->body;
  json j = json::parse(r->body);
  const std::string text = j["choices"][0]["message"]["content"];
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop") << text;
  EXPECT_FALSE(text.empty());
  EXPECT_EQ(text.find("<|im_end|>"), std::string::npos) << text;
}

// n = 3 through the cluster: three requests, one response; greedy, so every
// choice is the engine's greedy output.
TEST_F(DisaggregatedTest, NChoicesEachEqualTheEngine) {
  const std::vector<int32_t> prompt = ref_->Encode("The three primary colours are");
  const std::string want = ref_->Text(ref_->Greedy(prompt, 12));
  json body = CompletionBody(prompt, 12, false);
  body["n"] = 3;
  auto r = HttpCall(Post(port_, "/v1/completions", body));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->status, 200) << r->body;
  json j = json::parse(r->body);
  ASSERT_EQ(j["choices"].size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(j["choices"][i]["index"], i);
    EXPECT_EQ(j["choices"][i]["text"], want) << "choice " << i;
  }
  EXPECT_EQ(j["usage"]["completion_tokens"], 36);
  EXPECT_EQ(j["usage"]["prompt_tokens"], static_cast<int>(prompt.size()));
}

// presence_penalty / frequency_penalty travel from the API through the
// coordinator and the prefill and decode workers to the sampler: the cluster's
// greedy output equals the engine's with the same penalties, and differs from
// the unpenalized one on a prompt that makes the model repeat itself.
TEST_F(DisaggregatedTest, PenaltiesReachTheSampler) {
  const std::vector<int32_t> prompt = ref_->Encode("one one one one one one one one");
  constexpr int kTokens = 16;
  const std::vector<int32_t> plain = ref_->Greedy(prompt, kTokens);
  const std::vector<int32_t> penalized = ref_->Greedy(prompt, kTokens, 1.5f, 1.5f);
  ASSERT_NE(plain, penalized) << "the penalties change nothing on this prompt; pick another";
  CompletionOutcome got =
      Complete(port_, prompt, kTokens, {{"presence_penalty", 1.5}, {"frequency_penalty", 1.5}});
  ASSERT_EQ(got.http_status, 200) << got.error;
  EXPECT_EQ(got.text, ref_->Text(penalized));
}

// A decode group of TP = 2 (two processes, each holding and receiving only its
// KV heads, exact mode): the same tokens as one process.
TEST_F(ClusterTest, TensorParallelDecodeGreedyMatchesEngine) {
  auto cluster = StartCluster(1, 1, 0, "prefix_aware", /*tp=*/2);
  ASSERT_NE(cluster, nullptr);
  ExpectGreedyMatchesEngine(cluster->http_port());
  ExpectLogprobsAndBiasMatchEngine(cluster->http_port());
  ExpectStructuredOutputMatchesEngine(cluster->http_port());
}

// Prompts longer than one KV stream segment (worker/kv_streams.h: 32 blocks
// of 16 tokens) are prefilled in several chunks and streamed segment by
// segment as each chunk completes one, to both ranks of a TP = 2 group. Two
// of them at once share the step budget, so chunk ends fall inside segments.
// Every answer equals the single-process engine's.
TEST_F(ClusterTest, LongPromptsStreamInSegmentsAcrossChunks) {
  auto cluster = StartCluster(1, 1, 0, "round_robin", /*tp=*/2);
  ASSERT_NE(cluster, nullptr);
  const uint16_t port = cluster->http_port();
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 2; ++i) {
    std::string text = "Log of the river gauges, station " + std::to_string(i) + ". ";
    for (int day = 0; day < 90; ++day) {
      text += "Day " + std::to_string(day) + ": level " + std::to_string((day * 37 + i) % 90) +
              " cm, flow steady. ";
    }
    text += "The highest level was on day";
    prompts.push_back(ref_->Encode(text));
    ASSERT_GT(prompts.back().size(), 2u * 512) << "the prompt must span 3 segments";
  }
  std::vector<CompletionOutcome> got(prompts.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < prompts.size(); ++i) {
    threads.emplace_back([&, i] { got[i] = Complete(port, prompts[i], 12); });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(got[i].http_status, 200) << got[i].error;
    EXPECT_EQ(got[i].text, ref_->Text(ref_->Greedy(prompts[i], 12))) << "prompt " << i;
  }
}

TEST_F(DisaggregatedTest, ClientDisconnectFreesBlocksOnEveryWorker) {
  const std::string gauge = "kvrelay_worker_kv_utilization";
  auto all_idle = [&] {
    auto running = WorkerGauge(port_, "kvrelay_worker_running");
    if (running.size() != 3) return false;
    for (const auto& [w, v] : running) {
      if (v != 0) return false;
    }
    return true;
  };
  // Baseline: nothing running and the heartbeat-fed gauges unchanged for three
  // heartbeat intervals (so it is not a stale reading from an earlier test).
  // Unreferenced prefix-cache blocks count as free.
  std::map<std::string, double> baseline;
  auto stable_since = Clock::now();
  ASSERT_TRUE(WaitFor(
      [&] {
        auto now = WorkerGauge(port_, gauge);
        if (now != baseline || now.size() != 3 || !all_idle()) {
          baseline = now;
          stable_since = Clock::now();
          return false;
        }
        return Clock::now() - stable_since >= milliseconds(1500);
      },
      milliseconds(30'000)));
  std::vector<int32_t> prompt =
      ref_->Encode("Tell me a very long story about a lighthouse keeper and his cat.");
  std::atomic<bool> disconnect{false};
  StreamOutcome outcome;
  std::thread client([&] {
    outcome = Stream(port_, prompt, 2000, [&](const StreamOutcome&) { return !disconnect.load(); });
  });
  // Mid-stream the decode worker holds blocks (seen through its heartbeats).
  bool busy = WaitFor(
      [&] {
        auto now = WorkerGauge(port_, gauge);
        for (const auto& [w, v] : now) {
          if (w.rfind("decode-", 0) == 0 && v > baseline[w]) return true;
        }
        return false;
      },
      milliseconds(60'000));
  disconnect = true;
  client.join();
  ASSERT_TRUE(busy) << "no decode worker reported KV in use during the stream";
  EXPECT_FALSE(outcome.done) << "the stream finished before the client went away";
  // After the disconnect every worker is back at its baseline.
  std::map<std::string, double> last;
  bool freed = WaitFor(
      [&] {
        last = WorkerGauge(port_, gauge);
        if (last.size() != baseline.size() || !all_idle()) return false;
        for (const auto& [w, v] : last) {
          if (v > baseline[w] + 1e-9) return false;
        }
        return true;
      },
      milliseconds(15'000));
  std::string report;
  for (const auto& [w, v] : last) {
    report += w + "=" + std::to_string(v) + " (baseline " + std::to_string(baseline[w]) + ") ";
  }
  EXPECT_TRUE(freed) << "KV still held after the client disconnected: " << report;
  // And the cluster still serves.
  CompletionOutcome after = Complete(port_, prompt, 4);
  EXPECT_EQ(after.http_status, 200) << after.error;
}

TEST_F(DisaggregatedTest, OfficialPythonClient) {
  // A venv with the `openai` package: $KVRELAY_OPENAI_VENV, else one created
  // (pip install openai) under the build directory.
  const char* env_venv = std::getenv("KVRELAY_OPENAI_VENV");
  const std::string venv = env_venv ? env_venv : BuildDir() + "/openai-venv";
  auto run = [](const std::string& cmd, std::string* out) {
    FILE* p = popen(cmd.c_str(), "r");
    if (p == nullptr) return -1;
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out->append(buf, n);
    int status = pclose(p);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  std::string log;
  if (env_venv == nullptr && kvrelay::testing::EnsureOpenAiVenv(venv, &log) != 0) {
    KVRELAY_SKIP_OR_FAIL() << "cannot create a venv with the openai client: " << log;
  }
  HttpCallSpec models;
  models.port = port_;
  models.target = "/v1/models";
  auto m = HttpCall(models);
  ASSERT_TRUE(m.ok() && m->status == 200);
  std::string name = json::parse(m->body)["data"][0]["id"];
  std::string out;
  const std::string script = SourceDir() + "/tests/integration/coordinator/openai_client_check.py";
  int rc = run("'" + venv + "/bin/python' '" + script +
                   "' http://127.0.0.1:" + std::to_string(port_) + "/v1 '" + name + "'",
               &out);
  if (rc != 0 && out.find("No module named 'openai'") != std::string::npos)
    KVRELAY_SKIP_OR_FAIL() << out;
  ASSERT_EQ(rc, 0) << out;
  json j = json::parse(out);
  // The completion equals the engine's greedy continuation (same 8-token budget,
  // unless the model ended earlier).
  std::vector<int32_t> prompt = ref_->Encode("The capital of France is");
  testing::ExpectOpenAiClientReport(j, name, prompt.size());
  std::string expected = ref_->Text(ref_->Greedy(prompt, 8));
  std::string got = j["completion"]["text"];
  EXPECT_EQ(expected.rfind(got, 0), 0u) << "cluster '" << got << "' vs engine '" << expected << "'";
  if (j["completion"]["finish_reason"] == "length") {
    EXPECT_EQ(got, expected);
  }
}

// Last on the shared cluster: a failure here (a lost worker) must not fail the
// tests above.
TEST_F(DisaggregatedTest, ConcurrentStreamsEqualSoloOutputs) {
  constexpr int kDistinct = 16;
  constexpr int kTokens = 16;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < kDistinct; ++i) {
    prompts.push_back(ref_->Encode("Question " + std::to_string(i) + ": what is " +
                                   std::to_string(i * 7 + 3) + " plus " + std::to_string(i + 11) +
                                   "? Answer:"));
  }
  std::vector<std::string> solo(kDistinct);
  for (int i = 0; i < kDistinct; ++i) {
    StreamOutcome s = Stream(port_, prompts[i], kTokens);
    ASSERT_TRUE(s.done) << s.error;
    solo[i] = s.text;
  }
  constexpr int kConcurrent = 32;
  std::vector<StreamOutcome> results(kConcurrent);
  std::vector<std::thread> threads;
  for (int i = 0; i < kConcurrent; ++i) {
    threads.emplace_back([&, i] { results[i] = Stream(port_, prompts[i % kDistinct], kTokens); });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kConcurrent; ++i) {
    EXPECT_TRUE(results[i].done) << "request " << i << ": " << results[i].error;
    EXPECT_TRUE(results[i].error.empty()) << "request " << i << ": " << results[i].error;
    EXPECT_EQ(results[i].text, solo[i % kDistinct]) << "request " << i;
  }
}

// Four long streams spread over two decode groups; SIGKILL of `victim` (a
// process of decode group 0) mid-stream: the requests on that group end with
// an error within 10 s, the other group's complete, and new requests are
// still served.
void ExpectKillFailsOnlyItsGroup(Reference* ref, deploy::LocalLauncher& cluster,
                                 const std::string& victim_name) {
  const uint16_t port = cluster.http_port();
  constexpr int kRequests = 4;
  constexpr int kTokens = 300;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < kRequests; ++i) {
    prompts.push_back(
        ref->Encode("Story number " + std::to_string(i) + ": once upon a time in a faraway land"));
  }
  std::vector<StreamOutcome> results(kRequests);
  std::vector<std::thread> threads;
  for (int i = 0; i < kRequests; ++i) {
    threads.emplace_back([&, i] { results[i] = Stream(port, prompts[i], kTokens, {}, 120'000); });
  }
  // Both decode groups are decoding something.
  bool both = WaitFor(
      [&] {
        auto running = WorkerGauge(port, "kvrelay_worker_running");
        return running["decode-0"] >= 1 && running["decode-1"] >= 1;
      },
      milliseconds(60'000));
  const pid_t victim = cluster.processes().Pid(victim_name);
  ASSERT_GT(victim, 0);
  const auto killed_at = Clock::now();
  if (both) kill(victim, SIGKILL);
  for (auto& t : threads) t.join();
  ASSERT_TRUE(both) << "the router did not spread 4 requests over both decode groups";
  int errored = 0, completed = 0;
  for (int i = 0; i < kRequests; ++i) {
    const StreamOutcome& r = results[i];
    if (!r.error.empty()) {
      ++errored;
      EXPECT_FALSE(r.done && r.chunks >= kTokens) << "request " << i;
      double after_kill = std::chrono::duration<double>(r.ended - killed_at).count();
      EXPECT_LT(after_kill, 10.0) << "request " << i << " ended " << after_kill
                                  << " s after the kill: " << r.error;
    } else {
      ++completed;
      EXPECT_TRUE(r.done) << "request " << i;
    }
  }
  EXPECT_GE(errored, 1);
  EXPECT_GE(completed, 1);
  // The surviving group takes new requests.
  CompletionOutcome after = Complete(port, prompts[0], 8);
  EXPECT_EQ(after.http_status, 200) << after.error;
  EXPECT_EQ(after.completion_tokens, 8);
}

// With --migration-limit 0 (DecodeWorkerKilledMidStreamIsMigrated: with
// migration on, the default, those requests complete elsewhere).
TEST_F(ClusterTest, DecodeWorkerKilledMidStream) {
  deploy::LaunchOptions o = ClusterOptions(1, 2, 0);
  o.coordinator_args = {"--migration-limit", "0"};
  auto cluster = StartCluster(o);
  ASSERT_NE(cluster, nullptr);
  ExpectKillFailsOnlyItsGroup(ref_, *cluster, "decode-0");
}

// A TP = 2 group loses a follower rank: the whole group fails its requests
// (it cannot compute without that rank) and leaves; the other group goes on.
TEST_F(ClusterTest, TensorParallelRankKilledMidStream) {
  deploy::LaunchOptions o = ClusterOptions(1, 2, 0);
  o.tp = 2;
  o.coordinator_args = {"--migration-limit", "0"};  // as above
  auto cluster = StartCluster(o);
  ASSERT_NE(cluster, nullptr);
  ExpectKillFailsOnlyItsGroup(ref_, *cluster, "decode-0-tp1");
}

// A TP follower that dies while its group is idle: rank 0 notices the closed
// link and leaves, the coordinator drops the group, and requests are served by
// the other group (none of them fails).
TEST_F(ClusterTest, IdleTensorParallelGroupLosingARankLeavesTheCluster) {
  auto cluster = StartCluster(1, 2, 0, "prefix_aware", /*tp=*/2);
  ASSERT_NE(cluster, nullptr);
  const uint16_t port = cluster->http_port();
  auto registered = [&](const std::string& id) { return Registered(port, id); };
  ASSERT_TRUE(registered("decode-1"));
  ASSERT_EQ(WorkerGauge(port, "kvrelay_worker_healthy")["decode-1"], 1);
  const pid_t victim = cluster->processes().Pid("decode-1-tp1");
  ASSERT_GT(victim, 0);
  kill(victim, SIGKILL);
  EXPECT_TRUE(WaitFor([&] { return !registered("decode-1"); }, milliseconds(10'000)))
      << "the broken group is still registered 10 s after losing a rank";
  // /metrics no longer reports the dead group healthy (it kept 1 before).
  EXPECT_EQ(WorkerGauge(port, "kvrelay_worker_healthy")["decode-1"], 0);
  const std::vector<int32_t> prompt = ref_->Encode("A short question about rivers");
  const std::string want = ref_->Text(ref_->Greedy(prompt, 8));
  for (int i = 0; i < 4; ++i) {
    CompletionOutcome got = Complete(port, prompt, 8);
    EXPECT_EQ(got.http_status, 200) << got.error;
    EXPECT_EQ(got.text, want);
  }
}

// Once a prefill worker has handed a request's KV to the decode side and
// reported its first token, its death does not fail the request: here every
// prefill worker is killed while two requests are decoding, and both still
// finish with the engine's tokens. (Before: they failed with "worker prefill-N
// was lost".)
TEST_F(ClusterTest, PrefillDeathAfterHandOverDoesNotFailDecodingRequests) {
  auto cluster = StartCluster(2, 1, 0, "round_robin");
  ASSERT_NE(cluster, nullptr);
  const uint16_t port = cluster->http_port();
  constexpr int kTokens = 160;
  std::vector<std::vector<int32_t>> prompts = {ref_->Encode("Tell me a story about a lighthouse"),
                                               ref_->Encode("Tell me a story about a mountain")};
  std::vector<StreamOutcome> results(prompts.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < prompts.size(); ++i) {
    threads.emplace_back([&, i] { results[i] = Stream(port, prompts[i], kTokens, {}, 120'000); });
  }
  const bool decoding =
      WaitFor([&] { return WorkerGauge(port, "kvrelay_worker_running")["decode-0"] >= 2; },
              milliseconds(60'000));
  if (decoding) {
    for (const char* p : {"prefill-0", "prefill-1"}) kill(cluster->processes().Pid(p), SIGKILL);
  }
  for (auto& t : threads) t.join();
  ASSERT_TRUE(decoding) << "the two requests never decoded at once";
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_TRUE(results[i].error.empty()) << "request " << i << ": " << results[i].error;
    EXPECT_EQ(results[i].text, ref_->Text(ref_->Greedy(prompts[i], kTokens))) << "request " << i;
  }
}

// The prefix store survives a full restart of the cluster: a prompt served
// before the restart is loaded from RocksDB after it instead of recomputed
// (cached_tokens covers every full block of the shared prefix), and the answer
// is still the engine's. Before: only blocks evicted from RAM were written and
// a clean shutdown wrote nothing, so after a restart cached_tokens was 0.
TEST_F(ClusterTest, PrefixStoreIsReusedAfterAFullRestart) {
  char tmpl[] = "/tmp/kvrelay-store-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  struct RemoveOnExit {
    std::string path;
    ~RemoveOnExit() { std::filesystem::remove_all(path); }
  } cleanup{dir};
  std::string system = "You are a careful assistant for a river authority. ";
  for (int i = 0; i < 40; ++i) {
    system += "Rule " + std::to_string(i) + ": report the gauge level and the trend. ";
  }
  const std::vector<int32_t> first = ref_->Encode(system + "Question: is the Rhine high today?");
  const std::vector<int32_t> second = ref_->Encode(system + "Question: is the Elbe low today?");
  const std::vector<int32_t> shared = ref_->Encode(system);
  const int full_blocks_tokens = static_cast<int>(shared.size() / 16 * 16);
  ASSERT_GT(full_blocks_tokens, 256);
  // The prefill worker's store as its heartbeats carry it to /metrics.
  auto store_figure = [](const deploy::LocalLauncher& c, const char* name) {
    auto v = WorkerGauge(c.http_port(), name);
    return v.count("prefill-0") ? v["prefill-0"] : -1.0;
  };
  // Waits (10 s, heartbeats every 500 ms) until the figure reaches `want`;
  // a message with the last value read when it does not.
  auto reaches = [&](const deploy::LocalLauncher& c, const char* name, double want) {
    double got = -1;
    if (WaitFor([&] { return (got = store_figure(c, name)) >= want; }, milliseconds(10'000))) {
      return std::string();
    }
    return std::string(name) + " " + std::to_string(got) + ", want " + std::to_string(want);
  };
  const double shared_blocks = static_cast<double>(full_blocks_tokens / 16);
  {
    auto cluster = StartCluster(1, 1, 0, "prefix_aware", 1, dir);
    ASSERT_NE(cluster, nullptr);
    CompletionOutcome cold = Complete(cluster->http_port(), first, 4);
    ASSERT_EQ(cold.http_status, 200) << cold.error;
    EXPECT_EQ(cold.cached_tokens, 0);
    // Every full block of the shared prefix is written through to disk.
    EXPECT_EQ(reaches(*cluster, "kvrelay_worker_kvstore_disk_written_blocks_total", shared_blocks),
              "");
    EXPECT_EQ(store_figure(*cluster, "kvrelay_worker_kvstore_restored_blocks_total"), 0);
    EXPECT_EQ(WorkerGauge(cluster->http_port(), "kvrelay_worker_kvstore_disk_written_blocks_total")
                  .count("decode-0"),
              0u)
        << "the decode worker has no prefix store";
    cluster->Stop();
  }
  auto cluster = StartCluster(1, 1, 0, "prefix_aware", 1, dir);
  ASSERT_NE(cluster, nullptr);
  CompletionOutcome warm = Complete(cluster->http_port(), second, 8);
  EXPECT_EQ(warm.http_status, 200) << warm.error;
  EXPECT_GE(warm.cached_tokens, full_blocks_tokens - 16)
      << "after the restart the shared prefix was recomputed";
  EXPECT_EQ(warm.text, ref_->Text(ref_->Greedy(second, 8)));
  // What was served from the store came from disk (a fresh RAM tier).
  const double restored = static_cast<double>(warm.cached_tokens / 16);
  EXPECT_EQ(reaches(*cluster, "kvrelay_worker_kvstore_restored_disk_blocks_total", restored), "");
  EXPECT_GE(store_figure(*cluster, "kvrelay_worker_kvstore_restores_total"), 1);
  cluster->Stop();
}

// A scratch directory under $TMPDIR (or /tmp), removed with everything in it
// when the test ends, also on failure.
struct ScratchDir {
  ScratchDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl =
        std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/kvrelay-cluster-XXXXXX";
    if (mkdtemp(tmpl.data()) != nullptr) path = tmpl;
  }
  ~ScratchDir() {
    if (!path.empty()) fs::remove_all(path);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  std::string path;  // empty when it could not be made
};

// True when `pid` is gone or a zombie (dead, not yet reaped by whoever
// inherited it).
bool ProcessDead(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const auto rp = s.rfind(')');
  if (rp == std::string::npos || rp + 2 >= s.size()) return true;
  return s[rp + 2] == 'Z' || s[rp + 2] == 'X';
}

// `kvrelay launch` as users run it, as a child process leading a process
// group of its own: the launcher and every process it spawns (they inherit the
// group) can be SIGKILLed at once. Its stdout and stderr go to `log_path`.
// The destructor SIGKILLs the whole group and reaps the launcher, so a failed
// test leaves nothing running.
class CliCluster {
 public:
  explicit CliCluster(std::string log_path) : log_path_(std::move(log_path)) {}
  ~CliCluster() { KillAll(); }
  CliCluster(const CliCluster&) = delete;
  CliCluster& operator=(const CliCluster&) = delete;

  // Runs `kvrelay launch <flags> --port P` and waits (120 s) for its "serving
  // on" line. Empty when serving; otherwise why not (with the log's tail).
  std::string Start(const std::vector<std::string>& flags) {
#ifndef KVRELAY_CLUSTER_CLI_BIN
    return "built without the kvrelay CLI target";
#else
    auto port = deploy::PickFreePort();
    if (!port.ok()) return port.status().ToString();
    port_ = *port;
    std::vector<std::string> args = {
        KVRELAY_CLUSTER_CLI_BIN, "launch", "--host", "127.0.0.1", "--port", std::to_string(port_)};
    args.insert(args.end(), flags.begin(), flags.end());
    const pid_t pid = fork();
    if (pid < 0) return std::string("fork: ") + std::strerror(errno);
    if (pid == 0) {
      setpgid(0, 0);
      const int fd = ::open(log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
      if (fd >= 0) {
        dup2(fd, STDOUT_FILENO);
        dup2(fd, STDERR_FILENO);
      }
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    setpgid(pid, pid);  // also here: no race with a kill before the child ran setpgid
    pid_ = pid;
    const bool up = WaitFor(
        [&] {
          if (Reap(false)) return true;
          return Log().find("kvrelay cluster serving on") != std::string::npos;
        },
        milliseconds(120'000));
    if (up && pid_ > 0) return "";
    return std::string(pid_ > 0 ? "not serving after 120 s" : "kvrelay launch exited") +
           "; its log ends:\n" + LogTail();
#endif
  }

  uint16_t port() const { return port_; }
  pid_t launcher_pid() const { return pid_; }
  std::string Log() const {
    std::ifstream f(log_path_);
    return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  }
  std::string LogTail() const {
    std::string l = Log();
    return l.size() > 3000 ? l.substr(l.size() - 3000) : l;
  }
  // Every process the launcher reports starting ("started NAME (pid N)" in
  // its log), by name.
  std::map<std::string, pid_t> Children() const {
    std::map<std::string, pid_t> out;
    std::istringstream in(Log());
    for (std::string line; std::getline(in, line);) {
      const auto at = line.find("started ");
      const auto open = line.find(" (pid ", at);
      if (at == std::string::npos || open == std::string::npos) continue;
      out[line.substr(at + 8, open - at - 8)] =
          static_cast<pid_t>(std::atol(line.c_str() + open + 6));
    }
    return out;
  }
  // SIGKILL to the launcher's whole process group at once (no process gets
  // a SIGTERM first or has a chance to drain anything), then to each child
  // the launcher reported, in case one left the group; reaps the launcher.
  void KillAll() {
    if (pid_ <= 0) return;
    kill(-pid_, SIGKILL);
    for (const auto& [name, pid] : Children()) kill(pid, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  // True when the launcher has exited (reaped; pid_ becomes -1).
  bool Reap(bool block) {
    if (pid_ <= 0) return true;
    int status = 0;
    if (waitpid(pid_, &status, block ? 0 : WNOHANG) != pid_) return false;
    kill(-pid_, SIGKILL);  // whatever it left behind
    pid_ = -1;
    return true;
  }

  std::string log_path_;
  pid_t pid_ = -1;
  uint16_t port_ = 0;
};

// The prefix store survives kill -9 of every process of the cluster, as after
// a power cut of the processes (not the machine) or the OOM killer: a
// `kvrelay launch` cluster serves a long prompt cold, /metrics shows its full
// blocks written to disk, then the launcher, the coordinator and every worker
// are SIGKILLed at once (no SIGTERM, so no drain of the write queue). A new
// `kvrelay launch` on the same store directory serves the same prompt with
// its prefix restored from disk (cached_tokens, the restored-from-disk
// counter) and the same greedy answer, the engine's. A store that kept
// written blocks only in memory (a memtable without its write-ahead log, a
// queue still to write) fails here, where the clean-stop restart test passes.
TEST_F(ClusterTest, PrefixStoreIsReusedAfterKillMinus9OfEveryProcess) {
  ScratchDir scratch;
  ASSERT_FALSE(scratch.path.empty());
  const std::string store = scratch.path + "/kvstore";
  std::string system = "You are a careful assistant for a harbour master. ";
  for (int i = 0; i < 16; ++i) {
    system += "Rule " + std::to_string(i) + ": log the tide, the wind and every ship. ";
  }
  const std::vector<int32_t> prompt = ref_->Encode(system + "Question: may the ferry leave?");
  const int shared_tokens = static_cast<int>(ref_->Encode(system).size() / 16 * 16);
  ASSERT_GE(shared_tokens, 160);
  const double shared_blocks = shared_tokens / 16;
  constexpr int kTokens = 8;
  const std::string want = ref_->Text(ref_->Greedy(prompt, kTokens));
  const std::vector<std::string> flags = {"--model=" + ModelPath(),
                                          "--bin-dir=" + BinDir(),
                                          "--kv-store=" + store,
                                          "--kv-dtype=" + std::string(kKvDtype),
                                          "--prefill=1",
                                          "--decode=1",
                                          "--kv-capacity-mb=128",
                                          "--threads-per-worker=1"};
  // The prefill worker's store figure `name` as its heartbeats carry it to
  // /metrics, once it reaches `at_least` (10 s); NaN when missing.
  auto figure = [](uint16_t port, const char* name, double at_least) {
    double v = std::numeric_limits<double>::quiet_NaN();
    WaitFor([&] { return (v = WorkerGauge(port, name)["prefill-0"]) >= at_least; },
            milliseconds(10'000));
    return v;
  };
  std::string first_text;
  double written_before = 0;
  {
    CliCluster cluster(scratch.path + "/launch-1.log");
    const std::string why = cluster.Start(flags);
    ASSERT_EQ(why, "");
    const uint16_t port = cluster.port();
    CompletionOutcome cold = Complete(port, prompt, kTokens);
    ASSERT_EQ(cold.http_status, 200) << cold.error;
    EXPECT_EQ(cold.cached_tokens, 0);
    EXPECT_EQ(cold.text, want);
    first_text = cold.text;
    // The write-through may be asynchronous: wait until every full block of
    // the shared prefix is on disk as far as the worker reports.
    const double written =
        figure(port, "kvrelay_worker_kvstore_disk_written_blocks_total", shared_blocks);
    ASSERT_GE(written, shared_blocks) << "blocks written to disk before the kill";
    written_before = written;
    EXPECT_EQ(WorkerGauge(port, "kvrelay_worker_kvstore_restored_disk_blocks_total")["prefill-0"],
              0);
    const std::map<std::string, pid_t> children = cluster.Children();
    for (const char* name : {"coordinator", "prefill-0", "decode-0"}) {
      ASSERT_TRUE(children.count(name)) << "the launcher did not report " << name << "\n"
                                        << cluster.LogTail();
    }
    const pid_t launcher = cluster.launcher_pid();
    cluster.KillAll();
    EXPECT_TRUE(ProcessDead(launcher));
    for (const auto& [name, pid] : children) {
      EXPECT_TRUE(WaitFor([pid = pid] { return ProcessDead(pid); }, milliseconds(5'000)))
          << name << " (pid " << pid << ") survived SIGKILL";
    }
  }
  CliCluster cluster(scratch.path + "/launch-2.log");
  const std::string why = cluster.Start(flags);
  ASSERT_EQ(why, "");
  CompletionOutcome warm = Complete(cluster.port(), prompt, kTokens);
  ASSERT_EQ(warm.http_status, 200) << warm.error;
  EXPECT_GT(warm.cached_tokens, 0) << "after kill -9 the whole prompt was recomputed";
  EXPECT_GE(warm.cached_tokens, shared_tokens - 16);
  EXPECT_EQ(warm.text, first_text);
  EXPECT_EQ(warm.text, want);
  // What was served from the store came from disk (a fresh RAM tier).
  const double restored = std::max(1, warm.cached_tokens / 16);
  const double restored_disk =
      figure(cluster.port(), "kvrelay_worker_kvstore_restored_disk_blocks_total", restored);
  EXPECT_GE(restored_disk, restored);
  std::printf(
      "kill -9 of every process: %d-token prompt, %.0f blocks on disk before, "
      "cached_tokens %d after, %.0f blocks restored from disk\n",
      static_cast<int>(prompt.size()), written_before, warm.cached_tokens, restored_disk);
}

// A worker that stalls past the heartbeat deadline (SIGSTOP) is dropped by
// the coordinator; when it resumes it finds its link closed, reconnects,
// registers again and serves, so the cluster does not lose it for good.
// (Before: the worker exited on the lost link and, being the only prefill
// worker, every later request failed.)
TEST_F(ClusterTest, StalledWorkerReconnectsAndServesAgain) {
  auto cluster = StartCluster(1, 1, 0, "round_robin");
  ASSERT_NE(cluster, nullptr);
  const uint16_t port = cluster->http_port();
  const std::vector<int32_t> prompt = ref_->Encode("Why do rivers flow to the sea?");
  const std::string want = ref_->Text(ref_->Greedy(prompt, 8));
  ASSERT_EQ(Complete(port, prompt, 8).text, want);
  const pid_t stalled = cluster->processes().Pid("prefill-0");
  ASSERT_GT(stalled, 0);
  ASSERT_EQ(kill(stalled, SIGSTOP), 0);
  const bool dropped =
      WaitFor([&] { return !Registered(port, "prefill-0"); }, milliseconds(10'000));
  ASSERT_EQ(kill(stalled, SIGCONT), 0);
  ASSERT_TRUE(dropped) << "the coordinator kept a stalled worker registered for 10 s";
  EXPECT_TRUE(WaitFor([&] { return Registered(port, "prefill-0"); }, milliseconds(10'000)))
      << "the resumed worker did not register again within 10 s";
  for (int i = 0; i < 2; ++i) {
    CompletionOutcome got = Complete(port, prompt, 8);
    EXPECT_EQ(got.http_status, 200) << got.error;
    EXPECT_EQ(got.text, want);
  }
  EXPECT_EQ(cluster->processes().Pid("prefill-0"), stalled)
      << "the worker was restarted, not resumed";
}

// A prefill worker that stops answering (SIGSTOP: its connection stays open,
// its heartbeats stop) while holding requests that have produced no token:
// the coordinator notices within 3 heartbeat intervals and re-runs them on the
// other prefill worker, so every client still gets the right answer.
TEST_F(ClusterTest, RequestsOfAFrozenPrefillWorkerAreReRun) {
  auto cluster = StartCluster(2, 1, 0, "round_robin");
  ASSERT_NE(cluster, nullptr);
  const uint16_t port = cluster->http_port();
  const pid_t frozen = cluster->processes().Pid("prefill-0");
  ASSERT_GT(frozen, 0);
  ASSERT_EQ(kill(frozen, SIGSTOP), 0);
  constexpr int kRequests = 4;
  constexpr int kTokens = 8;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < kRequests; ++i) {
    prompts.push_back(ref_->Encode("Question " + std::to_string(i) + ": what is a river?"));
  }
  std::vector<CompletionOutcome> results(kRequests);
  std::vector<std::thread> threads;
  const auto start = Clock::now();
  for (int i = 0; i < kRequests; ++i) {
    threads.emplace_back([&, i] { results[i] = Complete(port, prompts[i], kTokens); });
  }
  for (auto& t : threads) t.join();
  const double took = std::chrono::duration<double>(Clock::now() - start).count();
  kill(frozen, SIGKILL);
  for (int i = 0; i < kRequests; ++i) {
    EXPECT_EQ(results[i].http_status, 200) << "request " << i << ": " << results[i].error;
    EXPECT_EQ(results[i].text, ref_->Text(ref_->Greedy(prompts[i], kTokens))) << "request " << i;
  }
  // Round robin sent half of them to the frozen worker first: they waited for
  // the missed heartbeats (1.5 s) before being re-run.
  std::printf("4 requests, 2 of them re-run, done in %.2f s\n", took);
  EXPECT_GT(took, 1.0);
}

// deploy/mpirun/launch.sh: coordinator + 1 prefill + 1 decode group of TP = 2
// under mpirun (4 MPI ranks, MPMD).
TEST_F(ClusterTest, MpirunLaunchServesGreedyRequest) {
  if (std::system("command -v mpirun >/dev/null 2>&1") != 0)
    KVRELAY_SKIP_OR_FAIL() << "mpirun not found";
  auto http = deploy::PickFreePort();
  auto control = deploy::PickFreePort();
  ASSERT_TRUE(http.ok() && control.ok());
  std::vector<std::string> args = {"/bin/bash", SourceDir() + "/deploy/mpirun/launch.sh",
                                   "-P",        "1",
                                   "-D",        "1",
                                   "-T",        "2",
                                   "-b",        BinDir(),
                                   "-m",        ModelPath(),
                                   "-p",        std::to_string(*http),
                                   "-C",        std::to_string(*control),
                                   "-k",        kKvDtype,
                                   "-t",        "1"};
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    setpgid(0, 0);  // its own process group: mpirun and every rank are stopped together
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  setpgid(pid, pid);
  bool exited = false;
  auto health = [&]() -> int {
    HttpCallSpec spec;
    spec.port = *http;
    spec.target = "/health";
    spec.timeout_ms = 1000;
    auto r = HttpCall(spec);
    return r.ok() ? r->status : 0;
  };
  bool ready = WaitFor(
      [&] {
        int status = 0;
        if (waitpid(pid, &status, WNOHANG) == pid) {
          exited = true;
          return true;
        }
        return health() == 200;
      },
      milliseconds(120'000));
  if (ready && !exited) {
    std::vector<int32_t> prompt = ref_->Encode(GreedyPrompts()[1]);
    std::vector<int32_t> expected = ref_->Greedy(prompt, 16);
    CompletionOutcome got = Complete(*http, prompt, 16);
    EXPECT_EQ(got.http_status, 200) << got.error;
    EXPECT_EQ(got.text, ref_->Text(expected));
  }
  // Shut down: SIGTERM to the group, SIGKILL if it lingers.
  kill(-pid, SIGTERM);
  bool reaped = exited || WaitFor(
                              [&] {
                                int status = 0;
                                return waitpid(pid, &status, WNOHANG) == pid;
                              },
                              milliseconds(20'000));
  if (!reaped) {
    kill(-pid, SIGKILL);
    waitpid(pid, nullptr, 0);
  }
  kill(-pid, SIGKILL);  // anything left in the group
  EXPECT_TRUE(ready && !exited) << "mpirun cluster did not become healthy";
  EXPECT_TRUE(reaped) << "mpirun did not stop within 20 s of SIGTERM";
  // Nothing serves on the port any more.
  EXPECT_TRUE(WaitFor([&] { return health() == 0; }, milliseconds(10'000)));
}

// coordinator + 1 prefill + 1 decode group of TP = `tp` under mpirun
// (deploy/mpirun/launch.sh), every process with --kv-dtype `kv_dtype` and the
// KV data plane on `kv_transport` (-X). The mpirun process leads a process
// group of its own; the destructor stops the group (SIGTERM, SIGKILL after
// 20 s) and reaps it, also when the test fails.
class MpirunCluster {
 public:
  ~MpirunCluster() { Stop(); }
  // Empty when /health answers 200 (120 s); otherwise why not.
  std::string Start(const std::string& kv_dtype, const std::string& kv_transport, int tp) {
    auto http = deploy::PickFreePort();
    auto control = deploy::PickFreePort();
    if (!http.ok() || !control.ok()) return "no free port";
    port_ = *http;
    std::vector<std::string> args = {"/bin/bash", SourceDir() + "/deploy/mpirun/launch.sh",
                                     "-P",        "1",
                                     "-D",        "1",
                                     "-T",        std::to_string(tp),
                                     "-b",        BinDir(),
                                     "-m",        ModelPath(),
                                     "-p",        std::to_string(*http),
                                     "-C",        std::to_string(*control),
                                     "-k",        kv_dtype,
                                     "-X",        kv_transport,
                                     "-t",        "1"};
    pid_ = fork();
    if (pid_ < 0) return "fork failed";
    if (pid_ == 0) {
      setpgid(0, 0);  // its own process group: mpirun and every rank are stopped together
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    setpgid(pid_, pid_);
    bool exited = false;
    const bool ready = WaitFor(
        [&] {
          if (waitpid(pid_, nullptr, WNOHANG) == pid_) {
            exited = true;
            return true;
          }
          return Health() == 200;
        },
        milliseconds(120'000));
    if (exited) {
      kill(-pid_, SIGKILL);
      pid_ = -1;
      return "mpirun exited before the cluster was healthy";
    }
    return ready ? "" : "the mpirun cluster was not healthy within 120 s";
  }
  uint16_t port() const { return port_; }
  // HTTP status of GET /health; 0 when nothing answers.
  int Health() const {
    HttpCallSpec spec;
    spec.port = port_;
    spec.target = "/health";
    spec.timeout_ms = 1000;
    auto r = HttpCall(spec);
    return r.ok() ? r->status : 0;
  }
  void Stop() {
    if (pid_ <= 0) return;
    kill(-pid_, SIGTERM);
    const bool reaped =
        WaitFor([&] { return waitpid(pid_, nullptr, WNOHANG) == pid_; }, milliseconds(20'000));
    kill(-pid_, SIGKILL);  // anything left in the group
    if (!reaped) waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  uint16_t port_ = 0;
};

// #41: quantized KV through the daemons. The parameter is a --kv-dtype name
// whose cache is not f32 (int8, KIVI-4); the reference is the single-process
// engine with that same KV dtype, so the cluster's greedy answers must be
// its answers token for token. The prompts are chosen so that the dtype's
// greedy answer differs from f32's on at least one of them (checked first):
// a cluster that silently ran f32 KV somewhere, or dequantized differently
// on the decode side, would not match.
class QuantizedKvClusterTest : public ClusterTest,
                               public ::testing::WithParamInterface<const char*> {
 protected:
  void SetUp() override {
    ClusterTest::SetUp();
    if (IsSkipped()) return;
    ref_ = GetReference(GetParam());
    ASSERT_NE(ref_, nullptr);
    f32_ = GetReference("f32");
    ASSERT_NE(f32_, nullptr);
    for (const char* text : kPrompts) {
      prompts_.push_back(ref_->Encode(text));
      want_.push_back(ref_->Text(ref_->Greedy(prompts_.back(), kTokens)));
    }
    int differ = 0;
    for (size_t i = 0; i < prompts_.size(); ++i) {
      if (f32_->Text(f32_->Greedy(prompts_[i], kTokens)) != want_[i]) ++differ;
    }
    ASSERT_GE(differ, 1) << "no prompt tells " << GetParam() << " KV from f32 KV in " << kTokens
                         << " greedy tokens";
  }
  deploy::LaunchOptions Options(const std::string& kv_store_dir) const {
    deploy::LaunchOptions o = ClusterOptions(1, 1, 0);
    o.kv_dtype = GetParam();
    o.kv_store_dir = kv_store_dir;
    return o;
  }
  // Every prompt through the cluster on `port` gives the reference's greedy
  // text; `what` names the run in failure messages.
  void ExpectEngineAnswers(uint16_t port, const char* what) {
    for (size_t i = 0; i < prompts_.size(); ++i) {
      CompletionOutcome got = Complete(port, prompts_[i], kTokens);
      ASSERT_EQ(got.http_status, 200) << what << ": " << got.error;
      EXPECT_EQ(got.completion_tokens, kTokens) << what;
      EXPECT_EQ(got.text, want_[i]) << what << ", " << GetParam() << " KV, prompt " << i << " ("
                                    << prompts_[i].size() << " tokens)";
    }
  }

  static constexpr int kTokens = 16;
  // Short prompts; the last spans two full KV blocks (16 tokens each), so the
  // prefix store has something to keep.
  static constexpr const char* kPrompts[] = {
      "The capital of France is",
      "My favourite recipe for a rainy afternoon is",
      "Once upon a time, in a small village by the river, there lived an old baker who every "
      "morning",
  };
  Reference* f32_ = nullptr;
  std::vector<std::vector<int32_t>> prompts_;
  std::vector<std::string> want_;
};

// The control case: one colocated worker (prefill and decode in one engine,
// no KV on any wire) with this dtype. When it passes and the hand-over cases
// fail, the fault is in moving quantized KV between processes.
TEST_P(QuantizedKvClusterTest, ColocatedMatchesEngine) {
  deploy::LaunchOptions o = ClusterOptions(0, 0, 1);
  o.kv_dtype = GetParam();
  auto cluster = StartCluster(o);
  ASSERT_NE(cluster, nullptr);
  ExpectEngineAnswers(cluster->http_port(), "colocated");
  cluster->Stop();
}

// 1 prefill + 1 decode worker over TCP with the prefix store on: the KV
// crosses the prefill->decode wire in the quantized dtype and the answers
// are the engine's. After a restart on the same store directory the longest
// prompt's prefix is restored from disk (cached_tokens, the restored-from-
// disk counter) and the answers are still the engine's.
TEST_P(QuantizedKvClusterTest, TcpHandOverAndDiskRestoreMatchEngine) {
  ScratchDir scratch;
  ASSERT_FALSE(scratch.path.empty());
  const std::vector<int32_t>& stored = prompts_.back();
  const double stored_blocks = static_cast<double>((stored.size() - 1) / 16);
  ASSERT_GE(stored_blocks, 1);
  {
    auto cluster = StartCluster(Options(scratch.path));
    ASSERT_NE(cluster, nullptr);
    ExpectEngineAnswers(cluster->http_port(), "cold");
    double written = std::numeric_limits<double>::quiet_NaN();
    WaitFor(
        [&] {
          written = WorkerGauge(cluster->http_port(),
                                "kvrelay_worker_kvstore_disk_written_blocks_total")["prefill-0"];
          return written >= stored_blocks;
        },
        milliseconds(10'000));
    EXPECT_GE(written, stored_blocks) << "blocks written to disk";
    cluster->Stop();
  }
  auto cluster = StartCluster(Options(scratch.path));
  ASSERT_NE(cluster, nullptr);
  const uint16_t port = cluster->http_port();
  CompletionOutcome warm = Complete(port, stored, kTokens);
  ASSERT_EQ(warm.http_status, 200) << warm.error;
  EXPECT_GE(warm.cached_tokens, 16) << "after the restart the prefix was recomputed";
  EXPECT_EQ(warm.text, want_.back()) << GetParam() << " KV restored from disk";
  const double restored = std::max(1, warm.cached_tokens / 16);
  double got = std::numeric_limits<double>::quiet_NaN();
  WaitFor(
      [&] {
        got = WorkerGauge(port, "kvrelay_worker_kvstore_restored_disk_blocks_total")["prefill-0"];
        return got >= restored;
      },
      milliseconds(10'000));
  EXPECT_GE(got, restored) << "blocks restored from disk";
  ExpectEngineAnswers(port, "after the restart");
  cluster->Stop();
}

// The same hand-over on the MPI data plane: coordinator + 1 prefill + 1
// decode worker under mpirun with --kv-transport mpi.
TEST_P(QuantizedKvClusterTest, MpiHandOverMatchesEngine) {
  if (std::system("command -v mpirun >/dev/null 2>&1") != 0)
    KVRELAY_SKIP_OR_FAIL() << "mpirun not found";
  MpirunCluster cluster;
  const std::string why = cluster.Start(GetParam(), "mpi", /*tp=*/1);
  ASSERT_EQ(why, "");
  ExpectEngineAnswers(cluster.port(), "mpirun, MPI KV");
  cluster.Stop();
  EXPECT_TRUE(WaitFor([&] { return cluster.Health() == 0; }, milliseconds(10'000)));
}

INSTANTIATE_TEST_SUITE_P(Kv, QuantizedKvClusterTest, ::testing::Values("int8", "kivi4"),
                         [](const ::testing::TestParamInfo<const char*>& p) {
                           return std::string(p.param);
                         });

// Gemma 3 270M's reference for the tests below: a 600-token prompt (past its
// 512-token sliding window) greedily decoded 48 tokens by the single engine,
// and what that engine held per KV cache group (checked here: each sliding
// group within its window + the block the next token goes to, the full
// group every position's block). Null (with a skip message) when the file
// is absent.
struct GemmaLongPrompt {
  std::string model_path;
  Reference ref;
  engine::EngineOptions eo;
  std::vector<int32_t> prompt;
  std::vector<int32_t> expected;
  std::vector<int64_t> engine_peaks;
  static constexpr int kTokens = 48;  // positions 600..647: all past the window
};

std::unique_ptr<GemmaLongPrompt> MakeGemmaLongPrompt(std::string* skip) {
  auto g = std::make_unique<GemmaLongPrompt>();
  g->model_path = SourceDir() + "/models/gemma-3-270m-q4_k_m.gguf";
  if (!fs::exists(g->model_path)) {
    *skip = "models/gemma-3-270m-q4_k_m.gguf absent (scripts/fetch-model.sh gemma3-270m)";
    return nullptr;
  }
  auto model = engine::Model::Load(g->model_path);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  if (!model.ok()) return nullptr;
  Reference& ref = g->ref;
  ref.model = std::shared_ptr<const engine::Model>(std::move(*model));
  ref.codec = std::make_unique<coordinator::EngineTextCodec>(ref.model->tokenizer(),
                                                             ref.model->chat_template());
  engine::EngineOptions& eo = g->eo;
  eo.kv_dtype = engine::KvDtype::kF32;
  eo.kv_capacity_bytes = 128 << 20;
  eo.threads = 1;
  auto eng = engine::Engine::Create(eo, ref.model);
  EXPECT_TRUE(eng.ok()) << eng.status().ToString();
  if (!eng.ok()) return nullptr;
  ref.engine = std::move(*eng);
  std::ifstream in(SourceDir() + "/tests/data/kjv_genesis_exodus.txt");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  g->prompt = ref.Encode(text.substr(0, 4000));
  EXPECT_GT(g->prompt.size(), 600u);
  if (g->prompt.size() < 600u) return nullptr;
  g->prompt.resize(600);
  g->expected = ref.Greedy(g->prompt, GemmaLongPrompt::kTokens);
  EXPECT_EQ(g->expected.size(), static_cast<size_t>(GemmaLongPrompt::kTokens));
  const engine::KvCacheGroups& groups = ref.engine->kv_groups();
  g->engine_peaks = ref.engine->stats().peak_group_blocks;
  EXPECT_EQ(groups.size(), 6) << groups.DebugString();  // 1 full + 5 sliding for this model
  if (groups.size() != 6 || g->engine_peaks.size() != 6u) return nullptr;
  const int B = eo.block_tokens;
  const int64_t full_blocks =
      (static_cast<int64_t>(g->prompt.size()) + GemmaLongPrompt::kTokens - 1 + B - 1) / B;
  for (int k = 0; k < groups.size(); ++k) {
    const int w = groups.window[static_cast<size_t>(k)];
    const int64_t peak = g->engine_peaks[static_cast<size_t>(k)];
    if (w == 0) {
      EXPECT_EQ(peak, full_blocks) << "full group " << k;
    } else {
      EXPECT_LE(peak, (w + B - 1) / B + 1) << "sliding group " << k;
      EXPECT_LT(peak, full_blocks) << "sliding group " << k;
    }
  }
  return g;
}

// Gemma 3 270M (scripts/fetch-model.sh gemma3-270m): a prompt longer than its
// sliding window (512 tokens, 15 of 18 layers) decoded well past it gives the
// single engine's tokens colocated, disaggregated (layer-wise KV transfer) and
// disaggregated into a decode group of TP = 2. The single engine and every
// worker split the KV cache into groups (the sliding-window layers hold
// only their window, engine/kv_cache/kv_groups.h): the layer stream lands in
// the decode side's group tables. The model has one KV head for four query heads, so both
// TP ranks hold a replica of it and the prefill worker streams it to each
// (engine::ShardAttentionHeads, kv_transfer::ShardHeads). Every worker's KV is
// back to none in use afterwards.
TEST(Gemma3Cluster, LongPromptPastTheWindowMatchesEngine) {
  std::string skip;
  auto gemma = MakeGemmaLongPrompt(&skip);
  if (gemma == nullptr && !skip.empty()) KVRELAY_SKIP_OR_FAIL() << skip;
  ASSERT_NE(gemma, nullptr);
  const std::string& model_path = gemma->model_path;
  Reference& ref = gemma->ref;
  const std::vector<int32_t>& prompt = gemma->prompt;
  const std::vector<int32_t>& expected = gemma->expected;
  const std::vector<int64_t>& engine_peaks = gemma->engine_peaks;
  const engine::KvCacheGroups& groups = ref.engine->kv_groups();
  constexpr int kTokens = GemmaLongPrompt::kTokens;
  const int B = gemma->eo.block_tokens;
  const json model_name = {{"model", fs::path(model_path).stem().string()}};
  for (const auto& [prefill, decode, colocated, tp] :
       std::vector<std::array<int, 4>>{{0, 0, 1, 1}, {1, 1, 0, 1}, {1, 1, 0, 2}}) {
    auto cluster = StartCluster(prefill, decode, colocated, "prefix_aware", tp, "", model_path);
    ASSERT_NE(cluster, nullptr);
    CompletionOutcome got = Complete(cluster->http_port(), prompt, kTokens, model_name);
    ASSERT_EQ(got.http_status, 200) << got.error;
    EXPECT_EQ(got.completion_tokens, kTokens);
    EXPECT_EQ(got.text, ref.Text(expected))
        << (colocated ? "colocated"
                      : "disaggregated (1 prefill, 1 decode of TP " + std::to_string(tp) + ")");
    if (!colocated) {
      // Again: a prefix hit on the prefill worker (its sliding-window groups
      // kept only what the window needs), streamed from the cached blocks.
      CompletionOutcome again = Complete(cluster->http_port(), prompt, kTokens, model_name);
      ASSERT_EQ(again.http_status, 200) << again.error;
      EXPECT_EQ(again.text, got.text) << "prefix hit, TP " << tp;
      std::map<std::string, double> hits;
      EXPECT_TRUE(WaitFor(
          [&] {
            hits = WorkerGauge(cluster->http_port(), "kvrelay_worker_prefix_hit_tokens_total");
            return hits["prefill-0"] > 0;
          },
          milliseconds(15'000)))
          << "the second request did not hit prefill-0's prefix cache";
    }
    // Unreferenced prefix-cache blocks count as free: utilization goes back to 0.
    std::map<std::string, double> util;
    EXPECT_TRUE(WaitFor(
        [&] {
          util = WorkerGauge(cluster->http_port(), "kvrelay_worker_kv_utilization");
          if (util.size() != static_cast<size_t>(prefill + decode + colocated)) return false;
          for (const auto& [w, v] : util) {
            if (v > 1e-9) return false;
          }
          return true;
        },
        milliseconds(15'000)))
        << "KV still in use after the request (" << util.size() << " workers reporting)";
    // The worker that decoded (rank 0 of the TP group; its followers run
    // the same block tables) held what the engine held, group by group, as
    // its heartbeats report it.
    const std::string decoder = colocated ? "worker-0" : "decode-0";
    std::vector<testing::KvGroupPeak> peaks;
    EXPECT_TRUE(WaitFor(
        [&] {
          auto all = testing::WorkerKvGroupPeaks(cluster->http_port());
          auto it = all.find(decoder);
          if (it == all.end()) return false;
          peaks = it->second;
          return peaks.size() == engine_peaks.size() &&
                 static_cast<int64_t>(peaks[0].blocks) == engine_peaks[0];
        },
        milliseconds(15'000)))
        << decoder << " reports " << peaks.size() << " KV cache groups";
    ASSERT_EQ(peaks.size(), engine_peaks.size()) << decoder;
    std::string line;
    for (const testing::KvGroupPeak& p : peaks) {
      line +=
          " " + std::to_string(static_cast<int64_t>(p.blocks)) + "@w" + std::to_string(p.window);
    }
    std::printf("[ KV groups ] %s (TP %d): most blocks per group:%s\n", decoder.c_str(), tp,
                line.c_str());
    for (size_t g = 0; g < peaks.size(); ++g) {
      EXPECT_EQ(peaks[g].window, groups.window[g]) << decoder << " group " << g;
      EXPECT_EQ(static_cast<int64_t>(peaks[g].blocks), engine_peaks[g])
          << decoder << " group " << g << " (window " << peaks[g].window << ")";
    }
    if (colocated) continue;
    // The prefill worker computed the prompt with the same groups: its
    // full group held every prompt block, each sliding group its window.
    const auto all = testing::WorkerKvGroupPeaks(cluster->http_port());
    auto it = all.find("prefill-0");
    ASSERT_NE(it, all.end()) << "prefill-0 reports no KV cache groups";
    ASSERT_EQ(it->second.size(), engine_peaks.size()) << "prefill-0";
    const int64_t prompt_blocks = (static_cast<int64_t>(prompt.size()) + B - 1) / B;
    for (size_t g = 0; g < it->second.size(); ++g) {
      const testing::KvGroupPeak& p = it->second[g];
      EXPECT_EQ(p.window, groups.window[g]) << "prefill-0 group " << g;
      if (p.window == 0) {
        EXPECT_EQ(static_cast<int64_t>(p.blocks), prompt_blocks) << "prefill-0 group " << g;
      } else {
        EXPECT_LE(static_cast<int64_t>(p.blocks), (p.window + B - 1) / B + 1)
            << "prefill-0 group " << g;
      }
    }
  }
}

// Gemma 3 with the prefix store (--kv-store, RocksDB): the workers keep the
// model's KV cache groups (the store holds one entry per group block,
// kv_store/tiered_cache.h SetKvGroups), so the 600-token prompt decoded 48
// past the window gives the engine's tokens while the worker that decodes
// holds per group what the engine held. After a restart of the whole
// cluster on the same store directory the prompt is a prefix hit served
// from disk (the pools are new: every cached token comes from the tier),
// loading the full group's blocks and each sliding group's window only,
// with the same tokens. Colocated, and 1 prefill + 1 decode group of TP 1
// and 2 (the store is on the prefill worker; the decode side gets the
// loaded KV by the layer stream).
TEST(Gemma3Cluster, PrefixStoreKeepsKvGroupsAndServesTheWindowFromDiskAfterARestart) {
  std::string skip;
  auto gemma = MakeGemmaLongPrompt(&skip);
  if (gemma == nullptr && !skip.empty()) KVRELAY_SKIP_OR_FAIL() << skip;
  ASSERT_NE(gemma, nullptr);
  const engine::KvCacheGroups& groups = gemma->ref.engine->kv_groups();
  const int B = gemma->eo.block_tokens;
  const json model_name = {{"model", fs::path(gemma->model_path).stem().string()}};
  const std::string want = gemma->ref.Text(gemma->expected);
  const int full_prompt_tokens = static_cast<int>(gemma->prompt.size()) / B * B;  // 592
  for (const auto& [prefill, decode, colocated, tp] :
       std::vector<std::array<int, 4>>{{0, 0, 1, 1}, {1, 1, 0, 1}, {1, 1, 0, 2}}) {
    const std::string shape =
        colocated ? "colocated" : "1 prefill + 1 decode of TP " + std::to_string(tp);
    char tmpl[] = "/tmp/kvrelay-gemma-store-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    struct RemoveOnExit {
      std::string path;
      ~RemoveOnExit() { std::filesystem::remove_all(path); }
    } cleanup{tmpl};
    const std::string store_worker = colocated ? "worker-0" : "prefill-0";
    const std::string decoder = colocated ? "worker-0" : "decode-0";
    for (int run = 0; run < 2; ++run) {
      auto cluster = StartCluster(prefill, decode, colocated, "prefix_aware", tp, cleanup.path,
                                  gemma->model_path);
      ASSERT_NE(cluster, nullptr);
      CompletionOutcome got =
          Complete(cluster->http_port(), gemma->prompt, GemmaLongPrompt::kTokens, model_name);
      ASSERT_EQ(got.http_status, 200) << got.error;
      EXPECT_EQ(got.completion_tokens, GemmaLongPrompt::kTokens);
      EXPECT_EQ(got.text, want) << shape << (run == 0 ? ", cold" : ", after the restart");
      if (run == 0) {
        EXPECT_EQ(got.cached_tokens, 0) << shape;
      } else {
        // Every full prompt block: the full group's 37 and each sliding
        // group's window of position 592, all from disk.
        EXPECT_EQ(got.cached_tokens, full_prompt_tokens) << shape << ": not served from the store";
        // The store worker's own prefix-hit counter (its engine's cached
        // prompt tokens; a fresh pool, so all of them from the tier).
        std::map<std::string, double> hits;
        EXPECT_TRUE(WaitFor(
            [&] {
              hits = WorkerGauge(cluster->http_port(), "kvrelay_worker_prefix_hit_tokens_total");
              return hits[store_worker] >= full_prompt_tokens;
            },
            milliseconds(15'000)))
            << shape << ": " << store_worker << " reports " << hits[store_worker]
            << " prefix-hit tokens after the restart";
      }
      // The store worker kept its groups: a sliding group within its window.
      std::map<std::string, std::vector<testing::KvGroupPeak>> all;
      EXPECT_TRUE(WaitFor(
          [&] {
            all = testing::WorkerKvGroupPeaks(cluster->http_port());
            return all.count(store_worker) != 0 && all.count(decoder) != 0 &&
                   all[decoder].size() == gemma->engine_peaks.size() &&
                   static_cast<int64_t>(all[decoder][0].blocks) == gemma->engine_peaks[0];
          },
          milliseconds(15'000)))
          << shape << ": " << decoder << " reports no (or other) KV cache groups";
      ASSERT_EQ(all[store_worker].size(), gemma->engine_peaks.size())
          << store_worker << " with a store has " << all[store_worker].size() << " KV cache groups";
      std::string line;
      for (size_t g = 0; g < all[decoder].size(); ++g) {
        const testing::KvGroupPeak& p = all[decoder][g];
        line +=
            " " + std::to_string(static_cast<int64_t>(p.blocks)) + "@w" + std::to_string(p.window);
        EXPECT_EQ(p.window, groups.window[g]) << decoder << " group " << g;
        if (p.window == 0) {
          EXPECT_EQ(static_cast<int64_t>(p.blocks), gemma->engine_peaks[g])
              << shape << " run " << run << ": " << decoder << " group " << g;
        } else {
          EXPECT_LE(static_cast<int64_t>(p.blocks), (p.window + B - 1) / B + 1)
              << shape << " run " << run << ": " << decoder << " group " << g;
          if (run == 0) {
            EXPECT_EQ(static_cast<int64_t>(p.blocks), gemma->engine_peaks[g])
                << shape << ": " << decoder << " group " << g;
          }
        }
      }
      for (const testing::KvGroupPeak& p : all[store_worker]) {
        if (p.window > 0) {
          EXPECT_LE(static_cast<int64_t>(p.blocks), (p.window + B - 1) / B + 1) << store_worker;
        }
      }
      std::printf("[ KV groups ] %s with a store (%s), %s: most blocks per group:%s\n",
                  decoder.c_str(), shape.c_str(), run == 0 ? "cold" : "after a restart",
                  line.c_str());
      cluster->Stop();
    }
  }
}

// Issue #39, request migration: kill -9 of the decode worker streaming a
// greedy answer. The coordinator re-prefills prompt + the tokens already sent
// on the other decode worker (--migration-limit, default 3) and the client's
// stream completes without an error, with the text of an undisturbed run.
TEST_F(ClusterTest, DecodeWorkerKilledMidStreamIsMigrated) {
  auto cluster = StartCluster(1, 2, 0);
  ASSERT_NE(cluster, nullptr);
  const uint16_t port = cluster->http_port();
  constexpr int kTokens = 400;
  const std::vector<int32_t> prompt = ref_->Encode("Tell me a story about a lighthouse keeper");
  const std::string want = ref_->Text(ref_->Greedy(prompt, kTokens));
  std::atomic<int> chunks{0};
  StreamOutcome got;
  std::thread client([&] {
    got = Stream(
        port, prompt, kTokens,
        [&](const StreamOutcome& s) {
          chunks = s.chunks;
          return true;
        },
        120'000);
  });
  std::string victim;
  WaitFor(
      [&] {
        if (chunks < 10) return false;
        for (const auto& [id, running] : WorkerGauge(port, "kvrelay_worker_running")) {
          if (id.rfind("decode-", 0) == 0 && running >= 1) victim = id;
        }
        return !victim.empty();
      },
      milliseconds(60'000));
  const int chunks_at_kill = chunks;
  if (!victim.empty()) kill(cluster->processes().Pid(victim), SIGKILL);
  client.join();
  ASSERT_FALSE(victim.empty()) << "no decode worker reported the request running";
  EXPECT_LT(chunks_at_kill, kTokens) << "the answer was complete before the kill";
  EXPECT_TRUE(got.error.empty()) << got.error;
  EXPECT_TRUE(got.done);
  EXPECT_EQ(got.text, want) << "killed " << victim << " after " << chunks_at_kill << " chunks";
  double migrated = -1;
  for (const std::string& line : testing::MetricsLines(port, 10'000)) {
    // "name{} value" (the series has no labels).
    if (line.rfind("kvrelay_requests_migrated_total", 0) == 0 &&
        line.find(' ') != std::string::npos) {
      migrated = std::strtod(line.c_str() + line.rfind(' ') + 1, nullptr);
    }
  }
  EXPECT_EQ(migrated, 1.0);
}

}  // namespace
}  // namespace kvrelay
