// The findings of issue #14 against a real cluster (kvrelay launch: a
// coordinator, one prefill and one decode worker process, a generated
// cluster key): each attack is refused, and afterwards the cluster still
// answers greedy requests exactly like the single-process engine.
//
// The attackers are this test process: without the key (a stranger on the
// machine), or with it (a compromised worker that tries to write into a
// request it does not own). Skips when the model file is absent.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "common/http_client.h"
#include "coordinator/openai/engine_text_codec.h"
#include "deploy/local_launcher.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/model.h"
#include "protocols/control.pb.h"
#include "protocols/messages.h"
#include "protocols/peer_handshake.h"
#include "tests/testing/greedy_cluster.h"
#include "tests/testing/skip.h"
#include "tests/testing/worker_metrics.h"

namespace kvrelay {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;
using protocols::MessageType;

std::string SourceDir() { return KVRELAY_SECURITY_SOURCE_DIR; }
std::string BinDir() { return KVRELAY_SECURITY_BIN_DIR; }
std::string ModelPath() { return SourceDir() + "/models/SmolLM2-135M-Instruct.Q4_1.gguf"; }

int64_t RssBytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/statm");
  int64_t pages = 0, resident = 0;
  in >> pages >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

// TCP ports `pid` listens on, from its socket fds and /proc/net/tcp.
std::vector<uint16_t> ListeningPorts(pid_t pid) {
  std::set<std::string> inodes;
  const std::string fd_dir = "/proc/" + std::to_string(pid) + "/fd";
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(fd_dir, ec)) {
    auto target = fs::read_symlink(e.path(), ec).string();
    if (target.rfind("socket:[", 0) == 0) inodes.insert(target.substr(8, target.size() - 9));
  }
  std::vector<uint16_t> ports;
  std::ifstream tcp("/proc/net/tcp");
  std::string line;
  std::getline(tcp, line);
  while (std::getline(tcp, line)) {
    std::istringstream in(line);
    std::string sl, local, remote, state, queues, timer, retr, uid, timeout, inode;
    in >> sl >> local >> remote >> state >> queues >> timer >> retr >> uid >> timeout >> inode;
    if (state != "0A" || !inodes.count(inode)) continue;
    ports.push_back(
        static_cast<uint16_t>(std::stoul(local.substr(local.find(':') + 1), nullptr, 16)));
  }
  return ports;
}

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!fs::exists(ModelPath())) return;
    auto c = testing::GreedyCluster::Start(ModelPath(), BinDir());
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
  }
  void SetUp() override {
    if (!model_) KVRELAY_SKIP_OR_FAIL() << "model file not present (run scripts/fetch-model.sh)";
    ASSERT_NE(launcher_, nullptr);
  }

  static std::vector<int32_t> Encode(const std::string& text) { return cluster_->Encode(text); }
  static std::string Greedy(const std::vector<int32_t>& prompt, int n) {
    return cluster_->Greedy(prompt, n);
  }
  // One greedy completion through the cluster: its HTTP status and text.
  static std::pair<int, std::string> Complete(const std::vector<int32_t>& prompt, int n) {
    return cluster_->Complete(prompt, n);
  }
  // The cluster still serves, exactly.
  static void ExpectServing() {
    const auto prompt = Encode("The capital of Japan is");
    const std::string want = Greedy(prompt, 12);
    auto [status, text] = Complete(prompt, 12);
    EXPECT_EQ(status, 200) << text;
    EXPECT_EQ(text, want);
  }
  static protocols::ClusterKey Key() {
    return std::move(protocols::ClusterKey::LoadFile(launcher_->cluster_key_file())).value();
  }
  std::shared_ptr<protocols::FramedConnection> Dial(uint16_t port) {
    auto c =
        protocols::FramedConnection::Connect(io_, "127.0.0.1", port, {}, Deadline::AfterMs(5000));
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? *c : nullptr;
  }

  static inline testing::GreedyCluster* cluster_ = nullptr;
  static inline std::shared_ptr<const engine::Model> model_;
  static inline deploy::LocalLauncher* launcher_ = nullptr;
  protocols::IoThread io_{"attacker-io"};
};

TEST_F(SecurityTest, ARogueWorkerWithoutTheKeyIsRefusedAndLearnsNothing) {
  auto rogue = Dial(launcher_->control_port());
  ASSERT_TRUE(rogue);
  ASSERT_TRUE(rogue->Send(MessageType::kHello, "").ok());  // the empty Hello of the report
  std::vector<protocols::Frame> said;
  for (auto f = rogue->Receive(Deadline::AfterMs(5000)); f.ok();
       f = rogue->Receive(Deadline::AfterMs(5000))) {
    said.push_back(*f);
  }
  ASSERT_EQ(said.size(), 1u);
  EXPECT_EQ(said[0].type, static_cast<uint16_t>(MessageType::kAuthProof));
  proto::AuthProof refusal;
  ASSERT_TRUE(refusal.ParseFromString(said[0].payload));
  EXPECT_TRUE(refusal.mac().empty());
  EXPECT_EQ(refusal.error(), "authentication failed");
  // A worker process started with another key cannot register, and says why.
  const std::string other = ::testing::TempDir() + "/kvrelay_other_" + std::to_string(getpid());
  ::unlink(other.c_str());
  ASSERT_TRUE(protocols::ClusterKey::GenerateFile(other).ok());
  const std::string log = other + ".log";
  const std::string cmd =
      BinDir() + "/kvrelay-prefill --id prefill-intruder --coordinator 127.0.0.1:" +
      std::to_string(launcher_->control_port()) + " --model " + ModelPath() +
      " --kv-dtype f32 --kv-capacity-mb 16 --threads 1 --rank 0 --world-size 2" +
      " --cluster-key-file " + other + " > " + log + " 2>&1";
  const int rc = std::system(cmd.c_str());
  EXPECT_NE(rc, 0);
  std::ifstream in(log);
  std::string out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(out.find("authentication failed"), std::string::npos) << out;
  EXPECT_NE(out.find("--cluster-key-file"), std::string::npos) << out;
  ::unlink(other.c_str());
  ::unlink(log.c_str());
  ExpectServing();
}

TEST_F(SecurityTest, ARogueTokenSenderCannotInjectIntoAnotherUsersAnswer) {
  // A compromised member (it holds the key) registers as a decode worker with
  // no room (so the router never picks it) and sprays TokenChunks for every
  // request id while a real request streams.
  auto rogue = Dial(launcher_->control_port());
  ASSERT_TRUE(rogue);
  protocols::PeerConfig cfg;
  const engine::KvLayout layout = model_->MakeKvLayout(engine::KvDtype::kF32, 16);
  cfg.model_fingerprint = model_->fingerprint();
  cfg.kv_dtype = layout.dtype;
  cfg.block_tokens = layout.block_tokens;
  cfg.layers = layout.layers;
  cfg.kv_heads = layout.kv_heads;
  cfg.head_dim = layout.head_dim;
  ASSERT_TRUE(
      protocols::ClientHandshake(*rogue, Key(), "decode-rogue", cfg, {}, Deadline::AfterMs(5000))
          .ok());
  proto::RegisterWorker reg;
  reg.set_worker_id("decode-rogue");
  reg.set_role(proto::WORKER_ROLE_DECODE);
  reg.set_rank(1);
  reg.set_tp_size(1);
  reg.set_capacity_blocks(1);
  protocols::ToProto(cfg, reg.mutable_config());
  ASSERT_TRUE(rogue->Send(MessageType::kRegisterWorker, reg.SerializeAsString()).ok());
  auto reply = rogue->Receive(Deadline::AfterMs(5000));
  ASSERT_TRUE(reply.ok());
  proto::TokenChunk inject;
  for (uint64_t id = 1; id <= 256; ++id) {
    auto* e = inject.add_entries();
    e->set_request_id(id);
    e->add_token_ids(Encode(" [INJECTED BY ROGUE WORKER]").back());
  }
  const std::string payload = inject.SerializeAsString();
  std::atomic<bool> stop{false};
  std::atomic<int> sent{0};
  std::thread spray([&] {
    while (!stop.load()) {
      if (rogue->Send(MessageType::kTokenChunk, payload).ok()) ++sent;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  const auto prompt = Encode("The capital of Japan is");
  const std::string want = Greedy(prompt, 24);
  for (int i = 0; i < 3; ++i) {
    auto [status, text] = Complete(prompt, 24);
    EXPECT_EQ(status, 200) << text;
    EXPECT_EQ(text, want);
  }
  stop = true;
  spray.join();
  EXPECT_GT(sent.load(), 10);
  rogue->Close(Cancelled("attack over"));
  ExpectServing();
}

TEST_F(SecurityTest, ATwentyByteFrameToTheDecodeKvPortDoesNotStopServing) {
  const pid_t decode = launcher_->processes().Pid("decode-0");
  ASSERT_GT(decode, 0);
  const auto ports = ListeningPorts(decode);
  ASSERT_EQ(ports.size(), 1u) << "the decode worker listens on its KV port only";
  {
    // A hello as rank 0 (12-byte header + 8-byte payload), then a disconnect.
    auto fake = Dial(ports[0]);
    ASSERT_TRUE(fake);
    const uint32_t hello[2] = {0, 2};
    ASSERT_TRUE(fake->Send(MessageType::kHello,
                           std::string_view(reinterpret_cast<const char*>(hello), sizeof(hello)))
                    .ok());
    (void)fake->WaitClosed(Deadline::AfterMs(5000));
    fake->Close(Cancelled("gone"));
  }
  // Several requests: each would have failed with "peer 0 is gone".
  for (int i = 0; i < 3; ++i) ExpectServing();
}

TEST_F(SecurityTest, PartialFramesDoNotGrowTheCoordinator) {
  const pid_t coord = launcher_->processes().Pid("coordinator");
  ASSERT_GT(coord, 0);
  const int64_t before = RssBytes(coord);
  std::string head(protocols::kFrameHeaderBytes, '\0');
  protocols::EncodeFrameHeader(static_cast<uint16_t>(MessageType::kHello), 16u << 20,
                               reinterpret_cast<uint8_t*>(head.data()));
  const std::string body((16u << 20) - 1, 'x');
  std::vector<std::shared_ptr<protocols::FramedConnection>> conns;
  for (int i = 0; i < 20; ++i) {
    auto c = Dial(launcher_->control_port());
    ASSERT_TRUE(c);
    ASSERT_TRUE(
        c->SendGatherWait(
             head, {boost::asio::buffer(body)}, [](const Status&) {}, Deadline::AfterMs(5000))
            .ok());
    conns.push_back(c);
  }
  for (auto& c : conns) {
    EXPECT_NE(c->WaitClosed(Deadline::AfterMs(10000)).code(), StatusCode::kDeadlineExceeded);
  }
  const int64_t grown = RssBytes(coord) - before;
  // Today: +325 MB, never released.
  EXPECT_LT(grown, 32ll << 20) << "coordinator RSS grew by " << (grown >> 20) << " MiB";
  for (auto& c : conns) c->Close(Cancelled("done"));
  ExpectServing();
}

// What the control plane refuses is counted on /metrics: a failed
// challenge-response, a frame header over the pre-authentication limit.
TEST_F(SecurityTest, RefusalsAreCountedOnMetrics) {
  auto counter = [](const std::string& name) -> double {
    HttpCallSpec spec;
    spec.port = launcher_->http_port();
    spec.target = "/metrics";
    spec.timeout_ms = 5000;
    auto r = HttpCall(spec);
    if (!r.ok() || r->status != 200) return -1;
    std::istringstream in(r->body);
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind(name + "{", 0) == 0) {
        return std::strtod(line.c_str() + line.find('}') + 1, nullptr);
      }
    }
    return -1;
  };
  const double auth_before = counter("kvrelay_control_auth_failures_total");
  const double oversized_before = counter("kvrelay_control_oversized_frames_total");
  ASSERT_GE(auth_before, 0) << "no kvrelay_control_auth_failures_total on /metrics";
  ASSERT_GE(oversized_before, 0);
  EXPECT_GE(counter("kvrelay_control_refused_connections_total"), 0);
  EXPECT_GE(counter("kvrelay_control_foreign_frames_total"), 0);
  {
    auto rogue = Dial(launcher_->control_port());
    ASSERT_TRUE(rogue);
    ASSERT_TRUE(rogue->Send(MessageType::kHello, "").ok());
    EXPECT_NE(rogue->WaitClosed(Deadline::AfterMs(10000)).code(), StatusCode::kDeadlineExceeded);
  }
  {
    auto big = Dial(launcher_->control_port());
    ASSERT_TRUE(big);
    std::string head(protocols::kFrameHeaderBytes, '\0');
    protocols::EncodeFrameHeader(static_cast<uint16_t>(MessageType::kAuthHello), 1u << 20,
                                 reinterpret_cast<uint8_t*>(head.data()));
    const std::string some(100, 'x');
    ASSERT_TRUE(
        big->SendGatherWait(
               head, {boost::asio::buffer(some)}, [](const Status&) {}, Deadline::AfterMs(5000))
            .ok());
    EXPECT_NE(big->WaitClosed(Deadline::AfterMs(10000)).code(), StatusCode::kDeadlineExceeded);
  }
  const Deadline deadline = Deadline::AfterMs(10000);
  while (!deadline.Expired() &&
         (counter("kvrelay_control_auth_failures_total") < auth_before + 1 ||
          counter("kvrelay_control_oversized_frames_total") < oversized_before + 1)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_GE(counter("kvrelay_control_auth_failures_total"), auth_before + 1);
  EXPECT_GE(counter("kvrelay_control_oversized_frames_total"), oversized_before + 1);
  ExpectServing();
}

// What a worker's KV data port refuses is counted, per worker, on the
// coordinator's /metrics (carried by the worker's heartbeats): an oversized
// frame from a stranger (an authentication failure too), a member that
// authenticated as one rank and says it is another, connections over the cap.
TEST_F(SecurityTest, KvPortRefusalsAreCountedOnTheWorkersMetrics) {
  const pid_t decode = launcher_->processes().Pid("decode-0");
  ASSERT_GT(decode, 0);
  const auto ports = ListeningPorts(decode);
  ASSERT_EQ(ports.size(), 1u) << "the decode worker listens on its KV port only";
  auto value = [](const std::string& what) {
    auto v = testing::WorkerGauge(launcher_->http_port(), "kvrelay_worker_kv_" + what + "_total");
    auto it = v.find("decode-0");
    return it == v.end() ? -1.0 : it->second;
  };
  const std::vector<std::string> kinds = {"auth_failures", "refused_connections",
                                          "oversized_frames", "foreign_frames"};
  std::map<std::string, double> before;
  for (const auto& k : kinds) {
    before[k] = value(k);
    ASSERT_GE(before[k], 0) << "no kvrelay_worker_kv_" << k << "_total{worker=\"decode-0\"}";
  }
  {
    auto big = Dial(ports[0]);
    ASSERT_TRUE(big);
    std::string head(protocols::kFrameHeaderBytes, '\0');
    protocols::EncodeFrameHeader(static_cast<uint16_t>(MessageType::kAuthHello), 1u << 20,
                                 reinterpret_cast<uint8_t*>(head.data()));
    ASSERT_TRUE(big->SendEncoded(head + std::string(64, 'x')).ok());
    EXPECT_NE(big->WaitClosed(Deadline::AfterMs(10000)).code(), StatusCode::kDeadlineExceeded);
  }
  {
    // A member with the key: authenticated as rank 0 (the prefill worker's
    // name), then says it is rank 5.
    auto member = Dial(ports[0]);
    ASSERT_TRUE(member);
    ASSERT_TRUE(protocols::ClientAuthenticate(*member, Key(), protocols::kAuthChannelKv,
                                              "kv-rank-0", Deadline::AfterMs(10000))
                    .ok());
    const uint32_t hello[2] = {5, 2};
    ASSERT_TRUE(member
                    ->Send(MessageType::kHello,
                           std::string_view(reinterpret_cast<const char*>(hello), sizeof(hello)))
                    .ok());
    EXPECT_NE(member->WaitClosed(Deadline::AfterMs(10000)).code(), StatusCode::kDeadlineExceeded);
  }
  std::vector<std::shared_ptr<protocols::FramedConnection>> strangers;
  for (int i = 0; i < 64; ++i) {
    auto c = Dial(ports[0]);
    ASSERT_TRUE(c);
    strangers.push_back(c);
    if (c->WaitClosed(Deadline::AfterMs(20)).code() != StatusCode::kDeadlineExceeded) break;
  }
  const Deadline deadline = Deadline::AfterMs(15000);
  auto all_counted = [&] {
    return value("auth_failures") >= before["auth_failures"] + 1 &&
           value("oversized_frames") >= before["oversized_frames"] + 1 &&
           value("foreign_frames") >= before["foreign_frames"] + 1 &&
           value("refused_connections") >= before["refused_connections"] + 1;
  };
  while (!all_counted() && !deadline.Expired()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (auto& c : strangers) c->Close(Cancelled("done"));
  EXPECT_GE(value("auth_failures"), before["auth_failures"] + 1);
  EXPECT_GE(value("oversized_frames"), before["oversized_frames"] + 1);
  EXPECT_GE(value("foreign_frames"), before["foreign_frames"] + 1);
  EXPECT_GE(value("refused_connections"), before["refused_connections"] + 1);
  // The TP link's series exist too (zeros: this decode worker has no TP group).
  EXPECT_EQ(testing::WorkerGauge(launcher_->http_port(), "kvrelay_worker_tp_auth_failures_total")
                .count("decode-0"),
            1u);
  ExpectServing();
}

// Issue #46: a TP follower has no coordinator link, so what its KV data port
// refuses reaches /metrics through rank 0 (the follower's pongs), added to
// the group's kvrelay_worker_kv_*_total.
TEST(SecurityTpTest, ATpFollowersKvPortRefusalsAreCounted) {
  if (!fs::exists(ModelPath())) {
    KVRELAY_SKIP_OR_FAIL() << "model file not present (run scripts/fetch-model.sh)";
  }
  auto cluster = testing::GreedyCluster::Start(ModelPath(), BinDir(),
                                               [](deploy::LaunchOptions& o) { o.tp = 2; });
  ASSERT_TRUE(cluster.ok()) << cluster.status().ToString();
  deploy::LocalLauncher& launcher = (*cluster)->launcher();
  const pid_t follower = launcher.processes().Pid("decode-0-tp1");
  ASSERT_GT(follower, 0);
  const auto ports = ListeningPorts(follower);
  ASSERT_EQ(ports.size(), 1u) << "a TP follower listens on its KV port only";
  auto oversized = [&] {
    auto v = testing::WorkerGauge(launcher.http_port(), "kvrelay_worker_kv_oversized_frames_total");
    auto it = v.find("decode-0");
    return it == v.end() ? -1.0 : it->second;
  };
  const double before = oversized();
  ASSERT_GE(before, 0) << "no kvrelay_worker_kv_oversized_frames_total{worker=\"decode-0\"}";
  protocols::IoThread io{"attacker-io"};
  auto big =
      protocols::FramedConnection::Connect(io, "127.0.0.1", ports[0], {}, Deadline::AfterMs(5000));
  ASSERT_TRUE(big.ok()) << big.status().ToString();
  std::string head(protocols::kFrameHeaderBytes, '\0');
  protocols::EncodeFrameHeader(static_cast<uint16_t>(MessageType::kAuthHello), 1u << 20,
                               reinterpret_cast<uint8_t*>(head.data()));
  ASSERT_TRUE((*big)->SendEncoded(head + std::string(64, 'x')).ok());
  EXPECT_NE((*big)->WaitClosed(Deadline::AfterMs(10000)).code(), StatusCode::kDeadlineExceeded);
  // A pong (every tp_step_timeout / 4) and a heartbeat later.
  const Deadline deadline = Deadline::AfterMs(15000);
  double now = oversized();
  while (now < before + 1 && !deadline.Expired()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // a poll, bounded by deadline
    now = oversized();
  }
  EXPECT_GE(now, before + 1) << "the follower's refusal never reached /metrics";
  const auto prompt = (*cluster)->Encode("The capital of Japan is");
  const std::string want = (*cluster)->Greedy(prompt, 12);
  auto [status, text] = (*cluster)->Complete(prompt, 12);
  EXPECT_EQ(status, 200) << text;
  EXPECT_EQ(text, want);
}

}  // namespace
}  // namespace kvrelay
