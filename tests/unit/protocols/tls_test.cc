// Mutual TLS on a FramedConnection (protocols/tls.h): frames and the
// cluster-key challenge-response run inside it; a plaintext peer, a peer
// whose certificate another CA signed and a server the client's CA did not
// sign are refused at the handshake, and the server goes on accepting.
// Certificates come from scripts/make-cluster-certs.sh (openssl).
#include "protocols/tls.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/asio/buffer.hpp>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <mutex>
#include <queue>

#include "protocols/framed_connection.h"
#include "protocols/messages.h"
#include "protocols/peer_handshake.h"

namespace kvrelay::protocols {
namespace {

namespace fs = std::filesystem;

struct Accepted {
  std::mutex mu;
  std::condition_variable cv;
  std::queue<std::shared_ptr<FramedConnection>> q;
  std::shared_ptr<FramedConnection> Take(Deadline d) {
    std::unique_lock lock(mu);
    if (!cv.wait_until(lock, d.at, [&] { return !q.empty(); })) return nullptr;
    auto c = q.front();
    q.pop();
    return c;
  }
};

class TlsTest : public ::testing::Test {
 protected:
  // Two clusters' certificates: A (the server's) and B (another CA).
  static void SetUpTestSuite() {
    root_ = ::testing::TempDir() + "/kvrelay_tls_" + std::to_string(getpid());
    fs::remove_all(root_);
    for (const char* c : {"a", "b"}) {
      const std::string cmd = "bash " KVRELAY_TLS_SOURCE_DIR "/scripts/make-cluster-certs.sh " +
                              root_ + "/" + c + " >/dev/null";
      ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    }
  }
  static void TearDownTestSuite() {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  // A context presenting `cluster`'s `name` certificate and trusting `ca_cluster`'s CA.
  static std::shared_ptr<TlsContext> Ctx(const std::string& cluster, const std::string& name,
                                         const std::string& ca_cluster) {
    TlsOptions o;
    o.cert_file = root_ + "/" + cluster + "/" + name + ".crt";
    o.key_file = root_ + "/" + cluster + "/" + name + ".key";
    o.ca_file = root_ + "/" + ca_cluster + "/ca.crt";
    auto c = TlsContext::Create(o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? *c : nullptr;
  }

  void Listen(std::shared_ptr<TlsContext> tls) {
    ConnectionOptions opts;
    opts.name = "tls-server";
    opts.require_authentication = true;
    opts.auth_timeout = std::chrono::milliseconds(5000);
    opts.tls = std::move(tls);
    auto s = FramedServer::Listen(io_, "127.0.0.1", 0, opts, [this](auto conn) {
      conn->Start();
      std::lock_guard lock(accepted_.mu);
      accepted_.q.push(conn);
      accepted_.cv.notify_all();
    });
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    server_ = std::move(s).value();
  }
  void TearDown() override {
    if (server_) server_->Stop();
    io_.Stop();
  }
  std::shared_ptr<FramedConnection> Dial(std::shared_ptr<TlsContext> tls) {
    ConnectionOptions opts;
    opts.name = "tls-client";
    opts.tls = std::move(tls);
    auto c = FramedConnection::Connect(client_io_, "127.0.0.1", server_->port(), opts,
                                       Deadline::AfterMs(5000));
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? *c : nullptr;
  }
  // Authenticates both ends of one TLS connection with the cluster key.
  std::shared_ptr<FramedConnection> Join(const std::shared_ptr<FramedConnection>& client) {
    auto server_side = accepted_.Take(Deadline::AfterMs(5000));
    if (!server_side) return nullptr;
    auto proved = std::async(std::launch::async, [&] {
      return ClientAuthenticate(*client, key_, kAuthChannelControl, "prefill-0",
                                Deadline::AfterMs(5000));
    });
    auto name =
        ServerAuthenticate(*server_side, key_, kAuthChannelControl, Deadline::AfterMs(5000));
    EXPECT_TRUE(proved.get().ok());
    EXPECT_TRUE(name.ok()) << name.status().ToString();
    if (!name.ok()) return nullptr;
    EXPECT_EQ(*name, "prefill-0");
    return server_side;
  }
  // The round trip of a sizeable frame each way (TLS records split it).
  static void ExpectRoundTrip(FramedConnection& a, FramedConnection& b) {
    const std::string big(300'000, 'k');
    std::string head(kFrameHeaderBytes, '\0');
    EncodeFrameHeader(static_cast<uint16_t>(MessageType::kHeartbeat), 4 + big.size(),
                      reinterpret_cast<uint8_t*>(head.data()));
    head += "head";
    std::promise<Status> written;
    ASSERT_TRUE(a.SendGatherWait(
                     head, {boost::asio::buffer(big)},
                     [&](const Status& s) { written.set_value(s); }, Deadline::AfterMs(5000))
                    .ok());
    auto f = b.Receive(Deadline::AfterMs(10000));
    ASSERT_TRUE(f.ok()) << f.status().ToString();
    EXPECT_EQ(f->payload, "head" + big);
    EXPECT_TRUE(written.get_future().get().ok());
    ASSERT_TRUE(b.Send(MessageType::kFinish, "reply").ok());
    auto r = a.Receive(Deadline::AfterMs(10000));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->payload, "reply");
  }

  static inline std::string root_;
  IoThread io_{"tls-srv-io"};
  IoThread client_io_{"tls-cli-io"};
  ClusterKey key_ = std::move(ClusterKey::Generate()).value();
  Accepted accepted_;
  std::unique_ptr<FramedServer> server_;
};

TEST_F(TlsTest, MutualTlsCarriesTheClusterKeyHandshakeAndFrames) {
  Listen(Ctx("a", "coordinator", "a"));
  auto client = Dial(Ctx("a", "worker", "a"));
  ASSERT_TRUE(client);
  auto server_side = Join(client);
  ASSERT_TRUE(server_side);
  ExpectRoundTrip(*client, *server_side);
  ExpectRoundTrip(*server_side, *client);
}

TEST_F(TlsTest, APlaintextPeerIsRefusedAndTheServerGoesOn) {
  Listen(Ctx("a", "coordinator", "a"));
  auto plain = Dial(nullptr);
  ASSERT_TRUE(plain);
  ASSERT_TRUE(plain->Send(MessageType::kAuthHello, "hello?").ok());
  auto server_side = accepted_.Take(Deadline::AfterMs(5000));
  ASSERT_TRUE(server_side);
  Status why = server_side->WaitClosed(Deadline::AfterMs(10000));
  EXPECT_TRUE(IsTlsHandshakeFailure(why)) << why.ToString();
  // Nothing was delivered: the bytes never got past the TLS layer.
  EXPECT_EQ(server_side->Receive(Deadline::AfterMs(0)).status().code(), why.code());
  EXPECT_NE(plain->WaitClosed(Deadline::AfterMs(10000)).code(), StatusCode::kDeadlineExceeded);
  // The server still serves a real member.
  auto client = Dial(Ctx("a", "worker", "a"));
  ASSERT_TRUE(client);
  auto member = Join(client);
  ASSERT_TRUE(member);
  ExpectRoundTrip(*client, *member);
}

TEST_F(TlsTest, ACertificateFromAnotherCaIsRefused) {
  Listen(Ctx("a", "coordinator", "a"));
  // Trusts the right CA but presents cluster B's certificate.
  auto stranger = Dial(Ctx("b", "worker", "a"));
  ASSERT_TRUE(stranger);
  auto server_side = accepted_.Take(Deadline::AfterMs(5000));
  ASSERT_TRUE(server_side);
  Status why = server_side->WaitClosed(Deadline::AfterMs(10000));
  EXPECT_TRUE(IsTlsHandshakeFailure(why)) << why.ToString();
  // Even with the cluster key the stranger cannot authenticate.
  Status proved = ClientAuthenticate(*stranger, key_, kAuthChannelControl, "prefill-0",
                                     Deadline::AfterMs(10000));
  EXPECT_FALSE(proved.ok());
  auto client = Dial(Ctx("a", "worker", "a"));
  ASSERT_TRUE(client);
  EXPECT_TRUE(Join(client));
}

TEST_F(TlsTest, AClientRefusesAServerItsCaDidNotSign) {
  Listen(Ctx("b", "coordinator", "b"));  // a server of cluster B
  auto client = Dial(Ctx("a", "worker", "a"));
  ASSERT_TRUE(client);
  Status why = client->WaitClosed(Deadline::AfterMs(10000));
  EXPECT_TRUE(IsTlsHandshakeFailure(why)) << why.ToString();
  EXPECT_NE(why.message().find("certificate verify failed"), std::string::npos) << why.ToString();
}

TEST_F(TlsTest, ATlsClientOfAPlaintextServerFailsCleanly) {
  Listen(nullptr);
  auto client = Dial(Ctx("a", "worker", "a"));
  ASSERT_TRUE(client);
  Status why = client->WaitClosed(Deadline::AfterMs(10000));
  EXPECT_NE(why.code(), StatusCode::kDeadlineExceeded) << why.ToString();
  auto server_side = accepted_.Take(Deadline::AfterMs(5000));
  ASSERT_TRUE(server_side);
  EXPECT_NE(server_side->WaitClosed(Deadline::AfterMs(10000)).code(),
            StatusCode::kDeadlineExceeded);
}

TEST_F(TlsTest, BadFilesAreRefusedNamingTheFlag) {
  const std::string a = root_ + "/a";
  TlsOptions partial;
  partial.cert_file = a + "/worker.crt";
  EXPECT_TRUE(partial.enabled());
  auto r = TlsContext::Create(partial);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--control-tls-key"), std::string::npos);

  TlsOptions missing{a + "/nope.crt", a + "/worker.key", a + "/ca.crt"};
  r = TlsContext::Create(missing);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("--control-tls-cert " + a + "/nope.crt"), std::string::npos)
      << r.status().ToString();

  TlsOptions mismatched{a + "/worker.crt", a + "/coordinator.key", a + "/ca.crt"};
  r = TlsContext::Create(mismatched);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("mismatch"), std::string::npos) << r.status().ToString();

  const std::string open_key = a + "/open.key";
  fs::copy_file(a + "/worker.key", open_key, fs::copy_options::overwrite_existing);
  ASSERT_EQ(::chmod(open_key.c_str(), 0644), 0);
  TlsOptions readable{a + "/worker.crt", open_key, a + "/ca.crt"};
  r = TlsContext::Create(readable);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("chmod 600"), std::string::npos) << r.status().ToString();

  TlsOptions bad_ca{a + "/worker.crt", a + "/worker.key", a + "/worker.key"};
  EXPECT_FALSE(TlsContext::Create(bad_ca).ok());
}

}  // namespace
}  // namespace kvrelay::protocols
