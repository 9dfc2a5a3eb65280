#include "worker/request_table.h"

#include <algorithm>

#include "common/logging.h"

namespace kvrelay::worker {

std::string_view RequestStateName(RequestState s) {
  switch (s) {
    case RequestState::kQueued:
      return "queued";
    case RequestState::kComputing:
      return "computing";
    case RequestState::kStreaming:
      return "streaming";
    case RequestState::kDelivered:
      return "delivered";
    case RequestState::kReserved:
      return "reserved";
    case RequestState::kReceiving:
      return "receiving";
    case RequestState::kRunning:
      return "running";
    case RequestState::kFinished:
      return "finished";
  }
  return "unknown";
}

namespace {
bool In(RequestState s, std::initializer_list<RequestState> states) {
  return std::find(states.begin(), states.end(), s) != states.end();
}
}  // namespace

RequestTable::~RequestTable() { Clear(); }

void RequestTable::ReleaseWork(Request& r) {
  if (r.work != nullptr && release_) release_(r);
  r.work.reset();
}

Request& RequestTable::Add(engine::RequestId id, RequestState state, int64_t prompt_tokens) {
  int stale = 0;
  if (auto it = records_.find(id); it != records_.end()) {
    ReleaseWork(it->second);
    stale = it->second.stale_cancels;
    if (it->second.state != RequestState::kFinished) {
      LOG_DEBUG << "request " << id << ": " << RequestStateName(it->second.state)
                << " -> replaced by a new attempt";
    }
    records_.erase(it);
  }
  Request& r = records_[id];
  r.id = id;
  r.state = state;
  r.since = r.created = Clock::now();
  r.prompt_tokens = prompt_tokens;
  r.stale_cancels = stale;
  LOG_DEBUG << "request " << id << ": " << RequestStateName(state);
  return r;
}

Request* RequestTable::Find(engine::RequestId id) {
  auto it = records_.find(id);
  if (it == records_.end() || it->second.state == RequestState::kFinished) return nullptr;
  return &it->second;
}

const Request* RequestTable::Find(engine::RequestId id) const {
  return const_cast<RequestTable*>(this)->Find(id);
}

void RequestTable::Move(Request& r, RequestState to) {
  if (r.state == to) return;
  LOG_DEBUG << "request " << r.id << ": " << RequestStateName(r.state) << " -> "
            << RequestStateName(to);
  r.state = to;
  r.since = Clock::now();
}

void RequestTable::DropWork(Request& r) { ReleaseWork(r); }

void RequestTable::Finish(engine::RequestId id) {
  auto it = records_.find(id);
  if (it == records_.end()) return;
  Request& r = it->second;
  ReleaseWork(r);
  if (r.state != RequestState::kFinished) Move(r, RequestState::kFinished);
  if (r.stale_cancels == 0) records_.erase(it);
}

void RequestTable::Cancelled(engine::RequestId id, bool engine_had_it) {
  auto it = records_.find(id);
  if (it == records_.end()) {
    if (!engine_had_it) return;
    it = records_.emplace(id, Request{}).first;
    it->second.id = id;
    it->second.state = RequestState::kFinished;
  }
  if (engine_had_it) ++it->second.stale_cancels;
  Finish(id);
}

bool RequestTable::TakeStaleCancel(engine::RequestId id) {
  auto it = records_.find(id);
  if (it == records_.end() || it->second.stale_cancels == 0) return false;
  if (--it->second.stale_cancels == 0 && it->second.state == RequestState::kFinished) {
    records_.erase(it);
  }
  return true;
}

void RequestTable::Clear() {
  for (auto& [id, r] : records_) ReleaseWork(r);
  records_.clear();
}

std::vector<engine::RequestId> RequestTable::IdsIn(RequestState state) const {
  std::vector<engine::RequestId> ids;
  for (const auto& [id, r] : records_) {
    if (r.state == state) ids.push_back(id);
  }
  return ids;
}

int64_t RequestTable::Count(std::initializer_list<RequestState> states) const {
  int64_t n = 0;
  for (const auto& [id, r] : records_) n += In(r.state, states) ? 1 : 0;
  return n;
}

int64_t RequestTable::PromptTokens(std::initializer_list<RequestState> states) const {
  int64_t n = 0;
  for (const auto& [id, r] : records_) n += In(r.state, states) ? r.prompt_tokens : 0;
  return n;
}

}  // namespace kvrelay::worker
