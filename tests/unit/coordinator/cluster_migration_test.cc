// Request migration (issue #39): a request whose decode worker is lost
// mid-answer continues on another one as a new prefill of its prompt plus the
// tokens already streamed, on the same client stream. Real TCP on 127.0.0.1
// to a real ClusterBackend; the workers are driven frame by frame
// (control_peer.h).
#include <gtest/gtest.h>

#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/cluster/cluster_backend.h"
#include "tests/unit/coordinator/control_peer.h"

namespace kvrelay::coordinator {
namespace {

using protocols::MessageType;
using testing::CollectedEvents;
using testing::ControlPeer;

constexpr uint64_t kId = 1;

class ClusterMigrationTest : public testing::ClusterBackendTest {
 protected:
  void StartBackend(int migration_limit,
                    std::chrono::milliseconds worker_wait = std::chrono::milliseconds(0)) {
    ClusterBackendTest::StartBackend([&](ClusterBackendOptions& o) {
      o.worker_wait = worker_wait;
      o.migration_limit = migration_limit;
    });
  }

  static GenerationRequest Request() {
    GenerationRequest req;
    req.id = kId;
    req.prompt = {11, 12, 13, 14, 15};
    req.sampling.max_tokens = 8;
    req.sampling.seed = 42;
    return req;
  }

  std::unique_ptr<ControlPeer> Join(const std::string& id, proto::WorkerRole role, uint32_t rank) {
    auto peer = std::make_unique<ControlPeer>(io_, port());
    Status s = peer->Join(key_, id, role, rank);
    EXPECT_TRUE(s.ok()) << id << ": " << s.ToString();
    return peer;
  }

  // Plays the request's reservation and prefill through `decode` and
  // `prefill`: the prefill's first token is `first`. Returns the prefill task
  // (its prompt and sampling, as the coordinator sent them).
  static proto::PrefillTask Prefill(ControlPeer& decode, ControlPeer& prefill, int32_t first) {
    proto::ReserveBlocks reserve;
    EXPECT_TRUE(decode.Expect(MessageType::kReserveBlocks, &reserve).ok());
    EXPECT_EQ(reserve.request_id(), kId);
    proto::PrefillTask task;
    EXPECT_TRUE(prefill.Expect(MessageType::kPrefillTask, &task).ok());
    EXPECT_EQ(task.request_id(), kId);
    // The decode side reserved for the same prompt as the prefill computes.
    EXPECT_EQ(
        std::vector<int32_t>(reserve.prompt_token_ids().begin(), reserve.prompt_token_ids().end()),
        std::vector<int32_t>(task.prompt_token_ids().begin(), task.prompt_token_ids().end()));
    EXPECT_EQ(reserve.sampling().max_tokens(), task.sampling().max_tokens());
    // Both ends name this attempt's KV streams alike.
    EXPECT_NE(task.kv_transfer_id(), 0u);
    EXPECT_EQ(reserve.kv_transfer_id(), task.kv_transfer_id());
    proto::PrefillDone done;
    done.set_request_id(kId);
    done.set_first_token(first);
    done.set_prompt_tokens(static_cast<uint32_t>(task.prompt_token_ids_size()));
    EXPECT_TRUE(prefill.Send(MessageType::kPrefillDone, done).ok());
    return task;
  }

  static void Stream(ControlPeer& decode, const std::vector<int32_t>& tokens) {
    proto::TokenChunk chunk;
    auto* entry = chunk.add_entries();
    entry->set_request_id(kId);
    for (int32_t t : tokens) entry->add_token_ids(t);
    EXPECT_TRUE(decode.Send(MessageType::kTokenChunk, chunk).ok());
  }

  static void Finish(ControlPeer& decode) {
    proto::Finish fin;
    fin.set_request_id(kId);
    fin.set_reason(proto::Finish::REASON_LENGTH);
    EXPECT_TRUE(decode.Send(MessageType::kFinish, fin).ok());
  }

  // The first attempt under way: prefill-0 (prefill_) and decode-0 joined,
  // the request submitted, decode-0 asked to reserve its blocks and
  // prefill-0 given the task (*task). Returns decode-0, or null (a failure
  // recorded) when a step did not happen.
  std::unique_ptr<ControlPeer> StartFirstAttempt(CollectedEvents& events,
                                                 proto::PrefillTask* task) {
    prefill_ = Join("prefill-0", proto::WORKER_ROLE_PREFILL, 10);
    auto decode0 = Join("decode-0", proto::WORKER_ROLE_DECODE, 20);
    proto::ReserveBlocks reserve;
    const bool ok = backend_->Submit(Request(), events.Sink()).ok() &&
                    decode0->Expect(MessageType::kReserveBlocks, &reserve).ok() &&
                    prefill_->Expect(MessageType::kPrefillTask, task).ok();
    EXPECT_TRUE(ok) << "the first attempt did not reach both workers";
    return ok ? std::move(decode0) : nullptr;
  }

  // decode-0 takes the request, streams 100, 101, 102 (they reach the
  // client), then decode-1 registers (unless !other) and decode-0's
  // connection drops.
  void StreamThreeThenLoseDecode0(CollectedEvents& events, bool other = true) {
    prefill_ = Join("prefill-0", proto::WORKER_ROLE_PREFILL, 10);
    auto decode0 = Join("decode-0", proto::WORKER_ROLE_DECODE, 20);
    ASSERT_TRUE(backend_->Submit(Request(), events.Sink()).ok());
    const proto::PrefillTask first = Prefill(*decode0, *prefill_, 100);
    first_transfer_id_ = first.kv_transfer_id();
    EXPECT_EQ(first.prompt_token_ids_size(), 5);
    EXPECT_EQ(first.sampling().max_tokens(), 8u);
    Stream(*decode0, {101, 102});
    ASSERT_TRUE(events.WaitTokens(3, Deadline::AfterMs(5000)));
    if (other) decode1_ = Join("decode-1", proto::WORKER_ROLE_DECODE, 21);
    decode0.reset();  // its connection closes: the coordinator drops it
  }

  // The request ended by its length with all 8 tokens, 100..107, in order.
  static void ExpectWholeAnswer(CollectedEvents& events) {
    ASSERT_TRUE(events.WaitFinished(Deadline::AfterMs(5000)));
    EXPECT_EQ(events.Last().finish_reason, FinishReason::kLength) << events.Last().error.ToString();
    EXPECT_EQ(events.Tokens(), (std::vector<int32_t>{100, 101, 102, 103, 104, 105, 106, 107}));
  }

  CollectedEvents& NewEvents() { return events_.emplace_back(); }

  // Waits until the backend counted `n` control messages "direction type".
  bool WaitForMessages(const std::string& what, double n) {
    const Deadline d = Deadline::AfterMs(5000);
    while (!d.Expired()) {
      for (const BackendMetric& c : backend_->Counters()) {
        if (c.name != "kvrelay_control_messages_total") continue;
        std::map<std::string, std::string> l(c.labels.begin(), c.labels.end());
        if (l["direction"] + " " + l["type"] == what && c.value >= n) return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));  // a poll, bounded by d
    }
    return false;
  }

  // Waits until kvrelay_cluster_requests counts `n` requests in each phase
  // of `want` (every other phase 0); false with the last counts in *seen.
  bool WaitForPhases(const std::map<std::string, double>& want,
                     std::map<std::string, double>* seen) {
    const Deadline d = Deadline::AfterMs(5000);
    while (!d.Expired()) {
      seen->clear();
      for (const BackendMetric& g : backend_->Gauges()) {
        if (g.name != "kvrelay_cluster_requests") continue;
        std::map<std::string, std::string> l(g.labels.begin(), g.labels.end());
        (*seen)[l["phase"]] = g.value;
      }
      std::map<std::string, double> full = {
          {"waiting", 0}, {"prefilling", 0}, {"handing_over", 0}, {"decoding", 0}};
      for (const auto& [phase, n] : want) full[phase] = n;
      if (*seen == full) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));  // a poll, bounded by d
    }
    return false;
  }

  // The old behaviour: the request ends in the loss of decode-0, with the
  // three tokens it had streamed, and nothing was migrated.
  void ExpectFailedAsBefore(CollectedEvents& events) {
    ASSERT_TRUE(events.WaitFinished(Deadline::AfterMs(5000)));
    const TokenEvent last = events.Last();
    EXPECT_EQ(last.finish_reason, FinishReason::kError);
    EXPECT_EQ(last.error.code(), StatusCode::kUnavailable) << last.error.ToString();
    EXPECT_NE(last.error.message().find("worker decode-0 was lost"), std::string::npos)
        << last.error.ToString();
    EXPECT_EQ(events.Tokens(), (std::vector<int32_t>{100, 101, 102}));
    EXPECT_EQ(backend_->requests_migrated(), 0u);
  }

  protocols::IoThread io_{"migration-test-io"};
  std::deque<CollectedEvents> events_;  // read until TearDown shut the backend down
  std::unique_ptr<ControlPeer> prefill_, decode1_;
  uint64_t first_transfer_id_ = 0;
};

// The client's stream goes on after its decode worker died: the tokens it had
// are re-prefilled after the prompt on another worker for the tokens left,
// and the rest reach the same sink; no error, no repeat, no gap, usage of
// the client's own prompt.
TEST_F(ClusterMigrationTest, ALostDecodeWorkersRequestContinuesOnAnother) {
  StartBackend(/*migration_limit=*/3);
  CollectedEvents& events = NewEvents();
  StreamThreeThenLoseDecode0(events);
  const proto::PrefillTask again = Prefill(*decode1_, *prefill_, 103);
  EXPECT_EQ(std::vector<int32_t>(again.prompt_token_ids().begin(), again.prompt_token_ids().end()),
            (std::vector<int32_t>{11, 12, 13, 14, 15, 100, 101, 102}));
  EXPECT_EQ(again.sampling().max_tokens(), 5u);  // 8 less the 3 sent
  // The seed after a move is derived, and documented as such.
  EXPECT_EQ(again.sampling().seed(), MigratedSeed(42, 3, 1));
  // Its KV streams are not the first attempt's: a cancelled receive of those
  // (whose late bytes the decode side drops) cannot swallow the new ones.
  EXPECT_NE(again.kv_transfer_id(), first_transfer_id_);
  Stream(*decode1_, {104, 105, 106, 107});
  Finish(*decode1_);
  ASSERT_TRUE(events.WaitFinished(Deadline::AfterMs(5000)));
  const TokenEvent last = events.Last();
  EXPECT_EQ(last.finish_reason, FinishReason::kLength) << last.error.ToString();
  EXPECT_TRUE(last.error.ok()) << last.error.ToString();
  EXPECT_EQ(events.Tokens(), (std::vector<int32_t>{100, 101, 102, 103, 104, 105, 106, 107}));
  {
    std::lock_guard lock(events.mu);
    for (const TokenEvent& e : events.got) {
      EXPECT_EQ(e.prompt_tokens, 5);  // never the re-prefill's 8
      EXPECT_NE(e.finish_reason, FinishReason::kError) << e.error.ToString();
    }
  }
  EXPECT_EQ(backend_->requests_migrated(), 1u);
  bool exported = false;
  for (const BackendMetric& c : backend_->Counters()) {
    if (c.name == "kvrelay_requests_migrated_total") {
      exported = true;
      EXPECT_EQ(c.value, 1.0);
    }
  }
  EXPECT_TRUE(exported);
}

// --migration-limit 0: the request fails as before the change.
TEST_F(ClusterMigrationTest, WithLimitZeroTheRequestFailsAsBefore) {
  StartBackend(/*migration_limit=*/0);
  CollectedEvents& events = NewEvents();
  StreamThreeThenLoseDecode0(events);
  ExpectFailedAsBefore(events);
}

// --migration-limit 1: the second loss fails the request, although a third
// decode worker could take it.
TEST_F(ClusterMigrationTest, ASecondLossPastTheLimitFails) {
  StartBackend(/*migration_limit=*/1);
  CollectedEvents& events = NewEvents();
  StreamThreeThenLoseDecode0(events);
  Prefill(*decode1_, *prefill_, 103);
  Stream(*decode1_, {104});
  ASSERT_TRUE(events.WaitTokens(5, Deadline::AfterMs(5000)));
  auto decode2 = Join("decode-2", proto::WORKER_ROLE_DECODE, 22);
  decode1_.reset();
  ASSERT_TRUE(events.WaitFinished(Deadline::AfterMs(5000)));
  const TokenEvent last = events.Last();
  EXPECT_EQ(last.finish_reason, FinishReason::kError);
  EXPECT_NE(last.error.message().find("worker decode-1 was lost"), std::string::npos)
      << last.error.ToString();
  EXPECT_EQ(events.Tokens(), (std::vector<int32_t>{100, 101, 102, 103, 104}));
  EXPECT_EQ(backend_->requests_migrated(), 1u);
}

// With no other decode worker registered the request fails at once, as
// before: a client mid-answer is not held for a worker to (re)register, even
// with a long --worker-wait-ms (that wait is for requests not yet started).
TEST_F(ClusterMigrationTest, WithNoWorkerWaitAndNoOtherWorkerItFailsAtOnce) {
  StartBackend(/*migration_limit=*/3, /*worker_wait=*/std::chrono::milliseconds(0));
  CollectedEvents& events = NewEvents();
  StreamThreeThenLoseDecode0(events, /*other=*/false);
  ExpectFailedAsBefore(events);
}

// With no other decode worker registered (the only one was dropped while
// stalled, or its TP group restarts), the request waits --worker-wait-ms for
// one, its client's stream held open, and continues on the worker that
// registers: here decode-0 itself, back under the same name.
TEST_F(ClusterMigrationTest, WithNoOtherWorkerItWaitsForOneToRegister) {
  StartBackend(/*migration_limit=*/3, /*worker_wait=*/std::chrono::milliseconds(60000));
  CollectedEvents& events = NewEvents();
  StreamThreeThenLoseDecode0(events, /*other=*/false);
  // The loss is handled (a frame after it on another connection is
  // answered) and the request neither failed nor moved.
  auto probe = Join("prefill-1", proto::WORKER_ROLE_PREFILL, 11);
  EXPECT_FALSE(events.Finished()) << "it failed at once, as before waiting";
  EXPECT_EQ(backend_->requests_migrated(), 0u);
  probe.reset();
  auto back = Join("decode-0", proto::WORKER_ROLE_DECODE, 20);
  const proto::PrefillTask again = Prefill(*back, *prefill_, 103);
  EXPECT_EQ(std::vector<int32_t>(again.prompt_token_ids().begin(), again.prompt_token_ids().end()),
            (std::vector<int32_t>{11, 12, 13, 14, 15, 100, 101, 102}));
  EXPECT_EQ(again.sampling().max_tokens(), 5u);
  Stream(*back, {104, 105, 106, 107});
  Finish(*back);
  ExpectWholeAnswer(events);
  EXPECT_EQ(backend_->requests_migrated(), 1u);
}

// A TP group that loses a rank mid-step leaves (WorkerLeaving) and then
// fails the step's requests with the fault (DEADLINE_EXCEEDED from its TP
// link): they move on to another decode worker, not back to the leaving
// group. An error that is the request's own (INVALID_ARGUMENT) is not moved.
TEST_F(ClusterMigrationTest, AFailedTpGroupsRequestMovesOn) {
  StartBackend(/*migration_limit=*/3);
  prefill_ = Join("prefill-0", proto::WORKER_ROLE_PREFILL, 10);
  auto decode0 = Join("decode-0", proto::WORKER_ROLE_DECODE, 20);
  CollectedEvents& events = NewEvents();
  ASSERT_TRUE(backend_->Submit(Request(), events.Sink()).ok());
  proto::ReserveBlocks reserve;
  ASSERT_TRUE(decode0->Expect(MessageType::kReserveBlocks, &reserve).ok());
  decode1_ = Join("decode-1", proto::WORKER_ROLE_DECODE, 21);
  ControlPeer* group = decode0.get();
  ControlPeer* other = decode1_.get();
  const std::string group_id = "decode-0";
  proto::PrefillTask task;
  ASSERT_TRUE(prefill_->Expect(MessageType::kPrefillTask, &task).ok());
  proto::PrefillDone done;
  done.set_request_id(kId);
  done.set_first_token(100);
  done.set_prompt_tokens(5);
  done.set_kv_transfer_id(task.kv_transfer_id());
  ASSERT_TRUE(prefill_->Send(MessageType::kPrefillDone, done).ok());
  Stream(*group, {101, 102});
  ASSERT_TRUE(events.WaitTokens(3, Deadline::AfterMs(5000)));
  proto::WorkerLeaving leaving;
  leaving.set_worker_id(group_id);
  leaving.set_reason("DEADLINE_EXCEEDED: TP link: peer did not answer in time");
  ASSERT_TRUE(group->Send(MessageType::kWorkerLeaving, leaving).ok());
  proto::Finish fin;
  fin.set_request_id(kId);
  fin.set_reason(proto::Finish::REASON_ERROR);
  fin.set_status_code(static_cast<uint32_t>(StatusCode::kDeadlineExceeded));
  fin.set_message("attention: collective with TP rank 1: TP link: peer did not answer in time");
  fin.set_kv_transfer_id(task.kv_transfer_id());
  ASSERT_TRUE(group->Send(MessageType::kFinish, fin).ok());
  const proto::PrefillTask again = Prefill(*other, *prefill_, 103);
  EXPECT_EQ(again.prompt_token_ids_size(), 8);
  EXPECT_EQ(again.decode().worker_id(), "decode-1");
  Stream(*other, {104, 105, 106, 107});
  Finish(*other);
  ExpectWholeAnswer(events);
  EXPECT_EQ(backend_->requests_migrated(), 1u);

  // A second request fails on the other worker with an error of its own.
  CollectedEvents& second = NewEvents();
  GenerationRequest req = Request();
  req.id = kId + 1;
  ASSERT_TRUE(backend_->Submit(req, second.Sink()).ok());
  ASSERT_TRUE(other->Expect(MessageType::kReserveBlocks, &reserve).ok());
  ASSERT_TRUE(prefill_->Expect(MessageType::kPrefillTask, &task).ok());
  done.set_request_id(kId + 1);
  done.set_kv_transfer_id(task.kv_transfer_id());
  ASSERT_TRUE(prefill_->Send(MessageType::kPrefillDone, done).ok());
  fin.set_request_id(kId + 1);
  fin.set_status_code(static_cast<uint32_t>(StatusCode::kInvalidArgument));
  fin.set_message("logit_bias names token 99999, out of the vocabulary");
  fin.set_kv_transfer_id(task.kv_transfer_id());
  ASSERT_TRUE(other->Send(MessageType::kFinish, fin).ok());
  ASSERT_TRUE(second.WaitFinished(Deadline::AfterMs(5000)));
  EXPECT_EQ(second.Last().error.code(), StatusCode::kInvalidArgument)
      << second.Last().error.ToString();
  EXPECT_EQ(backend_->requests_migrated(), 1u);
}

// A request moving on after a fault prefers workers other than the pair of
// the attempt that failed (a path stuck between those two): here the
// prefill side's "no progress to the decode rank" moves it from
// prefill-0 / decode-0 to prefill-1 / decode-1.
TEST_F(ClusterMigrationTest, AMovedRequestAvoidsThePairThatFailed) {
  StartBackend(/*migration_limit=*/3);
  CollectedEvents& events = NewEvents();
  proto::PrefillTask task;
  auto decode0 = StartFirstAttempt(events, &task);
  ASSERT_NE(decode0, nullptr);
  auto prefill1 = Join("prefill-1", proto::WORKER_ROLE_PREFILL, 11);
  decode1_ = Join("decode-1", proto::WORKER_ROLE_DECODE, 21);
  // The newcomers look busier than the failed pair, so only the avoidance
  // (not the load) sends the request to them.
  proto::Heartbeat busy;
  busy.set_worker_id("prefill-1");
  busy.set_queued_tokens(100000);
  busy.set_capacity_blocks(1000);
  busy.set_free_blocks(1000);
  ASSERT_TRUE(prefill1->Send(MessageType::kHeartbeat, busy).ok());
  busy.set_worker_id("decode-1");
  busy.set_queued_tokens(0);
  busy.set_free_blocks(2);
  busy.set_running_requests(50);
  ASSERT_TRUE(decode1_->Send(MessageType::kHeartbeat, busy).ok());
  ASSERT_TRUE(WaitForMessages("received Heartbeat", 2));
  proto::Finish fin;
  fin.set_request_id(kId);
  fin.set_reason(proto::Finish::REASON_ERROR);
  fin.set_status_code(static_cast<uint32_t>(StatusCode::kDeadlineExceeded));
  fin.set_message("KV transfer to decode: KV of request 1 made no progress to decode rank 20");
  fin.set_kv_transfer_id(task.kv_transfer_id());
  ASSERT_TRUE(prefill_->Send(MessageType::kFinish, fin).ok());
  const proto::PrefillTask again = Prefill(*decode1_, *prefill1, 100);
  EXPECT_EQ(again.decode().worker_id(), "decode-1");
  Stream(*decode1_, {101, 102, 103, 104, 105, 106, 107});
  Finish(*decode1_);
  ExpectWholeAnswer(events);
}

// A corrupt KV chunk found before the PrefillDone reached the coordinator
// (the decode side's DATA_LOSS overtook it): nothing reached the client, so
// the request runs again from its prompt; the first attempt's PrefillDone,
// arriving late on the same prefill worker, is not taken for the second's.
TEST_F(ClusterMigrationTest, ACorruptChunkBeforeThePrefillDoneIsRunAgain) {
  StartBackend(/*migration_limit=*/3);
  CollectedEvents& events = NewEvents();
  proto::PrefillTask task;
  auto decode0 = StartFirstAttempt(events, &task);
  ASSERT_NE(decode0, nullptr);
  proto::Finish fin;
  fin.set_request_id(kId);
  fin.set_reason(proto::Finish::REASON_ERROR);
  fin.set_status_code(static_cast<uint32_t>(StatusCode::kDataLoss));
  fin.set_message("receiving KV: request 1 layer 2: checksum mismatch in block 0");
  fin.set_kv_transfer_id(task.kv_transfer_id());  // the reservation names the same id
  ASSERT_TRUE(decode0->Send(MessageType::kFinish, fin).ok());
  proto::Cancel cancel;
  ASSERT_TRUE(prefill_->Expect(MessageType::kCancel, &cancel).ok());
  proto::ReserveBlocks reserve2;
  ASSERT_TRUE(decode0->Expect(MessageType::kReserveBlocks, &reserve2).ok());
  proto::PrefillTask task2;
  ASSERT_TRUE(prefill_->Expect(MessageType::kPrefillTask, &task2).ok());
  EXPECT_EQ(task2.prompt_token_ids_size(), 5);  // nothing carried
  EXPECT_NE(task2.kv_transfer_id(), task.kv_transfer_id());
  proto::PrefillDone stale;  // (its token differs only to tell them apart)
  stale.set_request_id(kId);
  stale.set_first_token(99);
  stale.set_prompt_tokens(5);
  stale.set_kv_transfer_id(task.kv_transfer_id());
  ASSERT_TRUE(prefill_->Send(MessageType::kPrefillDone, stale).ok());
  proto::PrefillDone done = stale;
  done.set_first_token(100);
  done.set_kv_transfer_id(task2.kv_transfer_id());
  ASSERT_TRUE(prefill_->Send(MessageType::kPrefillDone, done).ok());
  Stream(*decode0, {101, 102, 103, 104, 105, 106, 107});
  Finish(*decode0);
  ExpectWholeAnswer(events);
}

// A request under a JSON schema is not moved: the grammar's state on a new
// worker would start from the schema's beginning, not from the tokens sent.
TEST_F(ClusterMigrationTest, AJsonSchemaRequestIsNotMoved) {
  StartBackend(/*migration_limit=*/3);
  prefill_ = Join("prefill-0", proto::WORKER_ROLE_PREFILL, 10);
  auto decode0 = Join("decode-0", proto::WORKER_ROLE_DECODE, 20);
  CollectedEvents& events = NewEvents();
  GenerationRequest req = Request();
  req.sampling.json_schema = R"({"type":"object"})";
  ASSERT_TRUE(backend_->Submit(req, events.Sink()).ok());
  Prefill(*decode0, *prefill_, 100);
  ASSERT_TRUE(events.WaitTokens(1, Deadline::AfterMs(5000)));
  decode1_ = Join("decode-1", proto::WORKER_ROLE_DECODE, 21);
  decode0.reset();
  ASSERT_TRUE(events.WaitFinished(Deadline::AfterMs(5000)));
  EXPECT_NE(events.Last().error.message().find("worker decode-0 was lost"), std::string::npos)
      << events.Last().error.ToString();
  EXPECT_EQ(backend_->requests_migrated(), 0u);
}

// The decode worker sent the last allowed token and died before its Finish:
// nothing is left to generate, so the stream ends (length) without a move.
TEST_F(ClusterMigrationTest, ALossAfterTheLastTokenEndsTheStream) {
  StartBackend(/*migration_limit=*/3);
  prefill_ = Join("prefill-0", proto::WORKER_ROLE_PREFILL, 10);
  auto decode0 = Join("decode-0", proto::WORKER_ROLE_DECODE, 20);
  CollectedEvents& events = NewEvents();
  ASSERT_TRUE(backend_->Submit(Request(), events.Sink()).ok());
  Prefill(*decode0, *prefill_, 100);
  Stream(*decode0, {101, 102, 103, 104, 105, 106, 107});
  ASSERT_TRUE(events.WaitTokens(8, Deadline::AfterMs(5000)));
  decode0.reset();
  ASSERT_TRUE(events.WaitFinished(Deadline::AfterMs(5000)));
  EXPECT_EQ(events.Last().finish_reason, FinishReason::kLength) << events.Last().error.ToString();
  EXPECT_EQ(events.Tokens().size(), 8u);
  EXPECT_EQ(backend_->requests_migrated(), 0u);
}

// One hop: the prefill task leaves with the reservation (Prefill above sends
// no ReserveBlocksReply), and the decode side hears nothing more from the
// coordinator: the first token reaches it with the KV. A request costs two
// messages out and, before its tokens, one in (counted from the frames,
// kvrelay_control_messages_total).
TEST_F(ClusterMigrationTest, ARequestIsTwoMessagesOutAndOneBackBeforeItsTokens) {
  StartBackend(/*migration_limit=*/3);
  prefill_ = Join("prefill-0", proto::WORKER_ROLE_PREFILL, 10);
  auto decode0 = Join("decode-0", proto::WORKER_ROLE_DECODE, 20);
  CollectedEvents& events = NewEvents();
  ASSERT_TRUE(backend_->Submit(Request(), events.Sink()).ok());
  Prefill(*decode0, *prefill_, 100);
  Stream(*decode0, {101, 102, 103, 104, 105, 106, 107});
  Finish(*decode0);
  ASSERT_TRUE(events.WaitFinished(Deadline::AfterMs(5000)));
  std::map<std::string, double> seen;
  for (const BackendMetric& c : backend_->Counters()) {
    if (c.name != "kvrelay_control_messages_total") continue;
    std::map<std::string, std::string> l(c.labels.begin(), c.labels.end());
    if (l["type"] == "Heartbeat" || l["type"] == "RegisterReply") continue;
    seen[l["direction"] + " " + l["type"]] = c.value;
  }
  EXPECT_EQ(seen, (std::map<std::string, double>{{"sent ReserveBlocks", 1},
                                                 {"sent PrefillTask", 1},
                                                 {"received PrefillDone", 1},
                                                 {"received TokenChunk", 1},
                                                 {"received Finish", 1}}));
}

// The coordinator's per-phase gauge follows one request through its life:
// waiting for a worker, prefilling, handing over, decoding, gone.
TEST_F(ClusterMigrationTest, ThePhaseGaugeFollowsTheRequest) {
  StartBackend(/*migration_limit=*/3, /*worker_wait=*/std::chrono::milliseconds(60000));
  std::map<std::string, double> seen;
  auto expect = [&](const std::map<std::string, double>& want, const char* when) {
    EXPECT_TRUE(WaitForPhases(want, &seen))
        << when << ": waiting " << seen["waiting"] << ", prefilling " << seen["prefilling"]
        << ", handing_over " << seen["handing_over"] << ", decoding " << seen["decoding"];
  };
  expect({}, "before any request");
  CollectedEvents& events = NewEvents();
  ASSERT_TRUE(backend_->Submit(Request(), events.Sink()).ok());
  expect({{"waiting", 1}}, "with no worker registered");
  prefill_ = Join("prefill-0", proto::WORKER_ROLE_PREFILL, 10);
  auto decode0 = Join("decode-0", proto::WORKER_ROLE_DECODE, 20);
  proto::ReserveBlocks reserve;
  ASSERT_TRUE(decode0->Expect(MessageType::kReserveBlocks, &reserve).ok());
  proto::PrefillTask task;
  ASSERT_TRUE(prefill_->Expect(MessageType::kPrefillTask, &task).ok());
  expect({{"prefilling", 1}}, "after the prefill task went out");
  proto::PrefillDone done;
  done.set_request_id(kId);
  done.set_first_token(100);
  done.set_prompt_tokens(5);
  ASSERT_TRUE(prefill_->Send(MessageType::kPrefillDone, done).ok());
  expect({{"handing_over", 1}}, "after the PrefillDone");
  Stream(*decode0, {101});
  expect({{"decoding", 1}}, "after the decode side's first tokens");
  Stream(*decode0, {102, 103, 104, 105, 106, 107});
  Finish(*decode0);
  ASSERT_TRUE(events.WaitFinished(Deadline::AfterMs(5000)));
  expect({}, "after the Finish");
}

// A refused reservation is the decode side's only reply, and it cancels the
// prefill already under way.
TEST_F(ClusterMigrationTest, ARefusedReservationCancelsThePrefillUnderWay) {
  StartBackend(/*migration_limit=*/3);
  CollectedEvents& events = NewEvents();
  proto::PrefillTask task;
  auto decode0 = StartFirstAttempt(events, &task);
  ASSERT_NE(decode0, nullptr);
  EXPECT_FALSE(task.decode().ranks().empty());
  proto::ReserveBlocksReply refuse;
  refuse.set_request_id(kId);
  refuse.set_ok(false);
  refuse.set_reason("RESOURCE_EXHAUSTED: no free KV blocks");
  ASSERT_TRUE(decode0->Send(MessageType::kReserveBlocksReply, refuse).ok());
  proto::Cancel cancel;
  ASSERT_TRUE(prefill_->Expect(MessageType::kCancel, &cancel).ok());
  EXPECT_EQ(cancel.request_id(), kId);
  ASSERT_TRUE(events.WaitFinished(Deadline::AfterMs(5000)));
  EXPECT_EQ(events.Last().error.code(), StatusCode::kResourceExhausted)
      << events.Last().error.ToString();
  EXPECT_NE(events.Last().error.message().find("no free KV blocks"), std::string::npos);
}

// A reservation refused for a fault of the decode worker's KV path (its
// data connection from the prefill peer had just dropped: "peer 0 is gone")
// is run again, not failed.
TEST_F(ClusterMigrationTest, AReservationRefusedForAKvPathFaultIsRunAgain) {
  StartBackend(/*migration_limit=*/3);
  CollectedEvents& events = NewEvents();
  proto::PrefillTask task;
  auto decode0 = StartFirstAttempt(events, &task);
  ASSERT_NE(decode0, nullptr);
  proto::ReserveBlocksReply refuse;
  refuse.set_request_id(kId);
  refuse.set_ok(false);
  refuse.set_reason("UNAVAILABLE: peer 0 is gone");
  refuse.set_status_code(static_cast<uint32_t>(StatusCode::kUnavailable));
  ASSERT_TRUE(decode0->Send(MessageType::kReserveBlocksReply, refuse).ok());
  proto::Cancel cancel;
  ASSERT_TRUE(prefill_->Expect(MessageType::kCancel, &cancel).ok());
  // The same pair again (no other), as a new attempt.
  const proto::PrefillTask again = Prefill(*decode0, *prefill_, 100);
  EXPECT_NE(again.kv_transfer_id(), task.kv_transfer_id());
  Stream(*decode0, {101, 102, 103, 104, 105, 106, 107});
  Finish(*decode0);
  ExpectWholeAnswer(events);
}

// The prefill worker dies after its first token reached the client but
// before the decode side reported (the KV may not have arrived): the request
// moves on from prompt + that token, and the stream goes on.
TEST_F(ClusterMigrationTest, APrefillLostDuringTheHandOverMovesTheRequest) {
  StartBackend(/*migration_limit=*/3);
  prefill_ = Join("prefill-0", proto::WORKER_ROLE_PREFILL, 10);
  auto decode0 = Join("decode-0", proto::WORKER_ROLE_DECODE, 20);
  CollectedEvents& events = NewEvents();
  ASSERT_TRUE(backend_->Submit(Request(), events.Sink()).ok());
  Prefill(*decode0, *prefill_, 100);
  ASSERT_TRUE(events.WaitTokens(1, Deadline::AfterMs(5000)));
  auto prefill1 = Join("prefill-1", proto::WORKER_ROLE_PREFILL, 11);
  prefill_.reset();      // its connection closes: the coordinator drops it
  proto::Cancel cancel;  // the decode side lets go of the first attempt
  ASSERT_TRUE(decode0->Expect(MessageType::kCancel, &cancel).ok());
  EXPECT_EQ(cancel.request_id(), kId);
  const proto::PrefillTask again = Prefill(*decode0, *prefill1, 101);
  EXPECT_EQ(std::vector<int32_t>(again.prompt_token_ids().begin(), again.prompt_token_ids().end()),
            (std::vector<int32_t>{11, 12, 13, 14, 15, 100}));
  Stream(*decode0, {102, 103, 104, 105, 106, 107});
  Finish(*decode0);
  ExpectWholeAnswer(events);
  EXPECT_EQ(backend_->requests_migrated(), 1u);
}

// Once the decode side streams, the prefill worker no longer matters: its
// loss changes nothing for the request.
TEST_F(ClusterMigrationTest, APrefillLostAfterTheHandOverChangesNothing) {
  StartBackend(/*migration_limit=*/3);
  prefill_ = Join("prefill-0", proto::WORKER_ROLE_PREFILL, 10);
  auto decode0 = Join("decode-0", proto::WORKER_ROLE_DECODE, 20);
  CollectedEvents& events = NewEvents();
  ASSERT_TRUE(backend_->Submit(Request(), events.Sink()).ok());
  Prefill(*decode0, *prefill_, 100);
  Stream(*decode0, {101});
  ASSERT_TRUE(events.WaitTokens(2, Deadline::AfterMs(5000)));
  prefill_.reset();
  Stream(*decode0, {102, 103, 104, 105, 106, 107});
  Finish(*decode0);
  ASSERT_TRUE(events.WaitFinished(Deadline::AfterMs(5000)));
  EXPECT_EQ(events.Last().finish_reason, FinishReason::kLength) << events.Last().error.ToString();
  EXPECT_EQ(events.Tokens().size(), 8u);
  EXPECT_EQ(backend_->requests_migrated(), 0u);
}

// A hand-over that fails on the decode side (a corrupt KV chunk: DATA_LOSS)
// after the first token reached the client is run again from prompt + that
// token; with --migration-limit 0 it fails as before.
TEST_F(ClusterMigrationTest, ACorruptHandOverIsRunAgain) {
  for (const int limit : {3, 0}) {
    SCOPED_TRACE("migration limit " + std::to_string(limit));
    StartBackend(limit);
    prefill_ = Join("prefill-0", proto::WORKER_ROLE_PREFILL, 10);
    auto decode0 = Join("decode-0", proto::WORKER_ROLE_DECODE, 20);
    CollectedEvents& events = NewEvents();
    ASSERT_TRUE(backend_->Submit(Request(), events.Sink()).ok());
    first_transfer_id_ = Prefill(*decode0, *prefill_, 100).kv_transfer_id();
    ASSERT_TRUE(events.WaitTokens(1, Deadline::AfterMs(5000)));
    proto::Finish fin;
    fin.set_request_id(kId);
    fin.set_reason(proto::Finish::REASON_ERROR);
    fin.set_status_code(static_cast<uint32_t>(StatusCode::kDataLoss));
    fin.set_message("receiving KV: request 1 layer 3: checksum mismatch in block 0");
    ASSERT_TRUE(decode0->Send(MessageType::kFinish, fin).ok());
    proto::Cancel cancel;  // the prefill side drops what it still sends
    ASSERT_TRUE(prefill_->Expect(MessageType::kCancel, &cancel).ok());
    EXPECT_EQ(cancel.reason().rfind("peer failed: DATA_LOSS", 0), 0u) << cancel.reason();
    if (limit == 0) {
      ASSERT_TRUE(events.WaitFinished(Deadline::AfterMs(5000)));
      EXPECT_EQ(events.Last().error.code(), StatusCode::kDataLoss)
          << events.Last().error.ToString();
      EXPECT_EQ(backend_->requests_migrated(), 0u);
    } else {
      const proto::PrefillTask again = Prefill(*decode0, *prefill_, 101);
      EXPECT_EQ(again.prompt_token_ids_size(), 6);
      // The first attempt's own delivery failing late (before the prefill
      // side read the Cancel) says nothing about this one: ignored.
      proto::Finish stale;
      stale.set_request_id(kId);
      stale.set_reason(proto::Finish::REASON_ERROR);
      stale.set_status_code(static_cast<uint32_t>(StatusCode::kDeadlineExceeded));
      stale.set_message("KV transfer to decode: made no progress");
      stale.set_kv_transfer_id(first_transfer_id_);
      ASSERT_NE(first_transfer_id_, again.kv_transfer_id());
      ASSERT_TRUE(prefill_->Send(MessageType::kFinish, stale).ok());
      Stream(*decode0, {102, 103, 104, 105, 106, 107});
      Finish(*decode0);
      ASSERT_TRUE(events.WaitFinished(Deadline::AfterMs(5000)));
      EXPECT_EQ(events.Last().finish_reason, FinishReason::kLength)
          << events.Last().error.ToString();
      EXPECT_EQ(events.Tokens(), (std::vector<int32_t>{100, 101, 102, 103, 104, 105, 106, 107}));
      EXPECT_EQ(backend_->requests_migrated(), 1u);
    }
    prefill_.reset();
    backend_->Shutdown();
  }
}

// The decode side's reports travel on its own connection and may overtake
// the prefill side's PrefillDone (seen under a SIGSTOPped coordinator: both
// wait in their sockets). They are held until it comes: the client gets the
// first token first, and none is lost.
TEST_F(ClusterMigrationTest, DecodeReportsThatOvertakeThePrefillDoneWaitForIt) {
  StartBackend(/*migration_limit=*/3);
  CollectedEvents& events = NewEvents();
  proto::PrefillTask task;
  auto decode0 = StartFirstAttempt(events, &task);
  ASSERT_NE(decode0, nullptr);
  Stream(*decode0, {101, 102, 103, 104, 105, 106, 107});
  Finish(*decode0);
  // A frame after them on the same connection: once it is answered, the
  // coordinator has read the tokens and the Finish.
  proto::Heartbeat hb;
  hb.set_worker_id("decode-0");
  ASSERT_TRUE(decode0->Send(MessageType::kHeartbeat, hb).ok());
  EXPECT_TRUE(WaitForMessages("received Heartbeat", 1));
  EXPECT_FALSE(events.Finished());
  EXPECT_EQ(events.Tokens(), std::vector<int32_t>{});
  proto::PrefillDone done;
  done.set_request_id(kId);
  done.set_first_token(100);
  done.set_prompt_tokens(5);
  ASSERT_TRUE(prefill_->Send(MessageType::kPrefillDone, done).ok());
  ExpectWholeAnswer(events);
}

}  // namespace
}  // namespace kvrelay::coordinator
