#include "coordinator/admission.h"

#include <algorithm>
#include <string>

namespace kvrelay::coordinator {

AdmissionQueue::AdmissionQueue(Options options)
    : options_([&] {
        options.max_running = std::max(1, options.max_running);
        options.max_queue = std::max(0, options.max_queue);
        return options;
      }()) {}

Status AdmissionQueue::Enqueue(uint64_t id, std::function<void()> start) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (running_ >= options_.max_running || !queue_.empty()) {
      if (static_cast<int>(queue_.size()) >= options_.max_queue) {
        return ResourceExhausted("admission queue is full (" + std::to_string(queue_.size()) +
                                 " waiting, " + std::to_string(running_) + " running)");
      }
      queue_.push_back({id, std::move(start)});
      return Status::Ok();
    }
    ++running_;
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

void AdmissionQueue::Release() {
  std::function<void()> next;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (running_ > 0) --running_;
    if (queue_.empty() || running_ >= options_.max_running) return;
    next = std::move(queue_.front().start);
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

}  // namespace kvrelay::coordinator
