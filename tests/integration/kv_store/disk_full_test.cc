// RocksDbTier on a disk that really fills up: a small tmpfs mounted for the
// test (needs root / CAP_SYS_ADMIN; skipped otherwise, the fault-injecting
// FileSystem in tests/unit/kv_store/rocksdb_faults_test.cc covers the same
// paths without privileges).
//
// Before the fix this sequence aborted the process on the second open:
// the full disk's write errors marked the database damaged, the reopen moved
// it aside (keeping the copy, so the disk stayed full), and the fresh
// database's 4 MiB MANIFEST preallocation failed inside RocksDB 7.8, which
// then asserted `sync_without_flush_called_` (exit 134): every restart of
// the prefill worker crashed.
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "kv_store/rocksdb_tier.h"
#include "tests/testing/skip.h"
#include "tests/unit/kv_store/test_blocks.h"

namespace kvrelay::kv_store {
namespace {

namespace fs = std::filesystem;

engine::KvLayout Layout() {  // 32 KiB per block
  engine::KvLayout l;
  l.layers = 4;
  l.kv_heads = 2;
  l.head_dim = 16;
  l.block_tokens = 16;
  return l;
}

// A tmpfs of `size` at a fresh directory; unmounted (lazily) and removed on
// every path by the destructor.
class ScopedTmpfs {
 public:
  explicit ScopedTmpfs(const std::string& size) {
    dir_ = fs::temp_directory_path() / ("kvstore_tmpfs_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    const std::string opts = "size=" + size;
    mounted_ = ::mount("tmpfs", dir_.c_str(), "tmpfs", 0, opts.c_str()) == 0;
    if (!mounted_) error_ = std::strerror(errno);
  }
  ~ScopedTmpfs() {
    if (mounted_) ::umount2(dir_.c_str(), MNT_DETACH);
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  bool mounted() const { return mounted_; }
  const std::string& error() const { return error_; }
  const fs::path& dir() const { return dir_; }

 private:
  fs::path dir_;
  bool mounted_ = false;
  std::string error_;
};

RocksDbTier::Options Opts(const fs::path& dir) {
  RocksDbTier::Options o;
  o.path = (dir / "db").string();
  o.write_buffer_bytes = 512 << 10;
  o.blob_file_size = 1 << 20;
  o.resume_interval_ms = 10;
  return o;
}

TEST(KvStoreDiskFullTest, AFullTmpfsFailsWritesSoftlyAndTheRestartOpensReadOnly) {
  ScopedTmpfs tmpfs("24m");
  if (!tmpfs.mounted()) KVRELAY_SKIP_OR_FAIL() << "cannot mount a tmpfs (" << tmpfs.error() << ")";

  std::vector<uint64_t> durable;
  {
    auto t = RocksDbTier::Open(Opts(tmpfs.dir()));
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    // Write until the disk is full: durable batches are remembered.
    std::vector<uint64_t> batch;
    int failed_syncs = 0;
    for (uint64_t i = 0; i < 4000 && failed_syncs < 3; ++i) {
      auto b = testing::MakeBlock(i, Layout());
      if ((*t)->Put(b.meta.hash, b.Encoded()).ok()) batch.push_back(i);
      if (batch.size() == 8 || i % 8 == 7) {
        if ((*t)->WaitDurable(Deadline::AfterMs(10000)).ok()) {
          durable.insert(durable.end(), batch.begin(), batch.end());
        } else {
          ++failed_syncs;
        }
        batch.clear();
      }
    }
    ASSERT_GT(failed_syncs, 0) << "the tmpfs never filled up";
    ASSERT_FALSE(durable.empty());
    const TierStats s = (*t)->stats();
    EXPECT_GT(s.write_failures, 0);
    // Reads keep serving what was stored.
    for (uint64_t i : durable) {
      auto b = testing::MakeBlock(i, Layout());
      auto v = (*t)->Get(b.meta.hash);
      ASSERT_TRUE(v.ok()) << "block " << i << ": " << v.status().ToString();
      ASSERT_TRUE(DecodeBlock(*v, b.meta).ok()) << "block " << i;
    }
  }
  EXPECT_FALSE(fs::exists(tmpfs.dir() / "db" / "KVRELAY_DAMAGED")) << "a full disk is not damage";

  // The restart on the full disk: opens (read-only), serves every durable block.
  for (int restart = 0; restart < 2; ++restart) {
    auto t = RocksDbTier::Open(Opts(tmpfs.dir()));
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_NE((*t)->open_report().outcome, RocksDbTier::OpenOutcome::kMovedAside);
    EXPECT_TRUE((*t)->read_only()) << "restart " << restart;
    for (uint64_t i : durable) {
      auto b = testing::MakeBlock(i, Layout());
      auto v = (*t)->Get(b.meta.hash);
      ASSERT_TRUE(v.ok()) << "restart " << restart << ", block " << i << ": "
                          << v.status().ToString();
      ASSERT_TRUE(DecodeBlock(*v, b.meta).ok()) << "block " << i;
    }
    auto b = testing::MakeBlock(100000, Layout());
    EXPECT_FALSE((*t)->Put(b.meta.hash, b.Encoded()).ok());
  }
}

}  // namespace
}  // namespace kvrelay::kv_store
