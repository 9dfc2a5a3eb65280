#include <gtest/gtest.h>

#include "deploy/local_launcher.h"

namespace kvrelay::deploy {
namespace {

// Each rank of a TP group given plain "cuda" gets a GPU of its own; an
// explicit ordinal and the CPU are passed as given.
TEST(LaunchOptionsTest, PlainCudaGivesEachTpRankItsOwnGpu) {
  EXPECT_EQ(WorkerDevice("cuda", 0), "cuda");
  EXPECT_EQ(WorkerDevice("cuda", 1), "cuda:1");
  EXPECT_EQ(WorkerDevice("cuda", 3), "cuda:3");
  EXPECT_EQ(WorkerDevice("cuda:2", 1), "cuda:2");
  EXPECT_EQ(WorkerDevice("cpu", 1), "cpu");
}

TEST(LaunchOptionsTest, DevicesAreCheckedBeforeAnythingStarts) {
  LaunchOptions o;
  EXPECT_TRUE(o.Validate().ok());
  for (const char* good : {"cpu", "cuda", "cuda:0", "cuda:12"}) {
    o.prefill_device = good;
    o.decode_device = good;
    EXPECT_TRUE(o.Validate().ok()) << good;
  }
  o.decode_device = "cpu";
  for (const char* bad : {"gpu", "cuda:", "cuda:x", "cuda:-1", "CUDA", ""}) {
    o.prefill_device = bad;
    const Status s = o.Validate();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("--prefill-device"), std::string::npos) << s.ToString();
  }
  o.prefill_device = "cpu";
  o.decode_device = "cuda:1x";
  EXPECT_NE(o.Validate().message().find("--decode-device"), std::string::npos);
}

}  // namespace
}  // namespace kvrelay::deploy
