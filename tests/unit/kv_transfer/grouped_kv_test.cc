// KV cache groups at the worker edges: the TP step plan's protobuf carries
// every group's table (holes included), and a grouped stream's buffers read
// each model layer from its group's block, a hole from the stand-in layer.
#include <gtest/gtest.h>

#include <vector>

#include "decode_worker/tp_plan_codec.h"
#include "engine/kv_cache/kv_cache.h"
#include "engine/kv_cache/kv_groups.h"
#include "worker/kv_streams.h"

namespace kvrelay {
namespace {

using engine::BlockId;
using engine::kNoBlock;

TEST(TpPlanCodecTest, GroupTablesRoundTripWithHoles) {
  engine::StepPlan plan;
  plan.copies.push_back({3, 9});
  engine::SeqStep s;
  s.blocks = {1, 2, 3};
  s.cache_len = 40;
  s.tokens = {5};
  s.group_blocks = {{kNoBlock, 7, 8}, {kNoBlock, kNoBlock, 11}};
  plan.seqs.push_back(s);
  const proto::TpStepPlan m = decode_worker::ToProto(plan);
  proto::TpStepPlan parsed;
  ASSERT_TRUE(parsed.ParseFromString(m.SerializeAsString()));
  const engine::StepPlan back = decode_worker::FromProto(parsed);
  ASSERT_EQ(back.seqs.size(), 1u);
  EXPECT_EQ(back.seqs[0].blocks, s.blocks);
  EXPECT_EQ(back.seqs[0].cache_len, 40);
  EXPECT_EQ(back.seqs[0].tokens, s.tokens);
  EXPECT_EQ(back.seqs[0].group_blocks, s.group_blocks);
  EXPECT_EQ(back.seqs[0].logits, engine::LogitRows::kNone);  // followers never sample
  ASSERT_EQ(back.copies.size(), 1u);
  EXPECT_EQ(back.copies[0].src, 3);
  EXPECT_EQ(back.copies[0].dst, 9);
}

TEST(TpPlanCodecTest, OneGroupPlanHasNoGroupTables) {
  engine::StepPlan plan;
  plan.seqs.push_back(engine::MakeSeqStep(std::vector<BlockId>{4}, 0, std::vector<int32_t>{1, 2}));
  const proto::TpStepPlan m = decode_worker::ToProto(plan);
  EXPECT_EQ(m.seqs(0).group_blocks_size(), 0);  // the bytes a rank 0 before groups sent
  EXPECT_TRUE(decode_worker::FromProto(m).seqs[0].group_blocks.empty());
}

TEST(GroupedStreamBuffersTest, EachLayerFromItsGroupsBlockAndHolesFromTheStandIn) {
  // Layers 0, 2 full attention, 1, 3 a 32-token window: two groups of 2.
  const std::vector<int> windows = {0, 32, 0, 32};
  const engine::KvCacheGroups groups = engine::KvCacheGroups::FromLayerWindows(windows, true);
  ASSERT_EQ(groups.size(), 2);
  engine::KvBlockPool::Options o;
  o.layout = {groups.layers_per_block(), 1, 8, 4, engine::KvDtype::kF32};
  o.capacity_bytes = 8 * o.layout.BlockBytes();
  auto pool = engine::KvBlockPool::Create(o);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  engine::KvBlockPool* p = pool->get();
  const std::vector<std::vector<BlockId>> tables = {{0, 1, 2}, {kNoBlock, 3, 4}};
  std::vector<uint8_t> hole(static_cast<size_t>(o.layout.LayerBytes()), 0);
  const worker::BlockRange range{0, 3};
  const kv_transfer::StreamBuffers b = worker::MakeStreamBuffers(
      worker::StreamSide::kSend, p, groups, tables, range, {0, 1}, hole.data());
  ASSERT_EQ(b.block_layer0.size(), 3u);
  ASSERT_EQ(b.layer_data.size(), 4u * 3u);  // every model layer of every block
  for (int l = 0; l < 4; ++l) {
    const auto& table = tables[static_cast<size_t>(groups.group_of[static_cast<size_t>(l)])];
    for (size_t i = 0; i < 3; ++i) {
      const uint8_t* want =
          table[i] == kNoBlock
              ? hole.data()
              : p->LayerData(table[i], groups.slot_of[static_cast<size_t>(l)]).data();
      EXPECT_EQ(b.layer_data[static_cast<size_t>(l) * 3 + i], want)
          << "layer " << l << " block " << i;
    }
  }
  EXPECT_EQ(b.layer_data[1 * 3 + 0], hole.data());  // layer 1 (sliding) of block 0
}

}  // namespace
}  // namespace kvrelay
