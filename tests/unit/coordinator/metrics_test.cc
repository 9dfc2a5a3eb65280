#include "common/metrics.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace kvrelay {
namespace {

TEST(MetricsTest, CounterGaugeRendering) {
  MetricsRegistry r;
  Counter* c = r.GetCounter("req_total", "Requests.", {{"code", "200"}});
  c->Increment();
  c->Increment(2);
  c->Increment(-5);                                                          // ignored
  EXPECT_EQ(r.GetCounter("req_total", "other help", {{"code", "200"}}), c);  // same series
  r.GetCounter("req_total", "", {{"code", "404"}})->Increment();
  Gauge* g = r.GetGauge("depth", "Queue \"depth\".\nSecond line", {{"w", "a\"b\\c\nd"}});
  g->Set(3);
  g->Add(-0.5);
  const std::string text = r.RenderPrometheus();
  const std::string expected =
      "# HELP depth Queue \"depth\".\\nSecond line\n"
      "# TYPE depth gauge\n"
      "depth{w=\"a\\\"b\\\\c\\nd\"} 2.5\n"
      "# HELP req_total Requests.\n"
      "# TYPE req_total counter\n"
      "req_total{code=\"200\"} 3\n"
      "req_total{code=\"404\"} 1\n";
  EXPECT_EQ(text, expected);
}

TEST(MetricsTest, HistogramBucketsAreCumulativeWithLeSemantics) {
  MetricsRegistry r;
  Histogram* h = r.GetHistogram("lat_seconds", "Latency.", {}, {0.125, 1, 0.5});
  for (double v : {0.0625, 0.125, 0.25, 0.75, 2.0}) h->Observe(v);
  const std::string expected =
      "# HELP lat_seconds Latency.\n"
      "# TYPE lat_seconds histogram\n"
      "lat_seconds_bucket{le=\"0.125\"} 2\n"  // 0.0625 and 0.125 (le is inclusive)
      "lat_seconds_bucket{le=\"0.5\"} 3\n"
      "lat_seconds_bucket{le=\"1\"} 4\n"
      "lat_seconds_bucket{le=\"+Inf\"} 5\n"
      "lat_seconds_sum 3.1875\n"
      "lat_seconds_count 5\n";
  EXPECT_EQ(r.RenderPrometheus(), expected);
}

TEST(MetricsTest, LabelOrderDoesNotMatterAndTypeClashIsDetached) {
  MetricsRegistry r;
  Counter* a = r.GetCounter("x_total", "X.", {{"b", "2"}, {"a", "1"}});
  Counter* b = r.GetCounter("x_total", "X.", {{"a", "1"}, {"b", "2"}});
  EXPECT_EQ(a, b);
  Gauge* clash = r.GetGauge("x_total", "X.");
  clash->Set(99);
  EXPECT_EQ(r.RenderPrometheus().find("99"), std::string::npos);
}

TEST(MetricsTest, ConcurrentUpdatesAreNotLost) {
  MetricsRegistry r;
  Counter* c = r.GetCounter("n_total", "N.");
  Histogram* h = r.GetHistogram("h", "H.", {}, {1.0});
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) {
        c->Increment();
        h->Observe(0.5);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(c->value(), 40000);
  EXPECT_EQ(h->Take().count, 40000u);
  EXPECT_EQ(h->Take().cumulative[0], 40000u);
}

}  // namespace
}  // namespace kvrelay
