#include "coordinator/http/admission.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace kvrelay::coordinator {
namespace {

// Weight of the newest hold time in the mean: recent enough to follow a load
// change within tens of requests, smooth enough that one outlier does not
// flip admission.
constexpr double kHoldWeight = 0.1;
// Each new first-token interval weighs 1, older ones this much less per
// sample: the mean covers about the last 20 first tokens.
constexpr double kGapDecay = 0.95;

}  // namespace

AdmissionQueue::AdmissionQueue(Options options)
    : options_([&] {
        options.max_running = std::max(1, options.max_running);
        options.max_queue = std::max(0, options.max_queue);
        options.max_queue_delay_ms = std::max(0, options.max_queue_delay_ms);
        options.retry_after_seconds = std::max(1, options.retry_after_seconds);
        return options;
      }()) {}

double AdmissionQueue::HoldEstimateLocked() const {
  if (holds_ > 0) return hold_ms_;
  if (started_.empty()) return 0;
  const TimePoint now = Now();
  double sum = 0;
  for (const auto& [id, at] : started_) {
    sum += std::chrono::duration<double, std::milli>(now - at).count();
  }
  return sum / static_cast<double>(started_.size());
}

double AdmissionQueue::PredictedLocked() const {
  const double slot =
      running_ < options_.max_running && queue_.empty()
          ? 0
          : static_cast<double>(queue_.size() + 1) * HoldEstimateLocked() / options_.max_running;
  const size_t ahead = before_first_.size() + queue_.size();
  if (ahead == 0 || gap_count_ <= 0) return slot;
  const double gap = gap_sum_ / gap_count_;
  const double own = solo_count_ > 0 ? std::max(gap, solo_sum_ / solo_count_) : gap;
  return std::max(slot, static_cast<double>(ahead) * gap + own);
}

void AdmissionQueue::MarkWaitingLocked(TimePoint now) {
  if (before_first_.empty() && queue_.empty()) first_mark_ = now;
}

int AdmissionQueue::RetryAfterLocked(double excess_ms) const {
  const int computed = std::max(1, static_cast<int>(std::ceil(excess_ms / 1000.0)));
  // Before any request finished the estimate is a lower bound (the running
  // ones' age): the configured value is the floor.
  return holds_ == 0 ? std::max(options_.retry_after_seconds, computed) : computed;
}

Status AdmissionQueue::Enqueue(uint64_t id, std::function<void()> start, Refusal* refusal) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const bool must_wait = running_ >= options_.max_running || !queue_.empty();
    if (must_wait && static_cast<int>(queue_.size()) >= options_.max_queue) {
      // Come back when about one waiter has started.
      if (refusal) {
        *refusal = {Refusal::kQueueFull,
                    RetryAfterLocked(HoldEstimateLocked() / options_.max_running)};
      }
      return ResourceExhausted("admission queue is full (" + std::to_string(queue_.size()) +
                               " waiting, " + std::to_string(running_) + " running)");
    }
    // Checked with a slot free too: the wait may be inside the backend.
    const double predicted = PredictedLocked();
    if (options_.max_queue_delay_ms > 0 && predicted > options_.max_queue_delay_ms) {
      // Come back when the work ahead has drained to within the bound.
      if (refusal) {
        *refusal = {Refusal::kQueueDelay,
                    RetryAfterLocked(predicted - options_.max_queue_delay_ms)};
      }
      return ResourceExhausted(
          "predicted wait for a first token " + std::to_string(static_cast<int64_t>(predicted)) +
          " ms exceeds the bound of " + std::to_string(options_.max_queue_delay_ms) + " ms (" +
          std::to_string(queue_.size()) + " waiting, " + std::to_string(running_) + " running, " +
          std::to_string(before_first_.size()) + " before a first token)");
    }
    const TimePoint now = Now();
    MarkWaitingLocked(now);
    if (must_wait) {
      queue_.push_back({id, std::move(start)});
      return Status::Ok();
    }
    if (before_first_.empty()) solo_.insert(id);  // nothing ahead of it
    ++running_;
    started_[id] = now;
    before_first_.insert(id);
  }
  start();
  return Status::Ok();
}

bool AdmissionQueue::Remove(uint64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it =
      std::find_if(queue_.begin(), queue_.end(), [id](const Waiter& w) { return w.id == id; });
  if (it == queue_.end()) return false;
  queue_.erase(it);
  return true;
}

void AdmissionQueue::Release(uint64_t id) {
  std::function<void()> next;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const TimePoint now = Now();
    if (auto it = started_.find(id); it != started_.end()) {
      const double held = std::chrono::duration<double, std::milli>(now - it->second).count();
      hold_ms_ = holds_ == 0 ? held : (1 - kHoldWeight) * hold_ms_ + kHoldWeight * held;
      ++holds_;
      started_.erase(it);
    }
    before_first_.erase(id);  // ended without a first token: no interval to learn from
    solo_.erase(id);
    if (running_ > 0) --running_;
    if (queue_.empty() || running_ >= options_.max_running) return;
    next = std::move(queue_.front().start);
    started_[queue_.front().id] = now;
    before_first_.insert(queue_.front().id);
    queue_.pop_front();
    ++running_;
  }
  next();
}

void AdmissionQueue::FirstToken(uint64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (before_first_.erase(id) == 0) return;
  const TimePoint now = Now();
  if (solo_.erase(id) > 0) {
    if (auto it = started_.find(id); it != started_.end()) {
      const double took = std::chrono::duration<double, std::milli>(now - it->second).count();
      solo_sum_ = kGapDecay * solo_sum_ + took;
      solo_count_ = kGapDecay * solo_count_ + 1;
    }
  }
  // Some request waited for a first token from first_mark_ until now.
  const double gap =
      std::max(0.0, std::chrono::duration<double, std::milli>(now - first_mark_).count());
  gap_sum_ = kGapDecay * gap_sum_ + gap;
  gap_count_ = kGapDecay * gap_count_ + 1;
  first_mark_ = now;
}

int AdmissionQueue::running() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return running_;
}

int AdmissionQueue::queued() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int>(queue_.size());
}

double AdmissionQueue::PredictedQueueDelayMs() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return PredictedLocked();
}

double AdmissionQueue::MeanHoldMs() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return hold_ms_;
}

double AdmissionQueue::FirstTokenIntervalMs() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return gap_count_ > 0 ? gap_sum_ / gap_count_ : 0;
}

}  // namespace kvrelay::coordinator
