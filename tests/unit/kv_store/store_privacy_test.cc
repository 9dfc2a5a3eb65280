// The prefix store keeps tenants' prompts private: its files are 0600 in 0700
// directories whatever the umask, and every block on disk is sealed with a
// key derived from the cluster key and the tenant's salt (block_seal.h).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>

#include "kv_store/block_seal.h"
#include "kv_store/rocksdb_tier.h"
#include "kv_store/tiered_cache.h"
#include "tests/unit/kv_store/test_blocks.h"

namespace kvrelay::kv_store {
namespace {

namespace fs = std::filesystem;
using engine::BlockId;
using engine::KvBlockPool;

constexpr char kSecret[] = "0123456789abcdef0123456789abcdef-cluster-a";
constexpr char kOtherSecret[] = "0123456789abcdef0123456789abcdef-cluster-b";
constexpr char kSalt[] = "tenant-a";
constexpr int kBlocks = 4;

engine::KvLayout Layout() {
  engine::KvLayout l;
  l.layers = 2;
  l.kv_heads = 2;
  l.head_dim = 16;
  l.block_tokens = 8;
  l.dtype = engine::KvDtype::kF32;
  return l;
}

std::unique_ptr<KvBlockPool> MakePool(int blocks) {
  const engine::KvLayout l = Layout();
  return KvBlockPool::Create({.layout = l, .capacity_bytes = blocks * l.BlockBytes()}).value();
}

// A prompt whose token ids spell a known plaintext ("My bank PIN is 4711").
std::vector<int32_t> SecretPrompt() {
  const std::string text = "My bank PIN is 4711, my password is hunter2.";
  std::vector<int32_t> t;
  for (int i = 0; static_cast<int>(t.size()) < kBlocks * Layout().block_tokens; ++i) {
    t.push_back(static_cast<int32_t>(text[static_cast<size_t>(i) % text.size()]) + 1000 * i);
  }
  return t;
}

std::string TokenBytes(std::span<const int32_t> tokens) {
  return std::string(reinterpret_cast<const char*>(tokens.data()), tokens.size() * sizeof(int32_t));
}

// Writes deterministic KV for every full block, commits and releases it.
// Returns every block's layer bytes, back to back.
std::vector<std::string> Prefill(KvBlockPool* pool, std::span<const int32_t> tokens,
                                 const engine::ModelFingerprint& model, std::string_view salt) {
  const auto& l = pool->layout();
  auto hashes = engine::HashPrefixBlocks(tokens, l.block_tokens, model, salt);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1, 1);
  std::vector<float> k(static_cast<size_t>(l.kv_heads * l.head_dim)), v(k.size());
  std::vector<std::string> out;
  for (const BlockHash& h : hashes) {
    BlockId id = pool->Allocate().value();
    std::string bytes;
    for (int layer = 0; layer < l.layers; ++layer) {
      for (int off = 0; off < l.block_tokens; ++off) {
        for (auto& x : k) x = dist(rng);
        for (auto& x : v) x = dist(rng);
        pool->WriteToken(id, layer, off, k.data(), v.data());
      }
      auto d = pool->LayerData(id, layer);
      bytes.append(reinterpret_cast<const char*>(d.data()), d.size());
    }
    pool->Commit(id, h);
    pool->Release(id);
    out.push_back(std::move(bytes));
  }
  return out;
}

std::string BlockBytes(KvBlockPool* pool, BlockId id) {
  std::string bytes;
  for (int layer = 0; layer < pool->layout().layers; ++layer) {
    auto d = pool->LayerData(id, layer);
    bytes.append(reinterpret_cast<const char*>(d.data()), d.size());
  }
  return bytes;
}

std::string ReadFile(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

mode_t ModeOf(const fs::path& p) {
  struct stat st;
  EXPECT_EQ(::lstat(p.c_str(), &st), 0) << p;
  return st.st_mode & 07777;
}

class StorePrivacyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("kvstore_privacy_" + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
    dir_ = root_ / "kvstore" / "worker-0";
  }
  void TearDown() override { fs::remove_all(root_); }

  RocksDbTier::Options DiskOpts() const {
    RocksDbTier::Options o;
    o.path = dir_.string();
    o.write_buffer_bytes = 1 << 20;
    o.min_blob_size = 256;
    return o;
  }
  static TieredCache::Options Sealed(std::string_view secret) {
    TieredCache::Options o;
    o.sealer = BlockSealer::Create(secret).value();
    return o;
  }

  // Computes SecretPrompt's blocks for `salt` and writes them through to a
  // store opened with `options`; closes it. Returns the blocks' KV bytes.
  std::vector<std::string> Write(const TieredCache::Options& options,
                                 std::string_view salt = kSalt) {
    auto disk = RocksDbTier::Open(DiskOpts()).value();
    TieredCache cache(options, nullptr, disk.get());
    auto pool = MakePool(16);
    testing::AttachScope attached(cache, pool.get());
    const std::vector<int32_t> tokens = SecretPrompt();
    (void)cache.Match(tokens, model_, salt);
    std::vector<std::string> kv = Prefill(pool.get(), tokens, model_, salt);
    EXPECT_TRUE(cache.Drain(Deadline::AfterMs(10000)).ok());
    EXPECT_EQ(cache.stats().write_through_blocks, kBlocks);
    cache.Detach();
    return kv;
  }

  // Opens the store with `options` and loads SecretPrompt's blocks as
  // tenant `salt` (the keys looked up are always tenant kSalt's). Returns the
  // loaded blocks' KV bytes and the cache's stats.
  std::vector<std::string> Load(const TieredCache::Options& options, TieredCache::Stats* stats,
                                std::string_view salt = kSalt) {
    auto disk = RocksDbTier::Open(DiskOpts()).value();
    TieredCache cache(options, nullptr, disk.get());
    auto pool = MakePool(16);
    testing::AttachScope attached(cache, pool.get());
    const std::vector<int32_t> tokens = SecretPrompt();
    PrefixMatch m = cache.Match(tokens, model_, kSalt);
    EXPECT_EQ(m.external_blocks, kBlocks) << "the index knows every block";
    std::vector<BlockId> dst;
    for (int i = 0; i < kBlocks; ++i) dst.push_back(pool->Allocate().value());
    auto load = cache.StartLoad(m, tokens, model_, salt, dst);
    const int n = cache.FinishLoad(*load, Deadline::AfterMs(10000)).value();
    std::vector<std::string> kv;
    for (int i = 0; i < n; ++i) kv.push_back(BlockBytes(pool.get(), dst[static_cast<size_t>(i)]));
    for (BlockId b : dst) pool->Release(b);
    *stats = cache.stats();
    cache.Detach();
    return kv;
  }

  static int64_t Misses(const TieredCache::Stats& s, MissReason r) {
    return s.misses[static_cast<size_t>(r)];
  }

  fs::path root_;
  fs::path dir_;
  engine::ModelFingerprint model_ = testing::Fingerprint(4);
};

TEST_F(StorePrivacyTest, FilesAre0600InDirectories0700WhateverTheUmask) {
  const mode_t old_umask = ::umask(0);
  Write(Sealed(kSecret));  // closing flushes: SST and blob files exist now
  {
    auto disk = RocksDbTier::Open(DiskOpts()).value();  // a second open: new MANIFEST, WAL
  }
  ::umask(old_umask);
  EXPECT_EQ(ModeOf(root_ / "kvstore"), 0700u) << "a parent Open created";
  EXPECT_EQ(ModeOf(dir_), 0700u);
  int files = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir_)) {
    if (e.is_directory()) {
      EXPECT_EQ(ModeOf(e.path()), 0700u) << e.path();
    } else {
      EXPECT_EQ(ModeOf(e.path()), 0600u) << e.path();
      ++files;
    }
  }
  EXPECT_GE(files, 5);  // CURRENT, LOCK, MANIFEST, OPTIONS, WAL, SST, blob
}

TEST_F(StorePrivacyTest, OpenMakesAnExistingStorePrivate) {
  Write(Sealed(kSecret));
  // As an older kvrelay left it: umask 022 modes, and a world-writable file.
  fs::permissions(root_ / "kvstore", fs::perms(0755));
  fs::permissions(dir_, fs::perms(0755));
  fs::create_directories(dir_ / "archive");
  fs::permissions(dir_ / "archive", fs::perms(0777));
  std::ofstream(dir_ / "stray") << "x";
  for (const auto& e : fs::recursive_directory_iterator(dir_)) {
    if (!e.is_directory()) fs::permissions(e.path(), fs::perms(0666));
  }
  auto disk = RocksDbTier::Open(DiskOpts()).value();
  EXPECT_EQ(ModeOf(dir_), 0700u);
  for (const auto& e : fs::recursive_directory_iterator(dir_)) {
    EXPECT_EQ(ModeOf(e.path()), e.is_directory() ? 0700u : 0600u) << e.path();
  }
}

TEST_F(StorePrivacyTest, NoFileOrValueOnDiskHoldsThePromptsTokens) {
  Write(Sealed(kSecret));
  const std::vector<int32_t> tokens = SecretPrompt();
  const int bt = Layout().block_tokens;
  const auto hashes = engine::HashPrefixBlocks(tokens, bt, model_, kSalt);
  {
    auto disk = RocksDbTier::Open(DiskOpts()).value();
    for (int b = 0; b < kBlocks; ++b) {
      Result<std::string> raw = disk->Get(hashes[static_cast<size_t>(b)]);
      ASSERT_TRUE(raw.ok()) << raw.status().ToString();
      const std::span<const int32_t> block(tokens.data() + b * bt, static_cast<size_t>(bt));
      EXPECT_EQ(raw->find(TokenBytes(block)), std::string::npos) << "block " << b;
      EXPECT_EQ(raw->find(TokenBytes(block.subspan(0, 2))), std::string::npos) << "block " << b;
    }
  }
  int files = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir_)) {
    if (!e.is_regular_file()) continue;
    ++files;
    const std::string bytes = ReadFile(e.path());
    for (int b = 0; b < kBlocks; ++b) {
      const std::span<const int32_t> block(tokens.data() + b * bt, static_cast<size_t>(bt));
      EXPECT_EQ(bytes.find(TokenBytes(block.subspan(0, 2))), std::string::npos)
          << e.path() << " holds block " << b << "'s token ids";
    }
  }
  EXPECT_GT(files, 0);
}

TEST_F(StorePrivacyTest, TheSameKeyAfterAReopenIsAHit) {
  const std::vector<std::string> want = Write(Sealed(kSecret));
  {
    auto disk = RocksDbTier::Open(DiskOpts()).value();
    const auto hashes =
        engine::HashPrefixBlocks(SecretPrompt(), Layout().block_tokens, model_, kSalt);
    for (const BlockHash& h : hashes) {
      const std::string raw = disk->Get(h).value();
      uint32_t magic = 0;
      std::memcpy(&magic, raw.data(), std::min(raw.size(), sizeof(magic)));
      EXPECT_EQ(magic, kSealMagic) << "stored sealed";
    }
  }
  TieredCache::Stats s;
  const std::vector<std::string> got = Load(Sealed(kSecret), &s);
  EXPECT_EQ(got, want);
  EXPECT_EQ(s.restored_blocks_disk, kBlocks);
}

TEST_F(StorePrivacyTest, AnotherClusterKeyIsAMissAndStartsClean) {
  Write(Sealed(kSecret));
  TieredCache::Stats s;
  EXPECT_TRUE(Load(Sealed(kOtherSecret), &s).empty());
  EXPECT_EQ(s.restored_blocks_disk, 0);
  EXPECT_EQ(Misses(s, MissReason::kAuth), 1);  // a prefix ends at its first miss
  auto disk = RocksDbTier::Open(DiskOpts()).value();
  const auto hashes =
      engine::HashPrefixBlocks(SecretPrompt(), Layout().block_tokens, model_, kSalt);
  EXPECT_FALSE(disk->Contains(hashes[0])) << "a block that never opens is dropped";
}

TEST_F(StorePrivacyTest, AnotherTenantsSaltIsAMiss) {
  Write(Sealed(kSecret));
  TieredCache::Stats s;
  EXPECT_TRUE(Load(Sealed(kSecret), &s, "tenant-b").empty());
  EXPECT_EQ(Misses(s, MissReason::kAuth), 1) << "the key of tenant-b does not open it";
  EXPECT_EQ(Misses(s, MissReason::kTenant), 0) << "never decrypted";
}

TEST_F(StorePrivacyTest, ATamperedCiphertextIsAMissAndCounted) {
  const std::vector<std::string> want = Write(Sealed(kSecret));
  const auto hashes =
      engine::HashPrefixBlocks(SecretPrompt(), Layout().block_tokens, model_, kSalt);
  {
    auto disk = RocksDbTier::Open(DiskOpts()).value();
    std::string v = disk->Get(hashes[2]).value();
    v[v.size() / 2] ^= 0x01;
    ASSERT_TRUE(disk->Put(hashes[2], v).ok());
    ASSERT_TRUE(disk->Flush(Deadline::AfterMs(10000)).ok());
  }
  TieredCache::Stats s;
  const std::vector<std::string> got = Load(Sealed(kSecret), &s);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0], want[0]);
  EXPECT_EQ(got[1], want[1]);
  EXPECT_EQ(Misses(s, MissReason::kAuth), 1);
  auto disk = RocksDbTier::Open(DiskOpts()).value();
  EXPECT_FALSE(disk->Contains(hashes[2]));
  EXPECT_TRUE(disk->Contains(hashes[3]));
}

TEST_F(StorePrivacyTest, AnOldPlaintextBlockIsAMissNotACrash) {
  Write(TieredCache::Options());  // no sealer: as kvrelay wrote blocks before
  TieredCache::Stats s;
  EXPECT_TRUE(Load(Sealed(kSecret), &s).empty());
  EXPECT_EQ(Misses(s, MissReason::kUnsealed), 1);
}

}  // namespace
}  // namespace kvrelay::kv_store
