#include "kv_transfer/transport.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <future>
#include <numeric>
#include <random>
#include <thread>

#include "kv_transfer/regions.h"
#include "kv_transfer/transport_base.h"
#include "protocols/framed_connection.h"
#include "transport_pair.h"

namespace kvrelay::kv_transfer {
namespace {

using testing::DialAuthenticated;
using testing::MakePair;
using testing::RandomBytes;
using testing::TestKey;

// Bytes the receiving side holds for receives not posted (-1: not a
// TransportBase).
int64_t StagedBytes(Transport& t) {
  auto* base = dynamic_cast<TransportBase*>(&t);
  return base != nullptr ? base->staged_bytes() : -1;
}

// `blocks` contiguous blocks of `layers` layers in one buffer.
TransferDesc Desc(int peer, uint64_t req, uint32_t tag, std::vector<uint8_t>& buf, int blocks,
                  int layers, int kv_heads, int64_t slab, int hb, int he) {
  TransferDesc d;
  d.peer = peer;
  d.request_id = req;
  d.tag = tag;
  d.layout = {kv_heads, slab, MemoryKind::kHost};
  const int64_t block_bytes = layers * 2 * kv_heads * slab;
  EXPECT_EQ(buf.size(), static_cast<size_t>(blocks * block_bytes));
  for (int i = 0; i < blocks; ++i) {
    d.slices.push_back({i, 0, layers, hb, he, buf.data() + i * block_bytes, 0});
  }
  return d;
}

TEST(Regions, ResolveFollowsKvLayoutHeadMajor) {
  // 2 heads, slab 4 bytes, 2 layers: layer = [K0 K1 V0 V1] = 16 bytes.
  std::vector<uint8_t> buf(32);
  TransferDesc d = Desc(0, 1, 0, buf, 1, 2, 2, 4, 1, 2);  // head 1 only
  ASSERT_TRUE(ValidateDesc(d, 1).ok());
  auto r = ResolveRegions(d);
  // layer = [K0 K1 V0 V1]; head 1 is K1 and V1 of each layer.
  ASSERT_EQ(r.size(), 4u);
  EXPECT_EQ(r[0].data, buf.data() + 4);
  EXPECT_EQ(r[0].bytes, 4u);
  EXPECT_EQ(r[1].data, buf.data() + 12);
  EXPECT_EQ(r[2].data, buf.data() + 20);
  EXPECT_EQ(r[3].data, buf.data() + 28);
  EXPECT_EQ(TotalBytes(r), 16u);
  // All heads of contiguous layers merge into one region.
  auto all = ResolveRegions(Desc(0, 1, 0, buf, 1, 2, 2, 4, 0, 2));
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0].bytes, 32u);
}

TEST(Regions, ValidateNamesTheBadField) {
  std::vector<uint8_t> buf(32);
  TransferDesc d = Desc(0, 1, 0, buf, 1, 2, 2, 4, 0, 3);
  Status st = ValidateDesc(d, 2);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("head range [0, 3) outside [0, 2)"), std::string::npos)
      << st.ToString();
  d = Desc(5, 1, 0, buf, 1, 2, 2, 4, 0, 2);
  EXPECT_NE(ValidateDesc(d, 2).message().find("peer 5"), std::string::npos);
}

class TransportTest : public ::testing::TestWithParam<std::string> {};

TEST_P(TransportTest, RoundTripManySizesOutOfOrder) {
  auto pair = MakePair(GetParam());
  std::mt19937 rng(1);
  struct Case {
    int blocks, layers, heads;
    int64_t slab;
  };
  const std::vector<Case> cases = {{1, 1, 1, 2},    {3, 2, 3, 64},    {8, 30, 3, 128},
                                   {2, 4, 2, 4096}, {16, 2, 3, 2048}, {1, 3, 1, 300000}};
  std::vector<std::vector<uint8_t>> src, dst;
  std::vector<TransferHandle> recvs, sends;
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& c = cases[i];
    size_t n = static_cast<size_t>(c.blocks * c.layers * 2 * c.heads * c.slab);
    src.push_back(RandomBytes(n, static_cast<uint32_t>(i + 10)));
    dst.emplace_back(n, 0);
  }
  // Receives posted in reverse order; half of them after the sends.
  std::vector<size_t> order(cases.size());
  std::iota(order.begin(), order.end(), 0);
  recvs.assign(cases.size(), 0);
  auto post_recv = [&](size_t i) {
    const auto& c = cases[i];
    auto h = pair.b->PostRecv(Desc(0, 7, static_cast<uint32_t>(i), dst[i], c.blocks, c.layers,
                                   c.heads, c.slab, 0, c.heads));
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    recvs[i] = *h;
  };
  for (size_t k = cases.size(); k-- > cases.size() / 2;) post_recv(k);
  std::shuffle(order.begin(), order.end(), rng);
  for (size_t i : order) {
    const auto& c = cases[i];
    auto h = pair.a->PostSend(Desc(1, 7, static_cast<uint32_t>(i), src[i], c.blocks, c.layers,
                                   c.heads, c.slab, 0, c.heads));
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    sends.push_back(*h);
  }
  for (size_t k = 0; k < cases.size() / 2; ++k) post_recv(k);
  std::shuffle(order.begin(), order.end(), rng);
  for (size_t i : order) {
    ASSERT_TRUE(pair.b->Wait(recvs[i], Deadline::AfterMs(20000)).ok()) << i;
  }
  for (auto h : sends) ASSERT_TRUE(pair.a->Wait(h, Deadline::AfterMs(20000)).ok());
  for (size_t i = 0; i < cases.size(); ++i) EXPECT_TRUE(src[i] == dst[i]) << "case " << i;
  EXPECT_EQ(pair.a->inflight(), 0);
  EXPECT_EQ(pair.b->inflight(), 0);
}

TEST_P(TransportTest, PartialHeadRangeLandsOnlyInItsSlabs) {
  auto pair = MakePair(GetParam());
  // Sender holds 3 heads; receiver holds 1 head (a TP shard) and takes head 2.
  const int64_t slab = 256;
  auto src = RandomBytes(4 * 2 * 3 * slab, 3);  // 4 layers
  std::vector<uint8_t> dst(4 * 2 * 1 * slab, 0);
  auto r = pair.b->PostRecv(Desc(0, 1, 0, dst, 1, 4, 1, slab, 0, 1));
  auto s = pair.a->PostSend(Desc(1, 1, 0, src, 1, 4, 3, slab, 2, 3));
  ASSERT_TRUE(r.ok() && s.ok());
  ASSERT_TRUE(pair.b->Wait(*r, Deadline::AfterMs(5000)).ok());
  ASSERT_TRUE(pair.a->Wait(*s, Deadline::AfterMs(5000)).ok());
  for (int l = 0; l < 4; ++l) {
    // K of head 2 and V of head 2 of layer l.
    EXPECT_EQ(0, std::memcmp(dst.data() + l * 2 * slab, src.data() + (l * 6 + 2) * slab, slab));
    EXPECT_EQ(0,
              std::memcmp(dst.data() + (l * 2 + 1) * slab, src.data() + (l * 6 + 5) * slab, slab));
  }
}

TEST_P(TransportTest, SizeMismatchFailsTheReceive) {
  auto pair = MakePair(GetParam());
  std::vector<uint8_t> src(2 * 2 * 64, 1), dst(2 * 2 * 32, 0);
  auto r = pair.b->PostRecv(Desc(0, 2, 0, dst, 1, 2, 2, 16, 0, 2));
  auto s = pair.a->PostSend(Desc(1, 2, 0, src, 1, 2, 2, 32, 0, 2));
  ASSERT_TRUE(r.ok() && s.ok());
  Status st = pair.b->Wait(*r, Deadline::AfterMs(5000));
  EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.ToString();
  EXPECT_NE(st.message().find("sender sent 256 bytes, receive expects 128"), std::string::npos)
      << st.ToString();
  (void)pair.a->Wait(*s, Deadline::AfterMs(5000));
}

TEST_P(TransportTest, DeadlineExpiryFreesEverythingAndLateDataIsIgnored) {
  auto pair = MakePair(GetParam());
  std::vector<uint8_t> src(1024, 9), dst(1024, 0);
  auto r = pair.b->PostRecv(Desc(0, 3, 0, dst, 1, 1, 2, 256, 0, 2));
  ASSERT_TRUE(r.ok());
  auto start = Clock::now();
  Status st = pair.b->Wait(*r, Deadline::AfterMs(100));
  EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded);
  EXPECT_LT(SecondsSince(start), 2.0);
  EXPECT_EQ(pair.b->inflight(), 0);
  EXPECT_EQ(pair.b->Poll(*r).status().code(), StatusCode::kNotFound);  // handle consumed
  // The late send must not touch the abandoned buffer.
  auto s = pair.a->PostSend(Desc(1, 3, 0, src, 1, 1, 2, 256, 0, 2));
  ASSERT_TRUE(s.ok());
  if (GetParam() == "tcp") {
    ASSERT_TRUE(pair.a->Wait(*s, Deadline::AfterMs(5000)).ok());
  }
  // A marker transfer after it proves the late bytes were processed.
  std::vector<uint8_t> m_src(64, 1), m_dst(64, 0);
  auto mr = pair.b->PostRecv(Desc(0, 4, 0, m_dst, 1, 1, 1, 32, 0, 1));
  auto ms = pair.a->PostSend(Desc(1, 4, 0, m_src, 1, 1, 1, 32, 0, 1));
  ASSERT_TRUE(mr.ok() && ms.ok());
  ASSERT_TRUE(pair.b->Wait(*mr, Deadline::AfterMs(5000)).ok());
  EXPECT_TRUE(std::all_of(dst.begin(), dst.end(), [](uint8_t x) { return x == 0; }));
  // Discarded, not staged for a minute as if a receive might still come.
  EXPECT_EQ(StagedBytes(*pair.b), 0);
  if (GetParam() == "local") {
    // The rendezvous send waits for a receive that never comes: its deadline frees it.
    EXPECT_EQ(pair.a->Wait(*s, Deadline::AfterMs(50)).code(), StatusCode::kDeadlineExceeded);
  }
  (void)pair.a->Wait(*ms, Deadline::AfterMs(5000));
  EXPECT_EQ(pair.a->inflight(), 0);
}

TEST_P(TransportTest, CancelledReceiveReleasesHandle) {
  auto pair = MakePair(GetParam());
  std::vector<uint8_t> dst(512, 0);
  auto r = pair.b->PostRecv(Desc(0, 5, 0, dst, 1, 1, 1, 256, 0, 1));
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(pair.b->Cancel(*r).ok());
  EXPECT_EQ(pair.b->inflight(), 0);
  EXPECT_EQ(pair.b->Cancel(*r).code(), StatusCode::kNotFound);
  if (GetParam() != "tcp") return;  // (local: a send waits for its receive)
  // The sender had not started when the receive was cancelled (a request
  // cancelled before its KV left the prefill worker): its bytes are dropped
  // as they come, not staged; a marker transfer after them proves they came.
  std::vector<uint8_t> src(512, 3), m_src(64, 1), m_dst(64, 0);
  auto s = pair.a->PostSend(Desc(1, 5, 0, src, 1, 1, 1, 256, 0, 1));
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE(pair.a->Wait(*s, Deadline::AfterMs(5000)).ok());
  auto mr = pair.b->PostRecv(Desc(0, 15, 0, m_dst, 1, 1, 1, 32, 0, 1));
  auto ms = pair.a->PostSend(Desc(1, 15, 0, m_src, 1, 1, 1, 32, 0, 1));
  ASSERT_TRUE(mr.ok() && ms.ok());
  ASSERT_TRUE(pair.b->Wait(*mr, Deadline::AfterMs(5000)).ok());
  ASSERT_TRUE(pair.a->Wait(*ms, Deadline::AfterMs(5000)).ok());
  EXPECT_EQ(StagedBytes(*pair.b), 0);
  EXPECT_TRUE(std::all_of(dst.begin(), dst.end(), [](uint8_t x) { return x == 0; }));
  // A new receive of the same key takes a new send.
  auto r2 = pair.b->PostRecv(Desc(0, 5, 0, dst, 1, 1, 1, 256, 0, 1));
  auto s2 = pair.a->PostSend(Desc(1, 5, 0, src, 1, 1, 1, 256, 0, 1));
  ASSERT_TRUE(r2.ok() && s2.ok());
  ASSERT_TRUE(pair.b->Wait(*r2, Deadline::AfterMs(5000)).ok());
  ASSERT_TRUE(pair.a->Wait(*s2, Deadline::AfterMs(5000)).ok());
  EXPECT_EQ(dst, src);
}

TEST_P(TransportTest, MaxInflightIsEnforced) {
  auto pair = MakePair(GetParam());
  EXPECT_GT(pair.b->max_inflight(), 0);
  EXPECT_FALSE(pair.b->SupportsDeviceMemory());
  std::vector<uint8_t> dst(64, 0);
  TransferDesc d = Desc(0, 6, 0, dst, 1, 1, 1, 32, 0, 1);
  d.layout.memory = MemoryKind::kDevice;
  EXPECT_EQ(pair.b->PostRecv(d).status().code(), StatusCode::kUnimplemented);
}

INSTANTIATE_TEST_SUITE_P(Backends, TransportTest, ::testing::Values("local", "tcp"));

TEST(LocalTransport, CancelledSendFailsTheLaterReceive) {
  auto pair = MakePair("local");
  std::vector<uint8_t> src(64, 1), dst(64, 0);
  auto s = pair.a->PostSend(Desc(1, 8, 0, src, 1, 1, 1, 32, 0, 1));
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE(pair.a->Cancel(*s).ok());
  auto r = pair.b->PostRecv(Desc(0, 8, 0, dst, 1, 1, 1, 32, 0, 1));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(pair.b->Wait(*r, Deadline::AfterMs(1000)).code(), StatusCode::kCancelled);
}

TEST(LocalTransport, DisconnectedPeerFailsPendingAndFutureTransfers) {
  auto pair = MakePair("local");
  std::vector<uint8_t> dst(64, 0);
  auto r = pair.b->PostRecv(Desc(0, 9, 0, dst, 1, 1, 1, 32, 0, 1));
  ASSERT_TRUE(r.ok());
  pair.fabric->Disconnect(0);
  EXPECT_EQ(pair.b->Wait(*r, Deadline::AfterMs(1000)).code(), StatusCode::kUnavailable);
  EXPECT_EQ(pair.b->PostRecv(Desc(0, 9, 1, dst, 1, 1, 1, 32, 0, 1)).status().code(),
            StatusCode::kUnavailable);
}

// Chunk frame payload header of the TCP backend (see tcp_transport.cc).
struct ChunkHeader {
  uint64_t request_id;
  uint32_t tag;
  uint32_t reserved;
  uint64_t offset;
  uint64_t total;
};

TEST(TcpTransport, PeerProcessVanishingMidTransferFailsWithinDeadline) {
  // The sender is a child process that sends hello + 1 of 8 chunks and dies.
  int port_pipe[2];
  ASSERT_EQ(pipe(port_pipe), 0);
  const protocols::ClusterKey& key = TestKey();  // before the fork: both sides hold it
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    uint16_t port = 0;
    if (read(port_pipe[0], &port, sizeof(port)) != sizeof(port)) _exit(2);
    protocols::IoThread io("child-io");
    auto conn = DialAuthenticated(io, port, 0, key);
    if (!conn.ok()) _exit(3);
    uint32_t hello[2] = {0, 2};
    (void)(*conn)->Send(protocols::MessageType::kHello,
                        std::string_view(reinterpret_cast<char*>(hello), sizeof(hello)));
    std::string head(protocols::kFrameHeaderBytes + sizeof(ChunkHeader), '\0');
    protocols::EncodeFrameHeader(static_cast<uint16_t>(protocols::MessageType::kKvData),
                                 sizeof(ChunkHeader) + 4096,
                                 reinterpret_cast<uint8_t*>(head.data()));
    ChunkHeader h{77, 0, 0, 0, 8 * 4096};
    std::memcpy(head.data() + protocols::kFrameHeaderBytes, &h, sizeof(h));
    const std::string body(4096, 'k');
    std::promise<Status> written;
    auto done = written.get_future();
    if (!(*conn)
             ->SendGatherWait(
                 head, {boost::asio::buffer(body)},
                 [&written](const Status& s) { written.set_value(s); }, Deadline::AfterMs(5000))
             .ok()) {
      _exit(4);
    }
    // Every byte handed to the kernel, then die without any goodbye.
    if (done.wait_for(std::chrono::seconds(5)) != std::future_status::ready) _exit(5);
    _exit(done.get().ok() ? 0 : 6);
  }
  close(port_pipe[0]);
  TcpTransport::Options o;
  o.cluster_key = TestKey();
  o.rank = 1;
  auto recv_side = std::move(TcpTransport::Create(o)).value();
  uint16_t port = recv_side->port();
  ASSERT_EQ(write(port_pipe[1], &port, sizeof(port)), static_cast<ssize_t>(sizeof(port)));
  std::vector<uint8_t> dst(8 * 4096, 0);
  auto r = recv_side->PostRecv(Desc(0, 77, 0, dst, 1, 1, 1, 4 * 4096, 0, 1));
  ASSERT_TRUE(r.ok());
  auto start = Clock::now();
  Status st = recv_side->Wait(*r, Deadline::AfterMs(10000));
  double waited = SecondsSince(start);
  int wstatus = 0;
  waitpid(child, &wstatus, 0);
  EXPECT_EQ(WEXITSTATUS(wstatus), 0);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
  EXPECT_NE(st.message().find("peer 0"), std::string::npos) << st.ToString();
  EXPECT_LT(waited, 5.0);  // well before the 10 s deadline: the close is seen, not timed out
  EXPECT_EQ(recv_side->inflight(), 0);
  close(port_pipe[1]);
}

TEST(TcpTransport, CancelOfAReceiveStalledInsideAChunkClosesThatConnection) {
  // Rank 0 is played by a raw connection that declares a 64 KiB chunk, writes
  // 1000 bytes of it and stalls with the connection open.
  TcpTransport::Options o;
  o.cluster_key = TestKey();
  o.rank = 1;
  o.cancel_drain_timeout = std::chrono::milliseconds(200);
  auto recv_side = std::move(TcpTransport::Create(o)).value();
  std::vector<uint8_t> dst(65536, 0);
  auto r = recv_side->PostRecv(Desc(0, 78, 0, dst, 1, 1, 1, 32768, 0, 1));
  ASSERT_TRUE(r.ok());
  protocols::IoThread io("stall-io");
  auto conn = DialAuthenticated(io, recv_side->port(), 0, TestKey());
  ASSERT_TRUE(conn.ok()) << conn.status().ToString();
  uint32_t hello[2] = {0, 2};
  ASSERT_TRUE((*conn)
                  ->Send(protocols::MessageType::kHello,
                         std::string_view(reinterpret_cast<char*>(hello), sizeof(hello)))
                  .ok());
  const std::vector<uint8_t> part = RandomBytes(1000, 5);
  std::string head(protocols::kFrameHeaderBytes + sizeof(ChunkHeader), '\0');
  protocols::EncodeFrameHeader(static_cast<uint16_t>(protocols::MessageType::kKvData),
                               sizeof(ChunkHeader) + 65536,
                               reinterpret_cast<uint8_t*>(head.data()));
  ChunkHeader h{78, 0, 0, 0, 65536};
  std::memcpy(head.data() + protocols::kFrameHeaderBytes, &h, sizeof(h));
  ASSERT_TRUE(
      (*conn)
          ->SendGatherWait(
              head, {boost::asio::buffer(part)}, [](const Status&) {}, Deadline::AfterMs(5000))
          .ok());
  auto start = Clock::now();
  Status st = recv_side->Wait(*r, Deadline::AfterMs(1000));
  const double waited = SecondsSince(start);
  EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded) << st.ToString();
  EXPECT_LT(waited, 4.0);  // deadline + drain timeout, not the stall
  EXPECT_EQ(recv_side->inflight(), 0);
  // The receive has been given back (inflight 0), so its memory is ours again
  // and may be read: the bytes that did arrive were read straight into it.
  EXPECT_TRUE(std::equal(part.begin(), part.end(), dst.begin()));
  // The receiver gave up on the stalled chunk by closing the connection.
  EXPECT_TRUE((*conn)->WaitClosed(Deadline::AfterMs(5000)).code() != StatusCode::kDeadlineExceeded);
}

TEST(TcpTransport, ShutdownWhileUnexpectedChunksArriveIsSafe) {
  // Chunks nobody posted a receive for are read into a scratch buffer. A read
  // that completes just as the transport shuts down must not touch that
  // buffer after the connection released it (CI saw exactly this crash).
  // Each round streams unexpected chunks and destroys the receiver mid-stream.
  for (int round = 0; round < 40; ++round) {
    TcpTransport::Options o;
    o.cluster_key = TestKey();
    o.rank = 1;
    auto recv_side = std::move(TcpTransport::Create(o)).value();
    protocols::IoThread io("flood-io");
    auto conn = DialAuthenticated(io, recv_side->port(), 0, TestKey());
    ASSERT_TRUE(conn.ok()) << conn.status().ToString();
    uint32_t hello[2] = {0, 2};
    ASSERT_TRUE((*conn)
                    ->Send(protocols::MessageType::kHello,
                           std::string_view(reinterpret_cast<char*>(hello), sizeof(hello)))
                    .ok());
    constexpr size_t kChunk = 320;
    for (uint64_t request = 1; request <= 64; ++request) {
      std::string chunk(sizeof(ChunkHeader) + kChunk, static_cast<char>(request));
      ChunkHeader h{request, 0, 0, 0, kChunk};
      std::memcpy(chunk.data(), &h, sizeof(h));
      if (!(*conn)->Send(protocols::MessageType::kKvData, chunk).ok()) break;
    }
    // Shut down once the first chunks were staged, the rest still in flight.
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    while (recv_side->staged_bytes() == 0 && Clock::now() < deadline) std::this_thread::yield();
    EXPECT_GT(recv_side->staged_bytes(), 0) << "round " << round;
    recv_side.reset();
    EXPECT_NE((*conn)->WaitClosed(Deadline::AfterMs(5000)).code(), StatusCode::kDeadlineExceeded);
  }
}

TEST(TcpTransport, SendWithoutConnectionIsRefused) {
  TcpTransport::Options o;
  o.cluster_key = TestKey();
  auto t = std::move(TcpTransport::Create(o)).value();
  std::vector<uint8_t> src(64, 1);
  auto s = t->PostSend(Desc(1, 1, 0, src, 1, 1, 1, 32, 0, 1));
  EXPECT_EQ(s.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.status().message().find("ConnectPeer"), std::string::npos);
}

}  // namespace
}  // namespace kvrelay::kv_transfer
