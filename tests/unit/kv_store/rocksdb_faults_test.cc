// RocksDbTier under injected faults (tests/unit/kv_store/fault_fs.h): a disk
// that fills up, a failed fsync, an open on a full disk; plus the batched read
// and the stored/evicted events the router is fed from.
#include <gtest/gtest.h>

#include <filesystem>
#include <set>

#include "kv_store/rocksdb_tier.h"
#include "tests/unit/kv_store/fault_fs.h"
#include "tests/unit/kv_store/test_blocks.h"

namespace kvrelay::kv_store {
namespace {

namespace fs = std::filesystem;
using testing::FaultFs;
using testing::MakeBlock;

engine::KvLayout BlobLayout() {  // 8 KiB per block: every value is a blob
  engine::KvLayout l;
  l.layers = 4;
  l.kv_heads = 2;
  l.head_dim = 16;
  l.block_tokens = 8;
  return l;
}

class RocksDbFaultsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("kvstore_faults_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fault_ = FaultFs::Create();
    env_ = fault_->MakeEnv();
  }
  void TearDown() override {
    std::error_code ec;
    for (auto& e : fs::directory_iterator(dir_.parent_path(), ec)) {
      if (e.path().string().rfind(dir_.string(), 0) == 0) fs::remove_all(e.path(), ec);
    }
  }
  RocksDbTier::Options Opts() {
    RocksDbTier::Options o;
    o.path = dir_.string();
    o.env = env_.get();
    o.write_buffer_bytes = 256 << 10;
    o.blob_file_size = 1 << 20;
    o.open_reserve_bytes = 1 << 20;
    o.resume_interval_ms = 20;
    return o;
  }
  // Puts blocks [first, last) and waits until they are durable.
  static Status PutDurable(RocksDbTier& t, uint64_t first, uint64_t last) {
    for (uint64_t i = first; i < last; ++i) {
      auto b = MakeBlock(i, BlobLayout());
      RETURN_IF_ERROR(t.Put(b.meta.hash, b.Encoded()));
    }
    return t.WaitDurable(Deadline::AfterMs(10000));
  }
  static void ExpectServed(RocksDbTier& t, uint64_t first, uint64_t last) {
    for (uint64_t i = first; i < last; ++i) {
      auto b = MakeBlock(i, BlobLayout());
      auto v = t.Get(b.meta.hash);
      ASSERT_TRUE(v.ok()) << "block " << i << ": " << v.status().ToString();
      DecodedBlock d = DecodeBlock(*v, b.meta);
      ASSERT_TRUE(d.ok()) << "block " << i << ": " << MissReasonName(d.reason);
      EXPECT_EQ(std::vector<uint8_t>(d.payload.begin(), d.payload.end()), b.Payload());
    }
  }

  fs::path dir_;
  std::shared_ptr<FaultFs> fault_;
  std::unique_ptr<rocksdb::Env> env_;
};

TEST_F(RocksDbFaultsTest, FullDiskFailsWritesSoftlyKeepsReadsAndReopensReadOnly) {
  {
    auto t = RocksDbTier::Open(Opts());
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    ASSERT_TRUE(PutDurable(**t, 0, 16).ok());
    fault_->space_left.store(0);  // the disk is full from now on
    for (uint64_t i = 16; i < 32; ++i) {
      auto b = MakeBlock(i, BlobLayout());
      (void)(*t)->Put(b.meta.hash, b.Encoded());
    }
    EXPECT_FALSE((*t)->WaitDurable(Deadline::AfterMs(10000)).ok());
    const TierStats s = (*t)->stats();
    EXPECT_GT(s.write_failures, 0);
    EXPECT_GT(fault_->nospace_injected.load(), 0);
    ExpectServed(**t, 0, 16);  // what was stored stays readable
  }
  // A full disk is not damage: nothing is marked for discarding.
  EXPECT_FALSE(fs::exists(dir_ / "KVRELAY_DAMAGED"));

  // Restart on the full disk: opens read-only instead of aborting.
  {
    auto t = RocksDbTier::Open(Opts());
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_EQ((*t)->open_report().outcome, RocksDbTier::OpenOutcome::kReadOnly);
    EXPECT_TRUE((*t)->read_only());
    ExpectServed(**t, 0, 16);
    auto b = MakeBlock(100, BlobLayout());
    const Status put = (*t)->Put(b.meta.hash, b.Encoded());
    EXPECT_EQ(put.code(), StatusCode::kUnavailable) << put.ToString();
    EXPECT_EQ((*t)->stats().write_failures, 1);
    EXPECT_TRUE((*t)->WaitDurable(Deadline::AfterMs(1000)).ok());  // nothing pending
  }
  // Space is back: the next open is writable and keeps everything.
  fault_->space_left.store(-1);
  {
    auto t = RocksDbTier::Open(Opts());
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_EQ((*t)->open_report().outcome, RocksDbTier::OpenOutcome::kOpened);
    ExpectServed(**t, 0, 16);
    ASSERT_TRUE(PutDurable(**t, 200, 208).ok());
  }
}

TEST_F(RocksDbFaultsTest, WritesResumeAfterTheDiskHasRoomAgain) {
  auto t = RocksDbTier::Open(Opts());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_TRUE(PutDurable(**t, 0, 8).ok());
  fault_->space_left.store(0);
  auto b = MakeBlock(8, BlobLayout());
  (void)(*t)->Put(b.meta.hash, b.Encoded());
  EXPECT_FALSE((*t)->WaitDurable(Deadline::AfterMs(10000)).ok());
  EXPECT_TRUE((*t)->writes_suspended());
  fault_->space_left.store(-1);
  // Within a few resume intervals a write goes through again.
  const Deadline deadline = Deadline::AfterMs(10000);
  Status last = Unavailable("not tried");
  while (!deadline.Expired()) {
    last = PutDurable(**t, 20, 24);
    if (last.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the resume interval
  }
  ASSERT_TRUE(last.ok()) << last.ToString();
  EXPECT_FALSE((*t)->writes_suspended());
  ExpectServed(**t, 0, 8);
  ExpectServed(**t, 20, 24);
}

TEST_F(RocksDbFaultsTest, FailedFsyncIsNeverAcknowledgedAndTheProcessSurvives) {
  {
    auto t = RocksDbTier::Open(Opts());
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    ASSERT_TRUE(PutDurable(**t, 0, 8).ok());
    fault_->fail_sync.store(true);
    const Status s = PutDurable(**t, 8, 16);
    EXPECT_FALSE(s.ok()) << "a failed fsync must not be reported durable";
    EXPECT_GT(fault_->sync_failures_injected.load(), 0);
    fault_->fail_sync.store(false);
    ExpectServed(**t, 0, 8);
    const Deadline deadline = Deadline::AfterMs(10000);
    Status last = Unavailable("not tried");
    while (!deadline.Expired()) {
      last = PutDurable(**t, 16, 20);
      if (last.ok()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ASSERT_TRUE(last.ok()) << last.ToString();
  }
  EXPECT_FALSE(fs::exists(dir_ / "KVRELAY_DAMAGED"));
  auto t = RocksDbTier::Open(Opts());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->open_report().outcome, RocksDbTier::OpenOutcome::kOpened);
  ExpectServed(**t, 0, 8);
  ExpectServed(**t, 16, 20);
}

TEST_F(RocksDbFaultsTest, FreshDirectoryOnAFullDiskIsAnEmptyReadOnlyTier) {
  fault_->space_left.store(0);
  auto t = RocksDbTier::Open(Opts());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_TRUE((*t)->read_only());
  auto b = MakeBlock(1, BlobLayout());
  EXPECT_FALSE((*t)->Put(b.meta.hash, b.Encoded()).ok());
  EXPECT_EQ((*t)->Get(b.meta.hash).status().code(), StatusCode::kNotFound);
}

TEST_F(RocksDbFaultsTest, GetBatchAnswersInInputOrderWithOneMultiGet) {
  auto t = RocksDbTier::Open(Opts());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_TRUE(PutDurable(**t, 0, 6).ok());
  ASSERT_TRUE((*t)->Flush(Deadline::AfterMs(10000)).ok());
  (*t)->SetWriterPausedForTesting(true);
  auto pending = MakeBlock(50, BlobLayout());  // still in the queue
  ASSERT_TRUE((*t)->Put(pending.meta.hash, pending.Encoded()).ok());
  std::vector<BlockHash> keys = {MakeBlock(3, BlobLayout()).meta.hash, pending.meta.hash,
                                 MakeBlock(99, BlobLayout()).meta.hash,
                                 MakeBlock(0, BlobLayout()).meta.hash};
  const int64_t batches_before = (*t)->stats().get_batches;
  auto got = (*t)->GetBatch(keys);
  ASSERT_EQ(got.size(), 4u);
  EXPECT_EQ((*t)->stats().get_batches, batches_before + 1);
  ASSERT_TRUE(got[0].ok());
  EXPECT_TRUE(DecodeBlock(*got[0], MakeBlock(3, BlobLayout()).meta).ok());
  ASSERT_TRUE(got[1].ok());
  EXPECT_EQ(*got[1], pending.Encoded());
  EXPECT_EQ(got[2].status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(got[3].ok());
  EXPECT_TRUE(DecodeBlock(*got[3], MakeBlock(0, BlobLayout()).meta).ok());
  (*t)->SetWriterPausedForTesting(false);
}

TEST_F(RocksDbFaultsTest, StoredEventsFollowTheWriteAndEvictionsAreReported) {
  RocksDbTier::Options o = Opts();
  const int64_t block = static_cast<int64_t>(MakeBlock(0, BlobLayout()).Encoded().size());
  o.capacity_bytes = 4 * block;
  auto t = RocksDbTier::Open(o);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  (*t)->SetWriterPausedForTesting(true);
  auto b0 = MakeBlock(0, BlobLayout());
  ASSERT_TRUE((*t)->Put(b0.meta.hash, b0.Encoded()).ok());
  EXPECT_TRUE((*t)->TakeEvents(nullptr).empty()) << "not on disk yet: no stored event";
  (*t)->SetWriterPausedForTesting(false);
  ASSERT_TRUE((*t)->Flush(Deadline::AfterMs(10000)).ok());
  auto ev = (*t)->TakeEvents(nullptr);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, TierEvent::Kind::kStored);
  EXPECT_EQ(ev[0].tier, BlockTier::kDisk);
  EXPECT_EQ(ev[0].hash, b0.meta.hash);
  // Four more blocks push block 0 out (capacity 4 blocks).
  ASSERT_TRUE(PutDurable(**t, 1, 5).ok());
  ev = (*t)->TakeEvents(nullptr);
  std::set<BlockHash> evicted, stored;
  for (const TierEvent& e : ev) {
    (e.kind == TierEvent::Kind::kEvicted ? evicted : stored).insert(e.hash);
  }
  EXPECT_EQ(evicted, std::set<BlockHash>{b0.meta.hash});
  EXPECT_EQ(stored.size(), 4u);
  ASSERT_TRUE((*t)->Erase(MakeBlock(2, BlobLayout()).meta.hash).ok());
  ev = (*t)->TakeEvents(nullptr);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].kind, TierEvent::Kind::kEvicted);
  EXPECT_FALSE(ev[0].held_anywhere);
}

}  // namespace
}  // namespace kvrelay::kv_store
