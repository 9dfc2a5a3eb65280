// One HTTP/1.1 connection of the coordinator: reading and framing requests,
// routing them, and writing responses by RFC 9110 / 9112 (no content in a
// response to HEAD or in a 1xx / 204; Allow on 405; Connection: close exactly
// when the server closes afterwards).
#include <algorithm>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/write.hpp>
#include <chrono>
#include <string>
#include <string_view>

#include "common/logging.h"
#include "coordinator/http/http_request.h"
#include "coordinator/http/server_internal.h"

namespace kvrelay::coordinator::internal {
namespace {

using nlohmann::json;

constexpr size_t kWatchBufferLimit = 64 << 10;
// After an error that closes the connection, unread request bytes are drained
// (so the kernel does not answer them with a reset that destroys the response
// in flight) for at most this long and this much.
constexpr int kLingerMs = 1000;
constexpr size_t kLingerBytes = 1 << 20;

constexpr const char* kAllowGet = "GET, HEAD, OPTIONS";
constexpr const char* kAllowPost = "POST, OPTIONS";

RequestLimits LimitsOf(const ServerOptions& o) {
  return RequestLimits{o.max_body_bytes, o.max_header_bytes};
}

}  // namespace

Session::Session(tcp::socket socket, std::shared_ptr<Core> core, std::string client,
                 bool probe_only)
    : stream_(std::move(socket)),
      core_(std::move(core)),
      client_(std::move(client)),
      probe_only_(probe_only) {
  core_->connections.fetch_add(1);
  core_->open_connections->Add(1);
}

Session::~Session() {
  core_->connections.fetch_sub(1);
  core_->open_connections->Add(-1);
  core_->ReleaseClientSlot(client_);
}

void Session::Run() {
  net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->DoRead(); });
}

void Session::DoRead() {
  if (closed_) return;
  parser_.emplace();
  ConfigureRequestParser(LimitsOf(core_->options), &*parser_);
  info_ = RequestInfo{};
  stream_.expires_after(std::chrono::milliseconds(core_->options.header_timeout_ms));
  http::async_read_header(
      stream_, buffer_, *parser_,
      [self = shared_from_this()](beast::error_code ec, size_t) { self->OnHeader(ec); });
}

void Session::OnHeader(beast::error_code ec) {
  if (!ec) {
    const auto& h = parser_->get();
    info_.version = h.version();
    info_.keep_alive = h.keep_alive();
    info_.head = h.method() == http::verb::head;
    if (probe_only_) info_.keep_alive = false;  // one answer, then the slot goes back
    if (auto err = CheckRequestHeader(h)) return SendError(*err);
    if (WantsContinue(h)) {
      if (!parser_->is_done()) {
        // RFC 9110 §10.1.1: the client waits for this before sending the body.
        static constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
        return net::async_write(stream_, net::buffer(kContinue.data(), kContinue.size()),
                                [self = shared_from_this()](beast::error_code wec, size_t) {
                                  if (wec) return self->Close();
                                  http::async_read(
                                      self->stream_, self->buffer_, *self->parser_,
                                      [self](beast::error_code rec, size_t) { self->OnRead(rec); });
                                });
      }
    }
    if (parser_->is_done()) return OnRead({});
    return http::async_read(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code rec, size_t) { self->OnRead(rec); });
  }
  OnRead(ec);
}

void Session::OnRead(beast::error_code ec) {
  if (ec) {
    if (auto err = ReadError(ec, LimitsOf(core_->options))) {
      endpoint_label_ = "other";
      return SendError(*err);
    }
    return Close();  // end of stream, timeout, reset
  }
  req_ = parser_->release();
  Handle();
}

std::optional<std::string> Session::Authenticate() {
  if (core_->options.api_keys.empty()) return std::string();
  auto it = req_.find(http::field::authorization);
  HttpError e;
  e.api.http_status = 401;
  e.api.code = "invalid_api_key";
  e.headers.push_back({"WWW-Authenticate", "Bearer"});
  if (it == req_.end()) {
    e.api.message = "missing API key: send 'Authorization: Bearer <key>'";
  } else {
    std::string_view v(it->value().data(), it->value().size());
    constexpr std::string_view kBearer = "Bearer ";
    if (v.size() > kBearer.size() && v.substr(0, kBearer.size()) == kBearer) {
      if (auto tenant = core_->options.api_keys.TenantOf(v.substr(kBearer.size()))) return tenant;
    }
    e.api.message = "invalid API key";
  }
  SendError(e);
  return std::nullopt;
}

void Session::Handle() {
  const std::string_view target =
      RequestPath(std::string_view(req_.target().data(), req_.target().size()));
  const http::verb method = req_.method();
  const bool get = method == http::verb::get || method == http::verb::head;
  const std::string_view method_name(req_.method_string().data(), req_.method_string().size());
  // A GET route: GET and HEAD (the same status and headers, no content).
  auto get_route = [&](const char* label, auto&& handler) {
    endpoint_label_ = label;
    if (method == http::verb::options) return SendNoContent({{"Allow", kAllowGet}});
    if (!get) return SendError(MethodNotAllowed(method_name, target, kAllowGet));
    handler();
  };
  if (target == "/health") return get_route("health", [&] { HandleHealth(); });
  if (target == "/metrics") return get_route("metrics", [&] { HandleMetrics(); });
  if (probe_only_) {
    // The client is over its connection limit: only the two routes above.
    endpoint_label_ = "other";
    core_->refused_connections->Increment();
    HttpError e = TooManyRequests(
        "too_many_connections",
        "this client has " + std::to_string(core_->options.max_connections_per_client) +
            " open connections (only /health and /metrics are served beyond them); reuse them "
            "or close some",
        1);
    e.close = true;
    return SendError(e);
  }
  if (target == "/v1/models") {
    return get_route("models", [&] {
      if (!Authenticate()) return;
      const ServerOptions& o = core_->options;
      SendJson(http::status::ok, ModelsJson(o.model_name, UnixSeconds(), o.max_context_tokens));
    });
  }
  constexpr std::string_view kModelPrefix = "/v1/models/";
  if (target.starts_with(kModelPrefix)) {
    const std::string id(target.substr(kModelPrefix.size()));
    return get_route("models", [&] {
      if (!Authenticate()) return;
      const ServerOptions& o = core_->options;
      if (auto err = CheckModel(id.empty() ? "?" : id, o.model_name, o.limits)) {
        return SendError(*err);
      }
      SendJson(http::status::ok,
               ModelsJson(o.model_name, UnixSeconds(), o.max_context_tokens)["data"][0]);
    });
  }
  if (target == "/tokenize" || target == "/detokenize") {  // vLLM's tokenizer endpoints
    endpoint_label_ = std::string(target.substr(1));
    if (method == http::verb::options) return SendNoContent({{"Allow", kAllowPost}});
    if (method != http::verb::post)
      return SendError(MethodNotAllowed(method_name, target, kAllowPost));
    if (!Authenticate()) return;
    const ServerOptions& o = core_->options;
    json out;
    auto err = target == "/tokenize"
                   ? TokenizeJson(req_.body(), *core_->codec, o.model_name, o.limits,
                                  o.max_context_tokens, &out)
                   : DetokenizeJson(req_.body(), *core_->codec, o.model_name, o.limits, &out);
    return err ? SendError(*err) : SendJson(http::status::ok, out);
  }
  if (const std::optional<Endpoint> completion = CompletionEndpoint(target)) {
    const Endpoint endpoint = *completion;
    endpoint_label_ = EndpointName(endpoint);
    if (method == http::verb::options) return SendNoContent({{"Allow", kAllowPost}});
    if (method != http::verb::post) {
      return SendError(MethodNotAllowed(method_name, target, kAllowPost));
    }
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
    if (!w.data_plane_error.empty()) workers.back()["data_plane_error"] = w.data_plane_error;
  }
  json body = {{"status", st.ok() ? "ok" : "unavailable"}, {"workers", workers}};
  if (!st.ok()) body["message"] = st.message();
  SendJson(st.ok() ? http::status::ok : http::status::service_unavailable, body);
}

void Session::HandleMetrics() {
  SendText(http::status::ok, core_->RenderMetrics(), "text/plain; version=0.0.4; charset=utf-8",
           true);
}

template <typename Response>
void Session::WriteResponse(std::shared_ptr<Response> res, bool keep_alive) {
  writing_ = true;
  auto done = [self = shared_from_this(), res, keep_alive](beast::error_code ec, size_t) {
    self->writing_ = false;
    if (ec) return self->Close();
    self->AfterResponse(keep_alive);
  };
  if (info_.head) {
    // RFC 9110 §9.3.2: the GET's header fields (Content-Length included), no content.
    auto sr = std::make_shared<http::response_serializer<typename Response::body_type>>(*res);
    http::async_write_header(
        stream_, *sr,
        [sr, done = std::move(done)](beast::error_code ec, size_t n) mutable { done(ec, n); });
  } else {
    http::async_write(stream_, *res, std::move(done));
  }
}

template <typename Response>
void Session::AddCors(Response& res, const char* allow) const {
  const std::string& origin = core_->options.cors_allow_origin;
  if (origin.empty()) return;
  res.set(http::field::access_control_allow_origin, origin);
  if (origin != "*") res.set(http::field::vary, "Origin");
  if (allow != nullptr) {  // a preflight
    res.set(http::field::access_control_allow_methods, allow);
    res.set(http::field::access_control_allow_headers, "Authorization, Content-Type");
    res.set(http::field::access_control_max_age, "600");
  }
}

void Session::SendText(http::status status, std::string body, std::string content_type,
                       bool keep_alive, HttpHeaders headers) {
  if (closed_) return;
  core_->CountRequest(endpoint_label_, static_cast<int>(status));
  auto res = std::make_shared<http::response<http::string_body>>(status, info_.version);
  res->set(http::field::server, "kvrelay");
  res->set(http::field::content_type, content_type);
  AddCors(*res);
  for (auto& [k, v] : headers) res->set(k, v);
  keep_alive = keep_alive && info_.keep_alive && !client_gone_;
  res->keep_alive(keep_alive);
  res->body() = std::move(body);
  res->prepare_payload();
  WriteResponse(std::move(res), keep_alive);
}

void Session::SendNoContent(HttpHeaders headers) {
  if (closed_) return;
  core_->CountRequest(endpoint_label_, 204);
  // RFC 9110 §15.3.5 / §8.6: no content and no Content-Length.
  auto res =
      std::make_shared<http::response<http::empty_body>>(http::status::no_content, info_.version);
  res->set(http::field::server, "kvrelay");
  std::string allow;
  for (auto& [k, v] : headers) {
    if (k == "Allow") allow = v;
  }
  AddCors(*res, allow.empty() ? nullptr : allow.c_str());
  for (auto& [k, v] : headers) res->set(k, v);
  const bool keep_alive = info_.keep_alive && !client_gone_;
  res->keep_alive(keep_alive);
  WriteResponse(std::move(res), keep_alive);
}

void Session::SendJson(http::status status, const json& body, bool keep_alive,
                       HttpHeaders headers) {
  SendText(status, DumpJson(body), "application/json", keep_alive, std::move(headers));
}

void Session::SendError(const HttpError& e) {
  SendJson(static_cast<http::status>(e.api.http_status), ErrorToJson(e.api), !e.close, e.headers);
}

void Session::AfterResponse(bool keep_alive) {
  if (!keep_alive || client_gone_) {
    if (client_gone_ || watching_) return Close();
    // The response said Connection: close. Half-close, then drain what the
    // client still sends (bounded), so the response is not lost to a reset.
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
    if (ec) return Close();
    stream_.expires_after(std::chrono::milliseconds(kLingerMs));
    lingered_ = 0;
    return Linger();
  }
  stream_.expires_after(std::chrono::milliseconds(core_->options.header_timeout_ms));
  if (watching_) {
    resume_read_ = true;  // the pending watch read hands over to DoRead
  } else {
    DoRead();
  }
}

void Session::Linger() {
  stream_.async_read_some(net::buffer(linger_buffer_),
                          [self = shared_from_this()](beast::error_code ec, size_t n) {
                            self->lingered_ += n;
                            if (ec || self->lingered_ > kLingerBytes) return self->Close();
                            self->Linger();
                          });
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

void Session::Close() {
  if (closed_) return;
  closed_ = true;
  out_.clear();
  out_bytes_ = 0;
  beast::error_code ec;
  stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
  stream_.close();
}

}  // namespace kvrelay::coordinator::internal
