#include "protocols/framed_connection.h"

#include <gtest/gtest.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/write.hpp>
#include <future>
#include <mutex>
#include <queue>

#include "protocols/control.pb.h"
#include "protocols/messages.h"
#include "protocols/peer_handshake.h"

namespace kvrelay::protocols {
namespace {

// Collects accepted connections for the test thread (accept runs on the io thread).
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

class FramedConnectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ConnectionOptions opts;
    opts.name = "test-server";
    opts.max_payload_bytes = 1 << 16;
    auto s = FramedServer::Listen(io_, "127.0.0.1", 0, opts, [this](auto conn) {
      conn->Start();  // inbox mode
      std::lock_guard lock(accepted_.mu);
      accepted_.q.push(conn);
      accepted_.cv.notify_all();
    });
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    server_ = std::move(s).value();
  }
  void TearDown() override {
    server_->Stop();
    io_.Stop();
  }
  std::shared_ptr<FramedConnection> Dial() {
    ConnectionOptions opts;
    opts.name = "test-client";
    auto c = FramedConnection::Connect(client_io_, "127.0.0.1", server_->port(), opts,
                                       Deadline::AfterMs(5000));
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? *c : nullptr;
  }
  IoThread io_{"test-srv-io"};
  IoThread client_io_{"test-cli-io"};
  ClusterKey key_ = std::move(ClusterKey::Generate()).value();
  Accepted accepted_;
  std::unique_ptr<FramedServer> server_;
};

TEST_F(FramedConnectionTest, RoundTripsControlMessagesBothWays) {
  auto client = Dial();
  ASSERT_TRUE(client);
  auto server_side = accepted_.Take(Deadline::AfterMs(5000));
  ASSERT_TRUE(server_side);
  proto::PrefillTask task;
  task.set_request_id(99);
  for (int i = 0; i < 1000; ++i) task.add_prompt_token_ids(i);
  std::string payload;
  task.SerializeToString(&payload);
  ASSERT_TRUE(client->Send(MessageType::kPrefillTask, payload).ok());
  auto frame = server_side->Receive(Deadline::AfterMs(5000));
  ASSERT_TRUE(frame.ok()) << frame.status().ToString();
  proto::PrefillTask got;
  ASSERT_TRUE(DecodeMessage(*frame, MessageType::kPrefillTask, &got).ok());
  EXPECT_EQ(got.request_id(), 99u);
  EXPECT_EQ(got.prompt_token_ids_size(), 1000);
  EXPECT_EQ(got.prompt_token_ids(999), 999);
  ASSERT_TRUE(server_side->Send(MessageType::kCancel, "").ok());
  auto back = client->Receive(Deadline::AfterMs(5000));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->type, static_cast<uint16_t>(MessageType::kCancel));
}

TEST_F(FramedConnectionTest, GarbageClosesOnlyThatConnectionWithReason) {
  // A raw socket that writes junk.
  boost::asio::io_context ctx;
  boost::asio::ip::tcp::socket raw(ctx);
  boost::system::error_code ec;
  raw.connect({boost::asio::ip::make_address("127.0.0.1"), server_->port()}, ec);
  ASSERT_FALSE(ec) << ec.message();
  auto victim = accepted_.Take(Deadline::AfterMs(5000));
  ASSERT_TRUE(victim);
  std::string junk = "GET / HTTP/1.1\r\n\r\n";
  boost::asio::write(raw, boost::asio::buffer(junk), ec);
  Status reason = victim->WaitClosed(Deadline::AfterMs(5000));
  EXPECT_EQ(reason.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(reason.message().find("bad frame magic"), std::string::npos) << reason.ToString();
  // The server goes on: a new client works.
  auto client = Dial();
  ASSERT_TRUE(client);
  auto server_side = accepted_.Take(Deadline::AfterMs(5000));
  ASSERT_TRUE(server_side);
  ASSERT_TRUE(client->Send(MessageType::kHeartbeat, "").ok());
  EXPECT_TRUE(server_side->Receive(Deadline::AfterMs(5000)).ok());
}

TEST_F(FramedConnectionTest, OversizeFrameClosesWithResourceExhausted) {
  auto client = Dial();
  ASSERT_TRUE(client);
  auto victim = accepted_.Take(Deadline::AfterMs(5000));
  ASSERT_TRUE(victim);
  // The client allows big frames; the server's limit is 64 KiB.
  ASSERT_TRUE(client->Send(MessageType::kTokenChunk, std::string(100000, 'x')).ok());
  Status reason = victim->WaitClosed(Deadline::AfterMs(5000));
  EXPECT_EQ(reason.code(), StatusCode::kResourceExhausted) << reason.ToString();
  // The client sees the close as a failed receive, not a hang.
  auto r = client->Receive(Deadline::AfterMs(5000));
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.status().code(), StatusCode::kDeadlineExceeded) << r.status().ToString();
}

TEST_F(FramedConnectionTest, TruncatedFrameAtEofIsReported) {
  boost::asio::io_context ctx;
  boost::asio::ip::tcp::socket raw(ctx);
  boost::system::error_code ec;
  raw.connect({boost::asio::ip::make_address("127.0.0.1"), server_->port()}, ec);
  ASSERT_FALSE(ec);
  auto victim = accepted_.Take(Deadline::AfterMs(5000));
  ASSERT_TRUE(victim);
  std::string frame = *EncodeFrame(5, std::string(100, 'y'));
  boost::asio::write(raw, boost::asio::buffer(frame.data(), 50), ec);
  raw.close();
  Status reason = victim->WaitClosed(Deadline::AfterMs(5000));
  EXPECT_EQ(reason.code(), StatusCode::kDataLoss) << reason.ToString();
  EXPECT_NE(reason.message().find("38 of 100 payload bytes"), std::string::npos)
      << reason.ToString();
}

TEST_F(FramedConnectionTest, SendQueueIsBounded) {
  ConnectionOptions opts;
  opts.max_send_queue_frames = 4;
  auto c = FramedConnection::Connect(client_io_, "127.0.0.1", server_->port(), opts,
                                     Deadline::AfterMs(5000));
  ASSERT_TRUE(c.ok());
  auto victim = accepted_.Take(Deadline::AfterMs(5000));
  ASSERT_TRUE(victim);
  // Stall the io thread so nothing drains, then overfill the queue.
  std::promise<void> release;
  auto released = release.get_future().share();
  boost::asio::post(client_io_.context(), [released] { released.wait(); });
  int accepted = 0;
  Status last;
  for (int i = 0; i < 10; ++i) {
    last = (*c)->Send(MessageType::kHeartbeat, "x");
    if (last.ok()) ++accepted;
  }
  release.set_value();
  EXPECT_EQ(accepted, 4);
  EXPECT_EQ(last.code(), StatusCode::kResourceExhausted);
}

TEST_F(FramedConnectionTest, ConnectToClosedPortFailsWithinDeadline) {
  uint16_t port = server_->port();
  server_->Stop();
  auto start = Clock::now();
  auto c = FramedConnection::Connect(client_io_, "127.0.0.1", port, {}, Deadline::AfterMs(300));
  EXPECT_FALSE(c.ok());
  EXPECT_LT(SecondsSince(start), 2.0);
}

TEST_F(FramedConnectionTest, HandshakeMismatchBothRefuseNamingField) {
  PeerConfig server_cfg;
  server_cfg.model_fingerprint.fill(1);
  server_cfg.kv_dtype = engine::KvDtype::kF16;
  server_cfg.layers = 30;
  server_cfg.kv_heads = 3;
  server_cfg.head_dim = 64;
  PeerConfig client_cfg = server_cfg;
  client_cfg.head_dim = 128;
  auto client = Dial();
  ASSERT_TRUE(client);
  auto server_side = accepted_.Take(Deadline::AfterMs(5000));
  ASSERT_TRUE(server_side);
  Result<PeerConfig> server_result = InvalidArgument("not run");
  std::thread server_thread([&] {
    server_result = ServerHandshake(*server_side, key_, server_cfg, {}, Deadline::AfterMs(5000));
  });
  auto client_result =
      ClientHandshake(*client, key_, "decode-0", client_cfg, {}, Deadline::AfterMs(5000));
  server_thread.join();
  ASSERT_FALSE(server_result.ok());
  ASSERT_FALSE(client_result.ok());
  EXPECT_NE(server_result.status().message().find("head_dim mismatch: local 64, peer 128"),
            std::string::npos)
      << server_result.status().ToString();
  EXPECT_NE(client_result.status().message().find("head_dim"), std::string::npos)
      << client_result.status().ToString();
  EXPECT_FALSE(server_side->WaitClosed(Deadline::AfterMs(5000)).ok());
}

TEST_F(FramedConnectionTest, HandshakeAgreement) {
  PeerConfig cfg;
  cfg.model_fingerprint.fill(7);
  cfg.layers = 2;
  cfg.kv_heads = 2;
  cfg.head_dim = 8;
  PeerConfig client_cfg = cfg;
  client_cfg.tp_size = 2;
  client_cfg.tp_rank = 1;
  auto client = Dial();
  ASSERT_TRUE(client);
  auto server_side = accepted_.Take(Deadline::AfterMs(5000));
  ASSERT_TRUE(server_side);
  Result<PeerConfig> server_result = InvalidArgument("not run");
  std::thread server_thread([&] {
    server_result = ServerHandshake(*server_side, key_, cfg, {}, Deadline::AfterMs(5000));
  });
  auto client_result = ClientHandshake(*client, key_, "d", client_cfg, {}, Deadline::AfterMs(5000));
  server_thread.join();
  ASSERT_TRUE(server_result.ok()) << server_result.status().ToString();
  ASSERT_TRUE(client_result.ok()) << client_result.status().ToString();
  EXPECT_EQ(server_result->tp_rank, 1);
  EXPECT_EQ(client_result->tp_size, 1);
}

}  // namespace
}  // namespace kvrelay::protocols

namespace kvrelay::protocols {
namespace {

TEST_F(FramedConnectionTest, GatherSendWritesCallerMemoryAsOneFrame) {
  auto client = Dial();
  ASSERT_TRUE(client);
  auto server_side = accepted_.Take(Deadline::AfterMs(5000));
  ASSERT_TRUE(server_side);
  const std::string body1(3000, 'a'), body2(5000, 'b');
  std::string head(kFrameHeaderBytes + 4, '\0');
  EncodeFrameHeader(static_cast<uint16_t>(MessageType::kTokenChunk), 4 + 8000,
                    reinterpret_cast<uint8_t*>(head.data()));
  std::memcpy(head.data() + kFrameHeaderBytes, "HEAD", 4);
  std::promise<Status> written;
  auto done = written.get_future();
  ASSERT_TRUE(client
                  ->SendGatherWait(
                      head, {boost::asio::buffer(body1), boost::asio::buffer(body2)},
                      [&](const Status& s) { written.set_value(s); }, Deadline::AfterMs(5000))
                  .ok());
  ASSERT_EQ(done.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  EXPECT_TRUE(done.get().ok());
  auto frame = server_side->Receive(Deadline::AfterMs(5000));
  ASSERT_TRUE(frame.ok()) << frame.status().ToString();
  EXPECT_EQ(frame->type, static_cast<uint16_t>(MessageType::kTokenChunk));
  EXPECT_EQ(frame->payload, "HEAD" + body1 + body2);
  // A head without a frame header is refused and its callback never runs.
  bool called = false;
  EXPECT_EQ(client
                ->SendGatherWait(
                    "abc", {}, [&](const Status&) { called = true; }, Deadline::AfterMs(100))
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_FALSE(called);
}

TEST_F(FramedConnectionTest, GatherSendCompletesEveryQueuedFrameOnceWhenThePeerCloses) {
  auto client = Dial();
  ASSERT_TRUE(client);
  auto server_side = accepted_.Take(Deadline::AfterMs(5000));
  ASSERT_TRUE(server_side);
  // The server accepts 64 KiB payloads at most: the first 1 MiB frame makes it
  // close the connection, so the later frames (more than the socket buffers
  // hold) cannot all be written.
  const std::string body(1 << 20, 'x');
  constexpr int kFrames = 96;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Status> results;
  int sent = 0;
  for (int i = 0; i < kFrames; ++i) {
    std::string head(kFrameHeaderBytes, '\0');
    EncodeFrameHeader(static_cast<uint16_t>(MessageType::kTokenChunk),
                      static_cast<uint32_t>(body.size()), reinterpret_cast<uint8_t*>(head.data()));
    Status st = client->SendGatherWait(
        head, {boost::asio::buffer(body)},
        [&](const Status& s) {
          std::lock_guard lock(mu);
          results.push_back(s);
          cv.notify_all();
        },
        Deadline::AfterMs(5000));
    if (!st.ok()) break;  // closed already: no callback for this one
    ++sent;
  }
  ASSERT_GE(sent, 1);
  std::unique_lock lock(mu);
  ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(10),
                          [&] { return static_cast<int>(results.size()) == sent; }));
  // Exactly one callback per queued frame; once one failed, all later ones did.
  bool failed = false;
  for (const Status& s : results) {
    if (failed) {
      EXPECT_FALSE(s.ok());
    }
    failed = failed || !s.ok();
  }
  // The close must surface: as a failed callback, or (when it was seen before
  // the loop ended) as a refused SendGatherWait. Frames written into the socket
  // buffers before the close succeed legitimately.
  EXPECT_TRUE(failed || sent < kFrames)
      << "the peer closed, yet all " << kFrames << " frames were accepted and reported written";
  EXPECT_EQ(server_side->WaitClosed(Deadline::AfterMs(5000)).code(),
            StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace kvrelay::protocols
