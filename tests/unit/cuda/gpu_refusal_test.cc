// Without a GPU every CUDA entry point refuses with a Status that says so
// (never a crash), and bad options are rejected before any device is touched.
// On a machine with a GPU the "no device" expectations are skipped.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>

#include "engine/cuda/cuda_sampler.h"
#include "engine/cuda/device.h"
#include "engine/runtime/compute_backend.h"
#include "kv_transfer/cuda_ipc_transport.h"
#include "tests/gpu/synthetic_shapes.h"
#include "tests/unit/runtime/forward_test_util.h"
#if KVRELAY_WITH_NCCL
#include "engine/cuda/nccl_communicator.h"
#include "kv_transfer/nccl_transport.h"
#endif

namespace kvrelay {
namespace {

bool NoGpu() { return engine::cuda::DeviceCount() == 0; }

TEST(GpuRefusalTest, DeviceDiscoverySaysNoDevice) {
  if (!NoGpu()) GTEST_SKIP() << "this machine has a CUDA device";
  std::string desc;
  Status s = engine::cuda::UseDevice(0, &desc);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable);
  EXPECT_NE(s.message().find("no CUDA device was found"), std::string::npos) << s.message();
}

TEST(GpuRefusalTest, CudaIpcTransportChecksOptionsThenTheDevice) {
  kv_transfer::CudaIpcTransportOptions o;
  o.rank = 2;
  o.control_fd = 0;
  EXPECT_EQ(kv_transfer::CudaIpcTransport::Create(o).status().code(), StatusCode::kInvalidArgument);
  o.rank = 0;
  o.control_fd = -1;
  EXPECT_EQ(kv_transfer::CudaIpcTransport::Create(o).status().code(), StatusCode::kInvalidArgument);
  if (!NoGpu()) GTEST_SKIP() << "this machine has a CUDA device";
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  o.control_fd = sv[0];
  auto t = kv_transfer::CudaIpcTransport::Create(o);
  EXPECT_EQ(t.status().code(), StatusCode::kUnavailable) << t.status().ToString();
  ::close(sv[0]);
  ::close(sv[1]);
}

TEST(GpuRefusalTest, DeviceSamplerRejectsBadParamsBeforeTouchingTheDevice) {
  engine::cuda::CudaSampler sampler;
  std::vector<engine::cuda::DeviceSampleParams> p(2);
  int32_t out[2];
  EXPECT_EQ(sampler.Sample(nullptr, 3, 10, p, out, nullptr).code(), StatusCode::kInvalidArgument);
  p[0].temperature = 1.0f;
  p[0].top_k = 0;  // the full sort stays on the host
  EXPECT_EQ(sampler.Sample(nullptr, 2, 10, p, out, nullptr).code(), StatusCode::kUnimplemented);
  p[0].top_k = 5;
  p[1].uniform = 1.0;
  EXPECT_EQ(sampler.Sample(nullptr, 2, 10, p, out, nullptr).code(), StatusCode::kInvalidArgument);
}

#if KVRELAY_WITH_NCCL
TEST(GpuRefusalTest, NcclPiecesRefuseWithoutADevice) {
  EXPECT_EQ(kv_transfer::NcclTransport::Create({}).status().code(), StatusCode::kInvalidArgument);
  engine::cuda::NcclCommunicatorOptions o;
  o.rank = 1;
  o.size = 1;
  EXPECT_EQ(engine::cuda::NcclCommunicator::Create(o, {}).status().code(),
            StatusCode::kInvalidArgument);
  if (!NoGpu()) GTEST_SKIP() << "this machine has a CUDA device";
  o.rank = 0;
  auto c = engine::cuda::NcclCommunicator::Create(o, {});
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable) << c.status().ToString();
}
#endif

// The GPU check's generator: a one-layer model of the default model's shape
// loads and runs on the CPU engine.
TEST(GpuRefusalTest, ShapeGeneratorWritesALoadableModel) {
  auto shape = gpucheck::ShapeByName("default", 1);
  ASSERT_TRUE(shape.ok());
  EXPECT_EQ(shape->vocab, 49152);
  EXPECT_FALSE(gpucheck::ShapeByName("13b", 0).ok());
  const std::string path = ::testing::TempDir() + "/kvrelay_shape_test.gguf";
  ASSERT_TRUE(gpucheck::WriteShapeModel(path, *shape, 2).ok());
  engine::ModelLoadOptions lo;
  lo.load_tokenizer = false;
  auto m = engine::Model::Load(path, lo);
  std::remove(path.c_str());
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const engine::ModelConfig& c = (*m)->config();
  EXPECT_EQ(c.n_layers, 1);
  EXPECT_EQ(c.d_model, 576);
  EXPECT_EQ(c.n_kv_heads, 3);
  EXPECT_EQ(c.vocab, 49152);
  EXPECT_EQ((*m)->layers()[0].wq->type, engine::GgmlType::kQ4_1);
  auto pool = engine::testutil::MakePool(**m, 4);
  std::vector<engine::BlockId> blocks = {*pool->Allocate()};
  std::vector<int32_t> tokens = {1, 2, 3, 40000};
  engine::SeqStep s = engine::MakeSeqStep(blocks, 0, tokens, engine::LogitRows::kLast);
  engine::ForwardOutput out;
  engine::ForwardPass fwd(**m, pool.get(), nullptr);
  ASSERT_TRUE(fwd.Run(std::span<const engine::SeqStep>(&s, 1), &out).ok());
  ASSERT_EQ(out.logits.size(), 49152u);
  for (float v : out.logits) ASSERT_TRUE(std::isfinite(v));
}

}  // namespace
}  // namespace kvrelay
