// Test doubles for the coordinator: a byte-level TextCodec (token id = byte)
// and a FakeBackend that "generates" a scripted reply one byte-token at a time
// on its own thread, with fault injection (refuse submits, hang, fail midway).
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "coordinator/backend.h"
#include "coordinator/openai/text_codec.h"

namespace kvrelay::coordinator::testing {

// Length of the incomplete UTF-8 sequence at the end of `s` (0 if complete).
inline size_t IncompleteUtf8Tail(const std::string& s) {
  size_t n = s.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    unsigned char c = static_cast<unsigned char>(s[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // continuation byte
    size_t need = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 1;
    return need > back ? back : 0;
  }
  return 0;
}

class ByteDecoder : public StreamDecoder {
 public:
  std::string Push(int32_t token) override {
    held_ += static_cast<char>(token & 0xFF);
    size_t tail = IncompleteUtf8Tail(held_);
    std::string out = held_.substr(0, held_.size() - tail);
    held_.erase(0, held_.size() - tail);
    return out;
  }
  std::string Flush() override {
    std::string out;
    out.swap(held_);
    return out;
  }

 private:
  std::string held_;
};

// Token id = byte value. Chat: "<role>: <content>\n" per message, then "assistant: ".
class ByteCodec : public TextCodec {
 public:
  Result<std::vector<int32_t>> Encode(std::string_view text, bool) const override {
    std::vector<int32_t> out;
    for (unsigned char c : text) out.push_back(c);
    return out;
  }
  Result<std::vector<int32_t>> EncodeChat(const std::vector<ChatMessage>& messages) const override {
    return EncodeChatTemplate(messages, /*add_generation_prompt=*/true);
  }
  Result<std::vector<int32_t>> EncodeChatTemplate(const std::vector<ChatMessage>& messages,
                                                  bool add_generation_prompt) const override {
    std::string text;
    for (const auto& m : messages) text += m.role + ": " + m.content + "\n";
    if (add_generation_prompt) text += "assistant: ";
    return Encode(text, false);
  }
  std::unique_ptr<StreamDecoder> NewDecoder() const override {
    return std::make_unique<ByteDecoder>();
  }
  int64_t VocabSize() const override { return 256; }
};

class FakeBackend : public Backend {
 public:
  struct Options {
    std::string reply = "Hello, world!";
    std::chrono::milliseconds token_interval{1};
    int cached_tokens = 0;  // reported on the first event
  };
  explicit FakeBackend(Options options)
      : options_(std::move(options)), thread_([this] { Loop(); }) {}
  FakeBackend() : FakeBackend(Options{}) {}
  ~FakeBackend() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  // --- fault injection ---
  void SetSubmitStatus(Status s) {
    std::lock_guard<std::mutex> lock(mutex_);
    submit_status_ = std::move(s);
  }
  // Requests produce no tokens until cancelled (or until Unhang()).
  void SetHang(bool hang) {
    std::lock_guard<std::mutex> lock(mutex_);
    hang_ = hang;
    cv_.notify_all();
  }
  // Finish with an error after this many tokens (-1 = never).
  void SetFailAfter(int tokens) {
    std::lock_guard<std::mutex> lock(mutex_);
    fail_after_ = tokens;
  }
  void SetHealthy(bool healthy) {
    std::lock_guard<std::mutex> lock(mutex_);
    healthy_ = healthy;
  }

  // --- observation ---
  std::vector<GenerationRequest> submitted() {
    std::lock_guard<std::mutex> lock(mutex_);
    return submitted_;
  }
  std::set<uint64_t> cancelled() {
    std::lock_guard<std::mutex> lock(mutex_);
    return cancelled_;
  }
  // Waits (bounded) until `pred()` holds under the backend lock.
  template <typename Pred>
  bool WaitFor(Pred pred, std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
    std::unique_lock<std::mutex> lock(mutex_);
    return observe_cv_.wait_for(lock, timeout, [&] { return pred(); });
  }
  bool WaitForCancel(uint64_t id) {
    return WaitFor([&] { return cancelled_.count(id) > 0; });
  }
  bool WaitForSubmits(size_t n) {
    return WaitFor([&] { return submitted_.size() >= n; });
  }
  size_t active() {
    std::lock_guard<std::mutex> lock(mutex_);
    return active_.size();
  }

  // --- Backend ---
  Status Submit(GenerationRequest request, TokenSink sink) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!submit_status_.ok()) return submit_status_;
    submitted_.push_back(request);
    active_[request.id] = Active{std::move(request), std::move(sink), 0, false};
    observe_cv_.notify_all();
    cv_.notify_all();
    return Status::Ok();
  }
  void Cancel(uint64_t id) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = active_.find(id);
    if (it != active_.end()) it->second.cancel = true;
    cancelled_.insert(id);
    observe_cv_.notify_all();
    cv_.notify_all();
  }
  Status Health() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return healthy_ ? Status::Ok() : Unavailable("fake backend marked unhealthy");
  }
  std::vector<WorkerInfo> Workers() override {
    std::lock_guard<std::mutex> lock(mutex_);
    WorkerInfo w;
    w.id = "fake-0";
    w.healthy = healthy_;
    w.running = static_cast<int64_t>(active_.size());
    w.total_kv_blocks = 100;
    w.free_kv_blocks = 75;
    return {w};
  }

 private:
  struct Active {
    GenerationRequest request;
    TokenSink sink;
    int produced = 0;
    bool cancel = false;
  };

  // One "step" per token_interval: every active request gets one event.
  void Loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      cv_.wait_for(lock, options_.token_interval);
      if (stop_) break;
      std::vector<std::pair<TokenSink, TokenEvent>> out;
      for (auto it = active_.begin(); it != active_.end();) {
        Active& a = it->second;
        TokenEvent ev;
        ev.prompt_tokens = static_cast<int>(a.request.prompt.size());
        ev.cached_tokens = options_.cached_tokens;
        bool finish = false;
        if (a.cancel) {
          ev.finished = true;
          ev.finish_reason = FinishReason::kCancelled;
          finish = true;
        } else if (hang_) {
          ++it;
          continue;
        } else if (fail_after_ >= 0 && a.produced >= fail_after_) {
          ev.finished = true;
          ev.finish_reason = FinishReason::kError;
          ev.error = Internal("injected failure");
          finish = true;
        } else if (a.produced >= static_cast<int>(options_.reply.size())) {
          ev.finished = true;
          ev.finish_reason = FinishReason::kStop;  // EOS: no token
          finish = true;
        } else {
          ev.token = static_cast<unsigned char>(options_.reply[a.produced++]);
          if (a.produced >= a.request.sampling.max_tokens) {
            ev.finished = true;
            ev.finish_reason = FinishReason::kLength;
            finish = true;
          }
        }
        out.emplace_back(a.sink, ev);
        it = finish ? active_.erase(it) : std::next(it);
      }
      // Sinks run without the lock, in order, on this thread.
      lock.unlock();
      for (auto& [sink, ev] : out) sink(ev);
      lock.lock();
      observe_cv_.notify_all();
    }
    // Finish whatever is left so every sink sees its final event.
    for (auto& [id, a] : active_) {
      TokenEvent ev;
      ev.finished = true;
      ev.finish_reason = FinishReason::kCancelled;
      a.sink(ev);
    }
  }

  const Options options_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::condition_variable observe_cv_;
  // All guarded by mutex_.
  std::map<uint64_t, Active> active_;
  std::vector<GenerationRequest> submitted_;
  std::set<uint64_t> cancelled_;
  Status submit_status_;
  bool hang_ = false;
  int fail_after_ = -1;
  bool healthy_ = true;
  bool stop_ = false;
  std::thread thread_;  // declared last: starts after the members it uses
};

}  // namespace kvrelay::coordinator::testing
