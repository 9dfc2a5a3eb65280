// Control-plane TLS against a real cluster (kvrelay launch --control-tls-dir,
// certificates from scripts/make-cluster-certs.sh): the TLS cluster serves a
// greedy request exactly like the single-process engine; a plaintext peer and
// a peer presenting a certificate from another CA are refused at the TLS
// handshake and counted on /metrics; the coordinator survives and still
// serves. Skips when the model file is absent.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "coordinator/engine_text_codec.h"
#include "coordinator/http_client.h"
#include "deploy/local_launcher.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/model.h"
#include "protocols/framed_connection.h"
#include "protocols/messages.h"
#include "protocols/peer_handshake.h"
#include "protocols/tls.h"

namespace kvrelay {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;
using protocols::MessageType;

std::string SourceDir() { return KVRELAY_SECURITY_SOURCE_DIR; }
std::string BinDir() { return KVRELAY_SECURITY_BIN_DIR; }
std::string ModelPath() { return SourceDir() + "/models/SmolLM2-135M-Instruct.Q4_1.gguf"; }

class TlsClusterTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!fs::exists(ModelPath())) return;
    root_ = ::testing::TempDir() + "/kvrelay_tls_cluster_" + std::to_string(getpid());
    fs::remove_all(root_);
    for (const char* c : {"ours", "theirs"}) {
      const std::string cmd = "bash " + SourceDir() + "/scripts/make-cluster-certs.sh " + root_ +
                              "/" + c + " >/dev/null";
      ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    }
    auto model = engine::Model::Load(ModelPath());
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    model_ = std::shared_ptr<const engine::Model>(std::move(*model));
    codec_ = new coordinator::EngineTextCodec(model_->tokenizer(), model_->chat_template());
    engine::EngineOptions eo;
    eo.model_path = ModelPath();
    eo.kv_dtype = engine::KvDtype::kF32;
    eo.kv_capacity_bytes = 64 << 20;
    eo.threads = 1;
    auto eng = engine::Engine::Create(eo, model_);
    ASSERT_TRUE(eng.ok()) << eng.status().ToString();
    engine_ = eng->release();
    deploy::LaunchOptions o;
    o.model_path = ModelPath();
    o.port = 0;
    o.prefill = 1;
    o.decode = 1;
    o.kv_dtype = "f32";
    o.kv_capacity_mb = 64;
    o.bin_dir = BinDir();
    o.control_tls_dir = root_ + "/ours";
    launcher_ = new deploy::LocalLauncher(o);
    Status st = launcher_->Start();
    ASSERT_TRUE(st.ok()) << st.ToString();
  }
  static void TearDownTestSuite() {
    delete launcher_;
    launcher_ = nullptr;
    delete engine_;
    delete codec_;
    model_.reset();
    std::error_code ec;
    if (!root_.empty()) fs::remove_all(root_, ec);
  }
  void SetUp() override {
    if (!model_) GTEST_SKIP() << "model file not present (run scripts/fetch-model.sh)";
    ASSERT_NE(launcher_, nullptr);
  }

  static std::string Greedy(const std::vector<int32_t>& prompt, int n) {
    engine::RequestSpec spec;
    spec.id = static_cast<engine::RequestId>(2000000 + next_ref_++);
    spec.prompt = prompt;
    spec.sampling.temperature = 0;
    spec.sampling.max_tokens = n;
    spec.sampling.ignore_eos = true;
    EXPECT_TRUE(engine_->Submit(spec).ok());
    auto d = codec_->NewDecoder();
    std::string text;
    while (engine_->HasWork()) {
      auto events = engine_->Step();
      if (!events.ok()) break;
      for (const auto& e : *events) {
        if (e.token >= 0) text += d->Push(e.token);
      }
    }
    return text + d->Flush();
  }
  // The TLS cluster answers a greedy completion exactly.
  static void ExpectServing() {
    const auto prompt = std::move(codec_->Encode("The capital of Japan is", true)).value();
    const std::string want = Greedy(prompt, 12);
    coordinator::HttpCallSpec spec;
    spec.method = "POST";
    spec.port = launcher_->http_port();
    spec.target = "/v1/completions";
    spec.headers = {{"Content-Type", "application/json"}};
    spec.body = json{
        {"model", fs::path(ModelPath()).stem().string()},
        {"prompt", prompt},
        {"max_tokens", 12},
        {"temperature", 0},
        {"ignore_eos",
         true}}.dump();
    spec.timeout_ms = 120'000;
    auto r = coordinator::HttpCall(spec);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ(r->status, 200) << r->body;
    json j = json::parse(r->body, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << r->body;
    EXPECT_EQ(j["choices"][0]["text"].get<std::string>(), want);
  }
  static double Counter(const std::string& name) {
    coordinator::HttpCallSpec spec;
    spec.port = launcher_->http_port();
    spec.target = "/metrics";
    spec.timeout_ms = 5000;
    auto r = coordinator::HttpCall(spec);
    if (!r.ok() || r->status != 200) return -1;
    std::istringstream in(r->body);
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind(name + "{", 0) == 0 || line.rfind(name + " ", 0) == 0) {
        return std::strtod(line.c_str() + line.find_first_of("} ") + 1, nullptr);
      }
    }
    return -1;
  }
  // Waits (bounded) until the TLS failure counter passes `before`.
  static double WaitTlsFailures(double before) {
    const Deadline deadline = Deadline::AfterMs(10000);
    double now = Counter(kTlsFailures);
    while (now <= before && !deadline.Expired()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      now = Counter(kTlsFailures);
    }
    return now;
  }
  std::shared_ptr<protocols::FramedConnection> Dial(std::shared_ptr<protocols::TlsContext> tls) {
    protocols::ConnectionOptions opts;
    opts.name = "attacker";
    opts.tls = std::move(tls);
    auto c = protocols::FramedConnection::Connect(io_, "127.0.0.1", launcher_->control_port(), opts,
                                                  Deadline::AfterMs(5000));
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? *c : nullptr;
  }
  static bool CoordinatorAlive() {
    const pid_t pid = launcher_->processes().Pid("coordinator");
    return pid > 0 && ::kill(pid, 0) == 0;
  }

  static constexpr const char* kTlsFailures = "kvrelay_control_tls_handshake_failures_total";
  static inline std::string root_;
  static inline std::shared_ptr<const engine::Model> model_;
  static inline coordinator::EngineTextCodec* codec_ = nullptr;
  static inline engine::Engine* engine_ = nullptr;
  static inline deploy::LocalLauncher* launcher_ = nullptr;
  static inline int next_ref_ = 0;
  protocols::IoThread io_{"attacker-io"};
};

TEST_F(TlsClusterTest, ServesARequestEndToEnd) {
  ExpectServing();
  EXPECT_GE(Counter(kTlsFailures), 0) << "no " << kTlsFailures << " on /metrics";
}

TEST_F(TlsClusterTest, APlaintextPeerIsRefusedAndCounted) {
  const double before = Counter(kTlsFailures);
  ASSERT_GE(before, 0) << "no " << kTlsFailures << " on /metrics";
  auto plain = Dial(nullptr);
  ASSERT_TRUE(plain);
  ASSERT_TRUE(plain->Send(MessageType::kHello, "").ok());  // the rogue worker's empty Hello
  // Nothing comes back: the coordinator closes at the TLS layer.
  auto said = plain->Receive(Deadline::AfterMs(10000));
  EXPECT_FALSE(said.ok());
  EXPECT_NE(said.status().code(), StatusCode::kDeadlineExceeded) << said.status().ToString();
  EXPECT_GE(WaitTlsFailures(before), before + 1);
  EXPECT_TRUE(CoordinatorAlive());
  ExpectServing();
}

TEST_F(TlsClusterTest, ACertificateFromAnotherCaIsRefusedEvenWithTheClusterKey) {
  const double before = Counter(kTlsFailures);
  ASSERT_GE(before, 0);
  // Trusts our CA (so it would accept the coordinator) but presents theirs.
  protocols::TlsOptions o;
  o.cert_file = root_ + "/theirs/worker.crt";
  o.key_file = root_ + "/theirs/worker.key";
  o.ca_file = root_ + "/ours/ca.crt";
  auto ctx = protocols::TlsContext::Create(o);
  ASSERT_TRUE(ctx.ok()) << ctx.status().ToString();
  auto stranger = Dial(*ctx);
  ASSERT_TRUE(stranger);
  auto key = protocols::ClusterKey::LoadFile(launcher_->cluster_key_file());
  ASSERT_TRUE(key.ok());
  Status joined = protocols::ClientAuthenticate(*stranger, *key, protocols::kAuthChannelControl,
                                                "prefill-0", Deadline::AfterMs(10000));
  EXPECT_FALSE(joined.ok());
  EXPECT_NE(joined.code(), StatusCode::kDeadlineExceeded) << joined.ToString();
  EXPECT_GE(WaitTlsFailures(before), before + 1);
  EXPECT_TRUE(CoordinatorAlive());
  // prefill-0 is still the real one: the cluster serves.
  ExpectServing();
}

}  // namespace
}  // namespace kvrelay
