// The step deadline inside a TP group (decode_worker/tp_group.h, issue #14):
// a collective waits for a follower at most TpGroupOptions::timeout (the
// workers' --tp-step-timeout-ms), and a collective that failed breaks the
// group for good (the ranks are at different points of the step), so rank 0
// reports it at once instead of stepping on. Then the same through rank 0
// as a decode worker starts it (TpLeader::Start, a synthetic model), idle and
// mid-step.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <future>
#include <thread>

#include "decode_worker/tp_group.h"
#include "decode_worker/tp_leader.h"
#include "deploy/local_launcher.h"
#include "protocols/control.pb.h"
#include "tests/testing/synthetic_model.h"
#include "worker/worker.h"

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

// The whole of rank 0 as a decode worker starts it (TpLeader::Start from the
// worker's options, with its engine on a small model) and a follower that
// joins, then falls silent. What is tested is the wiring of
// --tp-step-timeout-ms into rank 0, not the group alone (above).
struct LeaderGroup {
  worker::WorkerOptions options;
  worker::ProcessBase base;
  std::unique_ptr<engine::Engine> engine;
  std::unique_ptr<TpLeader> leader;
  std::unique_ptr<TcpTpGroup> follower;
};

void StartLeaderGroup(LeaderGroup& g, milliseconds step_timeout) {
  testing::SyntheticModelOptions m;  // 2 KV heads: one per rank
  auto path = testing::WriteTempSyntheticModel(m);
  ASSERT_TRUE(path.ok()) << path.status().ToString();
  worker::WorkerOptions& o = g.options;
  o.worker_id = "decode-0";
  o.role = worker::RoleKind::kDecode;
  o.cluster_key = std::move(protocols::ClusterKey::Generate()).value();
  o.engine.model_path = *path;
  o.tp_size = 2;
  o.tp_rank = 0;
  o.tp_step_timeout = step_timeout;
  o.connect_timeout = milliseconds(10000);
  auto base = worker::LoadProcessBase(o);
  std::remove(path->c_str());  // loaded (mapped): the file is not needed again
  ASSERT_TRUE(base.ok()) << base.status().ToString();
  g.base = std::move(*base);
  auto engine = engine::Engine::Create(o.engine, g.base.model);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  g.engine = std::move(*engine);
  // The follower's hello as rank 1 sends it (decode_worker/tp_follower.cc).
  proto::TpHello hello;
  hello.set_tp_rank(1);
  hello.set_tp_size(2);
  protocols::PeerConfig pc = g.base.peer_config;
  pc.tp_rank = 1;
  protocols::ToProto(pc, hello.mutable_config());
  hello.set_kv_address("127.0.0.1:1");
  hello.set_data_rank(0);
  hello.set_tp_mode(static_cast<uint32_t>(o.tp_mode));
  for (int attempt = 0; attempt < 3 && g.leader == nullptr; ++attempt) {
    // Rank 0 listens on a fixed --tp-port, as the launcher gives it one.
    auto port = deploy::PickFreePort();
    ASSERT_TRUE(port.ok()) << port.status().ToString();
    o.tp_port = *port;
    Result<std::unique_ptr<TpLeader>> started = InvalidArgument("not run");
    std::thread rank0([&] {
      started = TpLeader::Start(o, g.base.peer_config, g.base.transport->conn_info(), 0,
                                g.engine.get(), nullptr);
    });
    TpGroupOptions f;
    f.tp_rank = 1;
    f.tp_size = 2;
    f.leader_port = o.tp_port;
    f.timeout = milliseconds(10000);
    f.cluster_key = o.cluster_key;
    auto joined = TcpTpGroup::Connect(f, hello.SerializeAsString(), Deadline::AfterMs(10000));
    rank0.join();
    if (!started.ok() && started.status().message().find("in use") != std::string::npos) {
      continue;  // the port was taken meanwhile: another one
    }
    ASSERT_TRUE(started.ok()) << started.status().ToString();
    ASSERT_TRUE(joined.ok()) << joined.status().ToString();
    g.leader = std::move(*started);
    g.follower = std::move(*joined);
    auto setup = g.follower->ReceiveFromLeader(Deadline::AfterMs(5000));
    ASSERT_TRUE(setup.ok() && setup->type == TpMsg::kSetup);
  }
  ASSERT_NE(g.leader, nullptr) << "no free TP port in 3 tries";
}

TEST(TpLeaderDeadline, AnIdleGroupDropsASilentFollowerWithinTheStepTimeout) {
  LeaderGroup g;
  ASSERT_NO_FATAL_FAILURE(StartLeaderGroup(g, milliseconds(400)));
  ASSERT_TRUE(g.leader->status().ok());
  // The follower answers nothing from now on (SIGSTOPped). Rank 0's loop
  // calls CheckFollowers every turn; it must give up on the follower within
  // about 1.25 x the step timeout, not before the timeout.
  const auto start = std::chrono::steady_clock::now();
  const Deadline give_up = Deadline::AfterMs(10000);
  while (g.leader->status().ok() && !give_up.Expired()) {
    g.leader->CheckFollowers();
    std::this_thread::sleep_for(milliseconds(10));  // the worker loop's turn
  }
  const auto took = std::chrono::steady_clock::now() - start;
  const Status s = g.leader->status();
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.ToString();
  EXPECT_NE(s.message().find("--tp-step-timeout-ms"), std::string::npos) << s.ToString();
  EXPECT_GE(took, milliseconds(400));
  EXPECT_LT(took, milliseconds(3000)) << "a silent follower kept the group for "
                                      << std::chrono::duration<double>(took).count() << " s";
}

TEST(TpLeaderDeadline, AStepWithASilentFollowerEndsWithinTheStepTimeout) {
  LeaderGroup g;
  ASSERT_NO_FATAL_FAILURE(StartLeaderGroup(g, milliseconds(400)));
  engine::RequestSpec r;
  r.id = 1;
  r.prompt = {1, 2, 3, 4, 5};
  r.sampling.max_tokens = 4;
  ASSERT_TRUE(g.engine->Submit(r).ok());
  // Rank 0 publishes the step's plan and meets the follower in the step's
  // first collective, which never comes: the step must fail at the step
  // timeout. Run on its own thread so that a step that never ends is
  // reported as such instead of hanging the suite.
  const auto start = std::chrono::steady_clock::now();
  auto step = std::async(std::launch::async, [&] { return g.engine->Step(); });
  if (step.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    ADD_FAILURE() << "a step with a silent TP follower did not end within 10 s "
                     "(--tp-step-timeout-ms 400)";
    std::fflush(nullptr);
    std::_Exit(1);  // the step thread cannot be joined
  }
  const auto took = std::chrono::steady_clock::now() - start;
  Result<std::vector<engine::TokenEvent>> events = step.get();
  bool failed = !events.ok();
  if (events.ok()) {
    for (const auto& e : *events) {
      if (e.id == r.id && e.finish_reason == engine::FinishReason::kError) failed = true;
    }
  }
  EXPECT_TRUE(failed) << "the step went on without the follower";
  EXPECT_FALSE(g.leader->status().ok());
  EXPECT_GE(took, milliseconds(400));
  EXPECT_LT(took, milliseconds(3000));
}

}  // namespace
}  // namespace kvrelay::decode_worker
