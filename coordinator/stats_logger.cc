#include "coordinator/stats_logger.h"

#include <cstdio>
#include <map>

#include "common/logging.h"

namespace kvrelay::coordinator {
namespace {

struct Totals {
  double prompt = 0, cached = 0, generated = 0;
};

Totals Of(const WorkerInfo& w) {
  return {static_cast<double>(w.prompt_tokens_computed + w.prefix_hit_tokens),
          static_cast<double>(w.prefix_hit_tokens), static_cast<double>(w.generated_tokens)};
}

// The increase of one cumulative figure; a worker that restarted reports from 0.
double Increase(double before, double after) { return after >= before ? after - before : after; }

}  // namespace

std::optional<std::string> StatsLogger::Line(const std::vector<WorkerInfo>& before,
                                             const std::vector<WorkerInfo>& after, double seconds) {
  std::map<std::string, Totals> was;
  for (const WorkerInfo& w : before) was[w.id] = Of(w);
  Totals d;
  int64_t running = 0, queued = 0, blocks = 0, free_blocks = 0;
  for (const WorkerInfo& w : after) {
    const Totals now = Of(w);
    const Totals then = was.count(w.id) ? was[w.id] : Totals{};
    d.prompt += Increase(then.prompt, now.prompt);
    d.cached += Increase(then.cached, now.cached);
    d.generated += Increase(then.generated, now.generated);
    running += w.running;
    queued += w.queued_tokens;
    blocks += w.total_kv_blocks;
    free_blocks += w.free_kv_blocks;
  }
  if (d.prompt == 0 && d.generated == 0 && running == 0 && queued == 0) return std::nullopt;
  const double s = seconds > 0 ? seconds : 1;
  char line[256];
  std::snprintf(
      line, sizeof line,
      "stats: prompt %.1f tok/s, generation %.1f tok/s, running %lld, queued %lld tokens, "
      "KV use %.1f%%, prefix hit rate %.1f%%",
      d.prompt / s, d.generated / s, static_cast<long long>(running),
      static_cast<long long>(queued),
      blocks > 0 ? 100.0 * static_cast<double>(blocks - free_blocks) / static_cast<double>(blocks)
                 : 0.0,
      d.prompt > 0 ? 100.0 * d.cached / d.prompt : 0.0);
  return std::string(line);
}

StatsLogger::StatsLogger(Backend* backend, std::chrono::milliseconds interval)
    : backend_(backend), interval_(interval), thread_([this] { Run(); }) {}

StatsLogger::~StatsLogger() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void StatsLogger::Run() {
  std::vector<WorkerInfo> last = backend_->Workers();
  auto last_at = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (wake_.wait_for(lock, interval_, [this] { return stop_; })) break;
    lock.unlock();
    std::vector<WorkerInfo> now = backend_->Workers();
    const auto at = std::chrono::steady_clock::now();
    const double seconds = std::chrono::duration<double>(at - last_at).count();
    if (auto line = Line(last, now, seconds)) LOG_INFO << *line;
    last = std::move(now);
    last_at = at;
    lock.lock();
  }
}

}  // namespace kvrelay::coordinator
