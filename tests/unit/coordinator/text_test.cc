// SSE framing and parsing, stop strings, API keys, admission.
#include <gtest/gtest.h>

#include <atomic>
#include <vector>

#include "coordinator/http/admission.h"
#include "coordinator/http/api_keys.h"
#include "coordinator/http/sse.h"

namespace kvrelay::coordinator {
namespace {

TEST(SseTest, Framing) {
  EXPECT_EQ(SseEvent("{\"a\":1}"), "data: {\"a\":1}\n\n");
  EXPECT_EQ(SseEvent("x\ny"), "data: x\ndata: y\n\n");
  EXPECT_EQ(std::string(kSseDone), "data: [DONE]\n\n");
}

TEST(SseTest, ParserRoundTripAcrossArbitrarySplits) {
  std::string stream = SseEvent("one") + ": comment\n\n" + SseEvent("two\nlines") +
                       "event: x\r\ndata: three\r\n\r\n" + std::string(kSseDone);
  for (size_t split = 0; split <= stream.size(); ++split) {
    SseParser p;
    ASSERT_TRUE(p.Feed(stream.substr(0, split)));
    ASSERT_TRUE(p.Feed(stream.substr(split)));
    std::vector<std::string> got;
    while (auto e = p.Next()) got.push_back(*e);
    ASSERT_EQ(got, (std::vector<std::string>{"one", "two\nlines", "three", "[DONE]"})) << split;
  }
}

TEST(SseTest, ParserBoundsMemory) {
  SseParser p(100);
  EXPECT_FALSE(p.Feed("data: " + std::string(200, 'x')));
}

TEST(ApiKeysTest, ParsesAndRejectsWithLineNumbers) {
  auto keys = ApiKeys::Parse("# comment\n\nsk-a alice\r\nsk-b   bob\n");
  ASSERT_TRUE(keys.ok()) << keys.status().ToString();
  EXPECT_EQ(keys->size(), 2u);
  EXPECT_EQ(keys->TenantOf("sk-a"), "alice");
  EXPECT_EQ(keys->TenantOf("sk-b"), "bob");
  EXPECT_FALSE(keys->TenantOf("sk-c").has_value());
  EXPECT_FALSE(keys->TenantOf("sk-").has_value());
  auto bad = ApiKeys::Parse("sk-a alice\nsk-b\n");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("line 2"), std::string::npos);
  auto dup = ApiKeys::Parse("k a\nk b\n");
  ASSERT_FALSE(dup.ok());
  EXPECT_NE(dup.status().message().find("duplicate"), std::string::npos);
  EXPECT_EQ(ApiKeys::LoadFile("/nonexistent/keys").status().code(), StatusCode::kNotFound);
}

TEST(AdmissionTest, RunsQueuesAndRefuses) {
  AdmissionQueue q({/*max_running=*/2, /*max_queue=*/1});
  std::vector<int> started;
  ASSERT_TRUE(q.Enqueue(1, [&] { started.push_back(1); }).ok());
  ASSERT_TRUE(q.Enqueue(2, [&] { started.push_back(2); }).ok());
  EXPECT_EQ(started, (std::vector<int>{1, 2}));
  ASSERT_TRUE(q.Enqueue(3, [&] { started.push_back(3); }).ok());  // queued
  EXPECT_EQ(q.queued(), 1);
  Status full = q.Enqueue(4, [&] { started.push_back(4); });
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted);
  q.Release(1);  // 1 finishes -> 3 starts
  EXPECT_EQ(started, (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(q.running(), 2);
  EXPECT_EQ(q.queued(), 0);
  // A removed waiter never starts.
  ASSERT_TRUE(q.Enqueue(5, [&] { started.push_back(5); }).ok());
  EXPECT_TRUE(q.Remove(5));
  EXPECT_FALSE(q.Remove(5));
  q.Release(2);
  q.Release(3);
  EXPECT_EQ(started, (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(q.running(), 0);
}

TEST(AdmissionTest, FifoOrderUnderRelease) {
  AdmissionQueue q({1, 10});
  std::vector<int> started;
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(q.Enqueue(i, [&, i] { started.push_back(i); }).ok());
  for (int i = 0; i < 5; ++i) q.Release(i);
  EXPECT_EQ(started, (std::vector<int>{0, 1, 2, 3, 4}));
}

}  // namespace
}  // namespace kvrelay::coordinator
