#include "worker/request_table.h"

#include <gtest/gtest.h>

#include <vector>

namespace kvrelay::worker {
namespace {

using S = RequestState;

// A role's work that counts its destructions.
struct CountedWork : RequestWork {
  explicit CountedWork(int* destroyed) : destroyed(destroyed) {}
  ~CountedWork() override { ++*destroyed; }
  int* destroyed;
};

TEST(RequestTableTest, GaugesFollowTheRecordsStates) {
  RequestTable t;
  t.Add(1, S::kQueued, 100);
  Request& b = t.Add(2, S::kQueued, 30);
  t.Add(3, S::kReserved, 7);
  EXPECT_EQ(t.PromptTokens({S::kQueued, S::kComputing}), 130);
  EXPECT_EQ(t.Count({S::kComputing, S::kRunning}), 0);

  t.Move(b, S::kComputing);
  EXPECT_EQ(t.PromptTokens({S::kQueued, S::kComputing}), 130);
  EXPECT_EQ(t.Count({S::kComputing, S::kRunning}), 1);
  EXPECT_EQ(t.IdsIn(S::kQueued), std::vector<engine::RequestId>{1});

  t.Move(b, S::kRunning);  // first token: no longer queued prompt tokens
  EXPECT_EQ(t.PromptTokens({S::kQueued, S::kComputing}), 100);
  EXPECT_EQ(t.Count({S::kComputing, S::kRunning}), 1);

  t.Finish(2);
  EXPECT_EQ(t.Find(2), nullptr);
  EXPECT_EQ(t.Count({S::kComputing, S::kRunning}), 0);
  EXPECT_EQ(t.size(), 2u);
  ASSERT_NE(t.Find(3), nullptr);
  EXPECT_EQ(t.Find(3)->state, S::kReserved);
}

TEST(RequestTableTest, WalkingASnapshotMayEndRecords) {
  RequestTable t;
  for (engine::RequestId id = 1; id <= 4; ++id) t.Add(id, S::kStreaming, 1);
  for (engine::RequestId id : t.IdsIn(S::kStreaming)) {
    if (id % 2 == 0) {
      t.Finish(id);
    } else {
      t.Move(*t.Find(id), S::kDelivered);
    }
  }
  EXPECT_TRUE(t.IdsIn(S::kStreaming).empty());
  EXPECT_EQ(t.IdsIn(S::kDelivered), (std::vector<engine::RequestId>{1, 3}));
}

TEST(RequestTableTest, ReleaseRunsOnceBeforeEveryWorkIsDropped) {
  RequestTable t;
  std::vector<engine::RequestId> released;
  t.SetRelease([&](Request& r) { released.push_back(r.id); });
  int destroyed = 0;
  auto add = [&](engine::RequestId id) {
    t.Add(id, S::kQueued, 1).work = std::make_unique<CountedWork>(&destroyed);
  };

  add(1);
  t.Finish(1);  // an ended request
  add(2);
  t.DropWork(*t.Find(2));  // a lost peer: the record stays, its work goes
  ASSERT_NE(t.Find(2), nullptr);
  EXPECT_EQ(t.Find(2)->work, nullptr);
  t.DropWork(*t.Find(2));  // nothing left to release
  add(3);
  add(3);  // a new attempt of the same id replaces the old one's work
  add(4);
  t.Cancelled(4, /*engine_had_it=*/true);
  add(5);
  t.Clear();  // the coordinator link is gone

  EXPECT_EQ(released, (std::vector<engine::RequestId>{1, 2, 3, 4, 3, 5}));
  EXPECT_EQ(destroyed, 6);
  EXPECT_EQ(t.size(), 0u);
}

TEST(RequestTableTest, WorkMovedOutByReleaseOutlivesTheRecord) {
  // A role quarantines work a transport still owns: the table must not
  // destroy what the release took.
  RequestTable t;
  std::vector<std::unique_ptr<RequestWork>> quarantine;
  t.SetRelease([&](Request& r) { quarantine.push_back(std::move(r.work)); });
  int destroyed = 0;
  t.Add(9, S::kStreaming, 1).work = std::make_unique<CountedWork>(&destroyed);
  t.Finish(9);
  EXPECT_EQ(destroyed, 0);
  ASSERT_EQ(quarantine.size(), 1u);
  quarantine.clear();
  EXPECT_EQ(destroyed, 1);
}

TEST(RequestTableTest, AStaleCancelDoesNotEndTheNextAttempt) {
  RequestTable t;
  t.Add(7, S::kRunning, 5);
  // The coordinator cancels attempt 1 (the engine will report kCancelled)
  // and starts attempt 2 of the same id at once.
  t.Cancelled(7, /*engine_had_it=*/true);
  EXPECT_EQ(t.Find(7), nullptr);
  Request& again = t.Add(7, S::kQueued, 5);
  EXPECT_EQ(again.state, S::kQueued);

  EXPECT_TRUE(t.TakeStaleCancel(7));   // attempt 1's event: swallowed
  ASSERT_NE(t.Find(7), nullptr);       // attempt 2 lives on
  EXPECT_FALSE(t.TakeStaleCancel(7));  // attempt 2's own cancel is reported
  t.Finish(7);
  EXPECT_EQ(t.size(), 0u);
}

TEST(RequestTableTest, StaleCancelsOutliveAFinishedAttempt) {
  RequestTable t;
  t.Add(3, S::kRunning, 5);
  t.Cancelled(3, true);
  t.Add(3, S::kRunning, 5);
  t.Cancelled(3, true);  // two attempts cancelled, two events pending
  EXPECT_EQ(t.size(), 1u);
  EXPECT_TRUE(t.TakeStaleCancel(3));
  EXPECT_EQ(t.size(), 1u);
  EXPECT_TRUE(t.TakeStaleCancel(3));
  EXPECT_EQ(t.size(), 0u);
  EXPECT_FALSE(t.TakeStaleCancel(3));
}

TEST(RequestTableTest, ACancelTheEngineNeverSawLeavesNothing) {
  RequestTable t;
  t.Cancelled(11, /*engine_had_it=*/false);  // unknown id
  EXPECT_EQ(t.size(), 0u);
  t.Add(12, S::kDelivered, 5);  // the engine is done with it
  t.Cancelled(12, false);
  EXPECT_EQ(t.size(), 0u);
  EXPECT_FALSE(t.TakeStaleCancel(12));
  // A cancel of an id the table never held, while the engine had it (an
  // engine request without a record is a bug, but its event must not leak).
  t.Cancelled(13, true);
  EXPECT_EQ(t.Find(13), nullptr);
  EXPECT_TRUE(t.TakeStaleCancel(13));
  EXPECT_EQ(t.size(), 0u);
}

}  // namespace
}  // namespace kvrelay::worker
