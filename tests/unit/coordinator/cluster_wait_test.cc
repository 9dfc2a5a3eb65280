// The cluster backend's request lifecycle around worker churn (issue #46
// finding 5), token-id validation (finding 6a) and prefix-aware routing of
// an immediate repeat (issue #42). Real TCP on 127.0.0.1 to a real
// ClusterBackend; the workers are driven frame by frame (control_peer.h).
#include <gtest/gtest.h>

#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "coordinator/cluster/cluster_backend.h"
#include "tests/unit/coordinator/control_peer.h"

namespace kvrelay::coordinator {
namespace {

using protocols::MessageType;
using testing::CollectedEvents;
using testing::ControlPeer;
using testing::ControlTestConfig;

class ClusterWaitTest : public testing::ClusterBackendTest {
 protected:
  void StartBackend(std::chrono::milliseconds worker_wait, int64_t vocab_size = 0) {
    ClusterBackendTest::StartBackend([&](ClusterBackendOptions& o) {
      o.worker_wait = worker_wait;
      o.vocab_size = vocab_size;
    });
  }

  static GenerationRequest Request(uint64_t id, int prompt_tokens = 5) {
    GenerationRequest req;
    req.id = id;
    for (int i = 0; i < prompt_tokens; ++i) req.prompt.push_back(1 + i % 50);
    req.sampling.max_tokens = 4;
    return req;
  }

  // Plays request `id` through a prefill and a decode peer to its Finish;
  // returns the rank of the prefill worker the decode side was told to expect.
  static uint32_t PlayThrough(ControlPeer& decode, ControlPeer& prefill, uint64_t id) {
    proto::ReserveBlocks reserve;
    EXPECT_TRUE(decode.Expect(MessageType::kReserveBlocks, &reserve).ok());
    EXPECT_EQ(reserve.request_id(), id);
    proto::PrefillTask task;
    EXPECT_TRUE(prefill.Expect(MessageType::kPrefillTask, &task).ok());
    EXPECT_EQ(task.request_id(), id);
    proto::PrefillDone done;
    done.set_request_id(id);
    done.set_first_token(100);
    done.set_prompt_tokens(static_cast<uint32_t>(task.prompt_token_ids_size()));
    EXPECT_TRUE(prefill.Send(MessageType::kPrefillDone, done).ok());
    proto::Finish fin;
    fin.set_request_id(id);
    fin.set_reason(proto::Finish::REASON_LENGTH);
    EXPECT_TRUE(decode.Send(MessageType::kFinish, fin).ok());
    return reserve.prefill_rank();
  }

  // A sink's events, alive until the backend is gone (a failing test may
  // leave requests live, whose final events come at Shutdown).
  CollectedEvents& NewEvents() { return events_.emplace_back(); }

  protocols::IoThread io_{"wait-test-io"};
  std::deque<CollectedEvents> events_;  // read until TearDown shut the backend down
};

// Finding 5: requests that arrived while no worker was registered (a stalled
// coordinator whose workers dropped their links and re-register on resume)
// failed at once. They now wait for a worker and start when one registers.
TEST_F(ClusterWaitTest, ARequestWithNoWorkerWaitsAndStartsWhenOneRegisters) {
  StartBackend(std::chrono::milliseconds(60000));  // far beyond the test
  CollectedEvents& events = NewEvents();
  Status st = backend_->Submit(Request(1), events.Sink());
  ASSERT_TRUE(st.ok()) << st.ToString();  // before: "no healthy prefill worker"
  EXPECT_FALSE(events.Finished());
  // A prefill worker alone is not enough: it waits on for a decode worker.
  ControlPeer prefill(io_, port()), decode(io_, port());
  ASSERT_TRUE(prefill.Join(key_, "prefill-0", proto::WORKER_ROLE_PREFILL).ok());
  EXPECT_FALSE(events.Finished());
  ASSERT_TRUE(decode.Join(key_, "decode-0", proto::WORKER_ROLE_DECODE).ok());
  PlayThrough(decode, prefill, 1);
  ASSERT_TRUE(events.WaitFinished(Deadline::AfterMs(5000)));
  EXPECT_EQ(events.Last().finish_reason, FinishReason::kLength);
  EXPECT_EQ(events.Tokens(), (std::vector<int32_t>{100}));
}

// Past the bound a waiting request ends with the error it got at once before.
TEST_F(ClusterWaitTest, TheWaitEndsAtItsBoundWithTheSameError) {
  StartBackend(std::chrono::milliseconds(300));
  CollectedEvents& events = NewEvents();
  const TimePoint submitted = Clock::now();
  ASSERT_TRUE(backend_->Submit(Request(1), events.Sink()).ok());
  // Generous: the watchdog runs at least once a heartbeat interval (5 s here).
  ASSERT_TRUE(events.WaitFinished(Deadline::AfterMs(20000)));
  EXPECT_GE(Clock::now() - submitted, std::chrono::milliseconds(300));
  const TokenEvent last = events.Last();
  EXPECT_EQ(last.finish_reason, FinishReason::kError);
  EXPECT_EQ(last.error.code(), StatusCode::kUnavailable) << last.error.ToString();
  EXPECT_NE(last.error.message().find("no healthy prefill worker"), std::string::npos)
      << last.error.ToString();
  // With the wait off, the refusal is immediate, as before.
  backend_->Shutdown();
  StartBackend(std::chrono::milliseconds(0));
  Status st = backend_->Submit(Request(2), events.Sink());
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
}

// A client that goes away while its request waits releases it at once: the
// final event arrives, and the request never reaches a worker that registers
// later.
TEST_F(ClusterWaitTest, ACancelledWaitingRequestIsReleased) {
  StartBackend(std::chrono::milliseconds(60000));
  CollectedEvents& cancelled = NewEvents();
  ASSERT_TRUE(backend_->Submit(Request(1), cancelled.Sink()).ok());
  backend_->Cancel(1);
  ASSERT_TRUE(cancelled.WaitFinished(Deadline::AfterMs(5000)));
  EXPECT_EQ(cancelled.Last().finish_reason, FinishReason::kCancelled);
  ControlPeer prefill(io_, port()), decode(io_, port());
  ASSERT_TRUE(prefill.Join(key_, "prefill-0", proto::WORKER_ROLE_PREFILL).ok());
  ASSERT_TRUE(decode.Join(key_, "decode-0", proto::WORKER_ROLE_DECODE).ok());
  // The first reservation the decode worker sees is the next request's.
  CollectedEvents& next = NewEvents();
  ASSERT_TRUE(backend_->Submit(Request(2), next.Sink()).ok());
  PlayThrough(decode, prefill, 2);
  ASSERT_TRUE(next.WaitFinished(Deadline::AfterMs(5000)));
  EXPECT_EQ(next.Last().finish_reason, FinishReason::kLength);
}

// The stall's other half: a worker that dropped its link re-registers (a new
// connection under the same name) while a request routed to its old entry
// has produced nothing. The replaced entry's request was re-run before the
// new entry existed, found no prefill worker and failed; now it waits for the
// registration under way and runs on it.
TEST_F(ClusterWaitTest, ARequestOnAReplacedWorkerRunsOnItsNewRegistration) {
  StartBackend(std::chrono::milliseconds(60000));
  auto prefill = std::make_unique<ControlPeer>(io_, port());
  ControlPeer decode(io_, port());
  ASSERT_TRUE(prefill->Join(key_, "prefill-0", proto::WORKER_ROLE_PREFILL).ok());
  ASSERT_TRUE(decode.Join(key_, "decode-0", proto::WORKER_ROLE_DECODE).ok());
  CollectedEvents& events = NewEvents();
  ASSERT_TRUE(backend_->Submit(Request(1), events.Sink()).ok());
  proto::ReserveBlocks first;
  ASSERT_TRUE(decode.Expect(MessageType::kReserveBlocks, &first).ok());
  // The same worker registers again on a new connection (the old one is
  // still open: the coordinator has not noticed it dead).
  ControlPeer again(io_, port());
  ASSERT_TRUE(again.Join(key_, "prefill-0", proto::WORKER_ROLE_PREFILL).ok());
  proto::Cancel cancel;
  ASSERT_TRUE(decode.Expect(MessageType::kCancel, &cancel).ok());
  EXPECT_EQ(cancel.request_id(), 1u);
  EXPECT_FALSE(events.Finished()) << events.Last().error.ToString();
  PlayThrough(decode, again, 1);
  ASSERT_TRUE(events.WaitFinished(Deadline::AfterMs(5000)));
  EXPECT_EQ(events.Last().finish_reason, FinishReason::kLength) << events.Last().error.ToString();
}

// Finding 6a: a token id outside the vocabulary (prompt or logit_bias) is
// the client's error, refused before any worker sees it (it was a worker's
// reservation refusal, answered 503 no_capacity with Retry-After).
TEST_F(ClusterWaitTest, TokenIdsOutsideTheVocabularyAreInvalidArguments) {
  StartBackend(std::chrono::milliseconds(0), /*vocab_size=*/1000);
  ControlPeer prefill(io_, port()), decode(io_, port());
  ASSERT_TRUE(prefill.Join(key_, "prefill-0", proto::WORKER_ROLE_PREFILL).ok());
  ASSERT_TRUE(decode.Join(key_, "decode-0", proto::WORKER_ROLE_DECODE).ok());
  CollectedEvents& events = NewEvents();
  GenerationRequest prompt = Request(1);
  prompt.prompt.push_back(1000);
  Status st = backend_->Submit(prompt, events.Sink());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("token id 1000"), std::string::npos) << st.ToString();
  GenerationRequest negative = Request(2);
  negative.prompt[0] = -1;
  EXPECT_EQ(backend_->Submit(negative, events.Sink()).code(), StatusCode::kInvalidArgument);
  GenerationRequest bias = Request(3);
  bias.sampling.logit_bias = {{5, 1.0f}, {123456, -100.0f}};
  st = backend_->Submit(bias, events.Sink());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("logit_bias token id 123456"), std::string::npos) << st.ToString();
  // In range: routed as usual.
  GenerationRequest fine = Request(4);
  fine.prompt.push_back(999);
  fine.sampling.logit_bias = {{999, 1.0f}};
  ASSERT_TRUE(backend_->Submit(fine, events.Sink()).ok());
  PlayThrough(decode, prefill, 4);
  ASSERT_TRUE(events.WaitFinished(Deadline::AfterMs(5000)));
  EXPECT_EQ(events.Last().finish_reason, FinishReason::kLength);
}

// Issue #42: with two prefill workers the same 1,251-token prompt sent right
// after the first finished went to the other worker (cached_tokens = 0): the
// router knew of the cached prefix only from the next heartbeat, and the
// first request's own prompt still counted as queued work where it had run.
TEST_F(ClusterWaitTest, AnImmediateRepeatGoesToTheWorkerThatHasItsPrefix) {
  StartBackend(std::chrono::milliseconds(0));
  ControlPeer p0(io_, port()), p1(io_, port()), decode(io_, port());
  ASSERT_TRUE(p0.Join(key_, "prefill-0", proto::WORKER_ROLE_PREFILL, /*rank=*/10).ok());
  ASSERT_TRUE(p1.Join(key_, "prefill-1", proto::WORKER_ROLE_PREFILL, /*rank=*/11).ok());
  ASSERT_TRUE(decode.Join(key_, "decode-0", proto::WORKER_ROLE_DECODE, /*rank=*/20).ok());
  GenerationRequest req = Request(1, 1251);
  for (int b = 0; b < 1251 / 16; ++b) {
    PrefixBlockHash h{};
    h.fill(static_cast<uint8_t>(b + 1));
    req.prefix_blocks.push_back(h);
  }
  CollectedEvents& first = NewEvents();
  ASSERT_TRUE(backend_->Submit(req, first.Sink()).ok());
  const uint32_t first_rank = PlayThrough(decode, p0, 1);  // ties go to the lower id
  EXPECT_EQ(first_rank, 10u);
  ASSERT_TRUE(first.WaitFinished(Deadline::AfterMs(5000)));
  // No heartbeat and no cache event arrived meanwhile.
  req.id = 2;
  CollectedEvents& repeat = NewEvents();
  ASSERT_TRUE(backend_->Submit(req, repeat.Sink()).ok());
  EXPECT_EQ(PlayThrough(decode, p0, 2), 10u);
  ASSERT_TRUE(repeat.WaitFinished(Deadline::AfterMs(5000)));
  EXPECT_EQ(repeat.Last().finish_reason, FinishReason::kLength);
}

}  // namespace
}  // namespace kvrelay::coordinator
