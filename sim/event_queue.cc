#include "sim/event_queue.h"

#include <algorithm>

namespace kvrelay::sim {

void EventQueue::Push(double time, uint32_t kind, uint32_t target, uint64_t arg) {
  heap_.push(Event{std::max(time, now_), next_seq_++, kind, target, arg});
}

Event EventQueue::Pop() {
  Event e = heap_.top();
  heap_.pop();
  now_ = e.time;
  ++popped_;
  return e;
}

}  // namespace kvrelay::sim
