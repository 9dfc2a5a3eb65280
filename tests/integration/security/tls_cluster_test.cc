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

#include "common/http_client.h"
#include "coordinator/openai/engine_text_codec.h"
#include "deploy/local_launcher.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/model.h"
#include "protocols/framed_connection.h"
#include "protocols/messages.h"
#include "protocols/peer_handshake.h"
#include "protocols/tls.h"
#include "tests/testing/greedy_cluster.h"
#include "tests/testing/skip.h"

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
    auto c = testing::GreedyCluster::Start(ModelPath(), BinDir(), [](deploy::LaunchOptions& o) {
      o.control_tls_dir = root_ + "/ours";
    });
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    cluster_ = c->release();
    model_ = cluster_->model();
    launcher_ = &cluster_->launcher();
  }
  static void TearDownTestSuite() {
    launcher_ = nullptr;
    model_.reset();
    delete cluster_;
    cluster_ = nullptr;
    std::error_code ec;
    if (!root_.empty()) fs::remove_all(root_, ec);
  }
  void SetUp() override {
    if (!model_) KVRELAY_SKIP_OR_FAIL() << "model file not present (run scripts/fetch-model.sh)";
    ASSERT_NE(launcher_, nullptr);
  }

  // The TLS cluster answers a greedy completion exactly.
  static void ExpectServing() {
    const auto prompt = cluster_->Encode("The capital of Japan is");
    const std::string want = cluster_->Greedy(prompt, 12);
    auto [status, text] = cluster_->Complete(prompt, 12);
    ASSERT_EQ(status, 200) << text;
    EXPECT_EQ(text, want);
  }
  static double Counter(const std::string& name) {
    HttpCallSpec spec;
    spec.port = launcher_->http_port();
    spec.target = "/metrics";
    spec.timeout_ms = 5000;
    auto r = HttpCall(spec);
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
  static inline testing::GreedyCluster* cluster_ = nullptr;
  static inline std::shared_ptr<const engine::Model> model_;
  static inline deploy::LocalLauncher* launcher_ = nullptr;
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
