// The coordinator's HTTP server: the listener and its connection limits, and
// the server's lifecycle. A connection is a Session (session.cc); a
// generation request on it is handled in completion.cc.
#include "coordinator/server.h"

#include <pthread.h>

#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <chrono>
#include <random>
#include <thread>

#include "common/logging.h"
#include "coordinator/server_internal.h"

namespace kvrelay::coordinator {
namespace internal {

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

Core::Core(ServerOptions o, Backend* b, const TextCodec* c, MetricsRegistry* m)
    : options(std::move(o)),
      backend(b),
      codec(c),
      registry(m),
      admission(AdmissionQueue::Options{options.max_running, options.max_queue,
                                        options.max_queue_delay_ms, options.retry_after_seconds,
                                        nullptr}) {
  const MetricLabels l = Labels();
  ttft = m->GetHistogram("kvrelay_time_to_first_token_seconds",
                         "Time from request arrival to the first generated token.", l);
  itl = m->GetHistogram("kvrelay_inter_token_latency_seconds",
                        "Time between consecutive generated tokens of a request.", l);
  e2e = m->GetHistogram("kvrelay_e2e_request_latency_seconds",
                        "Time from request arrival to its last token.", l);
  queue_wait =
      m->GetHistogram("kvrelay_queue_wait_seconds", "Time a request waited for admission.", l);
  prompt_tokens =
      m->GetCounter("kvrelay_prompt_tokens_total", "Prompt tokens of finished requests.", l);
  generation_tokens = m->GetCounter("kvrelay_generation_tokens_total", "Generated tokens.", l);
  cached_tokens = m->GetCounter("kvrelay_prefix_cache_hit_tokens_total",
                                "Prompt tokens served from a prefix cache.", l);
  queue_depth = m->GetGauge("kvrelay_queue_depth", "Requests waiting for admission.", l);
  running = m->GetGauge("kvrelay_running_requests", "Requests admitted to the backend.", l);
  open_connections = m->GetGauge("kvrelay_open_connections", "Open HTTP connections.", l);
  refused_connections =
      m->GetCounter("kvrelay_refused_connections_total",
                    "Connections refused on accept (server or per-client connection limit).", l);
  std::random_device rd;
  nonce = (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

MetricLabels Core::Labels(MetricLabels extra) const {
  extra.push_back({"model_name", options.model_name});
  return extra;
}

void Core::CountRequest(const std::string& endpoint, int status) {
  registry
      ->GetCounter("kvrelay_http_requests_total", "HTTP requests by endpoint and status code.",
                   Labels({{"endpoint", endpoint}, {"code", std::to_string(status)}}))
      ->Increment();
}

void Core::AdvanceWorkerCounter(const std::string& name, const std::string& help,
                                const std::string& worker, double total) {
  double delta = 0;
  {
    std::lock_guard<std::mutex> lock(worker_totals_mutex);
    double& last = worker_totals[name + '\0' + worker];
    // A worker that restarted reports from 0 again: all of it is new.
    delta = total >= last ? total - last : total;
    last = total;
  }
  registry->GetCounter(name, help, Labels({{"worker", worker}}))->Increment(delta);
}

void Core::ExportBackendCounters() {
  for (const BackendCounter& c : backend->Counters()) {
    double delta = 0;
    {
      std::lock_guard<std::mutex> lock(worker_totals_mutex);
      double& last = worker_totals[c.name];
      delta = c.value >= last ? c.value - last : c.value;
      last = c.value;
    }
    registry->GetCounter(c.name, c.help, Labels({}))->Increment(delta);
  }
}

void Core::UpdateAdmissionGauges() {
  queue_depth->Set(admission.queued());
  running->Set(admission.running());
}

bool Core::AcquireClientSlot(const std::string& client) {
  std::lock_guard<std::mutex> lock(clients_mutex);
  int& n = clients[client];
  if (n >= options.max_connections_per_client) {
    if (n == 0) clients.erase(client);
    return false;
  }
  ++n;
  return true;
}

void Core::ReleaseClientSlot(const std::string& client) {
  std::lock_guard<std::mutex> lock(clients_mutex);
  auto it = clients.find(client);
  if (it == clients.end()) return;
  if (--it->second <= 0) clients.erase(it);
}

}  // namespace internal

namespace {

using namespace internal;  // NOLINT: this file is the server's own

// A connection over a limit gets a complete error response and is closed at
// once, without a session: refusing must cost nothing the refused client
// could hold on to.
void Refuse(tcp::socket& socket, int status, const char* reason, const std::string& message) {
  ApiError e;
  e.http_status = status;
  e.type = status == 429 ? "rate_limit_exceeded" : "server_error";
  e.message = message;
  e.code = "too_many_connections";
  const std::string body = DumpJson(ErrorToJson(e));
  const std::string response = "HTTP/1.1 " + std::to_string(status) + " " + reason +
                               "\r\nServer: kvrelay\r\nContent-Type: application/json\r\n"
                               "Retry-After: 1\r\nConnection: close\r\nContent-Length: " +
                               std::to_string(body.size()) + "\r\n\r\n" + body;
  beast::error_code ec;
  socket.non_blocking(true, ec);
  if (!ec) socket.write_some(net::buffer(response), ec);  // a fresh socket's buffer takes it
  socket.shutdown(tcp::socket::shutdown_both, ec);
  socket.close(ec);
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

  net::steady_timer accept_backoff{acceptor.get_executor()};

  void DoAccept() {
    acceptor.async_accept(net::make_strand(ioc), [this](beast::error_code ec, tcp::socket socket) {
      if (ec == net::error::operation_aborted || !acceptor.is_open()) return;
      if (ec) {
        // Out of descriptors (EMFILE) or a transient failure: retrying at
        // once would spin; wait a little for connections to close.
        LOG_WARNING << "accept: " << ec.message();
        accept_backoff.expires_after(std::chrono::milliseconds(50));
        accept_backoff.async_wait([this](beast::error_code wec) {
          if (!wec && acceptor.is_open()) DoAccept();
        });
        return;
      }
      Admit(std::move(socket));
      DoAccept();
    });
  }

  void Admit(tcp::socket socket) {
    const ServerOptions& opt = core->options;
    beast::error_code ec;
    const auto remote = socket.remote_endpoint(ec);
    if (ec) return;  // already gone
    std::string client = remote.address().to_string();
    if (core->connections.load() >= opt.max_connections) {
      core->refused_connections->Increment();
      return Refuse(socket, 503, "Service Unavailable",
                    "the server has " + std::to_string(opt.max_connections) +
                        " open connections; retry later");
    }
    if (!core->AcquireClientSlot(client)) {
      core->refused_connections->Increment();
      return Refuse(socket, 429, "Too Many Requests",
                    "this client has " + std::to_string(opt.max_connections_per_client) +
                        " open connections; reuse them or close some");
    }
    std::make_shared<Session>(std::move(socket), core, std::move(client))->Run();
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
  if (options.max_connections < 1 || options.max_connections_per_client < 1) {
    return InvalidArgument("ServerOptions.max_connections(_per_client) must be >= 1");
  }
  if (options.max_queue_delay_ms < 0) {
    return InvalidArgument("ServerOptions.max_queue_delay_ms must be >= 0");
  }
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
    impl->accept_backoff.cancel();
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
