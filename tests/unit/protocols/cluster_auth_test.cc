// The cluster key and the mutual challenge-response (protocols/cluster_auth.h),
// and the pre-authentication limits of FramedConnection / FramedServer.
#include "protocols/cluster_auth.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <thread>

#include "protocols/control.pb.h"
#include "protocols/framed_connection.h"
#include "protocols/peer_handshake.h"

namespace kvrelay::protocols {
namespace {

ClusterKey NewKey() { return std::move(ClusterKey::Generate()).value(); }

Frame F(MessageType t, std::string payload) { return Frame{static_cast<uint16_t>(t), payload}; }

std::string TempPath(const std::string& name) {
  return ::testing::TempDir() + "/kvrelay_auth_" + std::to_string(getpid()) + "_" + name;
}

// Runs the four messages; returns the initiator's and responder's verdicts.
struct Outcome {
  Status initiator;
  Status responder;
};
Outcome Exchange(AuthInitiator& i, AuthResponder& r) {
  Outcome o;
  auto hello = i.Hello();
  if (!hello.ok()) return {hello.status(), Status::Ok()};
  auto challenge = r.OnHello(F(MessageType::kAuthHello, *hello));
  if (!challenge.ok()) {
    o.responder = challenge.status();
    o.initiator =
        i.OnChallenge(F(MessageType::kAuthProof, AuthResponder::RefusalPayload("no"))).status();
    return o;
  }
  auto proof = i.OnChallenge(F(MessageType::kAuthChallenge, *challenge));
  if (!proof.ok()) return {proof.status(), Status::Ok()};
  auto mine = r.OnProof(F(MessageType::kAuthProof, *proof));
  o.responder = mine.status();
  o.initiator = i.OnResult(
      F(MessageType::kAuthProof, mine.ok() ? *mine : AuthResponder::RefusalPayload("no")));
  return o;
}

TEST(ClusterAuth, SameKeyAuthenticatesBothSidesAndNamesThePeer) {
  const ClusterKey key = NewKey();
  AuthInitiator i(key, kAuthChannelControl, "prefill-0");
  AuthResponder r(key, kAuthChannelControl);
  Outcome o = Exchange(i, r);
  EXPECT_TRUE(o.initiator.ok()) << o.initiator.ToString();
  EXPECT_TRUE(o.responder.ok()) << o.responder.ToString();
  EXPECT_TRUE(i.authenticated());
  EXPECT_TRUE(r.authenticated());
  EXPECT_EQ(r.peer_name(), "prefill-0");
}

TEST(ClusterAuth, WrongKeyIsRefusedAndTheInitiatorIsToldWhy) {
  AuthInitiator i(NewKey(), kAuthChannelControl, "prefill-0");
  AuthResponder r(NewKey(), kAuthChannelControl);
  Outcome o = Exchange(i, r);
  EXPECT_EQ(o.responder.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(o.responder.message().find("does not hold the cluster key"), std::string::npos);
  EXPECT_NE(o.initiator.message().find("--cluster-key-file"), std::string::npos)
      << o.initiator.ToString();
  EXPECT_FALSE(r.authenticated());
  EXPECT_FALSE(i.authenticated());
}

TEST(ClusterAuth, AResponderWithoutTheKeyCannotFakeItsProof) {
  // A rogue listener answers with a proof of its own making.
  const ClusterKey key = NewKey();
  AuthInitiator i(key, kAuthChannelKv, "kv-rank-0");
  ASSERT_TRUE(i.Hello().ok());
  proto::AuthChallenge ch;
  ch.set_nonce(std::string(kAuthNonceBytes, 'n'));
  ASSERT_TRUE(i.OnChallenge(F(MessageType::kAuthChallenge, ch.SerializeAsString())).ok());
  proto::AuthProof fake;
  fake.set_mac(std::string(32, 'm'));
  Status st = i.OnResult(F(MessageType::kAuthProof, fake.SerializeAsString()));
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_FALSE(i.authenticated());
}

TEST(ClusterAuth, ARecordedProofDoesNotVerifyAgain) {
  const ClusterKey key = NewKey();
  AuthInitiator i(key, kAuthChannelControl, "decode-0");
  AuthResponder r(key, kAuthChannelControl);
  auto hello = *i.Hello();
  auto challenge = *r.OnHello(F(MessageType::kAuthHello, hello));
  auto proof = *i.OnChallenge(F(MessageType::kAuthChallenge, challenge));
  ASSERT_TRUE(r.OnProof(F(MessageType::kAuthProof, proof)).ok());
  // Replayed against a fresh responder (fresh nonce): refused.
  AuthResponder r2(key, kAuthChannelControl);
  ASSERT_TRUE(r2.OnHello(F(MessageType::kAuthHello, hello)).ok());
  EXPECT_FALSE(r2.OnProof(F(MessageType::kAuthProof, proof)).ok());
}

TEST(ClusterAuth, ProofsAreBoundToRoleAndChannel) {
  const std::string k(32, 'k'), ni(32, 'i'), nr(32, 'r');
  EXPECT_NE(AuthMac(k, "client", "control", "a", ni, nr),
            AuthMac(k, "server", "control", "a", ni, nr));
  EXPECT_NE(AuthMac(k, "client", "control", "a", ni, nr), AuthMac(k, "client", "kv", "a", ni, nr));
  EXPECT_NE(AuthMac(k, "client", "control", "ab", ni, nr),
            AuthMac(k, "client", "control", "a", "b" + ni, nr));
  // A hello for the control channel is refused on a KV port.
  const ClusterKey key = NewKey();
  AuthInitiator i(key, kAuthChannelControl, "x");
  AuthResponder r(key, kAuthChannelKv);
  EXPECT_FALSE(r.OnHello(F(MessageType::kAuthHello, *i.Hello())).ok());
}

TEST(ClusterAuth, GarbageAtEveryStepIsRefusedNotCrashed) {
  const ClusterKey key = NewKey();
  for (const std::string& junk :
       {std::string(), std::string("\xff\xff\xff"), std::string(900, 'z')}) {
    AuthResponder r(key, kAuthChannelControl);
    EXPECT_FALSE(r.OnHello(F(MessageType::kAuthHello, junk)).ok());
    EXPECT_FALSE(r.OnProof(F(MessageType::kAuthProof, junk)).ok());  // out of order too
    AuthInitiator i(key, kAuthChannelControl, "n");
    ASSERT_TRUE(i.Hello().ok());
    EXPECT_FALSE(i.OnChallenge(F(MessageType::kAuthChallenge, junk)).ok());
  }
}

TEST(ClusterKeyFile, GeneratedFilesArePrivateAndLoad) {
  const std::string path = TempPath("gen.key");
  ::unlink(path.c_str());
  ASSERT_TRUE(ClusterKey::GenerateFile(path).ok());
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  auto key = ClusterKey::LoadFile(path);
  ASSERT_TRUE(key.ok()) << key.status().ToString();
  EXPECT_EQ(key->secret().size(), 64u);               // hex of 32 bytes, newline trimmed
  EXPECT_FALSE(ClusterKey::GenerateFile(path).ok());  // never overwrites
  ::unlink(path.c_str());
}

TEST(ClusterKeyFile, ReadableByOthersOrShortIsRefusedNamingTheFix) {
  const std::string path = TempPath("bad.key");
  {
    std::ofstream out(path);
    out << std::string(64, 'a') << "\n";
  }
  ::chmod(path.c_str(), 0644);
  auto open = ClusterKey::LoadFile(path);
  EXPECT_EQ(open.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(open.status().message().find("chmod 600"), std::string::npos);
  ::chmod(path.c_str(), 0600);
  EXPECT_TRUE(ClusterKey::LoadFile(path).ok());
  {
    std::ofstream out(path, std::ios::trunc);
    out << "short\n";
  }
  EXPECT_EQ(ClusterKey::LoadFile(path).status().code(), StatusCode::kInvalidArgument);
  ::unlink(path.c_str());
  EXPECT_EQ(ClusterKey::LoadFile(path).status().code(), StatusCode::kNotFound);
}

// --- FramedConnection / FramedServer before authentication --------------------

class PreAuthTest : public ::testing::Test {
 protected:
  void Listen(ConnectionOptions opts, ServerLimits limits = {}) {
    auto s = FramedServer::Listen(
        io_, "127.0.0.1", 0, opts,
        [this](auto conn) {
          conn->Start();
          std::lock_guard lock(mu_);
          accepted_.push_back(conn);
          cv_.notify_all();
        },
        limits);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    server_ = std::move(*s);
  }
  std::shared_ptr<FramedConnection> Dial() {
    auto c = FramedConnection::Connect(client_io_, "127.0.0.1", server_->port(), {},
                                       Deadline::AfterMs(5000));
    EXPECT_TRUE(c.ok());
    return c.ok() ? *c : nullptr;
  }
  std::shared_ptr<FramedConnection> Accepted(size_t i) {
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(5), [&] { return accepted_.size() > i; });
    return accepted_.size() > i ? accepted_[i] : nullptr;
  }
  void TearDown() override {
    if (server_) server_->Stop();
  }
  IoThread io_{"preauth-srv"};
  IoThread client_io_{"preauth-cli"};
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<FramedConnection>> accepted_;
  std::unique_ptr<FramedServer> server_;
};

TEST_F(PreAuthTest, AnUnauthenticatedFrameOverTheSmallLimitClosesBeforeBuffering) {
  ConnectionOptions opts;
  opts.require_authentication = true;
  Listen(opts);
  auto c = Dial();
  std::string head(kFrameHeaderBytes, '\0');
  EncodeFrameHeader(static_cast<uint16_t>(MessageType::kHello), 16u << 20,
                    reinterpret_cast<uint8_t*>(head.data()));
  ASSERT_TRUE(c->SendEncoded(head + std::string(4096, 'x')).ok());
  auto s = Accepted(0);
  ASSERT_TRUE(s);
  Status why = s->WaitClosed(Deadline::AfterMs(5000));
  EXPECT_EQ(why.code(), StatusCode::kResourceExhausted) << why.ToString();
}

TEST_F(PreAuthTest, AfterAuthenticationFullFramesPass) {
  ConnectionOptions opts;
  opts.require_authentication = true;
  Listen(opts);
  const ClusterKey key = NewKey();
  auto c = Dial();
  auto s = Accepted(0);
  ASSERT_TRUE(s);
  Result<std::string> name = InvalidArgument("not run");
  std::thread server(
      [&] { name = ServerAuthenticate(*s, key, kAuthChannelKv, Deadline::AfterMs(5000)); });
  ASSERT_TRUE(
      ClientAuthenticate(*c, key, kAuthChannelKv, "kv-rank-3", Deadline::AfterMs(5000)).ok());
  server.join();
  ASSERT_TRUE(name.ok()) << name.status().ToString();
  EXPECT_EQ(*name, "kv-rank-3");
  EXPECT_TRUE(s->authenticated());
  ASSERT_TRUE(c->Send(MessageType::kKvData, std::string(1 << 20, 'q')).ok());
  auto f = s->Receive(Deadline::AfterMs(5000));
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->payload.size(), 1u << 20);
}

TEST_F(PreAuthTest, ASilentConnectionIsClosedAtTheAuthTimeout) {
  ConnectionOptions opts;
  opts.require_authentication = true;
  opts.auth_timeout = std::chrono::milliseconds(200);
  Listen(opts);
  auto c = Dial();
  auto s = Accepted(0);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->WaitClosed(Deadline::AfterMs(5000)).code(), StatusCode::kDeadlineExceeded);
}

TEST_F(PreAuthTest, APartialFrameIsClosedAtTheFrameTimeout) {
  ConnectionOptions opts;
  opts.frame_timeout = std::chrono::milliseconds(200);
  Listen(opts);
  auto c = Dial();
  std::string head(kFrameHeaderBytes, '\0');
  EncodeFrameHeader(static_cast<uint16_t>(MessageType::kKvData), 1 << 20,
                    reinterpret_cast<uint8_t*>(head.data()));
  ASSERT_TRUE(c->SendEncoded(head + std::string(1000, 'p')).ok());
  auto s = Accepted(0);
  ASSERT_TRUE(s);
  Status why = s->WaitClosed(Deadline::AfterMs(5000));
  EXPECT_EQ(why.code(), StatusCode::kDeadlineExceeded) << why.ToString();
  EXPECT_NE(why.message().find("incomplete"), std::string::npos) << why.ToString();
}

TEST_F(PreAuthTest, ConnectionsOverTheServerLimitAreRefused) {
  ConnectionOptions opts;
  ServerLimits limits;
  limits.max_connections = 2;
  Listen(opts, limits);
  auto a = Dial();
  auto b = Dial();
  ASSERT_TRUE(Accepted(1));
  auto extra = Dial();
  EXPECT_NE(extra->WaitClosed(Deadline::AfterMs(5000)).code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(server_->refused_connections(), 1u);
}

TEST(FrameDecoderBounds, AnAnnouncedFrameReservesNothingUntilItsBytesArrive) {
  // Today the decoder reserved the announced length at the header.
  FrameDecoder d;
  uint8_t head[kFrameHeaderBytes];
  EncodeFrameHeader(static_cast<uint16_t>(MessageType::kKvData), 16u << 20, head);
  ASSERT_TRUE(d.Feed(head, sizeof(head)).ok());
  const std::string some(100, 'a');
  ASSERT_TRUE(d.Feed(some.data(), some.size()).ok());
  EXPECT_LT(d.partial_capacity(), 4096u);
  EXPECT_EQ(d.buffered_bytes(), kFrameHeaderBytes + 100);
  d.Release();
  EXPECT_EQ(d.buffered_bytes(), 0u);
}

TEST(FrameDecoderBounds, AHeaderOverTheLimitIsRefusedBeforeAnyByte) {
  FrameDecoder d(FrameDecoder::Options{kMaxUnauthenticatedPayload});
  uint8_t head[kFrameHeaderBytes];
  EncodeFrameHeader(1, 0xFFFFFFFFu, head);
  Status st = d.Feed(head, sizeof(head));
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(d.partial_capacity(), Frame{}.payload.capacity());
}

}  // namespace
}  // namespace kvrelay::protocols
