#include "kv_transfer/layer_stream.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "kv_transfer/head_sharding.h"
#include "tests/testing/fault_injecting_transport.h"
#include "transport_pair.h"

namespace kvrelay::kv_transfer {
namespace {

using testing::MakePair;
using testing::RandomBytes;

// The default model's KV geometry: 30 layers, 3 kv heads, head_dim 64, f16, 16-token blocks.
constexpr int kLayers = 30, kHeads = 3, kHeadDim = 64, kBlockTokens = 16;
constexpr int64_t kSlab = kBlockTokens * kHeadDim * 2;

struct Blocks {
  int heads;
  int count;
  std::vector<uint8_t> bytes;
  Blocks(int heads, int count, uint32_t seed)
      : heads(heads),
        count(count),
        bytes(seed ? RandomBytes(BlockBytes(heads) * count, seed)
                   : std::vector<uint8_t>(BlockBytes(heads) * count, 0)) {}
  static size_t BlockBytes(int heads) { return static_cast<size_t>(kLayers * 2 * heads * kSlab); }
  uint8_t* block(int i) { return bytes.data() + i * BlockBytes(heads); }
  // Slab of (block, layer, K|V, head).
  const uint8_t* slab(int b, int l, int kv, int h) const {
    return bytes.data() + b * BlockBytes(heads) + (l * 2 * heads + kv * heads + h) * kSlab;
  }
};

StreamSpec Spec(uint64_t req, int nblocks, HeadRange global, uint32_t stream_id = 0) {
  StreamSpec s;
  s.request_id = req;
  s.stream_id = stream_id;
  s.layers = kLayers;
  for (int i = 0; i < nblocks; ++i) s.blocks.push_back(100 + i);
  s.global_heads = global;
  s.block_tokens = kBlockTokens;
  s.head_dim = kHeadDim;
  s.dtype = engine::KvDtype::kF16;
  s.model_fingerprint.fill(0x42);
  return s;
}

StreamBuffers Buffers(Blocks& b, HeadRange local) {
  StreamBuffers sb;
  sb.layout = {b.heads, kSlab, MemoryKind::kHost};
  sb.local_heads = local;
  for (int i = 0; i < b.count; ++i) sb.block_layer0.push_back(b.block(i));
  return sb;
}

class LayerStreamTest : public ::testing::TestWithParam<std::string> {};

TEST_P(LayerStreamTest, LayersCompleteOneByOneAndBytesMatch) {
  auto pair = MakePair(GetParam());
  Blocks src(kHeads, 8, 1), dst(kHeads, 8, 0);
  LayerStreamReceiver rx(pair.b.get(), 0, Spec(1, 8, {0, 3}), Buffers(dst, {0, 3}));
  LayerStreamSender tx(pair.a.get(), 1, Spec(1, 8, {0, 3}), Buffers(src, {0, 3}));
  ASSERT_TRUE(rx.Start().ok());
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(tx.SendLayer(l).ok());
    ASSERT_TRUE(rx.WaitLayer(l, Deadline::AfterMs(10000)).ok()) << rx.status().ToString();
    EXPECT_TRUE(rx.LayerComplete(l));
    if (l + 1 < kLayers) {
      EXPECT_FALSE(rx.LayerComplete(l + 1));
      EXPECT_FALSE(rx.complete());
    }
    EXPECT_EQ(rx.layers_complete(), l + 1);
  }
  ASSERT_TRUE(tx.Finish(Deadline::AfterMs(10000)).ok());
  ASSERT_TRUE(rx.WaitAll(Deadline::AfterMs(10000)).ok());
  EXPECT_TRUE(rx.complete());
  EXPECT_TRUE(src.bytes == dst.bytes);
  EXPECT_EQ(pair.a->inflight(), 0);
  EXPECT_EQ(pair.b->inflight(), 0);
}

// A receiver whose blocks keep their layers apart (an engine with KV cache
// groups: layer l of block i at layer_data[l * blocks + i]) gets the bytes of
// a contiguous sender, verified.
TEST_P(LayerStreamTest, ScatteredLayerAddressesReceiveEveryLayer) {
  auto pair = MakePair(GetParam());
  constexpr int kBlocks = 4;
  Blocks src(kHeads, kBlocks, 7);
  const size_t layer_bytes = static_cast<size_t>(2 * kHeads * kSlab);
  // One buffer per layer, the blocks of that layer side by side, in reverse
  // block order so no fixed stride can describe them.
  std::vector<std::vector<uint8_t>> per_layer(kLayers,
                                              std::vector<uint8_t>(layer_bytes * kBlocks, 0));
  Blocks unused(kHeads, kBlocks, 0);
  StreamBuffers rb = Buffers(unused, {0, kHeads});
  for (int l = 0; l < kLayers; ++l) {
    for (int i = 0; i < kBlocks; ++i) {
      rb.layer_data.push_back(per_layer[l].data() + (kBlocks - 1 - i) * layer_bytes);
    }
  }
  LayerStreamReceiver rx(pair.b.get(), 0, Spec(3, kBlocks, {0, kHeads}), rb);
  LayerStreamSender tx(pair.a.get(), 1, Spec(3, kBlocks, {0, kHeads}), Buffers(src, {0, kHeads}));
  ASSERT_TRUE(rx.Start().ok());
  for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(tx.SendLayer(l).ok());
  ASSERT_TRUE(tx.Finish(Deadline::AfterMs(10000)).ok());
  ASSERT_TRUE(rx.WaitAll(Deadline::AfterMs(10000)).ok()) << rx.status().ToString();
  for (int l = 0; l < kLayers; ++l) {
    for (int i = 0; i < kBlocks; ++i) {
      ASSERT_EQ(std::memcmp(rb.layer_data[l * kBlocks + i], src.slab(i, l, 0, 0), layer_bytes), 0)
          << "block " << i << " layer " << l;
    }
  }
  EXPECT_TRUE(
      std::all_of(unused.bytes.begin(), unused.bytes.end(), [](uint8_t b) { return b == 0; }));
  // A wrong number of addresses is refused up front.
  StreamBuffers short_rb = rb;
  short_rb.layer_data.pop_back();
  LayerStreamReceiver bad(pair.b.get(), 0, Spec(4, kBlocks, {0, kHeads}), short_rb);
  EXPECT_EQ(bad.Start().code(), StatusCode::kInvalidArgument);
}

TEST_P(LayerStreamTest, CorruptedPayloadIsCaughtAndNothingIsComplete) {
  auto pair = MakePair(GetParam());
  FaultInjectingTransport faulty(pair.a.get(), [](const TransferDesc& d) {
    return d.tag == StreamTag(0, 5, /*payload=*/true) ? Fault::kCorrupt : Fault::kNone;
  });
  Blocks src(kHeads, 4, 2), dst(kHeads, 4, 0);
  LayerStreamReceiver rx(pair.b.get(), 0, Spec(2, 4, {0, 3}), Buffers(dst, {0, 3}));
  LayerStreamSender tx(&faulty, 1, Spec(2, 4, {0, 3}), Buffers(src, {0, 3}));
  ASSERT_TRUE(rx.Start().ok());
  for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(tx.SendLayer(l).ok());
  Status st = rx.WaitAll(Deadline::AfterMs(10000));
  EXPECT_EQ(faulty.corrupted(), 1);
  EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.ToString();
  EXPECT_NE(st.message().find("layer 5: checksum mismatch in block"), std::string::npos)
      << st.ToString();
  EXPECT_FALSE(rx.complete());
  EXPECT_FALSE(rx.valid());
  EXPECT_FALSE(rx.LayerComplete(0));  // an invalid destination reports nothing complete
  (void)tx.Finish(Deadline::AfterMs(10000));
  EXPECT_EQ(pair.b->inflight(), 0);
}

TEST_P(LayerStreamTest, CorruptedManifestIsCaught) {
  auto pair = MakePair(GetParam());
  FaultInjectingTransport faulty(pair.a.get(), [](const TransferDesc& d) {
    return d.tag == StreamTag(0, 0, /*payload=*/false) ? Fault::kCorrupt : Fault::kNone;
  });
  Blocks src(kHeads, 2, 3), dst(kHeads, 2, 0);
  LayerStreamReceiver rx(pair.b.get(), 0, Spec(3, 2, {0, 3}), Buffers(dst, {0, 3}));
  LayerStreamSender tx(&faulty, 1, Spec(3, 2, {0, 3}), Buffers(src, {0, 3}));
  ASSERT_TRUE(rx.Start().ok());
  for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(tx.SendLayer(l).ok());
  Status st = rx.WaitAll(Deadline::AfterMs(10000));
  EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.ToString();
  EXPECT_NE(st.message().find("layer 0: manifest checksum mismatch"), std::string::npos)
      << st.ToString();
  EXPECT_FALSE(rx.complete());
  (void)tx.Finish(Deadline::AfterMs(10000));
}

TEST_P(LayerStreamTest, MissingLayerHitsDeadlineAndFreesEverything) {
  auto pair = MakePair(GetParam());
  FaultInjectingTransport faulty(pair.a.get(), [](const TransferDesc& d) {
    return d.tag == StreamTag(0, 7, /*payload=*/true) ? Fault::kDrop : Fault::kNone;
  });
  Blocks src(kHeads, 2, 4), dst(kHeads, 2, 0);
  LayerStreamReceiver rx(pair.b.get(), 0, Spec(4, 2, {0, 3}), Buffers(dst, {0, 3}));
  LayerStreamSender tx(&faulty, 1, Spec(4, 2, {0, 3}), Buffers(src, {0, 3}));
  ASSERT_TRUE(rx.Start().ok());
  for (int l = 0; l < kLayers; ++l) ASSERT_TRUE(tx.SendLayer(l).ok());
  ASSERT_TRUE(tx.Finish(Deadline::AfterMs(10000)).ok());
  auto start = Clock::now();
  Status st = rx.WaitAll(Deadline::AfterMs(300));
  EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded) << st.ToString();
  EXPECT_NE(st.message().find("layer 7"), std::string::npos) << st.ToString();
  EXPECT_LT(SecondsSince(start), 3.0);
  EXPECT_EQ(faulty.dropped(), 1);
  EXPECT_FALSE(rx.complete());
  EXPECT_EQ(pair.b->inflight(), 0);  // every receive was cancelled and released
}

TEST_P(LayerStreamTest, WrongModelFingerprintIsRefused) {
  auto pair = MakePair(GetParam());
  Blocks src(kHeads, 1, 5), dst(kHeads, 1, 0);
  StreamSpec other = Spec(5, 1, {0, 3});
  other.model_fingerprint[0] ^= 1;
  LayerStreamReceiver rx(pair.b.get(), 0, Spec(5, 1, {0, 3}), Buffers(dst, {0, 3}));
  LayerStreamSender tx(pair.a.get(), 1, other, Buffers(src, {0, 3}));
  ASSERT_TRUE(rx.Start().ok());
  ASSERT_TRUE(tx.SendLayer(0).ok());
  Status st = rx.WaitLayer(0, Deadline::AfterMs(10000));
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("model_fingerprint"), std::string::npos) << st.ToString();
}

INSTANTIATE_TEST_SUITE_P(Backends, LayerStreamTest, ::testing::Values("local", "tcp"));

TEST(HeadSharding, ShardsAndRoutesCoverEveryHeadOnce) {
  EXPECT_EQ(*ShardHeads(3, 2, 0), (HeadRange{0, 2}));
  EXPECT_EQ(*ShardHeads(3, 2, 1), (HeadRange{2, 3}));
  EXPECT_EQ(*ShardHeads(8, 4, 3), (HeadRange{6, 8}));
  EXPECT_FALSE(ShardHeads(3, 4, 0).ok());
  EXPECT_FALSE(ShardHeads(3, 2, 2).ok());
  auto routes = *PlanHeadRoutes(3, 2, 3);
  std::vector<int> seen(3, 0);
  for (const auto& r : routes) {
    for (int h = r.global.begin; h < r.global.end; ++h) ++seen[h];
    EXPECT_EQ(r.src_local.size(), r.global.size());
    EXPECT_EQ(r.dst_local.size(), r.global.size());
  }
  EXPECT_EQ(seen, std::vector<int>({1, 1, 1}));
  // 2 -> 3 with 3 heads: src0 has {0,1}, src1 {2}; dst d has {d}.
  ASSERT_EQ(routes.size(), 3u);
  EXPECT_EQ(routes[1].src_rank, 0);
  EXPECT_EQ(routes[1].src_local, (HeadRange{1, 2}));
  EXPECT_EQ(routes[2].src_rank, 1);
}

// More ranks than KV heads (Gemma 3 270M: 1 KV head, TP 2): each rank holds the
// one head its query heads share, the routes deliver it to every holder, and a
// replicated source sends each head once (from its first holder).
TEST(HeadSharding, ReplicatesHeadsWhenRanksOutnumberThem) {
  EXPECT_EQ(*ShardHeads(1, 2, 0), (HeadRange{0, 1}));
  EXPECT_EQ(*ShardHeads(1, 2, 1), (HeadRange{0, 1}));
  EXPECT_EQ(*ShardHeads(2, 4, 1), (HeadRange{0, 1}));
  EXPECT_EQ(*ShardHeads(2, 4, 2), (HeadRange{1, 2}));
  EXPECT_EQ(*ShardHeads(3, 6, 5), (HeadRange{2, 3}));
  EXPECT_FALSE(ShardHeads(2, 3, 0).ok());  // 3 ranks cannot replicate 2 heads evenly
  EXPECT_FALSE(ShardHeads(1, 2, 2).ok());
  auto one_to_two = *PlanHeadRoutes(1, 1, 2);
  ASSERT_EQ(one_to_two.size(), 2u);
  for (int d = 0; d < 2; ++d) {
    EXPECT_EQ(one_to_two[d].src_rank, 0);
    EXPECT_EQ(one_to_two[d].dst_rank, d);
    EXPECT_EQ(one_to_two[d].global, (HeadRange{0, 1}));
    EXPECT_EQ(one_to_two[d].dst_local, (HeadRange{0, 1}));
  }
  // 6 -> 3 with 3 heads: src ranks 2h and 2h + 1 both hold head h; dst h gets
  // it once, from rank 2h.
  auto six_to_three = *PlanHeadRoutes(3, 6, 3);
  ASSERT_EQ(six_to_three.size(), 3u);
  for (int d = 0; d < 3; ++d) {
    EXPECT_EQ(six_to_three[d].src_rank, 2 * d);
    EXPECT_EQ(six_to_three[d].global, (HeadRange{d, d + 1}));
    EXPECT_EQ(six_to_three[d].src_local, (HeadRange{0, 1}));
  }
}

// Prefill TP S -> decode TP D over one local fabric: every decode rank ends
// up with exactly the slabs of its own heads, byte-identical to the source.
void ReshardAndCheck(int src_tp, int dst_tp) {
  SCOPED_TRACE("src_tp " + std::to_string(src_tp) + " -> dst_tp " + std::to_string(dst_tp));
  const int nblocks = 3;
  auto fabric = LocalFabric::Create({.world_size = src_tp + dst_tp});
  std::vector<std::unique_ptr<LocalTransport>> ep;
  for (int r = 0; r < src_tp + dst_tp; ++r)
    ep.push_back(std::move(fabric->CreateEndpoint(r)).value());
  Blocks global(kHeads, nblocks, 77);
  // Each prefill rank holds its heads' slabs, extracted from the global blocks.
  std::vector<Blocks> src, dst;
  for (int s = 0; s < src_tp; ++s) {
    HeadRange hr = *ShardHeads(kHeads, src_tp, s);
    Blocks b(hr.size(), nblocks, 0);
    for (int i = 0; i < nblocks; ++i)
      for (int l = 0; l < kLayers; ++l)
        for (int kv = 0; kv < 2; ++kv)
          for (int h = 0; h < hr.size(); ++h)
            std::memcpy(const_cast<uint8_t*>(b.slab(i, l, kv, h)),
                        global.slab(i, l, kv, hr.begin + h), kSlab);
    src.push_back(std::move(b));
  }
  for (int d = 0; d < dst_tp; ++d)
    dst.emplace_back(ShardHeads(kHeads, dst_tp, d)->size(), nblocks, 0);
  auto routes = *PlanHeadRoutes(kHeads, src_tp, dst_tp);
  std::vector<std::unique_ptr<LayerStreamReceiver>> rxs;
  std::vector<std::unique_ptr<LayerStreamSender>> txs;
  for (size_t i = 0; i < routes.size(); ++i) {
    const auto& r = routes[i];
    const int src_ep = r.src_rank, dst_ep = src_tp + r.dst_rank;
    StreamSpec spec = Spec(9, nblocks, r.global, static_cast<uint32_t>(i));
    rxs.push_back(std::make_unique<LayerStreamReceiver>(ep[dst_ep].get(), src_ep, spec,
                                                        Buffers(dst[r.dst_rank], r.dst_local)));
    ASSERT_TRUE(rxs.back()->Start().ok());
    txs.push_back(std::make_unique<LayerStreamSender>(ep[src_ep].get(), dst_ep, spec,
                                                      Buffers(src[r.src_rank], r.src_local)));
  }
  for (int l = 0; l < kLayers; ++l)
    for (auto& tx : txs) ASSERT_TRUE(tx->SendLayer(l).ok());
  for (auto& rx : rxs)
    ASSERT_TRUE(rx->WaitAll(Deadline::AfterMs(10000)).ok()) << rx->status().ToString();
  for (auto& tx : txs) ASSERT_TRUE(tx->Finish(Deadline::AfterMs(10000)).ok());
  for (int d = 0; d < dst_tp; ++d) {
    HeadRange hr = *ShardHeads(kHeads, dst_tp, d);
    for (int i = 0; i < nblocks; ++i)
      for (int l = 0; l < kLayers; ++l)
        for (int kv = 0; kv < 2; ++kv)
          for (int h = 0; h < hr.size(); ++h)
            ASSERT_EQ(0, std::memcmp(dst[d].slab(i, l, kv, h), global.slab(i, l, kv, hr.begin + h),
                                     kSlab))
                << "dst rank " << d << " block " << i << " layer " << l << " kv " << kv << " head "
                << h;
  }
}

TEST(HeadSharding, ReassemblyMatchesSourceAcrossTpSizes) {
  ReshardAndCheck(1, 2);
  ReshardAndCheck(2, 3);
  ReshardAndCheck(3, 1);
  ReshardAndCheck(2, 2);
  ReshardAndCheck(1, 6);  // every head on two decode ranks
  ReshardAndCheck(6, 2);  // replicated source
  ReshardAndCheck(6, 6);
}

}  // namespace
}  // namespace kvrelay::kv_transfer
