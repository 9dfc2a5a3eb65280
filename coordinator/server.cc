#include "coordinator/server.h"

#include <pthread.h>

#include <algorithm>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "common/clock.h"
#include "common/logging.h"
#include "coordinator/admission.h"
#include "coordinator/sse.h"
#include "common/stop_matcher.h"

namespace kvrelay::coordinator {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;
using nlohmann::json;

constexpr size_t kWatchBufferLimit = 64 << 10;

std::string EndpointName(Endpoint e) {
  return e == Endpoint::kChatCompletions ? "chat_completions" : "completions";
}

std::string FinishName(FinishReason r) {
  switch (r) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kError:
      return "error";
    case FinishReason::kNone:
      break;
  }
  return "none";
}

int64_t UnixSeconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// State shared by the listener, every session and every request. Holds no
// I/O objects, so a request can outlive its connection safely.
struct Core {
  Core(ServerOptions o, Backend* b, const TextCodec* c, MetricsRegistry* m)
      : options(std::move(o)),
        backend(b),
        codec(c),
        registry(m),
        admission(AdmissionQueue::Options{options.max_running, options.max_queue}) {
    ttft = m->GetHistogram("kvrelay_time_to_first_token_seconds",
                           "Time from request arrival to the first generated token.");
    itl = m->GetHistogram("kvrelay_inter_token_latency_seconds",
                          "Time between consecutive generated tokens of a request.");
    e2e = m->GetHistogram("kvrelay_e2e_request_latency_seconds",
                          "Time from request arrival to its last token.");
    queue_wait =
        m->GetHistogram("kvrelay_queue_wait_seconds", "Time a request waited for admission.");
    prompt_tokens =
        m->GetCounter("kvrelay_prompt_tokens_total", "Prompt tokens of finished requests.");
    generation_tokens = m->GetCounter("kvrelay_generation_tokens_total", "Generated tokens.");
    cached_tokens = m->GetCounter("kvrelay_prefix_cache_hit_tokens_total",
                                  "Prompt tokens served from a prefix cache.");
    queue_depth = m->GetGauge("kvrelay_queue_depth", "Requests waiting for admission.");
    running = m->GetGauge("kvrelay_running_requests", "Requests admitted to the backend.");
    open_connections = m->GetGauge("kvrelay_open_connections", "Open HTTP connections.");
    std::random_device rd;
    nonce = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }

  void CountRequest(const std::string& endpoint, int status) {
    registry
        ->GetCounter("kvrelay_http_requests_total", "HTTP requests by endpoint and status code.",
                     {{"endpoint", endpoint}, {"code", std::to_string(status)}})
        ->Increment();
  }
  void UpdateAdmissionGauges() {
    queue_depth->Set(admission.queued());
    running->Set(admission.running());
  }

  const ServerOptions options;
  Backend* const backend;
  const TextCodec* const codec;
  MetricsRegistry* const registry;
  AdmissionQueue admission;
  Histogram* ttft;
  Histogram* itl;
  Histogram* e2e;
  Histogram* queue_wait;
  Counter* prompt_tokens;
  Counter* generation_tokens;
  Counter* cached_tokens;
  Gauge* queue_depth;
  Gauge* running;
  Gauge* open_connections;
  uint64_t nonce = 0;
  std::atomic<uint64_t> next_id{1};
  std::atomic<int> connections{0};

  // Requests submitted to the backend whose final event has not arrived.
  std::mutex mutex;
  std::condition_variable drained;
  bool open = true;               // guarded by mutex; false once Stop() began
  std::set<uint64_t> in_backend;  // guarded by mutex
};

class Session;

// One generation request. Created and mostly touched on its session's
// strand; OnBackendEvent runs on a backend thread.
struct RequestState {
  std::shared_ptr<Core> core;
  std::shared_ptr<Session> session;  // guarded by core->mutex; reset when the request ends
  uint64_t id = 0;
  int index = 0;  // which of the request's n choices
  CompletionParams params;
  GenerationRequest generation;
  ResponseIdentity ident;
  TimePoint arrived;
  std::atomic<bool> slot_held{false};

  // Strand-only state.
  bool submitted = false;
  bool stopped = false;  // a stop string matched
  bool done = false;
  bool first_chunk = true;
  std::unique_ptr<StreamDecoder> decoder;
  std::optional<StopMatcher> matcher;
  std::string text;  // non-streaming: the whole completion
  UsageCounts usage;
  std::optional<TimePoint> last_token_at;

  // `session` is read on backend threads: take and drop it under core->mutex.
  std::shared_ptr<Session> GetSession() {
    std::lock_guard<std::mutex> lock(core->mutex);
    return session;
  }
  void DetachSession() {
    std::shared_ptr<Session> old;
    {
      std::lock_guard<std::mutex> lock(core->mutex);
      old.swap(session);
    }
  }

  void ReleaseSlot() {
    if (slot_held.exchange(false)) {
      core->admission.Release();
      core->UpdateAdmissionGauges();
    }
  }
  // Backend thread: events arrive in order, one at a time.
  void OnBackendEvent(const std::shared_ptr<RequestState>& self, const TokenEvent& ev);
};

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, std::shared_ptr<Core> core)
      : stream_(std::move(socket)), core_(std::move(core)) {
    core_->connections.fetch_add(1);
    core_->open_connections->Add(1);
  }
  ~Session() {
    core_->connections.fetch_sub(1);
    core_->open_connections->Add(-1);
  }

  void Run() {
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->DoRead(); });
  }
  net::any_io_executor executor() { return stream_.get_executor(); }

  // Strand: the admission queue let `r` start.
  void StartGeneration(const std::shared_ptr<RequestState>& r);
  // Strand: one backend event of `r`, stamped when the backend produced it.
  void OnEvent(const std::shared_ptr<RequestState>& r, const TokenEvent& ev, TimePoint at);

 private:
  struct OutItem {
    enum Kind { kHeader, kChunk, kLast } kind;
    std::string data;
  };

  void DoRead();
  void OnRead(beast::error_code ec);
  void Handle();
  void HandleCompletion(Endpoint endpoint, std::string tenant);
  std::optional<std::string> Authenticate();  // tenant, or nullopt after answering 401
  void HandleMetrics();
  void HandleHealth();

  void SendJson(http::status status, const json& body, bool keep_alive = true,
                std::vector<std::pair<std::string, std::string>> headers = {});
  void SendText(http::status status, std::string body, std::string content_type, bool keep_alive,
                std::vector<std::pair<std::string, std::string>> headers = {});
  void SendError(const ApiError& e, bool keep_alive = true,
                 std::vector<std::pair<std::string, std::string>> headers = {});
  void AfterResponse(bool keep_alive);

  void StartWatch();
  void OnWatch(beast::error_code ec, size_t n);
  void ClientGone();

  void Emit(RequestState& r, const std::string& piece);
  void Finish(const std::shared_ptr<RequestState>& r, const TokenEvent& ev);
  void QueueOut(OutItem item);
  void PumpWrites();
  void Close();

  beast::tcp_stream stream_;
  std::shared_ptr<Core> core_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  http::request<http::string_body> req_;
  std::string endpoint_label_ = "other";

  // The choices (n of them, in index order) of the generation in progress;
  // empty when none. A choice leaves the list when it ends.
  std::vector<std::shared_ptr<RequestState>> active_;
  std::vector<ChoiceResult> results_;  // per choice, for the non-streaming answer
  UsageCounts total_usage_;            // summed over the finished choices
  bool stream_started_ = false;        // the SSE header is queued
  bool IsActive(const std::shared_ptr<RequestState>& r) const {
    return std::find(active_.begin(), active_.end(), r) != active_.end();
  }
  // Drops r from active_ and detaches it from this session.
  void Forget(const std::shared_ptr<RequestState>& r) {
    std::erase(active_, r);
    r->DetachSession();
  }
  // Ends every other choice: cancels those in the backend (their final events
  // are then ignored), unqueues the queued ones.
  void AbortOthers(const std::shared_ptr<RequestState>& r);
  bool watching_ = false;     // a disconnect-watch read is pending
  bool resume_read_ = false;  // start the next request read when the watch returns
  bool client_gone_ = false;
  bool closed_ = false;

  std::deque<OutItem> out_;
  size_t out_bytes_ = 0;
  bool writing_ = false;
  bool stream_keep_alive_ = false;
  std::shared_ptr<http::response<http::empty_body>> stream_header_;
  std::shared_ptr<http::response_serializer<http::empty_body>> stream_serializer_;
};

void RequestState::OnBackendEvent(const std::shared_ptr<RequestState>& self, const TokenEvent& ev) {
  TimePoint at = Clock::now();
  if (ev.finished) {
    ReleaseSlot();
    std::lock_guard<std::mutex> lock(core->mutex);
    core->in_backend.erase(id);
    core->drained.notify_all();
  }
  std::lock_guard<std::mutex> lock(core->mutex);
  if (!core->open || !session) return;
  auto s = session;
  net::post(s->executor(), [s, self, ev, at] { s->OnEvent(self, ev, at); });
}

void Session::DoRead() {
  if (closed_) return;
  parser_.emplace();
  parser_->body_limit(core_->options.max_body_bytes);
  parser_->header_limit(static_cast<uint32_t>(core_->options.max_header_bytes));
  stream_.expires_after(std::chrono::milliseconds(core_->options.header_timeout_ms));
  http::async_read(stream_, buffer_, *parser_,
                   [self = shared_from_this()](beast::error_code ec, size_t) { self->OnRead(ec); });
}

void Session::OnRead(beast::error_code ec) {
  if (ec == http::error::body_limit) {
    endpoint_label_ = "other";
    ApiError e;
    e.http_status = 413;
    e.message = "request body exceeds " + std::to_string(core_->options.max_body_bytes) + " bytes";
    e.code = "request_too_large";
    return SendError(e, /*keep_alive=*/false);
  }
  if (ec == http::error::header_limit) {
    ApiError e;
    e.http_status = 431;
    e.message =
        "request headers exceed " + std::to_string(core_->options.max_header_bytes) + " bytes";
    return SendError(e, false);
  }
  if (ec) return Close();  // end of stream, timeout, reset, malformed HTTP
  req_ = parser_->release();
  Handle();
}

std::optional<std::string> Session::Authenticate() {
  if (core_->options.api_keys.empty()) return std::string();
  auto it = req_.find(http::field::authorization);
  ApiError e;
  e.http_status = 401;
  e.code = "invalid_api_key";
  if (it == req_.end()) {
    e.message = "missing API key: send 'Authorization: Bearer <key>'";
  } else {
    std::string_view v(it->value().data(), it->value().size());
    constexpr std::string_view kBearer = "Bearer ";
    if (v.size() > kBearer.size() && v.substr(0, kBearer.size()) == kBearer) {
      if (auto tenant = core_->options.api_keys.TenantOf(v.substr(kBearer.size()))) return tenant;
    }
    e.message = "invalid API key";
  }
  SendError(e, true, {{"WWW-Authenticate", "Bearer"}});
  return std::nullopt;
}

void Session::Handle() {
  std::string_view target(req_.target().data(), req_.target().size());
  if (size_t q = target.find('?'); q != std::string_view::npos) target = target.substr(0, q);
  const http::verb method = req_.method();
  auto method_not_allowed = [&](const char* allow) {
    ApiError e;
    e.http_status = 405;
    e.message =
        "method " + std::string(req_.method_string()) + " not allowed on " + std::string(target);
    e.code = "method_not_allowed";
    SendError(e, true, {{"Allow", allow}});
  };
  if (target == "/health") {
    endpoint_label_ = "health";
    if (method != http::verb::get) return method_not_allowed("GET");
    return HandleHealth();
  }
  if (target == "/metrics") {
    endpoint_label_ = "metrics";
    if (method != http::verb::get) return method_not_allowed("GET");
    return HandleMetrics();
  }
  if (target == "/v1/models") {
    endpoint_label_ = "models";
    if (method != http::verb::get) return method_not_allowed("GET");
    if (!Authenticate()) return;
    return SendJson(http::status::ok, ModelsJson(core_->options.model_name, UnixSeconds()));
  }
  if (target == "/v1/chat/completions" || target == "/v1/completions") {
    Endpoint endpoint =
        target == "/v1/completions" ? Endpoint::kCompletions : Endpoint::kChatCompletions;
    endpoint_label_ = EndpointName(endpoint);
    if (method != http::verb::post) return method_not_allowed("POST");
    auto tenant = Authenticate();
    if (!tenant) return;
    return HandleCompletion(endpoint, std::move(*tenant));
  }
  endpoint_label_ = "other";
  ApiError e;
  e.http_status = 404;
  e.message = "unknown path " + std::string(target);
  e.code = "not_found";
  SendError(e);
}

void Session::HandleHealth() {
  Status st = core_->backend->Health();
  json workers = json::array();
  for (const auto& w : core_->backend->Workers()) {
    workers.push_back({{"id", w.id},
                       {"role", w.role == WorkerRole::kPrefill  ? "prefill"
                                : w.role == WorkerRole::kDecode ? "decode"
                                                                : "colocated"},
                       {"healthy", w.healthy}});
  }
  json body = {{"status", st.ok() ? "ok" : "unavailable"}, {"workers", workers}};
  if (!st.ok()) body["message"] = st.message();
  SendJson(st.ok() ? http::status::ok : http::status::service_unavailable, body);
}

void Session::HandleMetrics() {
  MetricsRegistry* m = core_->registry;
  for (const auto& w : core_->backend->Workers()) {
    MetricLabels l = {{"worker", w.id}};
    double util = w.total_kv_blocks > 0 ? 1.0 - static_cast<double>(w.free_kv_blocks) /
                                                    static_cast<double>(w.total_kv_blocks)
                                        : 0.0;
    m->GetGauge("kvrelay_worker_kv_utilization", "Fraction of the worker's KV blocks in use.", l)
        ->Set(util);
    m->GetGauge("kvrelay_worker_running", "Sequences in the worker's running batch.", l)
        ->Set(static_cast<double>(w.running));
    m->GetGauge("kvrelay_worker_queued_tokens", "Prompt tokens queued at the worker.", l)
        ->Set(static_cast<double>(w.queued_tokens));
    m->GetGauge("kvrelay_worker_prefix_hit_tokens",
                "Prompt tokens the worker served from its prefix cache (cumulative).", l)
        ->Set(static_cast<double>(w.prefix_hit_tokens));
    m->GetGauge("kvrelay_worker_transfer_bytes", "KV bytes the worker transferred (cumulative).", l)
        ->Set(static_cast<double>(w.transfer_bytes));
    m->GetGauge("kvrelay_worker_transfer_seconds",
                "Seconds the worker spent in KV transfer (cumulative).", l)
        ->Set(w.transfer_seconds);
    m->GetGauge("kvrelay_worker_healthy", "1 when the worker is healthy.", l)
        ->Set(w.healthy ? 1 : 0);
  }
  core_->UpdateAdmissionGauges();
  SendText(http::status::ok, m->RenderPrometheus(), "text/plain; version=0.0.4; charset=utf-8",
           true);
}

void Session::HandleCompletion(Endpoint endpoint, std::string tenant) {
  const ServerOptions& opt = core_->options;
  auto r = std::make_shared<RequestState>();
  r->core = core_;
  r->arrived = Clock::now();
  if (auto err = ParseCompletionRequest(endpoint, req_.body(), opt.limits, &r->params)) {
    return SendError(*err);
  }
  const CompletionParams& p = r->params;
  if (p.model != opt.model_name) {
    ApiError e;
    e.http_status = 404;
    e.message =
        "The model '" + p.model + "' does not exist (this server serves '" + opt.model_name + "')";
    e.param = "model";
    e.code = "model_not_found";
    return SendError(e);
  }
  Result<std::vector<int32_t>> tokens = std::vector<int32_t>();
  if (endpoint == Endpoint::kChatCompletions) {
    tokens = core_->codec->EncodeChat(p.messages);
  } else if (p.prompt_is_tokens) {
    tokens = p.prompt_token_ids;
  } else {
    tokens = core_->codec->Encode(p.prompt, /*add_special=*/true);
  }
  if (!tokens.ok()) {
    return SendError(BadRequest("cannot tokenize the prompt: " + tokens.status().message(),
                                endpoint == Endpoint::kChatCompletions ? "messages" : "prompt"));
  }
  if (tokens->empty()) {
    return SendError(BadRequest("the prompt is empty",
                                endpoint == Endpoint::kChatCompletions ? "messages" : "prompt"));
  }
  if (static_cast<int64_t>(tokens->size()) > opt.max_prompt_tokens) {
    ApiError e;
    e.http_status = 413;
    e.message = "the prompt has " + std::to_string(tokens->size()) + " tokens; at most " +
                std::to_string(opt.max_prompt_tokens) + " are allowed";
    e.param = endpoint == Endpoint::kChatCompletions ? "messages" : "prompt";
    e.code = "context_length_exceeded";
    return SendError(e);
  }
  if (opt.max_context_tokens > 0 &&
      static_cast<int64_t>(tokens->size()) + p.max_tokens > opt.max_context_tokens) {
    return SendError(BadRequest("prompt (" + std::to_string(tokens->size()) +
                                    " tokens) plus max_tokens (" + std::to_string(p.max_tokens) +
                                    ") exceeds the context length " +
                                    std::to_string(opt.max_context_tokens),
                                "max_tokens", "context_length_exceeded"));
  }

  r->id = core_->next_id.fetch_add(1);
  char idbuf[48];
  std::snprintf(idbuf, sizeof(idbuf), "%s%016llx%08llx",
                endpoint == Endpoint::kChatCompletions ? "chatcmpl-" : "cmpl-",
                static_cast<unsigned long long>(core_->nonce),
                static_cast<unsigned long long>(r->id));
  r->ident = {idbuf, UnixSeconds(), p.model};
  GenerationRequest& g = r->generation;
  g.id = r->id;
  g.prompt = std::move(*tokens);
  g.sampling.temperature = p.temperature;
  g.sampling.top_p = p.top_p;
  g.sampling.top_k = p.top_k;
  g.sampling.min_p = p.min_p;
  g.sampling.repetition_penalty = p.repetition_penalty;
  g.sampling.presence_penalty = p.presence_penalty;
  g.sampling.frequency_penalty = p.frequency_penalty;
  g.sampling.has_seed = p.seed.has_value();
  g.sampling.seed = p.seed.value_or(0);
  g.sampling.max_new_tokens = p.max_tokens;
  g.sampling.ignore_eos = p.ignore_eos;
  g.tenant_salt = tenant;
  if (opt.prefix_hasher) g.prefix_blocks = opt.prefix_hasher(g.prompt, tenant);
  r->usage.prompt_tokens = static_cast<int>(g.prompt.size());
  r->decoder = core_->codec->NewDecoder();
  r->matcher.emplace(p.stop);
  if (endpoint == Endpoint::kCompletions && p.echo) r->text = p.prompt_is_tokens ? "" : p.prompt;
  // Every request gets a seed here (when the client gave none), so that
  // sampling differs between requests and between the n choices of one.
  if (!g.sampling.has_seed) {
    g.sampling.has_seed = true;
    g.sampling.seed =
        (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  }
  std::vector<std::shared_ptr<RequestState>> choices = {r};
  for (int i = 1; i < p.n; ++i) {
    auto c = std::make_shared<RequestState>();
    c->core = core_;
    c->arrived = r->arrived;
    c->params = r->params;
    c->ident = r->ident;
    c->index = i;
    c->id = core_->next_id.fetch_add(1);
    c->generation = r->generation;
    c->generation.id = c->id;
    c->generation.sampling.seed = g.sampling.seed + static_cast<uint64_t>(i);
    c->usage.prompt_tokens = r->usage.prompt_tokens;
    c->decoder = core_->codec->NewDecoder();
    c->matcher.emplace(p.stop);
    c->text = r->text;
    choices.push_back(std::move(c));
  }
  {
    std::lock_guard<std::mutex> lock(core_->mutex);
    for (auto& c : choices) c->session = shared_from_this();
  }
  active_ = choices;
  results_.assign(choices.size(), ChoiceResult{});
  total_usage_ = UsageCounts{};
  total_usage_.prompt_tokens = r->usage.prompt_tokens;
  stream_started_ = false;
  stream_keep_alive_ = req_.keep_alive();

  Status st;
  for (auto& c : choices) {
    std::weak_ptr<RequestState> weak = c;
    st = core_->admission.Enqueue(c->id, [weak] {
      auto req = weak.lock();
      if (!req) return;  // cannot happen while queued: the session holds it
      req->slot_held.store(true);
      auto s = req->GetSession();
      if (!s) {
        req->ReleaseSlot();
        return;
      }
      net::post(s->executor(), [s, req] { s->StartGeneration(req); });
    });
    if (!st.ok()) break;
  }
  core_->UpdateAdmissionGauges();
  if (!st.ok()) {
    // Unqueue the choices queued so far; one whose start is already posted
    // finds itself inactive in StartGeneration and gives its slot back.
    for (auto& c : choices) {
      core_->admission.Remove(c->id);
      c->DetachSession();
    }
    active_.clear();
    core_->UpdateAdmissionGauges();
    ApiError e;
    e.http_status = 429;
    e.type = "rate_limit_exceeded";
    e.code = "queue_full";
    e.message = "server is at capacity: " + st.message() + "; retry later";
    return SendError(e, true,
                     {{"Retry-After", std::to_string(core_->options.retry_after_seconds)}});
  }
  // From here the request deadline covers queueing and generation.
  stream_.expires_after(std::chrono::milliseconds(opt.request_timeout_ms));
  StartWatch();
}

void Session::StartGeneration(const std::shared_ptr<RequestState>& r) {
  core_->queue_wait->Observe(SecondsSince(r->arrived));
  if (!IsActive(r) || client_gone_ || closed_) {
    r->ReleaseSlot();
    if (IsActive(r)) {
      Forget(r);
      if (active_.empty()) Close();
    }
    return;
  }
  {
    std::lock_guard<std::mutex> lock(core_->mutex);
    if (!core_->open) {
      r->ReleaseSlot();
      return;
    }
    core_->in_backend.insert(r->id);
  }
  r->submitted = true;
  Status st = core_->backend->Submit(r->generation,
                                     [r](const TokenEvent& ev) { r->OnBackendEvent(r, ev); });
  if (!st.ok()) {
    r->submitted = false;
    r->ReleaseSlot();
    {
      std::lock_guard<std::mutex> lock(core_->mutex);
      core_->in_backend.erase(r->id);
      core_->drained.notify_all();
    }
    AbortOthers(r);
    Forget(r);
    ApiError e;
    bool busy =
        st.code() == StatusCode::kResourceExhausted || st.code() == StatusCode::kUnavailable;
    e.http_status = busy ? 503 : (st.code() == StatusCode::kInvalidArgument ? 400 : 500);
    e.type =
        busy ? "server_error" : (e.http_status == 400 ? "invalid_request_error" : "server_error");
    e.code = busy ? "no_capacity" : "";
    e.message = st.message();
    return SendError(
        e, true,
        busy ? std::vector<std::pair<std::string, std::string>>{{"Retry-After",
                                                                 std::to_string(
                                                                     core_->options
                                                                         .retry_after_seconds)}}
             : std::vector<std::pair<std::string, std::string>>{});
  }
  if (r->params.stream && !stream_started_) {
    stream_started_ = true;
    stream_header_ =
        std::make_shared<http::response<http::empty_body>>(http::status::ok, req_.version());
    stream_header_->set(http::field::content_type, "text/event-stream");
    stream_header_->set(http::field::cache_control, "no-cache");
    stream_header_->set("X-Request-Id", r->ident.id);
    stream_header_->keep_alive(stream_keep_alive_);
    stream_header_->chunked(true);
    QueueOut({OutItem::kHeader, ""});
  }
}

void Session::Emit(RequestState& r, const std::string& piece) {
  if (piece.empty()) return;
  if (!r.params.stream) {
    r.text += piece;
    return;
  }
  QueueOut({OutItem::kChunk,
            SseEvent(DumpJson(StreamChunkJson(r.params.endpoint, r.ident, piece, r.first_chunk,
                                              FinishReason::kNone, r.index)))});
  r.first_chunk = false;
}

void Session::OnEvent(const std::shared_ptr<RequestState>& r, const TokenEvent& ev, TimePoint at) {
  if (!IsActive(r) || r->done) return;
  if (ev.prompt_tokens > 0) r->usage.prompt_tokens = ev.prompt_tokens;
  if (ev.cached_tokens > 0) r->usage.cached_tokens = ev.cached_tokens;
  if (ev.token >= 0 && !r->stopped) {
    ++r->usage.completion_tokens;
    if (!r->last_token_at) {
      core_->ttft->Observe(std::chrono::duration<double>(at - r->arrived).count());
    } else {
      core_->itl->Observe(std::chrono::duration<double>(at - *r->last_token_at).count());
    }
    r->last_token_at = at;
    StopMatcher::Output out = r->matcher->Push(r->decoder->Push(ev.token));
    Emit(*r, out.text);
    if (out.stopped) {
      r->stopped = true;
      core_->backend->Cancel(r->id);
    }
  }
  if (ev.finished) Finish(r, ev);
}

void Session::Finish(const std::shared_ptr<RequestState>& r, const TokenEvent& ev) {
  r->done = true;
  FinishReason finish = r->stopped ? FinishReason::kStop : ev.finish_reason;
  if (!r->stopped && finish != FinishReason::kError) {
    StopMatcher::Output out = r->matcher->Push(r->decoder->Flush());
    Emit(*r, out.text);
    if (out.stopped) {
      finish = FinishReason::kStop;
    } else {
      Emit(*r, r->matcher->Flush());
    }
  }
  core_->e2e->Observe(SecondsSince(r->arrived));
  core_->prompt_tokens->Increment(r->usage.prompt_tokens);
  core_->generation_tokens->Increment(r->usage.completion_tokens);
  core_->cached_tokens->Increment(r->usage.cached_tokens);
  core_->registry
      ->GetCounter(
          "kvrelay_requests_finished_total",
          "Finished generation requests by endpoint and finish reason.",
          {{"endpoint", EndpointName(r->params.endpoint)}, {"finish_reason", FinishName(finish)}})
      ->Increment();
  Forget(r);
  total_usage_.completion_tokens += r->usage.completion_tokens;
  total_usage_.cached_tokens = std::max(total_usage_.cached_tokens, r->usage.cached_tokens);
  if (r->usage.prompt_tokens > 0) total_usage_.prompt_tokens = r->usage.prompt_tokens;
  if (client_gone_) {
    if (active_.empty()) Close();
    return;
  }

  const CompletionParams& p = r->params;
  if (finish == FinishReason::kError) {
    // One failed choice fails the response: the others are cancelled.
    AbortOthers(r);
    // The backend validates what the coordinator cannot (token ids against
    // the vocabulary, prompt + max_tokens against the pool): those are the
    // client's or capacity errors, not the server's.
    ApiError e;
    switch (ev.error.code()) {
      case StatusCode::kInvalidArgument:
        e.http_status = 400;
        break;
      case StatusCode::kResourceExhausted:
      case StatusCode::kUnavailable:
        e.http_status = 503;
        e.type = "server_error";
        e.code = "no_capacity";
        break;
      default:
        e.http_status = 500;
        e.type = "server_error";
    }
    e.message = "generation failed: " + ev.error.ToString();
    if (!p.stream) return SendError(e);
    QueueOut({OutItem::kChunk, SseEvent(DumpJson(ErrorToJson(e)))});
    QueueOut({OutItem::kChunk, std::string(kSseDone)});
    QueueOut({OutItem::kLast, ""});
    return;
  }
  results_[r->index] = {r->text, finish};
  if (p.stream) {
    QueueOut({OutItem::kChunk, SseEvent(DumpJson(StreamChunkJson(
                                   p.endpoint, r->ident, "", r->first_chunk, finish, r->index)))});
  }
  if (!active_.empty()) return;  // other choices still running
  if (!p.stream) {
    return SendJson(http::status::ok,
                    CompletionResponseJson(p.endpoint, r->ident, results_, total_usage_));
  }
  if (p.include_usage) {
    QueueOut(
        {OutItem::kChunk, SseEvent(DumpJson(UsageChunkJson(p.endpoint, r->ident, total_usage_)))});
  }
  QueueOut({OutItem::kChunk, std::string(kSseDone)});
  QueueOut({OutItem::kLast, ""});
}

void Session::AbortOthers(const std::shared_ptr<RequestState>& r) {
  for (auto& c : std::vector<std::shared_ptr<RequestState>>(active_)) {
    if (c == r) continue;
    if (c->submitted && !c->done) core_->backend->Cancel(c->id);
    if (!c->submitted) core_->admission.Remove(c->id);
    Forget(c);
  }
  core_->UpdateAdmissionGauges();
}

void Session::QueueOut(OutItem item) {
  if (closed_) return;
  out_bytes_ += item.data.size();
  out_.push_back(std::move(item));
  if (out_bytes_ > core_->options.max_stream_backlog_bytes) {
    LOG_WARNING << "client too slow: " << out_bytes_ << " unsent bytes; dropping the connection";
    ClientGone();
    return;
  }
  PumpWrites();
}

void Session::PumpWrites() {
  if (writing_ || out_.empty() || closed_) return;
  writing_ = true;
  auto item = std::make_shared<OutItem>(std::move(out_.front()));
  out_.pop_front();
  out_bytes_ -= item->data.size();
  auto done = [self = shared_from_this(), item](beast::error_code ec, size_t) {
    self->writing_ = false;
    if (ec) return self->ClientGone();
    if (item->kind == OutItem::kLast) {
      self->stream_header_.reset();
      self->stream_serializer_.reset();
      return self->AfterResponse(self->stream_keep_alive_);
    }
    self->PumpWrites();
  };
  switch (item->kind) {
    case OutItem::kHeader:
      stream_serializer_ =
          std::make_shared<http::response_serializer<http::empty_body>>(*stream_header_);
      http::async_write_header(stream_, *stream_serializer_, std::move(done));
      break;
    case OutItem::kChunk:
      net::async_write(stream_, http::make_chunk(net::buffer(item->data)), std::move(done));
      break;
    case OutItem::kLast:
      net::async_write(stream_, http::make_chunk_last(), std::move(done));
      break;
  }
}

void Session::SendText(http::status status, std::string body, std::string content_type,
                       bool keep_alive, std::vector<std::pair<std::string, std::string>> headers) {
  if (closed_) return;
  core_->CountRequest(endpoint_label_, static_cast<int>(status));
  auto res = std::make_shared<http::response<http::string_body>>(
      status, req_.version() ? req_.version() : 11);
  res->set(http::field::server, "kvrelay");
  res->set(http::field::content_type, content_type);
  for (auto& [k, v] : headers) res->set(k, v);
  keep_alive = keep_alive && req_.keep_alive() && !client_gone_;
  res->keep_alive(keep_alive);
  res->body() = std::move(body);
  res->prepare_payload();
  writing_ = true;
  http::async_write(stream_, *res,
                    [self = shared_from_this(), res, keep_alive](beast::error_code ec, size_t) {
                      self->writing_ = false;
                      if (ec) return self->Close();
                      self->AfterResponse(keep_alive);
                    });
}

void Session::SendJson(http::status status, const json& body, bool keep_alive,
                       std::vector<std::pair<std::string, std::string>> headers) {
  SendText(status, DumpJson(body), "application/json", keep_alive, std::move(headers));
}

void Session::SendError(const ApiError& e, bool keep_alive,
                        std::vector<std::pair<std::string, std::string>> headers) {
  SendJson(static_cast<http::status>(e.http_status), ErrorToJson(e), keep_alive,
           std::move(headers));
}

void Session::AfterResponse(bool keep_alive) {
  if (!keep_alive || client_gone_) return Close();
  stream_.expires_after(std::chrono::milliseconds(core_->options.header_timeout_ms));
  if (watching_) {
    resume_read_ = true;  // the pending watch read hands over to DoRead
  } else {
    DoRead();
  }
}

void Session::StartWatch() {
  if (watching_ || closed_ || buffer_.size() > kWatchBufferLimit) return;
  watching_ = true;
  stream_.async_read_some(
      buffer_.prepare(4096),
      [self = shared_from_this()](beast::error_code ec, size_t n) { self->OnWatch(ec, n); });
}

void Session::OnWatch(beast::error_code ec, size_t n) {
  watching_ = false;
  if (ec) {
    resume_read_ = false;
    return ClientGone();
  }
  buffer_.commit(n);  // bytes of a pipelined next request: the next DoRead parses them
  if (resume_read_) {
    resume_read_ = false;
    return DoRead();
  }
  if (!active_.empty()) StartWatch();
}

void Session::ClientGone() {
  if (client_gone_) return;
  client_gone_ = true;
  bool waiting = false;  // a choice in the backend still owes its final event
  for (auto& c : std::vector<std::shared_ptr<RequestState>>(active_)) {
    if (c->done) continue;
    if (c->submitted) {
      core_->backend->Cancel(c->id);  // its final event ends the choice
      waiting = true;
      continue;
    }
    if (core_->admission.Remove(c->id)) {
      core_->UpdateAdmissionGauges();
      Forget(c);
    }
    // else: its start is already posted; StartGeneration sees client_gone_.
  }
  if (waiting) {
    out_.clear();
    out_bytes_ = 0;
    return;
  }
  Close();
}

void Session::Close() {
  if (closed_) return;
  closed_ = true;
  out_.clear();
  out_bytes_ = 0;
  beast::error_code ec;
  stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
  stream_.close();
}

}  // namespace

struct Server::Impl {
  std::shared_ptr<Core> core;
  net::io_context ioc;
  tcp::acceptor acceptor{net::make_strand(ioc)};
  std::vector<std::thread> threads;
  std::mutex mutex;
  bool started = false;  // guarded by mutex
  bool stopped = false;  // guarded by mutex

  void DoAccept() {
    acceptor.async_accept(net::make_strand(ioc), [this](beast::error_code ec, tcp::socket socket) {
      if (ec == net::error::operation_aborted || !acceptor.is_open()) return;
      if (!ec) {
        if (core->connections.load() >= core->options.max_connections) {
          beast::error_code ignored;
          socket.close(ignored);
        } else {
          std::make_shared<Session>(std::move(socket), core)->Run();
        }
      }
      DoAccept();
    });
  }
};

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Server::~Server() { Stop(); }

Result<std::unique_ptr<Server>> Server::Create(ServerOptions options, Backend* backend,
                                               const TextCodec* codec, MetricsRegistry* metrics) {
  if (backend == nullptr || codec == nullptr || metrics == nullptr) {
    return InvalidArgument("Server::Create: backend, codec and metrics are required");
  }
  if (options.threads < 1) return InvalidArgument("ServerOptions.threads must be >= 1");
  if (options.max_running < 1) return InvalidArgument("ServerOptions.max_running must be >= 1");
  if (options.max_queue < 0) return InvalidArgument("ServerOptions.max_queue must be >= 0");
  if (options.model_name.empty())
    return InvalidArgument("ServerOptions.model_name must not be empty");
  auto impl = std::make_unique<Impl>();
  impl->core = std::make_shared<Core>(std::move(options), backend, codec, metrics);
  const ServerOptions& opt = impl->core->options;
  beast::error_code ec;
  auto address = net::ip::make_address(opt.host, ec);
  if (ec) return InvalidArgument("ServerOptions.host: '" + opt.host + "' is not an IP address");
  tcp::endpoint endpoint(address, opt.port);
  impl->acceptor.open(endpoint.protocol(), ec);
  if (!ec) impl->acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(endpoint, ec);
  if (!ec) impl->acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) {
    return Unavailable("cannot listen on " + opt.host + ":" + std::to_string(opt.port) + ": " +
                       ec.message());
  }
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

uint16_t Server::port() const {
  beast::error_code ec;
  auto ep = impl_->acceptor.local_endpoint(ec);
  return ec ? 0 : ep.port();
}

Status Server::Start() {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  if (impl_->started) return FailedPrecondition("server already started");
  if (impl_->stopped) return FailedPrecondition("server was stopped");
  impl_->started = true;
  impl_->DoAccept();
  for (int i = 0; i < impl_->core->options.threads; ++i) {
    impl_->threads.emplace_back([this] { impl_->ioc.run(); });
    std::string name = "http-" + std::to_string(i);
    pthread_setname_np(impl_->threads.back().native_handle(), name.c_str());
  }
  LOG_INFO << "serving '" << impl_->core->options.model_name << "' on " << impl_->core->options.host
           << ":" << port();
  return Status::Ok();
}

void Server::Stop() {
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    if (impl_->stopped) return;
    impl_->stopped = true;
  }
  net::post(impl_->acceptor.get_executor(), [impl = impl_.get()] {
    beast::error_code ec;
    impl->acceptor.close(ec);
  });
  Core& core = *impl_->core;
  std::set<uint64_t> running;
  {
    std::lock_guard<std::mutex> lock(core.mutex);
    running = core.in_backend;
  }
  for (uint64_t id : running) core.backend->Cancel(id);
  {
    std::unique_lock<std::mutex> lock(core.mutex);
    Deadline deadline = Deadline::AfterMs(core.options.stop_drain_timeout_ms);
    core.drained.wait_until(lock, deadline.at, [&] { return core.in_backend.empty(); });
    if (!core.in_backend.empty()) {
      LOG_WARNING << core.in_backend.size() << " requests did not finish within the stop deadline";
    }
    core.open = false;  // sinks stop posting to sessions
  }
  impl_->ioc.stop();
  for (auto& t : impl_->threads) t.join();
  impl_->threads.clear();
}

}  // namespace kvrelay::coordinator
