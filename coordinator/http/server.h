// The coordinator's HTTP/1.1 server (Boost.Beast): the OpenAI-compatible API
// over a Backend, with admission control, API keys and Prometheus metrics.
//
//   POST /v1/chat/completions, POST /v1/completions   (JSON, or SSE with stream=true)
//   GET  /v1/models, GET /v1/models/{id}, GET /health, GET /metrics
//   (HEAD on every GET route; OPTIONS on every route: 204 with Allow)
//
// Threads: one io_context run by `threads` named threads ("http-N"); each
// connection runs on its own strand. Backend sinks post onto the strand.
// Every connection has a deadline: header/idle timeout while reading a
// request, request timeout while a generation runs.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/metrics.h"
#include "common/status.h"
#include "coordinator/backend.h"
#include "coordinator/http/admission.h"
#include "coordinator/http/api_keys.h"
#include "coordinator/openai/openai_api.h"
#include "coordinator/openai/text_codec.h"

namespace kvrelay::coordinator {

// Chain hashes of the full blocks of `tokens` for one tenant.
using PrefixHasher = std::function<std::vector<PrefixBlockHash>(std::span<const int32_t> tokens,
                                                                std::string_view tenant_salt)>;

// Connections a client over max_connections_per_client still gets for
// /health and /metrics; beyond them it is refused on accept.
inline constexpr int kHealthConnectionsPerClient = 8;

struct ServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 8080;                // 0 picks a free port (see Server::port())
  int threads = 2;                     // io threads
  std::string model_name = "kvrelay";  // the only model served; others get 404
  size_t max_body_bytes = 1 << 20;     // larger bodies get 413
  size_t max_header_bytes = 16 << 10;
  int max_prompt_tokens = 8192;               // longer prompts get 400 context_length_exceeded
  int max_context_tokens = 0;                 // prompt + max_tokens cap; 0 = unchecked
  int header_timeout_ms = 10'000;             // to read one request (and keep-alive idle)
  int request_timeout_ms = 600'000;           // for one generation, end to end
  size_t max_stream_backlog_bytes = 4 << 20;  // unsent SSE bytes before a slow client is dropped
  int max_connections = 4096;                 // more are refused on accept (503)
  // One client (remote IP address) holding more open connections is refused
  // (429), so one client cannot take every connection; its next
  // kHealthConnectionsPerClient connections still answer /health and
  // /metrics (one request each), so a monitor on its address sees the server.
  int max_connections_per_client = 1024;
  int retry_after_seconds = 1;  // Retry-After of a 429 / 503 until hold times are measured
  int max_running = 64;         // admission: concurrent requests in the backend
  int max_queue = 256;          // admission: waiting requests; beyond: 429
  // admission: refuse (429 + Retry-After from the queue) when the predicted
  // queue wait exceeds this; 0 = no bound (see coordinator/http/admission.h).
  int max_queue_delay_ms = kDefaultMaxQueueDelayMs;
  ApiLimits limits;
  ApiKeys api_keys;                   // empty: no authentication
  PrefixHasher prefix_hasher;         // optional; fills GenerationRequest::prefix_blocks
  int stop_drain_timeout_ms = 5'000;  // Stop(): wait this long for cancelled requests
  // CORS: the Access-Control-Allow-Origin value ("*" or one origin) sent on
  // every response, with preflight answers on OPTIONS; empty = no CORS headers.
  std::string cors_allow_origin;
};

class Server {
 public:
  // Binds and listens (so port() is known) but serves nothing until Start().
  // `backend`, `codec` and `metrics` must outlive the server.
  static Result<std::unique_ptr<Server>> Create(ServerOptions options, Backend* backend,
                                                const TextCodec* codec, MetricsRegistry* metrics);
  ~Server();  // Stop()s
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  uint16_t port() const;
  Status Start();
  // Stops accepting, cancels running requests, waits (bounded) for their final
  // events, closes connections and joins the threads. Idempotent.
  void Stop();

  struct Impl;

 private:
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvrelay::coordinator
