// A small metrics registry: counters, gauges and histograms with labels,
// rendered in the Prometheus text exposition format (version 0.0.4).
//
// Thread-safety: every metric object is safe to update from any thread
// (atomics for counters/gauges, a mutex per histogram). The registry itself is
// safe to use concurrently; metric pointers it hands out stay valid for the
// registry's lifetime (metrics are never removed).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace kvrelay {

// Label set of one time series, e.g. {{"worker", "prefill-0"}}. Order does not
// matter: labels are sorted by name when registered.
using MetricLabels = std::vector<std::pair<std::string, std::string>>;

// Monotonic counter (a double so it can count seconds or bytes).
class Counter {
 public:
  void Increment(double v = 1.0);  // v < 0 is ignored (counters never go down)
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double v);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// Cumulative histogram with fixed upper bounds (+Inf is implicit).
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void Observe(double v);

  struct Snapshot {
    std::vector<double> bounds;
    std::vector<uint64_t> cumulative;  // one per bound, then +Inf (== count)
    uint64_t count = 0;
    double sum = 0;
  };
  Snapshot Take() const;

 private:
  const std::vector<double> bounds_;  // sorted ascending
  mutable std::mutex mutex_;
  std::vector<uint64_t> buckets_;  // guarded by mutex_; non-cumulative, size bounds+1
  uint64_t count_ = 0;             // guarded by mutex_
  double sum_ = 0;                 // guarded by mutex_
};

// Latency buckets in seconds from 1 ms to 60 s.
std::vector<double> DefaultLatencyBuckets();
// Buckets start, start*factor, ... (count of them).
std::vector<double> ExponentialBuckets(double start, double factor, int count);

class MetricsRegistry {
 public:
  // Returns the series (name, labels), creating it on first use. `help` is
  // taken from the first registration of a name. A name registered as one
  // type and requested as another returns a series of a separate, detached
  // object that is not rendered (a programming error, logged once).
  Counter* GetCounter(const std::string& name, const std::string& help, MetricLabels labels = {});
  Gauge* GetGauge(const std::string& name, const std::string& help, MetricLabels labels = {});
  // `bounds` is used when the series is created; empty means DefaultLatencyBuckets().
  Histogram* GetHistogram(const std::string& name, const std::string& help,
                          MetricLabels labels = {}, std::vector<double> bounds = {});

  // Prometheus text format, families sorted by name, series by label set.
  std::string RenderPrometheus() const;

 private:
  enum class Type { kCounter, kGauge, kHistogram };
  struct Family {
    Type type;
    std::string help;
    std::map<MetricLabels, std::unique_ptr<Counter>> counters;
    std::map<MetricLabels, std::unique_ptr<Gauge>> gauges;
    std::map<MetricLabels, std::unique_ptr<Histogram>> histograms;
  };
  Family* FamilyFor(const std::string& name, const std::string& help, Type type);

  mutable std::mutex mutex_;
  std::map<std::string, Family> families_;  // guarded by mutex_
  // Objects handed out for type-mismatched requests; guarded by mutex_.
  std::vector<std::unique_ptr<Counter>> orphan_counters_;
  std::vector<std::unique_ptr<Gauge>> orphan_gauges_;
  std::vector<std::unique_ptr<Histogram>> orphan_histograms_;
};

// Escapes a label value for the text format (backslash, quote, newline).
std::string EscapeLabelValue(const std::string& v);

}  // namespace kvrelay
