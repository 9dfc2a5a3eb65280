// One generation request on a session: validation and tokenization, the
// n-choice fan-out (one backend request per choice, each through admission),
// and the answer: collected into one JSON body, or streamed as SSE.
#include <boost/asio/post.hpp>
#include <cstdio>
#include <limits>
#include <random>

#include "common/logging.h"
#include "coordinator/http/server_internal.h"
#include "coordinator/http/sse.h"

namespace kvrelay::coordinator::internal {
namespace {

using nlohmann::json;

// When the prompt (plus the tokens it may generate) can never fit the KV
// pool of any worker of a role it needs, the reason; such a request is the
// client's error (400), not a lack of capacity to retry later (503).
// Workers that do not report their pool size are not judged.
std::optional<std::string> NeverFits(const std::vector<WorkerInfo>& workers, int64_t prompt,
                                     int64_t max_tokens, int64_t context) {
  // As the engine admits: the most positions whose K/V the request will hold.
  int64_t total = prompt + max_tokens;
  if (context > 0) total = std::min(total, context);
  const int64_t decode_tokens = std::max(total - 1, prompt);
  struct Need {
    bool prefill;
    int64_t tokens;
    int64_t best = 0;  // the largest pool of the role, in tokens
    bool any = false;
    bool unknown = false;
  };
  Need needs[2] = {{true, prompt}, {false, decode_tokens}};
  for (const auto& w : workers) {
    Need& n = needs[w.role == WorkerRole::kPrefill ? 0 : 1];
    n.any = true;
    if (w.total_kv_blocks <= 0 || w.block_tokens <= 0) {
      n.unknown = true;
      continue;
    }
    n.best = std::max(n.best, w.total_kv_blocks * w.block_tokens);
  }
  for (const Need& n : needs) {
    if (!n.any || n.unknown || n.tokens <= n.best) continue;
    return std::string("the request needs KV space for ") + std::to_string(n.tokens) +
           " tokens (prompt " + std::to_string(prompt) +
           (n.prefill ? "" : " + max_tokens " + std::to_string(max_tokens)) + ") but the largest " +
           (n.prefill ? "prefill" : "decode") + " worker holds " + std::to_string(n.best) +
           "; shorten the prompt or lower max_tokens";
  }
  return std::nullopt;
}

// The largest KV pool (in tokens) of the workers that decode (decode or
// colocated), or nullopt when none reports one.
std::optional<int64_t> LargestDecodePool(const std::vector<WorkerInfo>& workers) {
  std::optional<int64_t> best;
  for (const auto& w : workers) {
    if (w.role == WorkerRole::kPrefill) continue;
    if (w.total_kv_blocks <= 0 || w.block_tokens <= 0) return std::nullopt;
    best = std::max(best.value_or(0), w.total_kv_blocks * w.block_tokens);
  }
  return best;
}

// vLLM's words for a request the context cannot hold (clients and people
// search for them).
std::string ContextExceeded(int64_t max_model_len, int64_t prompt, int64_t max_tokens,
                            Endpoint endpoint) {
  const char* what = endpoint == Endpoint::kChatCompletions ? "messages" : "prompt";
  std::string m =
      "This model's maximum context length is " + std::to_string(max_model_len) + " tokens. ";
  if (max_tokens <= 0) {
    return m + "However, you requested " + std::to_string(prompt) + " tokens in the " + what +
           ", leaving no room to generate. Please reduce the length of the " + what + ".";
  }
  return m + "However, you requested " + std::to_string(prompt + max_tokens) + " tokens (" +
         std::to_string(prompt) + " in the " + what + ", " + std::to_string(max_tokens) +
         " in the completion). Please reduce the length of the " + what + " or completion.";
}

// The access line of a finished request (all its choices; the timings are
// those of the choice that finished last): one line at info level.
void LogAccess(const RequestState& r, const UsageCounts& usage, const std::string& finish) {
  const TimePoint now = Clock::now();
  auto ms = [](TimePoint from, TimePoint to) {
    return static_cast<long long>(std::chrono::duration<double, std::milli>(to - from).count());
  };
  const std::string& tenant = r.generation.tenant_salt;
  LOG_INFO << "request " << r.ident.id << " " << EndpointName(r.params.endpoint)
           << " tenant=" << (tenant.empty() ? "-" : tenant) << " prompt=" << usage.prompt_tokens
           << " cached=" << usage.cached_tokens << " generated=" << usage.completion_tokens
           << " ttft_ms="
           << (r.first_token_at ? std::to_string(ms(r.arrived, *r.first_token_at)) : "-")
           << " total_ms=" << ms(r.arrived, now) << " finish=" << finish;
}

}  // namespace

std::shared_ptr<Session> RequestState::GetSession() {
  std::lock_guard<std::mutex> lock(core->mutex);
  return session;
}

void RequestState::DetachSession() {
  std::shared_ptr<Session> old;
  {
    std::lock_guard<std::mutex> lock(core->mutex);
    old.swap(session);
  }
}

void RequestState::ReleaseSlot() {
  if (slot_held.exchange(false)) {
    core->admission.Release(id);
    core->UpdateAdmissionGauges();
  }
}

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

void Session::HandleCompletion(Endpoint endpoint, std::string tenant) {
  const ServerOptions& opt = core_->options;
  auto r = std::make_shared<RequestState>();
  r->core = core_;
  r->arrived = Clock::now();
  if (auto err = ParseCompletionRequest(endpoint, req_.body(), opt.limits, &r->params)) {
    return SendError(*err);
  }
  const CompletionParams& p = r->params;
  const char* prompt_param = endpoint == Endpoint::kChatCompletions ? "messages" : "prompt";
  LogIgnoredFields(p.ignored_fields);
  if (auto err = CheckModel(p.model, opt.model_name, opt.limits)) return SendError(*err);
  Result<std::vector<int32_t>> tokens = std::vector<int32_t>();
  if (endpoint == Endpoint::kChatCompletions) {
    tokens = core_->codec->EncodeChat(p.messages);
  } else if (p.prompt_is_tokens) {
    tokens = p.prompt_token_ids;
  } else {
    tokens = core_->codec->Encode(p.prompt, /*add_special=*/true);
  }
  if (!tokens.ok()) {
    return SendError(
        BadRequest("cannot tokenize the prompt: " + tokens.status().message(), prompt_param));
  }
  if (tokens->empty()) return SendError(BadRequest("the prompt is empty", prompt_param));
  // A batched completion: prompts 1.. (choice i * n + j answers prompt i).
  // Every prompt must fit; the limits below are checked on the longest.
  std::vector<std::vector<int32_t>> batch;
  for (int b = 1; b < p.batch_size(); ++b) {
    Result<std::vector<int32_t>> t =
        p.prompt_is_tokens ? Result<std::vector<int32_t>>(p.batch_prompt_token_ids[b])
                           : core_->codec->Encode(p.batch_prompts[b], /*add_special=*/true);
    const std::string where = "prompt[" + std::to_string(b) + "]";
    if (!t.ok()) {
      return SendError(BadRequest("cannot tokenize " + where + ": " + t.status().message(), where));
    }
    if (t->empty()) return SendError(BadRequest(where + " is empty", where));
    batch.push_back(std::move(*t));
  }
  size_t longest = tokens->size();
  for (const auto& t : batch) longest = std::max(longest, t.size());
  if (static_cast<int64_t>(longest) > opt.max_prompt_tokens) {
    // 400 as OpenAI answers context_length_exceeded (a 413 is what the
    // official clients take for a body the proxy refused).
    return SendError(BadRequest("the prompt has " + std::to_string(longest) + " tokens; at most " +
                                    std::to_string(opt.max_prompt_tokens) + " are allowed",
                                prompt_param, "context_length_exceeded"));
  }
  const std::vector<WorkerInfo> workers = core_->backend->Workers();
  if (!p.max_tokens_given) {
    // No max_tokens: the default, lowered to what fits (never refused for
    // it); a default of 0 means all the room left (as vLLM).
    const int64_t n = static_cast<int64_t>(longest);
    int64_t room = std::numeric_limits<int32_t>::max();
    if (opt.max_context_tokens > 0) room = opt.max_context_tokens - n;
    if (auto pool = LargestDecodePool(workers)) room = std::min(room, *pool - n);
    const int64_t want = opt.limits.max_tokens_default > 0 ? opt.limits.max_tokens_default : room;
    if (room < 1) {
      return SendError(BadRequest(ContextExceeded(opt.max_context_tokens, n, 0, endpoint),
                                  prompt_param, "context_length_exceeded"));
    }
    r->params.max_tokens = static_cast<int>(std::min(want, room));
  }
  if (opt.max_context_tokens > 0 &&
      static_cast<int64_t>(longest) + p.max_tokens > opt.max_context_tokens) {
    return SendError(
        BadRequest(ContextExceeded(opt.max_context_tokens, static_cast<int64_t>(longest),
                                   p.max_tokens, endpoint),
                   "max_tokens", "context_length_exceeded"));
  }
  if (auto reason =
          NeverFits(workers, static_cast<int64_t>(longest), p.max_tokens, opt.max_context_tokens)) {
    return SendError(BadRequest(*reason, "max_tokens", "context_length_exceeded"));
  }

  r->id = core_->next_id.fetch_add(1);
  char idbuf[48];
  std::snprintf(idbuf, sizeof(idbuf), "%s%016llx%08llx",
                endpoint == Endpoint::kChatCompletions ? "chatcmpl-" : "cmpl-",
                static_cast<unsigned long long>(core_->nonce),
                static_cast<unsigned long long>(r->id));
  r->ident = {idbuf, UnixSeconds(), opt.model_name};  // the served name, whatever alias was asked
  GenerationRequest& g = r->generation;
  g.id = r->id;
  g.prompt = std::move(*tokens);
  g.sampling = p.sampling;
  g.sampling.max_tokens = p.max_tokens;
  g.sampling.seed = p.seed.value_or(0);
  g.tenant_salt = tenant;
  if (opt.prefix_hasher) g.prefix_blocks = opt.prefix_hasher(g.prompt, tenant);
  r->usage.prompt_tokens = static_cast<int>(g.prompt.size());
  LOG_DEBUG << "request " << r->ident.id << " " << EndpointName(endpoint)
            << " tenant=" << (tenant.empty() ? "-" : tenant) << " prompt=" << g.prompt.size()
            << " max_tokens=" << p.max_tokens << " n=" << p.n << " prompts=" << p.batch_size()
            << " stream=" << (p.stream ? "true" : "false");
  r->decoder = core_->codec->NewDecoder();
  r->matcher.emplace(p.stop);
  if (endpoint == Endpoint::kCompletions && p.echo) r->text = p.prompt_is_tokens ? "" : p.prompt;
  r->logprob_offset = r->text.size();
  // Every request gets a seed here (when the client gave none), so that
  // sampling differs between requests and between the n choices of one.
  if (!p.seed.has_value()) {
    g.sampling.seed =
        (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  }
  std::vector<std::shared_ptr<RequestState>> choices = {r};
  for (int i = 1; i < p.batch_size() * p.n; ++i) {
    auto c = std::make_shared<RequestState>();
    c->core = core_;
    c->arrived = r->arrived;
    c->params = r->params;
    c->ident = r->ident;
    c->index = i;
    c->prompt_index = i / p.n;
    c->id = core_->next_id.fetch_add(1);
    c->generation = r->generation;
    c->generation.id = c->id;
    c->generation.sampling.seed = g.sampling.seed + static_cast<uint64_t>(i);
    c->usage.prompt_tokens = r->usage.prompt_tokens;
    c->text = r->text;
    if (c->prompt_index > 0) {
      const std::vector<int32_t>& prompt = batch[static_cast<size_t>(c->prompt_index - 1)];
      c->generation.prompt = prompt;
      if (opt.prefix_hasher) c->generation.prefix_blocks = opt.prefix_hasher(prompt, tenant);
      c->usage.prompt_tokens = static_cast<int>(prompt.size());
      c->text = p.echo && !p.prompt_is_tokens ? p.batch_prompts[c->prompt_index] : "";
    }
    c->decoder = core_->codec->NewDecoder();
    c->matcher.emplace(p.stop);
    c->logprob_offset = c->text.size();
    choices.push_back(std::move(c));
  }
  {
    std::lock_guard<std::mutex> lock(core_->mutex);
    for (auto& c : choices) c->session = shared_from_this();
  }
  active_ = choices;
  results_.assign(choices.size(), ChoiceResult{});
  total_usage_ = UsageCounts{};
  prompt_usage_.assign(static_cast<size_t>(p.batch_size()), UsageCounts{});
  for (const auto& c : choices) {
    prompt_usage_[static_cast<size_t>(c->prompt_index)].prompt_tokens = c->usage.prompt_tokens;
  }
  stream_started_ = false;
  stream_keep_alive_ = info_.keep_alive;

  Status st;
  AdmissionQueue::Refusal refusal;
  for (auto& c : choices) {
    std::weak_ptr<RequestState> weak = c;
    st = core_->admission.Enqueue(
        c->id,
        [weak] {
          auto req = weak.lock();
          if (!req) return;  // cannot happen while queued: the session holds it
          req->slot_held.store(true);
          auto s = req->GetSession();
          if (!s) {
            req->ReleaseSlot();
            return;
          }
          net::post(s->executor(), [s, req] { s->StartGeneration(req); });
        },
        &refusal);
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
    const bool full = refusal.reason == AdmissionQueue::Refusal::kQueueFull;
    return SendError(TooManyRequests(full ? "queue_full" : "queue_delay_exceeded",
                                     "server is at capacity: " + st.message() + "; retry later",
                                     refusal.retry_after_seconds));
  }
  // From here the request deadline covers queueing and generation.
  stream_.expires_after(std::chrono::milliseconds(opt.request_timeout_ms));
  StartWatch();
}

void Session::StartGeneration(const std::shared_ptr<RequestState>& r) {
  core_->queue_wait->Observe(SecondsSince(r->arrived));
  r->admitted_at = Clock::now();
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
    return SendError(ErrorFromStatus(st, st.message(), core_->options.retry_after_seconds));
  }
  if (r->params.stream && !stream_started_) {
    stream_started_ = true;
    stream_header_ =
        std::make_shared<http::response<http::empty_body>>(http::status::ok, info_.version);
    stream_header_->set(http::field::server, "kvrelay");
    stream_header_->set(http::field::content_type, "text/event-stream");
    stream_header_->set(http::field::cache_control, "no-cache");
    AddCors(*stream_header_);
    stream_header_->set("X-Request-Id", r->ident.id);
    stream_header_->keep_alive(stream_keep_alive_);
    stream_header_->chunked(true);
    core_->CountRequest(endpoint_label_, 200);
    QueueOut({OutItem::kHeader, ""});
  }
}

void Session::Emit(RequestState& r, const std::string& piece) {
  if (piece.empty()) return;
  // With tools (or tool calls in the history) the answer is tool calls and
  // text, known at the end: a stream sends it then (Finish), so no fragment
  // of a <tool_call> block reaches the content.
  if (!r.params.stream || r.params.tool_choice != ToolChoice::kNone || r.params.tool_markup) {
    r.text += piece;
    return;
  }
  QueueOut({OutItem::kChunk, SseEvent(DumpJson(StreamChunkJson(r.params.endpoint, r.ident, piece,
                                                               r.first_chunk, FinishReason::kNone,
                                                               r.index, TakeStreamLogprobs(r))))});
  r.first_chunk = false;
}

nlohmann::json Session::TakeStreamLogprobs(RequestState& r) {
  if (!r.params.logprobs) return nullptr;
  std::vector<LogprobEntry> part(r.logprobs.begin() + static_cast<std::ptrdiff_t>(r.logprobs_sent),
                                 r.logprobs.end());
  nlohmann::json j = LogprobsJson(r.params.endpoint, part, r.logprob_offset);
  for (const LogprobEntry& e : part) r.logprob_offset += e.token.size();
  r.logprobs_sent = r.logprobs.size();
  return j;
}

void Session::OnEvent(const std::shared_ptr<RequestState>& r, const TokenEvent& ev, TimePoint at) {
  if (!IsActive(r) || r->done) return;
  if (ev.prompt_tokens > 0) r->usage.prompt_tokens = ev.prompt_tokens;
  if (ev.cached_tokens > 0) r->usage.cached_tokens = ev.cached_tokens;
  if (ev.token >= 0 && !r->stopped) {
    ++r->usage.completion_tokens;
    if (!r->last_token_at) {
      core_->ttft->Observe(std::chrono::duration<double>(at - r->arrived).count());
      core_->admission.FirstToken(r->id);
      r->first_token_at = at;
    } else {
      core_->itl->Observe(std::chrono::duration<double>(at - *r->last_token_at).count());
    }
    r->last_token_at = at;
    if (r->params.logprobs && ev.has_logprobs) {
      LogprobEntry e;
      e.token = core_->codec->TokenPiece(ev.token);
      e.logprob = ev.logprobs.logprob;
      for (const auto& [t, lp] : ev.logprobs.top)
        e.top.emplace_back(core_->codec->TokenPiece(t), lp);
      r->logprobs.push_back(std::move(e));
    }
    StopMatcher::Output out = r->matcher->Push(r->decoder->Push(ev.token));
    Emit(*r, out.text);
    if (out.stopped) {
      r->stopped = true;
      core_->backend->Cancel(r->id);
    }
  }
  if (ev.finished) Finish(r, ev);
}

UsageCounts Session::TotalUsage() const {
  UsageCounts u = total_usage_;  // completion tokens of every choice
  u.prompt_tokens = 0;
  u.cached_tokens = 0;
  for (const UsageCounts& pu : prompt_usage_) {  // each prompt once, whatever n
    u.prompt_tokens += pu.prompt_tokens;
    u.cached_tokens += pu.cached_tokens;
  }
  return u;
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
  core_->request_prompt_tokens->Observe(static_cast<double>(r->usage.prompt_tokens));
  core_->request_generation_tokens->Observe(static_cast<double>(r->usage.completion_tokens));
  if (r->first_token_at) {
    const double prefill_s =
        r->admitted_at ? std::chrono::duration<double>(*r->first_token_at - *r->admitted_at).count()
                       : 0.0;
    const double decode_s =
        r->last_token_at
            ? std::chrono::duration<double>(*r->last_token_at - *r->first_token_at).count()
            : 0.0;
    if (r->admitted_at) core_->prefill_time->Observe(prefill_s);
    core_->decode_time->Observe(decode_s);
    core_->AddThroughput(r->usage.prompt_tokens - r->usage.cached_tokens, prefill_s,
                         r->usage.completion_tokens, decode_s);
  }
  core_->prompt_tokens->Increment(r->usage.prompt_tokens);
  core_->generation_tokens->Increment(r->usage.completion_tokens);
  core_->cached_tokens->Increment(r->usage.cached_tokens);
  core_->registry
      ->GetCounter("kvrelay_requests_finished_total",
                   "Finished generation requests by endpoint and finish reason.",
                   core_->Labels({{"endpoint", EndpointName(r->params.endpoint)},
                                  {"finish_reason", FinishName(finish)}}))
      ->Increment();
  Forget(r);
  total_usage_.completion_tokens += r->usage.completion_tokens;
  if (static_cast<size_t>(r->prompt_index) < prompt_usage_.size()) {
    UsageCounts& pu = prompt_usage_[static_cast<size_t>(r->prompt_index)];
    pu.cached_tokens = std::max(pu.cached_tokens, r->usage.cached_tokens);
    if (r->usage.prompt_tokens > 0) pu.prompt_tokens = r->usage.prompt_tokens;
  }
  if (client_gone_) {
    if (active_.empty()) {
      LogAccess(*r, TotalUsage(), "client_gone");
      Close();
    }
    return;
  }

  const CompletionParams& p = r->params;
  if (finish == FinishReason::kError) {
    // One failed choice fails the response: the others are cancelled. The
    // backend validates what the coordinator cannot (token ids against the
    // vocabulary, prompt + max_tokens against the pool): those are the
    // client's or capacity errors, not the server's.
    AbortOthers(r);
    LogAccess(*r, TotalUsage(), FinishName(finish));
    HttpError e = ErrorFromStatus(ev.error, "generation failed: " + ev.error.ToString(),
                                  core_->options.retry_after_seconds);
    if (!p.stream) return SendError(e);
    QueueOut({OutItem::kChunk, SseEvent(DumpJson(ErrorToJson(e.api)))});
    QueueOut({OutItem::kChunk, std::string(kSseDone)});
    QueueOut({OutItem::kLast, ""});
    return;
  }
  results_[r->index] = {r->text, finish, nullptr};
  if (p.logprobs && !p.stream) {
    results_[r->index].logprobs = LogprobsJson(p.endpoint, r->logprobs, r->logprob_offset);
  }
  nlohmann::json tool_calls = nullptr;
  const bool split = p.tool_choice != ToolChoice::kNone || p.tool_markup;
  if (split) {
    ToolCallSplit parts = SplitToolCalls(
        r->text, p.tool_choice,
        r->ident.id.substr(r->ident.id.find('-') + 1) + "_" + std::to_string(r->index));
    tool_calls = parts.tool_calls;
    results_[r->index].text = parts.content.is_string() ? parts.content.get<std::string>() : "";
    results_[r->index].tool_calls = tool_calls;
  }
  if (p.stream && split) {
    // The buffered answer in one delta: its text and the tool calls (with their index).
    const std::string& content = results_[r->index].text;
    nlohmann::json chunk = StreamChunkJson(p.endpoint, r->ident, content, r->first_chunk,
                                           FinishReason::kNone, r->index, TakeStreamLogprobs(*r));
    if (!tool_calls.is_null()) {
      nlohmann::json deltas = nlohmann::json::array();
      for (size_t k = 0; k < tool_calls.size(); ++k) {
        nlohmann::json d = tool_calls[k];
        d["index"] = k;
        deltas.push_back(d);
      }
      chunk["choices"][0]["delta"]["tool_calls"] = deltas;
      if (content.empty()) chunk["choices"][0]["delta"].erase("content");
    }
    QueueOut({OutItem::kChunk, SseEvent(DumpJson(chunk))});
    r->first_chunk = false;
    nlohmann::json last = StreamChunkJson(p.endpoint, r->ident, "", false, finish, r->index);
    if (!tool_calls.is_null()) last["choices"][0]["finish_reason"] = "tool_calls";
    QueueOut({OutItem::kChunk, SseEvent(DumpJson(last))});
  } else if (p.stream) {
    QueueOut({OutItem::kChunk,
              SseEvent(DumpJson(StreamChunkJson(p.endpoint, r->ident, "", r->first_chunk, finish,
                                                r->index, TakeStreamLogprobs(*r))))});
  }
  if (!active_.empty()) return;  // other choices still running
  LogAccess(*r, TotalUsage(), tool_calls.is_null() ? FinishName(finish) : "tool_calls");
  if (!p.stream) {
    return SendJson(http::status::ok,
                    CompletionResponseJson(p.endpoint, r->ident, results_, TotalUsage()));
  }
  if (p.include_usage) {
    QueueOut(
        {OutItem::kChunk, SseEvent(DumpJson(UsageChunkJson(p.endpoint, r->ident, TotalUsage())))});
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

}  // namespace kvrelay::coordinator::internal
