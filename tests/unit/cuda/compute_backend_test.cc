// The compute-backend seam without a GPU: device names, the CPU backend
// being ForwardPass exactly, and --device cuda refusing clearly on a machine
// (or a build) without CUDA.
#include "engine/runtime/compute_backend.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <utility>

#include "engine/runtime/engine.h"
#include "tests/testing/synthetic_model.h"
#include "tests/unit/runtime/forward_test_util.h"

#if KVRELAY_WITH_CUDA
#include "engine/cuda/device.h"
#endif

namespace kvrelay::engine {
namespace {

TEST(ComputeBackendTest, ParsesDeviceNames) {
  EXPECT_EQ(ParseDevice("cpu")->kind, DeviceKind::kCpu);
  EXPECT_EQ(*ParseDevice("cuda"), (DeviceSpec{DeviceKind::kCuda, 0}));
  EXPECT_EQ(*ParseDevice("cuda:3"), (DeviceSpec{DeviceKind::kCuda, 3}));
  EXPECT_EQ(DeviceName(*ParseDevice("cuda:3")), "cuda:3");
  EXPECT_EQ(DeviceName(DeviceSpec{}), "cpu");
  for (const char* bad : {"gpu", "cuda:", "cuda:-1", "cuda:x", "cuda:1x", "CPU", ""}) {
    auto d = ParseDevice(bad);
    ASSERT_FALSE(d.ok()) << bad;
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(d.status().message().find("cpu, cuda or cuda:N"), std::string::npos);
  }
}

std::shared_ptr<const Model> Synthetic() {
  testing::SyntheticModelOptions o;
  o.matrix_type = GgmlType::kQ4_1;
  o.embedding_type = GgmlType::kQ8_0;
  auto path = testing::WriteTempSyntheticModel(o);
  EXPECT_TRUE(path.ok());
  ModelLoadOptions lo;
  lo.load_tokenizer = false;
  auto m = Model::Load(*path, lo);
  std::remove(path->c_str());
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return std::shared_ptr<const Model>(std::move(m).value());
}

TEST(ComputeBackendTest, CpuBackendIsTheForwardPass) {
  auto model = Synthetic();
  auto pool_a = testutil::MakePool(*model, 8), pool_b = testutil::MakePool(*model, 8);
  ComputeBackendOptions o;
  auto backend = CreateComputeBackend(o, *model, pool_a.get(), nullptr);
  ASSERT_TRUE(backend.ok()) << backend.status().ToString();
  EXPECT_EQ((*backend)->device().kind, DeviceKind::kCpu);
  ForwardPass fwd(*model, pool_b.get(), nullptr);
  std::vector<int32_t> tokens = {1, 50, 7, 200, 3, 9, 11};
  std::vector<BlockId> blocks = {*pool_a->Allocate()};
  std::vector<BlockId> blocks_b = {*pool_b->Allocate()};
  SeqStep sa = MakeSeqStep(blocks, 0, tokens, LogitRows::kAll);
  SeqStep sb = MakeSeqStep(blocks_b, 0, tokens, LogitRows::kAll);
  ForwardOutput a, b;
  int hooks = 0;
  ASSERT_TRUE((*backend)->Run(std::span<const SeqStep>(&sa, 1), &a, [&](int) { ++hooks; }).ok());
  ASSERT_TRUE(fwd.Run(std::span<const SeqStep>(&sb, 1), &b).ok());
  EXPECT_EQ(hooks, model->config().n_layers);
  ASSERT_EQ(a.logits.size(), b.logits.size());
  EXPECT_EQ(0, std::memcmp(a.logits.data(), b.logits.data(), a.logits.size() * sizeof(float)));
  EXPECT_EQ(a.row_begin, b.row_begin);
}

TEST(ComputeBackendTest, PoolReportsEveryHostWriteTheBackendDidNotMake) {
  auto model = Synthetic();
  auto owned = testutil::MakePool(*model, 8);
  KvBlockPool& pool = *owned;
  struct {
    std::vector<BlockId> invalidated;  // what a device copy of the pool would be told
  } backend;
  pool.SetHostWriteHook([&](BlockId b) { backend.invalidated.push_back(b); });
  const BlockId a = *pool.Allocate(), b = *pool.Allocate();
  std::vector<float> k(model->config().kv_dim(), 1.0f), v(k.size(), 2.0f);
  pool.WriteToken(a, 0, 0, k.data(), v.data());  // the backend's own mirror path
  EXPECT_TRUE(backend.invalidated.empty());
  auto ro = std::as_const(pool).LayerData(a, 1);  // reading: no invalidation
  EXPECT_EQ(static_cast<int64_t>(ro.size()), pool.layout().LayerBytes());
  EXPECT_TRUE(backend.invalidated.empty());
  auto rw = pool.LayerData(b, 1);  // an importer writes block b
  rw[0] = 7;
  EXPECT_EQ(backend.invalidated, std::vector<BlockId>{b});
  pool.CopyBlock(a, b);  // copy-on-write lands in b
  EXPECT_EQ(backend.invalidated, (std::vector<BlockId>{b, b}));
  std::vector<float> k2(16 * model->config().head_dim), v2(k2.size());
  pool.ReadHead(b, 0, 0, 1, k2.data(), v2.data());
  EXPECT_EQ(k2[0], 1.0f);
  EXPECT_EQ(v2[0], 2.0f);
  EXPECT_EQ(backend.invalidated.size(), 2u);  // reads, refs and releases: none
  EXPECT_EQ(pool.refcount(a), 1);
  pool.Release(a);
  pool.Release(b);
  EXPECT_EQ(pool.free_blocks(), pool.total_blocks());
  EXPECT_EQ(backend.invalidated.size(), 2u);
  // Without a hook, writes are simply not reported.
  pool.SetHostWriteHook(nullptr);
  const BlockId c = *pool.Allocate();
  pool.LayerData(c, 0)[0] = 1;
  EXPECT_EQ(backend.invalidated.size(), 2u);
  pool.Release(c);
}

TEST(ComputeBackendTest, EngineWithCudaDeviceRefusesClearlyWithoutAGpu) {
#if KVRELAY_WITH_CUDA
  if (cuda::DeviceCount() > 0) GTEST_SKIP() << "a CUDA device is present: tests/gpu covers it";
#endif
  auto model = Synthetic();
  EngineOptions eo;
  eo.device = "cuda";
  auto engine = Engine::Create(eo, model);
  ASSERT_FALSE(engine.ok());
  const std::string msg = engine.status().ToString();
  if (CudaBackendBuilt()) {
    EXPECT_EQ(engine.status().code(), StatusCode::kUnavailable) << msg;
    EXPECT_NE(msg.find("no CUDA device was found"), std::string::npos) << msg;
  } else {
    EXPECT_EQ(engine.status().code(), StatusCode::kUnimplemented) << msg;
    EXPECT_NE(msg.find("no CUDA backend"), std::string::npos) << msg;
  }
  // A malformed device is rejected by validation, naming the field.
  eo.device = "tpu";
  auto bad = Engine::Create(eo, model);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().ToString().find("EngineOptions.device"), std::string::npos);
  // The CPU default still works.
  eo.device = "cpu";
  EXPECT_TRUE(Engine::Create(eo, model).ok());
}

}  // namespace
}  // namespace kvrelay::engine
