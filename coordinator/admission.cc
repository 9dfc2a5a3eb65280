#include "coordinator/admission.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace kvrelay::coordinator {
namespace {

// Weight of the newest hold time in the mean: recent enough to follow a load
// change within tens of requests, smooth enough that one outlier does not
// flip admission.
constexpr double kHoldWeight = 0.1;

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
  if (running_ < options_.max_running && queue_.empty()) return 0;
  return static_cast<double>(queue_.size() + 1) * HoldEstimateLocked() / options_.max_running;
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
    if (running_ >= options_.max_running || !queue_.empty()) {
      if (static_cast<int>(queue_.size()) >= options_.max_queue) {
        // Come back when about one waiter has started.
        if (refusal) {
          *refusal = {Refusal::kQueueFull,
                      RetryAfterLocked(HoldEstimateLocked() / options_.max_running)};
        }
        return ResourceExhausted("admission queue is full (" + std::to_string(queue_.size()) +
                                 " waiting, " + std::to_string(running_) + " running)");
      }
      const double predicted = PredictedLocked();
      if (options_.max_queue_delay_ms > 0 && predicted > options_.max_queue_delay_ms) {
        // Come back when the queue ahead has drained to within the bound.
        if (refusal) {
          *refusal = {Refusal::kQueueDelay,
                      RetryAfterLocked(predicted - options_.max_queue_delay_ms)};
        }
        return ResourceExhausted(
            "predicted queue wait " + std::to_string(static_cast<int64_t>(predicted)) +
            " ms exceeds the bound of " + std::to_string(options_.max_queue_delay_ms) + " ms (" +
            std::to_string(queue_.size()) + " waiting, " + std::to_string(running_) + " running)");
      }
      queue_.push_back({id, std::move(start)});
      return Status::Ok();
    }
    ++running_;
    started_[id] = Now();
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
    if (running_ > 0) --running_;
    if (queue_.empty() || running_ >= options_.max_running) return;
    next = std::move(queue_.front().start);
    started_[queue_.front().id] = now;
    queue_.pop_front();
    ++running_;
  }
  next();
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

}  // namespace kvrelay::coordinator
