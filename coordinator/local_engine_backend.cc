#include "coordinator/local_engine_backend.h"

#include <pthread.h>

#include <chrono>

#include "common/logging.h"

namespace kvrelay::coordinator {
namespace {

FinishReason Translate(engine::FinishReason r) {
  switch (r) {
    case engine::FinishReason::kNone:
      return FinishReason::kNone;
    case engine::FinishReason::kStop:
      return FinishReason::kStop;
    case engine::FinishReason::kLength:
      return FinishReason::kLength;
    case engine::FinishReason::kCancelled:
      return FinishReason::kCancelled;
    case engine::FinishReason::kError:
      return FinishReason::kError;
    case engine::FinishReason::kPrefilled:
      return FinishReason::kError;  // never requested here
  }
  return FinishReason::kError;
}

}  // namespace

Result<std::unique_ptr<LocalEngineBackend>> LocalEngineBackend::Create(
    std::unique_ptr<engine::Engine> engine, Options options) {
  if (engine == nullptr) return InvalidArgument("LocalEngineBackend needs an engine");
  std::unique_ptr<LocalEngineBackend> backend(
      new LocalEngineBackend(std::move(engine), std::move(options)));
  backend->thread_ = std::thread([b = backend.get()] { b->Loop(); });
  pthread_setname_np(backend->thread_.native_handle(), "engine-step");
  return backend;
}

LocalEngineBackend::LocalEngineBackend(std::unique_ptr<engine::Engine> engine, Options options)
    : engine_(std::move(engine)), options_(std::move(options)) {
  snapshot_.id = options_.worker_id;
  snapshot_.role = WorkerRole::kColocated;
  UpdateSnapshot();
}

LocalEngineBackend::~LocalEngineBackend() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

Status LocalEngineBackend::Submit(GenerationRequest request, TokenSink sink) {
  if (request.prompt.empty()) return InvalidArgument("empty prompt");
  std::lock_guard<std::mutex> lock(mutex_);
  if (stop_) return Unavailable("backend is shutting down");
  if (!failure_.ok()) return Unavailable("engine failed: " + failure_.message());
  submits_.push_back({std::move(request), std::move(sink)});
  cv_.notify_all();
  return Status::Ok();
}

void LocalEngineBackend::Cancel(uint64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  cancels_.push_back(id);
  cv_.notify_all();
}

Status LocalEngineBackend::Health() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (stop_) return Unavailable("backend is shutting down");
  if (!failure_.ok()) return Unavailable("engine failed: " + failure_.message());
  return Status::Ok();
}

std::vector<WorkerInfo> LocalEngineBackend::Workers() {
  std::lock_guard<std::mutex> lock(mutex_);
  return {snapshot_};
}

void LocalEngineBackend::UpdateSnapshot() {
  WorkerInfo w;
  w.id = options_.worker_id;
  w.role = WorkerRole::kColocated;
  w.running = engine_->running();
  w.queued_requests = engine_->queued();
  w.max_batch = engine_->options().max_running;
  if (engine::KvBlockPool* pool = engine_->pool()) {
    w.total_kv_blocks = pool->total_blocks();
    w.free_kv_blocks = pool->available_blocks();
    w.block_tokens = pool->layout().block_tokens;
  }
  const engine::Engine::Stats stats = engine_->stats();
  w.prefix_hit_tokens = stats.prompt_tokens_cached;
  const engine::KvCacheGroups& groups = engine_->kv_groups();
  for (int g = 0; g < groups.size(); ++g) {
    w.kv_group_window.push_back(groups.window[static_cast<size_t>(g)]);
    w.kv_group_peak_blocks.push_back(g < static_cast<int>(stats.peak_group_blocks.size())
                                         ? stats.peak_group_blocks[static_cast<size_t>(g)]
                                         : 0);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  w.healthy = failure_.ok();
  snapshot_ = w;
}

void LocalEngineBackend::DrainInbox(std::vector<std::pair<TokenSink, TokenEvent>>* out,
                                    bool* step_needed) {
  std::deque<Pending> submits;
  std::vector<uint64_t> cancels;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    submits.swap(submits_);
    cancels.swap(cancels_);
  }
  for (auto& p : submits) {
    engine::RequestSpec spec;
    spec.id = p.request.id;
    spec.want_text = false;  // the server detokenizes and matches stop strings
    spec.prompt = std::move(p.request.prompt);
    spec.tenant_salt = p.request.tenant_salt;
    const bool ignore_eos = p.request.sampling.ignore_eos;
    spec.sampling = std::move(p.request.sampling);
    Status st = engine_->Submit(std::move(spec));
    if (!st.ok()) {
      TokenEvent ev;
      ev.finished = true;
      ev.finish_reason = FinishReason::kError;
      ev.error = st;
      out->emplace_back(std::move(p.sink), ev);
      continue;
    }
    live_[p.request.id] = Live{std::move(p.sink), ignore_eos};
  }
  for (uint64_t id : cancels) {
    if (!live_.count(id)) continue;  // already finished, or never submitted
    Status st = engine_->Cancel(id);
    if (st.ok()) {
      *step_needed = true;  // the next Step emits the final kCancelled event
    } else {
      TokenEvent ev;
      ev.finished = true;
      ev.finish_reason = FinishReason::kCancelled;
      out->emplace_back(std::move(live_[id].sink), ev);
      live_.erase(id);
    }
  }
}

void LocalEngineBackend::Loop() {
  while (true) {
    std::vector<std::pair<TokenSink, TokenEvent>> out;
    bool step_needed = false;
    DrainInbox(&out, &step_needed);
    for (auto& [sink, ev] : out) sink(ev);
    out.clear();

    if (!step_needed && !engine_->HasWork()) {
      UpdateSnapshot();
      std::unique_lock<std::mutex> lock(mutex_);
      if (stop_) break;
      cv_.wait_for(lock, std::chrono::milliseconds(options_.idle_wait_ms),
                   [&] { return stop_ || !submits_.empty() || !cancels_.empty(); });
      if (stop_) break;
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stop_) break;
    }

    auto events = engine_->Step();
    if (!events.ok()) {
      LOG_ERROR << "engine step failed: " << events.status().ToString();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        failure_ = events.status();
      }
      for (auto& [id, live] : live_) {
        TokenEvent ev;
        ev.finished = true;
        ev.finish_reason = FinishReason::kError;
        ev.error = events.status();
        live.sink(ev);
        (void)engine_->Cancel(id);
      }
      live_.clear();
      UpdateSnapshot();
      break;
    }
    for (const engine::TokenEvent& e : *events) {
      const uint64_t id = e.id;
      auto it = live_.find(id);
      if (it == live_.end()) continue;
      TokenEvent ev;
      ev.token = e.token;
      ev.finished = e.finished;
      ev.finish_reason = Translate(e.finish_reason);
      ev.error = e.error;
      ev.prompt_tokens = static_cast<int>(e.prompt_tokens);
      ev.cached_tokens = static_cast<int>(e.cached_prompt_tokens);
      if (e.has_logprobs) {
        ev.has_logprobs = true;
        ev.logprobs = e.logprobs;
      }
      // End-of-generation tokens are control tokens, not text.
      if (ev.token >= 0 && !it->second.ignore_eos && options_.is_end_of_generation &&
          options_.is_end_of_generation(ev.token)) {
        ev.token = -1;
      }
      if (ev.token < 0 && !ev.finished) continue;
      it->second.sink(ev);
      if (ev.finished) live_.erase(it);
    }
    UpdateSnapshot();
  }
  // Shutdown: every live request gets its final event.
  for (auto& [id, live] : live_) {
    (void)engine_->Cancel(id);
    TokenEvent ev;
    ev.finished = true;
    ev.finish_reason = FinishReason::kCancelled;
    live.sink(ev);
  }
  live_.clear();
  std::deque<Pending> submits;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    submits.swap(submits_);
  }
  for (auto& p : submits) {
    TokenEvent ev;
    ev.finished = true;
    ev.finish_reason = FinishReason::kCancelled;
    p.sink(ev);
  }
}

}  // namespace kvrelay::coordinator
