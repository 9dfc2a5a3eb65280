// The discrete-event core of the cluster simulator: a time-ordered queue of
// small typed events. Simulated time is in seconds (double). Events at the
// same time pop in the order they were pushed (a sequence number breaks ties),
// so a run is a pure function of its inputs: no wall clock, no addresses, no
// unordered iteration decide anything.
#pragma once

#include <cstddef>
#include <cstdint>
#include <queue>
#include <vector>

namespace kvrelay::sim {

struct Event {
  double time = 0;      // seconds since the start of the simulation
  uint64_t seq = 0;     // push order; ties at one time pop in this order
  uint32_t kind = 0;    // what happens (the owner's enum)
  uint32_t target = 0;  // which entity (worker index, link index, ...)
  uint64_t arg = 0;     // e.g. a request index or a step generation
};

class EventQueue {
 public:
  // Schedules an event; `time` must not be before now() (it is clamped to
  // now(), so a model can never move time backwards).
  void Push(double time, uint32_t kind, uint32_t target, uint64_t arg = 0);
  bool empty() const { return heap_.empty(); }
  size_t size() const { return heap_.size(); }
  // Removes and returns the earliest event and advances now() to its time.
  // Precondition: !empty().
  Event Pop();
  double now() const { return now_; }
  uint64_t popped() const { return popped_; }

 private:
  struct Later {
    bool operator()(const Event& a, const Event& b) const {
      return a.time != b.time ? a.time > b.time : a.seq > b.seq;
    }
  };
  std::priority_queue<Event, std::vector<Event>, Later> heap_;
  double now_ = 0;
  uint64_t next_seq_ = 0;
  uint64_t popped_ = 0;
};

}  // namespace kvrelay::sim
