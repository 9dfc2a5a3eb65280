// The coordinator's periodic stats line (coordinator/stats_logger.h).
#include "coordinator/stats_logger.h"

#include <gtest/gtest.h>

namespace kvrelay::coordinator {
namespace {

WorkerInfo Worker(const std::string& id, int64_t computed, int64_t cached, int64_t generated) {
  WorkerInfo w;
  w.id = id;
  w.prompt_tokens_computed = computed;
  w.prefix_hit_tokens = cached;
  w.generated_tokens = generated;
  w.total_kv_blocks = 100;
  w.free_kv_blocks = 100;
  return w;
}

TEST(StatsLoggerTest, RatesUseTheIncreaseOverTheInterval) {
  std::vector<WorkerInfo> before = {Worker("prefill-0", 1000, 0, 1), Worker("decode-0", 0, 0, 50)};
  std::vector<WorkerInfo> after = {Worker("prefill-0", 1600, 200, 2),
                                   Worker("decode-0", 0, 0, 149)};
  after[1].running = 3;
  after[1].free_kv_blocks = 75;
  after[0].queued_tokens = 512;
  // 800 prompt tokens (600 computed + 200 cached) and 100 generated in 2 s;
  // KV use 25 of 200 blocks; hit rate 200 / 800.
  EXPECT_EQ(StatsLogger::Line(before, after, 2.0),
            "stats: prompt 400.0 tok/s, generation 50.0 tok/s, running 3, queued 512 tokens, "
            "KV use 12.5%, prefix hit rate 25.0%");
}

TEST(StatsLoggerTest, IdleClusterLogsNothing) {
  std::vector<WorkerInfo> w = {Worker("decode-0", 10, 5, 7)};
  EXPECT_EQ(StatsLogger::Line(w, w, 10.0), std::nullopt);
}

TEST(StatsLoggerTest, ARestartedWorkerCountsFromZero) {
  // decode-0 restarted: its totals fell from 1000 to 40; the 40 are new.
  std::vector<WorkerInfo> before = {Worker("decode-0", 0, 0, 1000)};
  std::vector<WorkerInfo> after = {Worker("decode-0", 0, 0, 40), Worker("decode-1", 0, 0, 60)};
  auto line = StatsLogger::Line(before, after, 1.0);
  ASSERT_TRUE(line.has_value());
  EXPECT_NE(line->find("generation 100.0 tok/s"), std::string::npos) << *line;
}

}  // namespace
}  // namespace kvrelay::coordinator
