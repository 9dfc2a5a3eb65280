// The NCCL communicator's completion and version rules (engine/cuda/nccl_progress.h),
// checked on the host: the H200 run's `nccl1` failure came from treating an idle
// stream as "done" while the non-blocking communicator still reported
// ncclInProgress (the work was accepted but not yet on the stream).
#include "engine/cuda/nccl_progress.h"

#include <gtest/gtest.h>

namespace kvrelay::engine::cuda {
namespace {

TEST(NcclProgressTest, IdleStreamIsNotDoneWhileTheCommunicatorIsInProgress) {
  // The case that read a header nobody had written ("got request 0 tag 0").
  EXPECT_EQ(ClassifyNcclProgress(NcclCommState::kInProgress, StreamState::kIdle),
            NcclOpProgress::kPending);
  EXPECT_EQ(ClassifyNcclProgress(NcclCommState::kInProgress, StreamState::kBusy),
            NcclOpProgress::kPending);
}

TEST(NcclProgressTest, IdleStreamIsDoneOnceEnqueued) {
  EXPECT_EQ(ClassifyNcclProgress(NcclCommState::kSuccess, StreamState::kIdle),
            NcclOpProgress::kDone);
  EXPECT_EQ(ClassifyNcclProgress(NcclCommState::kSuccess, StreamState::kBusy),
            NcclOpProgress::kPending);
}

TEST(NcclProgressTest, AnyFailureFails) {
  for (StreamState s : {StreamState::kIdle, StreamState::kBusy, StreamState::kFailed}) {
    EXPECT_EQ(ClassifyNcclProgress(NcclCommState::kFailed, s), NcclOpProgress::kFailed);
  }
  EXPECT_EQ(ClassifyNcclProgress(NcclCommState::kSuccess, StreamState::kFailed),
            NcclOpProgress::kFailed);
  EXPECT_EQ(ClassifyNcclProgress(NcclCommState::kInProgress, StreamState::kFailed),
            NcclOpProgress::kFailed);
}

TEST(NcclProgressTest, VersionCodeDecodes) {
  const NcclVersion v = NcclVersion::FromCode(22809);  // NCCL 2.28.9's NCCL_VERSION_CODE
  EXPECT_EQ(v.major, 2);
  EXPECT_EQ(v.minor, 28);
  EXPECT_EQ(v.patch, 9);
  EXPECT_EQ(v.ToString(), "2.28.9");
}

TEST(NcclProgressTest, VersionRule) {
  // Same, newer patch, newer minor: served.
  EXPECT_TRUE(CheckNcclVersion(22809, 22809, false).ok());
  EXPECT_TRUE(CheckNcclVersion(22809, 22803, false).ok());  // patch older: same ABI
  EXPECT_TRUE(CheckNcclVersion(22809, 22901, false).ok());
  // Older minor or another major: refused, both versions named.
  const Status older = CheckNcclVersion(22809, 22703, false);
  EXPECT_EQ(older.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(older.message().find("2.27.3"), std::string::npos) << older.message();
  EXPECT_NE(older.message().find("2.28.9"), std::string::npos) << older.message();
  EXPECT_FALSE(CheckNcclVersion(22809, 30001, false).ok());
  // The escape hatch.
  EXPECT_TRUE(CheckNcclVersion(22809, 22703, true).ok());
}

}  // namespace
}  // namespace kvrelay::engine::cuda
