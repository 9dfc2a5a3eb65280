#include "common/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "common/logging.h"

namespace kvrelay {
namespace {

void AtomicAdd(std::atomic<double>& a, double v) {
  double cur = a.load(std::memory_order_relaxed);
  while (!a.compare_exchange_weak(cur, cur + v, std::memory_order_relaxed)) {
  }
}

std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    std::snprintf(buf, sizeof(buf), "%.0f", v);
    return buf;
  }
  // Shortest representation that reads back as the same double.
  for (int precision = 6; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

std::string LabelText(const MetricLabels& labels, const std::string& extra_name = "",
                      const std::string& extra_value = "") {
  if (labels.empty() && extra_name.empty()) return "";
  std::string out = "{";
  bool first = true;
  for (const auto& [k, v] : labels) {
    if (!first) out += ",";
    first = false;
    out += k + "=\"" + EscapeLabelValue(v) + "\"";
  }
  if (!extra_name.empty()) {
    if (!first) out += ",";
    out += extra_name + "=\"" + extra_value + "\"";
  }
  out += "}";
  return out;
}

std::string EscapeHelp(const std::string& h) {
  std::string out;
  for (char c : h) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

std::string EscapeLabelValue(const std::string& v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

void Counter::Increment(double v) {
  if (!(v > 0)) return;
  AtomicAdd(value_, v);
}

void Gauge::Add(double v) { AtomicAdd(value_, v); }

Histogram::Histogram(std::vector<double> bounds)
    : bounds_([&] {
        std::sort(bounds.begin(), bounds.end());
        bounds.erase(std::unique(bounds.begin(), bounds.end()), bounds.end());
        return bounds;
      }()),
      buckets_(bounds_.size() + 1, 0) {}

void Histogram::Observe(double v) {
  // First bucket whose upper bound is >= v ("le" semantics).
  size_t i =
      static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  std::lock_guard<std::mutex> lock(mutex_);
  ++buckets_[i];
  ++count_;
  sum_ += v;
}

Histogram::Snapshot Histogram::Take() const {
  Snapshot s;
  s.bounds = bounds_;
  std::lock_guard<std::mutex> lock(mutex_);
  uint64_t acc = 0;
  for (uint64_t b : buckets_) {
    acc += b;
    s.cumulative.push_back(acc);
  }
  s.count = count_;
  s.sum = sum_;
  return s;
}

std::vector<double> DefaultLatencyBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  std::vector<double> out;
  double v = start;
  for (int i = 0; i < count; ++i) {
    out.push_back(v);
    v *= factor;
  }
  return out;
}

MetricsRegistry::Family* MetricsRegistry::FamilyFor(const std::string& name,
                                                    const std::string& help, Type type) {
  auto it = families_.find(name);
  if (it == families_.end()) {
    it = families_.emplace(name, Family{type, help, {}, {}, {}}).first;
  }
  if (it->second.type != type) {
    LOG_ERROR << "metric '" << name << "' requested with two different types";
    return nullptr;
  }
  return &it->second;
}

Counter* MetricsRegistry::GetCounter(const std::string& name, const std::string& help,
                                     MetricLabels labels) {
  std::sort(labels.begin(), labels.end());
  std::lock_guard<std::mutex> lock(mutex_);
  Family* f = FamilyFor(name, help, Type::kCounter);
  if (f == nullptr) {
    orphan_counters_.push_back(std::make_unique<Counter>());
    return orphan_counters_.back().get();
  }
  auto& slot = f->counters[labels];
  if (!slot) slot = std::make_unique<Counter>();
  return slot.get();
}

Gauge* MetricsRegistry::GetGauge(const std::string& name, const std::string& help,
                                 MetricLabels labels) {
  std::sort(labels.begin(), labels.end());
  std::lock_guard<std::mutex> lock(mutex_);
  Family* f = FamilyFor(name, help, Type::kGauge);
  if (f == nullptr) {
    orphan_gauges_.push_back(std::make_unique<Gauge>());
    return orphan_gauges_.back().get();
  }
  auto& slot = f->gauges[labels];
  if (!slot) slot = std::make_unique<Gauge>();
  return slot.get();
}

Histogram* MetricsRegistry::GetHistogram(const std::string& name, const std::string& help,
                                         MetricLabels labels, std::vector<double> bounds) {
  std::sort(labels.begin(), labels.end());
  if (bounds.empty()) bounds = DefaultLatencyBuckets();
  std::lock_guard<std::mutex> lock(mutex_);
  Family* f = FamilyFor(name, help, Type::kHistogram);
  if (f == nullptr) {
    orphan_histograms_.push_back(std::make_unique<Histogram>(bounds));
    return orphan_histograms_.back().get();
  }
  auto& slot = f->histograms[labels];
  if (!slot) slot = std::make_unique<Histogram>(std::move(bounds));
  return slot.get();
}

std::string MetricsRegistry::RenderPrometheus() const {
  std::ostringstream out;
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [name, f] : families_) {
    const char* type = f.type == Type::kCounter ? "counter"
                       : f.type == Type::kGauge ? "gauge"
                                                : "histogram";
    out << "# HELP " << name << " " << EscapeHelp(f.help) << "\n";
    out << "# TYPE " << name << " " << type << "\n";
    for (const auto& [labels, c] : f.counters) {
      out << name << LabelText(labels) << " " << FormatValue(c->value()) << "\n";
    }
    for (const auto& [labels, g] : f.gauges) {
      out << name << LabelText(labels) << " " << FormatValue(g->value()) << "\n";
    }
    for (const auto& [labels, h] : f.histograms) {
      Histogram::Snapshot s = h->Take();
      for (size_t i = 0; i < s.bounds.size(); ++i) {
        out << name << "_bucket" << LabelText(labels, "le", FormatValue(s.bounds[i])) << " "
            << s.cumulative[i] << "\n";
      }
      out << name << "_bucket" << LabelText(labels, "le", "+Inf") << " " << s.count << "\n";
      out << name << "_sum" << LabelText(labels) << " " << FormatValue(s.sum) << "\n";
      out << name << "_count" << LabelText(labels) << " " << s.count << "\n";
    }
  }
  return out.str();
}

}  // namespace kvrelay
