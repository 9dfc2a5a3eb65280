#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "engine/kv_cache/kv_cache.h"

namespace kvrelay::engine {
namespace {

KvLayout SmallLayout(KvDtype dtype = KvDtype::kF32) {
  KvLayout l;
  l.layers = 2;
  l.kv_heads = 3;
  l.head_dim = 8;
  l.block_tokens = 4;
  l.dtype = dtype;
  return l;
}

std::unique_ptr<KvBlockPool> MakePool(int64_t blocks, KvDtype dtype = KvDtype::kF32) {
  KvBlockPool::Options o;
  o.layout = SmallLayout(dtype);
  o.staging_bytes = 0;
  o.capacity_bytes = blocks * o.layout.BlockBytes();
  auto pool = KvBlockPool::Create(o);
  EXPECT_TRUE(pool.ok()) << pool.status().ToString();
  return std::move(pool).value();
}

BlockHash H(uint8_t v) {
  BlockHash h{};
  h[0] = v;
  h[31] = static_cast<uint8_t>(~v);
  return h;
}

// Distinct value for (layer, kv, head, token, channel).
float Val(int layer, int kv, int head, int tok, int ch) {
  return static_cast<float>(layer * 10000 + kv * 1000 + head * 100 + tok * 10 + ch) * 0.25f;
}

void FillBlock(KvBlockPool& pool, BlockId id, int tokens) {
  const KvLayout& l = pool.layout();
  std::vector<float> k(l.kv_heads * l.head_dim), v(k.size());
  for (int layer = 0; layer < l.layers; ++layer) {
    for (int t = 0; t < tokens; ++t) {
      for (int h = 0; h < l.kv_heads; ++h)
        for (int c = 0; c < l.head_dim; ++c) {
          k[h * l.head_dim + c] = Val(layer, 0, h, t, c);
          v[h * l.head_dim + c] = Val(layer, 1, h, t, c);
        }
      pool.WriteToken(id, layer, t, k.data(), v.data());
    }
  }
}

TEST(KvLayoutTest, SizesPerDtype) {
  KvLayout l = SmallLayout();
  // f32: 4 tokens * 8 dims * 4 bytes.
  EXPECT_EQ(l.SlabBytes(), 128);
  EXPECT_EQ(l.LayerBytes(), 2 * 3 * 128);
  EXPECT_EQ(l.BlockBytes(), 2 * 2 * 3 * 128);
  EXPECT_DOUBLE_EQ(l.BytesPerToken(), 2.0 * 2 * 3 * 8 * 4);
  l.dtype = KvDtype::kF16;
  EXPECT_EQ(l.SlabBytes(), 64);
  l.dtype = KvDtype::kBF16;
  EXPECT_EQ(l.SlabBytes(), 64);
  l.dtype = KvDtype::kInt8;
  EXPECT_EQ(l.SlabBytes(), 32 + 4 * 4);  // codes + one f32 scale per token
  // SmolLM2 geometry, block of 16: kivi4 codes 16*64/2 = 512 bytes, parameters
  // max(64 channels, 16 tokens * 2 groups) * (2 x f16) = 256 bytes.
  KvLayout s{30, 3, 64, 16, KvDtype::kKivi4};
  EXPECT_EQ(s.SlabBytes(), 512 + 256);
  s.dtype = KvDtype::kKivi2;
  EXPECT_EQ(s.SlabBytes(), 256 + 256);
  s.dtype = KvDtype::kF32;
  EXPECT_DOUBLE_EQ(s.BytesPerToken(), 2.0 * 30 * 3 * 64 * 4);  // 46080
}

TEST(KvPoolTest, CreateRejectsBadOptions) {
  KvBlockPool::Options o;
  o.layout = SmallLayout();
  o.layout.head_dim = 0;
  auto r = KvBlockPool::Create(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);

  o.layout = SmallLayout();
  o.capacity_bytes = o.layout.BlockBytes() - 1;
  r = KvBlockPool::Create(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);

  o.layout = SmallLayout(KvDtype::kKivi2);
  o.layout.head_dim = 6;  // 6 * 2 bits is not a whole number of bytes
  o.capacity_bytes = 1 << 20;
  r = KvBlockPool::Create(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

TEST(KvPoolTest, AllocateUntilExhaustedThenRelease) {
  auto pool = MakePool(3);
  EXPECT_EQ(pool->total_blocks(), 3);
  std::vector<BlockId> ids;
  for (int i = 0; i < 3; ++i) {
    auto b = pool->Allocate();
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(pool->refcount(*b), 1);
    ids.push_back(*b);
  }
  EXPECT_EQ(pool->free_blocks(), 0);
  auto none = pool->Allocate();
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kResourceExhausted);
  pool->Ref(ids[0]);
  EXPECT_EQ(pool->refcount(ids[0]), 2);
  pool->Release(ids[0]);
  EXPECT_EQ(pool->free_blocks(), 0);
  pool->Release(ids[0]);
  EXPECT_EQ(pool->refcount(ids[0]), 0);
  EXPECT_EQ(pool->free_blocks(), 1);
  pool->Release(ids[0]);  // a stray release is ignored, not a crash or a double free
  EXPECT_EQ(pool->free_blocks(), 1);
  for (int i = 1; i < 3; ++i) pool->Release(ids[i]);
  EXPECT_EQ(pool->free_blocks(), 3);
}

TEST(KvPoolTest, F32WriteReadAndLayerLayout) {
  auto pool = MakePool(2);
  const KvLayout& l = pool->layout();
  BlockId id = *pool->Allocate();
  FillBlock(*pool, id, l.block_tokens);
  std::vector<float> k(l.block_tokens * l.head_dim), v(k.size());
  for (int layer = 0; layer < l.layers; ++layer) {
    for (int h = 0; h < l.kv_heads; ++h) {
      pool->ReadHead(id, layer, h, 3, k.data(), v.data());
      for (int t = 0; t < 3; ++t)
        for (int c = 0; c < l.head_dim; ++c) {
          ASSERT_EQ(k[t * l.head_dim + c], Val(layer, 0, h, t, c));
          ASSERT_EQ(v[t * l.head_dim + c], Val(layer, 1, h, t, c));
        }
    }
    // In-place f32 slabs hold the same values.
    for (int h = 0; h < l.kv_heads; ++h) {
      const float* ks = pool->HeadSlabF32(id, layer, false, h);
      const float* vs = pool->HeadSlabF32(id, layer, true, h);
      ASSERT_NE(ks, nullptr);
      EXPECT_EQ(ks[2 * l.head_dim + 5], Val(layer, 0, h, 2, 5));
      EXPECT_EQ(vs[3 * l.head_dim + 7], Val(layer, 1, h, 3, 7));
    }
    // LayerData: K slabs of all heads, then V slabs; each slab [token][dim].
    auto bytes = pool->LayerData(id, layer);
    ASSERT_EQ(static_cast<int64_t>(bytes.size()), l.LayerBytes());
    for (int kv = 0; kv < 2; ++kv)
      for (int h = 0; h < l.kv_heads; ++h)
        for (int t = 0; t < l.block_tokens; ++t)
          for (int c = 0; c < l.head_dim; ++c) {
            float f;
            std::memcpy(
                &f, bytes.data() + (kv * l.kv_heads + h) * l.SlabBytes() + (t * l.head_dim + c) * 4,
                4);
            ASSERT_EQ(f, Val(layer, kv, h, t, c));
          }
  }
}

TEST(KvPoolTest, CopyBlockCopiesEveryLayer) {
  auto pool = MakePool(2);
  const KvLayout& l = pool->layout();
  BlockId a = *pool->Allocate(), b = *pool->Allocate();
  FillBlock(*pool, a, l.block_tokens);
  pool->CopyBlock(a, b);
  for (int layer = 0; layer < l.layers; ++layer) {
    auto da = pool->LayerData(a, layer), db = pool->LayerData(b, layer);
    EXPECT_EQ(0, std::memcmp(da.data(), db.data(), da.size()));
  }
}

TEST(KvPoolTest, PrefixCacheCommitMatchAndEvents) {
  auto pool = MakePool(4);
  std::vector<KvEvent> events;
  pool->SetEventListener([&](const KvEvent& e) { events.push_back(e); });
  BlockId a = *pool->Allocate(), b = *pool->Allocate();
  pool->Commit(a, H(1));
  pool->Commit(b, H(2));
  pool->Commit(b, H(3));  // already cached block: no-op
  BlockId c = *pool->Allocate();
  pool->Commit(c, H(1));  // hash held by another block: no-op
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].kind, KvEvent::Kind::kStored);
  EXPECT_EQ(events[0].hash, H(1));
  EXPECT_EQ(events[1].hash, H(2));
  EXPECT_TRUE(pool->IsCached(H(2)));
  EXPECT_FALSE(pool->IsCached(H(3)));

  pool->Release(a);
  pool->Release(b);
  pool->Release(c);
  // a and b stay cached though unreferenced; c is free.
  EXPECT_EQ(pool->free_blocks(), 2);
  EXPECT_EQ(pool->available_blocks(), 4);

  const std::vector<BlockHash> query = {H(1), H(2), H(9), H(1)};
  auto m = pool->MatchPrefix(query);
  ASSERT_EQ(m.size(), 2u);  // stops at the first miss
  EXPECT_EQ(m[0], a);
  EXPECT_EQ(m[1], b);
  EXPECT_EQ(pool->refcount(a), 1);
  EXPECT_EQ(pool->available_blocks(), 2);
  pool->Release(a);
  pool->Release(b);
  EXPECT_TRUE(pool->MatchPrefix(std::vector<BlockHash>{H(2)}).size() == 1);
  pool->Release(b);
}

TEST(KvPoolTest, LruEvictsLeastRecentlyUsedWithSpillBeforeReuse) {
  auto pool = MakePool(3);
  const KvLayout& l = pool->layout();
  std::vector<BlockId> ids;
  for (int i = 0; i < 3; ++i) {
    BlockId id = *pool->Allocate();
    FillBlock(*pool, id, l.block_tokens);
    pool->Commit(id, H(static_cast<uint8_t>(10 + i)));
    ids.push_back(id);
  }
  // Release order 1, 0, 2 -> LRU order 1, 0, 2.
  pool->Release(ids[1]);
  pool->Release(ids[0]);
  pool->Release(ids[2]);
  // Touch block 1 (match + release): now order 0, 2, 1.
  auto m = pool->MatchPrefix(std::vector<BlockHash>{H(11)});
  ASSERT_EQ(m.size(), 1u);
  pool->Release(m[0]);

  std::vector<std::string> log;
  pool->SetEventListener([&](const KvEvent& e) {
    log.push_back(std::string(e.kind == KvEvent::Kind::kEvicted ? "evicted " : "stored ") +
                  std::to_string(e.hash[0]));
  });
  pool->SetSpillHook([&](const BlockHash& h, BlockId id) {
    log.push_back("spill " + std::to_string(h[0]));
    // The hook sees the block's contents intact and the hash still cached.
    EXPECT_TRUE(pool->IsCached(h));
    std::vector<float> k(l.block_tokens * l.head_dim), v(k.size());
    pool->ReadHead(id, 1, 2, l.block_tokens, k.data(), v.data());
    EXPECT_EQ(v[3 * l.head_dim + 5], Val(1, 1, 2, 3, 5));
  });
  BlockId x = *pool->Allocate();
  EXPECT_EQ(x, ids[0]);
  BlockId y = *pool->Allocate();
  EXPECT_EQ(y, ids[2]);
  EXPECT_EQ(log, (std::vector<std::string>{"spill 10", "evicted 10", "spill 12", "evicted 12"}));
  EXPECT_FALSE(pool->IsCached(H(10)));
  EXPECT_TRUE(pool->IsCached(H(11)));
  // Block 1 is still cached and matchable; with it referenced nothing is left.
  auto m2 = pool->MatchPrefix(std::vector<BlockHash>{H(11)});
  ASSERT_EQ(m2.size(), 1u);
  auto none = pool->Allocate();
  EXPECT_EQ(none.status().code(), StatusCode::kResourceExhausted);
  pool->Release(m2[0]);
  pool->Release(x);
  pool->Release(y);
  EXPECT_EQ(pool->available_blocks(), 3);
}

TEST(KvPoolTest, TenantsNeverShareBlocks) {
  auto pool = MakePool(4);
  ModelFingerprint model{};
  model[0] = 42;
  std::vector<int32_t> tokens = {1, 2, 3, 4, 5, 6, 7, 8};
  auto ha = HashPrefixBlocks(tokens, 4, model, "tenant-a");
  auto hb = HashPrefixBlocks(tokens, 4, model, "tenant-b");
  std::vector<BlockId> owned;
  for (const auto& h : ha) {
    BlockId id = *pool->Allocate();
    pool->Commit(id, h);
    owned.push_back(id);
  }
  EXPECT_TRUE(pool->MatchPrefix(hb).empty());
  auto same = pool->MatchPrefix(ha);
  EXPECT_EQ(same, owned);
  for (BlockId id : same) pool->Release(id);
  for (BlockId id : owned) pool->Release(id);
}

// The pool's pages are faulted in behind it (kv_storage.cc, Slab): a restore
// into never-used blocks spent most of its time in page faults when they
// came on first touch. Nothing is written: the pages become resident and
// still read zero.
TEST(KvPoolTest, PagesBecomeResidentWithoutBeingTouched) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  {
    void* probe = mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(probe, MAP_FAILED);
    const bool supported = madvise(probe, page, MADV_POPULATE_WRITE) == 0;
    munmap(probe, page);
    if (!supported) GTEST_SKIP() << "the kernel has no MADV_POPULATE_WRITE (before Linux 5.14)";
  }
  const int64_t blocks = (int64_t{32} << 20) / SmallLayout().BlockBytes();  // 32 MiB
  auto pool = MakePool(blocks);
  const auto first = reinterpret_cast<uintptr_t>(pool->LayerAddress(0, 0));
  const uintptr_t last = reinterpret_cast<uintptr_t>(pool->LayerAddress(blocks - 1, 1)) +
                         static_cast<uintptr_t>(SmallLayout().LayerBytes());
  const uintptr_t begin = first / page * page;
  const size_t pages = (last - begin + page - 1) / page;
  std::vector<unsigned char> in_core(pages);
  auto resident = [&] {
    if (mincore(reinterpret_cast<void*>(begin), pages * page, in_core.data()) != 0)
      return size_t{0};
    size_t n = 0;
    for (unsigned char c : in_core) n += c & 1;
    return n;
  };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  size_t got = resident();
  while (got < pages && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // polling, to the deadline
    got = resident();
  }
  EXPECT_EQ(got, pages) << "of the pool's pages resident 20 s after it was made";
  const uint8_t* bytes = pool->LayerAddress(0, 0);
  for (size_t i = 0; i < last - first; i += 4093) ASSERT_EQ(bytes[i], 0) << "byte " << i;
}

}  // namespace
}  // namespace kvrelay::engine
