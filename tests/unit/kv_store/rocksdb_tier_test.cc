#include "kv_store/rocksdb_tier.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "tests/unit/kv_store/test_blocks.h"

namespace kvrelay::kv_store {
namespace {

namespace fs = std::filesystem;
using testing::MakeBlock;

class RocksDbTierTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("kvstore_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    for (auto& e : fs::directory_iterator(dir_.parent_path())) {
      if (e.path().string().rfind(dir_.string() + ".corrupt", 0) == 0) fs::remove_all(e.path());
    }
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
    o.now_us = [this] { return now_us_.load(); };
    o.write_buffer_bytes = 1 << 20;
    return o;
  }
  static Deadline Soon() { return Deadline::AfterMs(10000); }

  fs::path dir_;
  std::atomic<int64_t> now_us_{1'700'000'000'000'000};
};

TEST_F(RocksDbTierTest, ValuesSurviveCloseAndReopen) {
  std::vector<testing::TestBlock> blocks;
  for (int i = 0; i < 20; ++i) blocks.push_back(MakeBlock(i));
  {
    auto tier = RocksDbTier::Open(Opts()).value();
    EXPECT_EQ(tier->open_report().outcome, RocksDbTier::OpenOutcome::kOpened);
    for (auto& b : blocks) ASSERT_TRUE(tier->Put(b.meta.hash, b.Encoded()).ok());
    // Visible immediately, before the writer ran.
    for (auto& b : blocks) EXPECT_EQ(*tier->Get(b.meta.hash), b.Encoded());
    ASSERT_TRUE(tier->WaitDurable(Soon()).ok());
  }
  auto tier = RocksDbTier::Open(Opts()).value();
  EXPECT_EQ(tier->open_report().entries, 20);
  for (auto& b : blocks) {
    auto v = tier->Get(b.meta.hash);
    ASSERT_TRUE(v.ok()) << v.status().ToString();
    EXPECT_TRUE(DecodeBlock(*v, b.meta).ok());
    EXPECT_TRUE(tier->Contains(b.meta.hash));
  }
  const int64_t one = static_cast<int64_t>(blocks[0].Encoded().size());
  EXPECT_EQ(tier->used_bytes(), 20 * one);
  ASSERT_TRUE(tier->Erase(blocks[0].meta.hash).ok());
  EXPECT_FALSE(tier->Contains(blocks[0].meta.hash));
  ASSERT_TRUE(tier->Flush(Soon()).ok());
  tier.reset();
  tier = RocksDbTier::Open(Opts()).value();
  EXPECT_EQ(tier->Get(blocks[0].meta.hash).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(tier->open_report().entries, 19);
}

TEST_F(RocksDbTierTest, CapacityEvictsInLeastRecentlyUsedOrderAcrossRestarts) {
  std::vector<testing::TestBlock> b;
  for (int i = 0; i < 6; ++i) b.push_back(MakeBlock(100 + i));
  const int64_t one = static_cast<int64_t>(b[0].Encoded().size());
  auto opts = Opts();
  opts.capacity_bytes = 4 * one;
  {
    auto tier = RocksDbTier::Open(opts).value();
    for (int i = 0; i < 4; ++i) {
      now_us_ += 1000;
      ASSERT_TRUE(tier->Put(b[i].meta.hash, b[i].Encoded()).ok());
    }
    ASSERT_TRUE(tier->Flush(Soon()).ok());
    now_us_ += 1000;
    ASSERT_TRUE(tier->Get(b[0].meta.hash).ok());  // order now 1, 2, 3, 0
    ASSERT_TRUE(tier->WaitDurable(Soon()).ok());
  }
  auto tier = RocksDbTier::Open(opts).value();
  // The access-time index was rebuilt from disk: 0 is the most recent.
  EXPECT_EQ(tier->KeysLruOrder(), (std::vector<BlockHash>{b[1].meta.hash, b[2].meta.hash,
                                                          b[3].meta.hash, b[0].meta.hash}));
  now_us_ += 1000;
  ASSERT_TRUE(tier->Put(b[4].meta.hash, b[4].Encoded()).ok());
  now_us_ += 1000;
  ASSERT_TRUE(tier->Put(b[5].meta.hash, b[5].Encoded()).ok());
  EXPECT_FALSE(tier->Contains(b[1].meta.hash));
  EXPECT_FALSE(tier->Contains(b[2].meta.hash));
  EXPECT_TRUE(tier->Contains(b[0].meta.hash));
  EXPECT_EQ(tier->used_bytes(), 4 * one);
  EXPECT_EQ(tier->stats().evictions, 2);
  ASSERT_TRUE(tier->Flush(Soon()).ok());
  tier.reset();
  // Evictions reached the disk too; a smaller capacity evicts at open.
  opts.capacity_bytes = 2 * one;
  tier = RocksDbTier::Open(opts).value();
  EXPECT_EQ(tier->KeysLruOrder(), (std::vector<BlockHash>{b[4].meta.hash, b[5].meta.hash}));
  EXPECT_EQ(tier->Get(b[1].meta.hash).status().code(), StatusCode::kNotFound);
}

TEST_F(RocksDbTierTest, TtlExpiresEntriesAtGetAndAtOpen) {
  auto opts = Opts();
  opts.ttl_seconds = 60;
  auto a = MakeBlock(1), b = MakeBlock(2);
  {
    auto tier = RocksDbTier::Open(opts).value();
    ASSERT_TRUE(tier->Put(a.meta.hash, a.Encoded()).ok());
    now_us_ += 30'000'000;
    ASSERT_TRUE(tier->Put(b.meta.hash, b.Encoded()).ok());
    now_us_ += 29'000'000;  // a is 59 s old
    EXPECT_TRUE(tier->Get(a.meta.hash).ok());
    now_us_ += 2'000'000;  // a is 61 s old, b 31 s
    EXPECT_FALSE(tier->Contains(a.meta.hash));
    EXPECT_EQ(tier->Get(a.meta.hash).status().code(), StatusCode::kNotFound);
    EXPECT_TRUE(tier->Get(b.meta.hash).ok());
    EXPECT_EQ(tier->stats().expired, 1);
    ASSERT_TRUE(tier->WaitDurable(Soon()).ok());
  }
  now_us_ += 30'000'000;  // b is 61 s old when reopened
  auto tier = RocksDbTier::Open(opts).value();
  EXPECT_EQ(tier->open_report().entries, 0);
  EXPECT_FALSE(tier->Contains(b.meta.hash));
}

TEST_F(RocksDbTierTest, FullSpillQueueDropsInsteadOfBlocking) {
  auto opts = Opts();
  opts.max_queue_blocks = 4;
  auto tier = RocksDbTier::Open(opts).value();
  tier->SetWriterPausedForTesting(true);
  std::vector<testing::TestBlock> b;
  for (int i = 0; i < 6; ++i) b.push_back(MakeBlock(200 + i));
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(tier->Put(b[i].meta.hash, b[i].Encoded()).ok());
  // The writer is paused: a blocking Put would hang here (and the test time out).
  EXPECT_EQ(tier->Put(b[4].meta.hash, b[4].Encoded()).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(tier->Put(b[5].meta.hash, b[5].Encoded()).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(tier->stats().puts_dropped, 2);
  EXPECT_EQ(tier->queued_blocks(), 4);
  EXPECT_FALSE(tier->Contains(b[4].meta.hash));
  EXPECT_EQ(*tier->Get(b[3].meta.hash), b[3].Encoded());  // served from the queue
  EXPECT_EQ(tier->WaitDurable(Deadline::AfterMs(50)).code(), StatusCode::kDeadlineExceeded);
  tier->SetWriterPausedForTesting(false);
  ASSERT_TRUE(tier->WaitDurable(Soon()).ok());
  EXPECT_EQ(tier->queued_blocks(), 0);
  ASSERT_TRUE(tier->Put(b[4].meta.hash, b[4].Encoded()).ok());
}

TEST_F(RocksDbTierTest, ConcurrentPutGetFromSeveralThreads) {
  auto opts = Opts();
  opts.max_queue_blocks = 1 << 20;
  opts.max_queue_bytes = 1LL << 30;
  auto tier = RocksDbTier::Open(opts).value();
  constexpr int kThreads = 4, kPerThread = 150;
  std::atomic<int> bad{0}, hits{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        auto b = MakeBlock(1000 + t * kPerThread + i);
        if (!tier->Put(b.meta.hash, b.Encoded()).ok()) ++bad;
        // Read back someone's earlier block (maybe still queued, maybe written).
        auto o = MakeBlock(1000 + ((t + 1) % kThreads) * kPerThread + i / 2);
        auto v = tier->Get(o.meta.hash);
        if (v.ok()) {
          ++hits;
          if (!DecodeBlock(*v, o.meta).ok()) ++bad;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  ASSERT_TRUE(tier->WaitDurable(Soon()).ok());
  for (int i = 0; i < kThreads * kPerThread; ++i) {
    auto b = MakeBlock(1000 + i);
    auto v = tier->Get(b.meta.hash);
    ASSERT_TRUE(v.ok()) << i;
    ASSERT_TRUE(DecodeBlock(*v, b.meta).ok()) << i;
  }
  EXPECT_EQ(tier->stats().entries, kThreads * kPerThread);
}

// Overwrites every file of the database whose name ends with `suffix`.
int Scribble(const fs::path& dir, const std::string& suffix, std::mt19937& rng, int flips) {
  int files = 0;
  for (auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.size() < suffix.size() ||
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
      continue;
    if (suffix.empty() && name.rfind("MANIFEST", 0) != 0) continue;
    std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    const auto size = static_cast<int64_t>(fs::file_size(e.path()));
    if (size == 0) continue;
    for (int i = 0; i < flips; ++i) {
      f.seekg(static_cast<std::streamoff>(rng() % size));
      char c = 0;
      f.read(&c, 1);
      f.seekp(static_cast<std::streamoff>(f.tellg()) - 1);
      c = static_cast<char>(c ^ (1 << (rng() % 8)));
      f.write(&c, 1);
    }
    ++files;
  }
  return files;
}

// Flips the byte at `offset` into the first occurrence of `needle` in the
// files of `dir` whose names end with `suffix` and whose content also holds
// `also` (empty: any); the number of files changed.
int FlipWhere(const fs::path& dir, const std::string& suffix, std::string_view needle,
              size_t offset, std::string_view also = {}) {
  int changed = 0;
  for (auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (!name.ends_with(suffix)) continue;
    std::ifstream in(e.path(), std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t at = bytes.find(needle);
    if (at == std::string::npos || bytes.find(also) == std::string::npos) continue;
    bytes[at + offset] = static_cast<char>(bytes[at + offset] ^ 0x04);
    std::ofstream(e.path(), std::ios::binary | std::ios::trunc) << bytes;
    ++changed;
  }
  return changed;
}

// verify_value_checksums = false, as the prefill worker opens its store:
// reads skip RocksDB's checksums, so a value damaged on disk is served as
// read and the block codec rejects it (with them on, RocksDB does: DataLoss);
// the tables are verified whole at open instead, so a damaged table of the
// value family is damage at open (moved aside), never a misread later.
TEST_F(RocksDbTierTest, WithoutValueChecksumsTheTablesAreVerifiedAtOpenAndValuesByTheCodec) {
  std::vector<testing::TestBlock> blocks;
  for (int i = 0; i < 12; ++i) blocks.push_back(MakeBlock(500 + i, testing::SmallLayout()));
  auto fill = [&](const RocksDbTier::Options& opts) {
    fs::remove_all(dir_);
    {
      auto tier = RocksDbTier::Open(opts).value();
      for (auto& b : blocks) ASSERT_TRUE(tier->Put(b.meta.hash, b.Encoded()).ok());
      ASSERT_TRUE(tier->WaitDurable(Soon()).ok());
    }
    RocksDbTier::Open(opts).value().reset();  // into table and blob files
  };
  for (const bool verify : {true, false}) {
    SCOPED_TRACE(verify ? "value checksums on" : "value checksums off");
    auto opts = Opts();
    opts.min_blob_size = 256;  // the small test blocks go to blob files
    opts.verify_value_checksums = verify;
    fill(opts);
    const std::string damaged = blocks[3].Encoded();
    ASSERT_EQ(FlipWhere(dir_, ".blob", damaged, damaged.size() / 2), 1);
    auto tier = RocksDbTier::Open(opts).value();
    EXPECT_EQ(tier->open_report().outcome, RocksDbTier::OpenOutcome::kOpened);
    for (size_t i = 0; i < blocks.size(); ++i) {
      Result<std::string> v = tier->Get(blocks[i].meta.hash);
      if (i == 3 && verify) {
        EXPECT_EQ(v.status().code(), StatusCode::kDataLoss) << v.status().ToString();
        continue;
      }
      ASSERT_TRUE(v.ok()) << i << ": " << v.status().ToString();
      const DecodedBlock d = DecodeBlock(*v, blocks[i].meta);
      if (i == 3) {
        EXPECT_EQ(d.reason, MissReason::kChecksum);
        continue;
      }
      ASSERT_TRUE(d.ok()) << i;
      EXPECT_EQ(std::vector<uint8_t>(d.payload.begin(), d.payload.end()), blocks[i].Payload());
    }
  }
  // A flipped byte in the first data block of the value family's table (the
  // keys and blob references; its properties name the family "default").
  auto opts = Opts();
  opts.min_blob_size = 256;
  opts.verify_value_checksums = false;
  fill(opts);
  const std::string key(reinterpret_cast<const char*>(blocks[0].meta.hash.data()), 8);
  ASSERT_GE(FlipWhere(dir_, ".sst", key, 0, "namedefault"), 1);
  auto tier = RocksDbTier::Open(opts).value();
  EXPECT_EQ(tier->open_report().outcome, RocksDbTier::OpenOutcome::kMovedAside);
  EXPECT_EQ(tier->open_report().entries, 0);
}

TEST_F(RocksDbTierTest, DamagedDirectoryOpensAndNeverServesBadBlocks) {
  std::vector<testing::TestBlock> blocks;
  for (int i = 0; i < 40; ++i) blocks.push_back(MakeBlock(300 + i, testing::SmallLayout()));
  auto opts = Opts();
  opts.min_blob_size = 256;  // the small test blocks go to blob files
  std::mt19937 rng(1234);
  for (const char* what : {".blob", ".sst", ".log", ""}) {  // "" = MANIFEST
    fs::remove_all(dir_);
    {
      auto tier = RocksDbTier::Open(opts).value();
      for (auto& b : blocks) ASSERT_TRUE(tier->Put(b.meta.hash, b.Encoded()).ok());
      ASSERT_TRUE(tier->WaitDurable(Soon()).ok());
    }
    if (std::string(what) != ".log") {
      // Push everything into SST + blob files.
      auto tier = RocksDbTier::Open(opts).value();
      tier.reset();
    }
    Scribble(dir_, what, rng, 20);
    // Two older damaged copies from earlier runs: a move-aside keeps only the newest.
    for (const char* old : {".corrupt-1", ".corrupt-2"})
      fs::create_directories(dir_.string() + old);
    auto opened = RocksDbTier::Open(opts);
    ASSERT_TRUE(opened.ok()) << what << ": " << opened.status().ToString();
    auto& tier = *opened;
    int served = 0;
    for (auto& b : blocks) {
      auto v = tier->Get(b.meta.hash);
      if (!v.ok()) continue;
      DecodedBlock d = DecodeBlock(*v, b.meta);
      if (!d.ok()) continue;  // caught by the codec: a miss
      ++served;
      ASSERT_EQ(std::vector<uint8_t>(d.payload.begin(), d.payload.end()), b.Payload()) << what;
    }
    int copies = 0;
    for (auto& e : fs::directory_iterator(dir_.parent_path())) {
      if (e.path().string().rfind(dir_.string() + ".corrupt-", 0) == 0) ++copies;
    }
    if (tier->open_report().outcome == RocksDbTier::OpenOutcome::kMovedAside) {
      EXPECT_EQ(copies, 1) << what;
      EXPECT_TRUE(fs::exists(tier->open_report().moved_to)) << what;
    } else {
      EXPECT_GE(copies, 2) << what;
    }
    for (const char* old : {".corrupt-1", ".corrupt-2"}) fs::remove_all(dir_.string() + old);
    // Still usable for new writes.
    auto fresh = MakeBlock(999);
    ASSERT_TRUE(tier->Put(fresh.meta.hash, fresh.Encoded()).ok());
    (void)tier->WaitDurable(Soon());  // may fail on a read-only DB; must return, not hang
    if (tier->stats().errors > 0) {
      // A corrupt read marked the database damaged: the next open starts over.
      tier.reset();
      auto again = RocksDbTier::Open(opts);
      ASSERT_TRUE(again.ok()) << again.status().ToString();
      EXPECT_EQ((*again)->open_report().outcome, RocksDbTier::OpenOutcome::kMovedAside) << what;
      EXPECT_EQ((*again)->open_report().entries, 0);
      std::cout << "damaged " << what << ": read errors, reopened empty\n";
      continue;
    }
    std::cout << "damaged " << (*what ? what : "MANIFEST") << ": outcome "
              << static_cast<int>(tier->open_report().outcome) << ", served " << served << "/"
              << blocks.size() << "\n";
  }
}

}  // namespace
}  // namespace kvrelay::kv_store
