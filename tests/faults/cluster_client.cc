#include "tests/faults/cluster_client.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "common/http_client.h"
#include "coordinator/openai/engine_text_codec.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/model.h"

namespace kvrelay::faults {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

}  // namespace

std::string ModelPath() {
  return std::string(KVRELAY_FAULTS_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

// ---------------------------------------------------------------- metrics

bool HealthyWith(uint16_t port, const std::vector<std::string>& ids) {
  HttpCallSpec spec;
  spec.port = port;
  spec.target = "/health";
  spec.timeout_ms = 2000;
  auto r = HttpCall(spec);
  if (!r.ok() || r->status != 200) return false;
  json j = json::parse(r->body, nullptr, false);
  if (!j.is_object() || !j.contains("workers")) return false;
  for (const std::string& id : ids) {
    bool found = false;
    for (const auto& w : j["workers"]) found = found || w.value("id", "") == id;
    if (!found) return false;
  }
  return true;
}

bool WaitFor(const std::function<bool()>& cond, std::chrono::milliseconds timeout) {
  const Deadline deadline = Deadline::After(timeout);
  while (!deadline.Expired()) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return cond();
}

// ---------------------------------------------------------------- client

Outcome Complete(uint16_t port, const std::vector<int32_t>& prompt, int max_tokens,
                 int timeout_ms) {
  Outcome out;
  out.sent = Clock::now();
  json body = {{"model", fs::path(ModelPath()).stem().string()},
               {"prompt", prompt},
               {"max_tokens", max_tokens},
               {"temperature", 0},
               {"ignore_eos", true}};
  HttpCallSpec spec;
  spec.method = "POST";
  spec.port = port;
  spec.target = "/v1/completions";
  spec.body = body.dump();
  spec.headers = {{"Content-Type", "application/json"}};
  spec.timeout_ms = timeout_ms;
  auto r = HttpCall(spec);
  out.ended = Clock::now();
  if (!r.ok()) {
    out.error = r.status().ToString();
    return out;
  }
  out.http_status = r->status;
  json j = json::parse(r->body, nullptr, false);
  if (r->status == 200 && j.is_object() && j.contains("choices") && !j["choices"].empty()) {
    out.text = j["choices"][0].value("text", "");
  } else {
    out.error = r->body;
  }
  return out;
}

void LoadClient::Start(double rate_per_s) {
  const auto interval =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(1.0 / rate_per_s));
  sender_ = std::thread([this, interval] {
    auto next = Clock::now();
    for (int i = 0; !stop_.load(); ++i) {
      {
        std::lock_guard lock(mu_);
        outs_.push_back(std::make_unique<Outcome>());
        Outcome* slot = outs_.back().get();
        const int p = i % static_cast<int>(prompts_.size());
        slot->prompt = p;
        in_flight_.fetch_add(1);
        requests_.emplace_back([this, slot, p] {
          *slot = Complete(port_, prompts_[p], max_tokens_, timeout_ms_);
          slot->prompt = p;
          in_flight_.fetch_sub(1);
        });
      }
      next += interval;
      while (!stop_.load() && Clock::now() < next) {
        std::this_thread::sleep_for(
            std::min<Clock::duration>(next - Clock::now(), std::chrono::milliseconds(20)));
      }
    }
  });
}

std::vector<Outcome> LoadClient::Stop() {
  stop_.store(true);
  if (sender_.joinable()) sender_.join();
  std::vector<std::thread> requests;
  {
    std::lock_guard lock(mu_);
    requests.swap(requests_);
  }
  for (auto& t : requests) t.join();  // each ends within its timeout
  std::lock_guard lock(mu_);
  std::vector<Outcome> out;
  for (auto& o : outs_) out.push_back(*o);
  outs_.clear();
  return out;
}

// ---------------------------------------------------------------- reference

struct GreedyReference::Impl {
  std::shared_ptr<const engine::Model> model;
  std::unique_ptr<coordinator::EngineTextCodec> codec;
  std::unique_ptr<engine::Engine> engine;
  std::map<std::pair<std::vector<int32_t>, int>, std::string> cache;
  int next_id = 0;
};

GreedyReference* GreedyReference::Get() {
  // Destroyed at exit (its engine's threads joined), so a ThreadSanitizer
  // build of a test sees no thread leaked.
  static const std::unique_ptr<GreedyReference> ref = []() -> std::unique_ptr<GreedyReference> {
    if (!fs::exists(ModelPath())) return nullptr;
    auto model = engine::Model::Load(ModelPath());
    if (!model.ok()) return nullptr;
    std::unique_ptr<GreedyReference> r(new GreedyReference());
    r->impl_ = std::make_unique<Impl>();
    r->impl_->model = std::shared_ptr<const engine::Model>(std::move(*model));
    r->impl_->codec = std::make_unique<coordinator::EngineTextCodec>(
        r->impl_->model->tokenizer(), r->impl_->model->chat_template());
    engine::EngineOptions eo;
    eo.model_path = ModelPath();
    eo.kv_dtype = engine::KvDtype::kF32;
    eo.kv_capacity_bytes = 64 << 20;
    eo.threads = 1;
    auto eng = engine::Engine::Create(eo, r->impl_->model);
    if (!eng.ok()) return nullptr;
    r->impl_->engine = std::move(*eng);
    return r;
  }();
  return ref.get();
}

std::vector<int32_t> GreedyReference::Encode(const std::string& text) const {
  auto r = impl_->codec->Encode(text, true);
  return r.ok() ? *r : std::vector<int32_t>{};
}

std::string GreedyReference::Text(const std::vector<int32_t>& prompt, int max_tokens) {
  auto key = std::make_pair(prompt, max_tokens);
  if (auto it = impl_->cache.find(key); it != impl_->cache.end()) return it->second;
  engine::RequestSpec spec;
  spec.id = static_cast<engine::RequestId>(++impl_->next_id);
  spec.prompt = prompt;
  spec.sampling.temperature = 0;
  spec.sampling.max_tokens = max_tokens;
  spec.sampling.ignore_eos = true;
  std::vector<int32_t> tokens;
  if (impl_->engine->Submit(spec).ok()) {
    while (impl_->engine->HasWork()) {
      auto events = impl_->engine->Step();
      if (!events.ok()) break;
      for (const auto& e : *events) {
        if (e.token >= 0) tokens.push_back(e.token);
      }
    }
  }
  auto d = impl_->codec->NewDecoder();
  std::string s;
  for (int32_t t : tokens) s += d->Push(t);
  s += d->Flush();
  impl_->cache[key] = s;
  return s;
}

}  // namespace kvrelay::faults
