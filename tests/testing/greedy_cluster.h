// The fixture the cluster-level security tests share (security_test,
// tls_cluster_test): the model, the single-process engine as the greedy
// reference, and a `kvrelay launch` cluster of one prefill and one decode
// worker (f32 KV, 64 MiB pools, a generated cluster key) whose answers must
// equal it. Header-only; the test links kvrelay_deploy, kvrelay_engine and
// kvrelay_coordinator_codec.
//
// Thread-compatibility: Greedy() steps the one reference engine (call it from
// one thread); Complete() may run on any thread.
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "common/http_client.h"
#include "common/status.h"
#include "coordinator/openai/engine_text_codec.h"
#include "deploy/local_launcher.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/model.h"

namespace kvrelay::testing {

class GreedyCluster {
 public:
  // Loads `model_path`, builds the reference engine and starts the cluster
  // (daemons from `bin_dir`); `customize` may change the launch options
  // (e.g. control_tls_dir) before the start. The launcher stops the cluster
  // when this object is destroyed.
  static Result<std::unique_ptr<GreedyCluster>> Start(
      const std::string& model_path, const std::string& bin_dir,
      const std::function<void(deploy::LaunchOptions&)>& customize = nullptr) {
    std::unique_ptr<GreedyCluster> c(new GreedyCluster());
    c->model_path_ = model_path;
    ASSIGN_OR_RETURN(auto model, engine::Model::Load(model_path));
    c->model_ = std::shared_ptr<const engine::Model>(std::move(model));
    c->codec_ = std::make_unique<coordinator::EngineTextCodec>(c->model_->tokenizer(),
                                                               c->model_->chat_template());
    engine::EngineOptions eo;
    eo.model_path = model_path;
    eo.kv_dtype = engine::KvDtype::kF32;
    eo.kv_capacity_bytes = 64 << 20;
    eo.threads = 1;
    ASSIGN_OR_RETURN(c->engine_, engine::Engine::Create(eo, c->model_));
    deploy::LaunchOptions o;
    o.model_path = model_path;
    o.port = 0;
    o.prefill = 1;
    o.decode = 1;
    o.kv_dtype = "f32";
    o.kv_capacity_mb = 64;
    o.bin_dir = bin_dir;
    if (customize) customize(o);
    c->launcher_ = std::make_unique<deploy::LocalLauncher>(o);
    RETURN_IF_ERROR(c->launcher_->Start());
    return c;
  }

  const std::shared_ptr<const engine::Model>& model() const { return model_; }
  deploy::LocalLauncher& launcher() { return *launcher_; }

  // The prompt's token ids (with the model's BOS).
  std::vector<int32_t> Encode(const std::string& text) const {
    return std::move(codec_->Encode(text, true)).value();
  }

  // The single-process engine's greedy text for `prompt`, `n` tokens
  // (ignore_eos): what the cluster must answer.
  std::string Greedy(const std::vector<int32_t>& prompt, int n) {
    engine::RequestSpec spec;
    spec.id = static_cast<engine::RequestId>(1000000 + next_ref_++);
    spec.prompt = prompt;
    spec.sampling.temperature = 0;
    spec.sampling.max_tokens = n;
    spec.sampling.ignore_eos = true;
    if (!engine_->Submit(spec).ok()) return "<reference engine refused the request>";
    auto d = codec_->NewDecoder();
    std::string text;
    while (engine_->HasWork()) {
      auto events = engine_->Step();
      if (!events.ok()) break;
      for (const auto& e : *events) {
        if (e.token >= 0) text += d->Push(e.token);
      }
    }
    return text + d->Flush();
  }

  // One greedy completion through the cluster: its HTTP status (0 = no HTTP
  // response) and its text, or the body / transport error otherwise.
  std::pair<int, std::string> Complete(const std::vector<int32_t>& prompt, int n) const {
    HttpCallSpec spec;
    spec.method = "POST";
    spec.port = launcher_->http_port();
    spec.target = "/v1/completions";
    spec.headers = {{"Content-Type", "application/json"}};
    spec.body = nlohmann::json{
        {"model", std::filesystem::path(model_path_).stem().string()},
        {"prompt", prompt},
        {"max_tokens", n},
        {"temperature", 0},
        {"ignore_eos",
         true}}.dump();
    spec.timeout_ms = 120'000;
    auto r = HttpCall(spec);
    if (!r.ok()) return {0, r.status().ToString()};
    nlohmann::json j = nlohmann::json::parse(r->body, nullptr, false);
    if (r->status != 200 || j.is_discarded()) return {r->status, r->body};
    return {200, j["choices"][0]["text"].get<std::string>()};
  }

 private:
  GreedyCluster() = default;
  std::string model_path_;
  std::shared_ptr<const engine::Model> model_;
  std::unique_ptr<coordinator::EngineTextCodec> codec_;
  std::unique_ptr<engine::Engine> engine_;
  std::unique_ptr<deploy::LocalLauncher> launcher_;  // destroyed first: stops the cluster
  int next_ref_ = 0;
};

}  // namespace kvrelay::testing
