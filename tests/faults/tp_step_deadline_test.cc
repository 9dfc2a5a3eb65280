// The step deadline inside a TP group (decode_worker/tp_group.h, issue #14):
// a collective waits for a follower at most TpGroupOptions::timeout (the
// workers' --tp-step-timeout-ms), and a collective that failed breaks the
// group for good (the ranks are at different points of the step), so rank 0
// reports it at once instead of stepping on. No model needed.
#include <gtest/gtest.h>

#include <thread>

#include "decode_worker/tp_group.h"

namespace kvrelay::decode_worker {
namespace {

using std::chrono::milliseconds;

struct Pair {
  std::unique_ptr<TcpTpGroup> leader, follower;
};

// A formed group of 2 over loopback, every wait bounded by `timeout`.
Pair Form(milliseconds timeout) {
  auto key = std::move(protocols::ClusterKey::Generate()).value();
  TpGroupOptions o;
  o.tp_size = 2;
  o.timeout = timeout;
  o.cluster_key = key;
  Pair p;
  p.leader = std::move(TcpTpGroup::Listen(o)).value();
  o.tp_rank = 1;
  o.leader_port = p.leader->port();
  Result<std::vector<std::string>> hellos = InvalidArgument("not run");
  std::thread accept([&] {
    hellos = p.leader->Accept(
        Deadline::AfterMs(10000),
        [](const std::string&) -> Result<TcpTpGroup::SetupAnswer> {
          return TcpTpGroup::SetupAnswer{1, "setup"};
        },
        [](const Status& s) { return s.message(); });
  });
  auto f = TcpTpGroup::Connect(o, "hello", Deadline::AfterMs(10000));
  accept.join();
  EXPECT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_TRUE(hellos.ok()) << hellos.status().ToString();
  if (f.ok()) {
    p.follower = std::move(*f);
    auto setup = p.follower->ReceiveFromLeader(Deadline::AfterMs(5000));
    EXPECT_TRUE(setup.ok() && setup->type == TpMsg::kSetup);
  }
  return p;
}

TEST(TpStepDeadline, ASilentFollowerFailsTheStepWithinTheDeadlineAndBreaksTheGroup) {
  Pair g = Form(milliseconds(300));
  ASSERT_NE(g.follower, nullptr);
  // A step both ranks take part in works.
  {
    float mine = 1, theirs = 2, out_leader[2] = {}, out_follower[2] = {};
    std::thread t([&] { ASSERT_TRUE(g.follower->AllGather(&theirs, 1, out_follower, 2).ok()); });
    ASSERT_TRUE(g.leader->AllGather(&mine, 1, out_leader, 2).ok());
    t.join();
    EXPECT_EQ(out_leader[1], 2);
    EXPECT_EQ(out_follower[0], 1);
  }
  // The follower stops answering (as SIGSTOPped): rank 0's next step fails
  // at its deadline, not at the 30 s the group used before.
  float x = 1, out[2];
  const auto start = std::chrono::steady_clock::now();
  Status s = g.leader->AllGather(&x, 1, out, 2);
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_GE(took, milliseconds(290));
  EXPECT_LT(took, milliseconds(5000));
  // The group is broken from now on, and says so without waiting again.
  EXPECT_FALSE(g.leader->status().ok());
  const auto again = std::chrono::steady_clock::now();
  EXPECT_FALSE(g.leader->AllGather(&x, 1, out, 2).ok());
  EXPECT_LT(std::chrono::steady_clock::now() - again, milliseconds(100));
}

TEST(TpStepDeadline, AFollowerAnswersAPingEvenInsideACollective) {
  Pair g = Form(milliseconds(5000));
  ASSERT_NE(g.follower, nullptr);
  // Rank 0 pings, then steps; the follower meets the ping while it waits in
  // the step's collective and answers it there.
  const uint64_t seq = 7;
  std::string ping(reinterpret_cast<const char*>(&seq), sizeof(seq));
  // The pong carries the follower's KV port refusals (it has no coordinator
  // link of its own; rank 0's heartbeat reports them).
  g.follower->SetKvPortCounters([] { return protocols::PortSecurityCounters{1, 2, 3, 4}; });
  ASSERT_TRUE(g.leader->Broadcast(TpMsg::kPing, ping).ok());
  float mine = 1, theirs = 2, out_leader[2] = {}, out_follower[2] = {};
  std::thread t([&] { EXPECT_TRUE(g.follower->AllGather(&theirs, 1, out_follower, 2).ok()); });
  ASSERT_TRUE(g.leader->AllGather(&mine, 1, out_leader, 2).ok());
  t.join();
  auto pong = g.leader->PollFollowers(Deadline::AfterMs(2000));
  ASSERT_TRUE(pong.ok()) << pong.status().ToString();
  ASSERT_TRUE(pong->has_value());
  EXPECT_EQ((*pong)->first, 1);
  EXPECT_EQ((*pong)->second.type, TpMsg::kPong);
  uint64_t got = 0;
  protocols::PortSecurityCounters kv_port;
  ASSERT_TRUE(DecodePong((*pong)->second.payload, &got, &kv_port));
  EXPECT_EQ(got, seq);
  EXPECT_EQ(kv_port.auth_failures, 1u);
  EXPECT_EQ(kv_port.refused_connections, 2u);
  EXPECT_EQ(kv_port.oversized_frames, 3u);
  EXPECT_EQ(kv_port.foreign_frames, 4u);
  EXPECT_TRUE(g.leader->status().ok());
}

}  // namespace
}  // namespace kvrelay::decode_worker
