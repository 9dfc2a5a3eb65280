// Internals of the coordinator's HTTP server, shared by its translation units:
//   server.cc      the listener (accept, connection limits), Create/Start/Stop
//   session.cc     one connection: reading and framing requests, routing,
//                  writing responses (HEAD, 1xx, 204, Connection: close)
//   completion.cc  one generation request: admission, the n-choice fan-out
//                  over the backend, streaming or collecting the answer
// Not a public header: only those three files include it.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/metrics.h"
#include "common/stop_matcher.h"
#include "coordinator/http/admission.h"
#include "coordinator/http/http_errors.h"
#include "coordinator/http/server.h"

namespace kvrelay::coordinator::internal {

namespace beast = boost::beast;
namespace http = beast::http;
namespace net = boost::asio;
using tcp = net::ip::tcp;

std::string EndpointName(Endpoint e);
std::string FinishName(FinishReason r);
int64_t UnixSeconds();

// State shared by the listener, every session and every request. Holds no
// I/O objects, so a request can outlive its connection safely.
struct Core {
  Core(ServerOptions o, Backend* b, const TextCodec* c, MetricsRegistry* m);

  // Every series carries model_name (as vLLM's), after `extra`.
  MetricLabels Labels(MetricLabels extra = {}) const;
  void CountRequest(const std::string& endpoint, int status);
  // Counts a worker's cumulative figure (from its snapshot) into counter
  // `name`: the increase since the last scrape.
  void AdvanceWorkerCounter(const std::string& name, const std::string& help,
                            const std::string& worker, double total);
  void UpdateAdmissionGauges();
  // Brings the registry's copies of backend->Counters() and Gauges() up to date.
  void ExportBackendMetrics();
  // The /metrics body: every series brought up to date, then rendered
  // (metrics_export.cc).
  std::string RenderMetrics();
  void ExportProcessMetrics();
  void ExportWorkerMetrics();

  // Per-client connection accounting (client = remote IP address). Past
  // max_connections_per_client a client still gets kHealthConnectionsPerClient
  // connections that serve only /health and /metrics (a monitor on the same
  // address as a busy client must see the server), then kRefused. Every
  // connection that was not refused is released once.
  enum class ClientSlot { kFull, kProbeOnly, kRefused };
  ClientSlot AcquireClientSlot(const std::string& client);
  void ReleaseClientSlot(const std::string& client);

  const ServerOptions options;
  Backend* const backend;
  const TextCodec* const codec;
  MetricsRegistry* const registry;
  AdmissionQueue admission;
  Histogram* ttft;
  Histogram* itl;
  Histogram* e2e;
  Histogram* queue_wait;
  Histogram* prefill_time;  // admission -> first token
  Histogram* decode_time;   // first token -> last token
  Histogram* request_prompt_tokens;
  Histogram* request_generation_tokens;
  Gauge* prompt_tokens_per_second;      // as llama.cpp's server: over finished requests
  Gauge* generation_tokens_per_second;  // (tokens / the seconds spent on them)
  // Finishes a request's throughput accounting (thread-safe).
  void AddThroughput(int64_t prompt_tokens, double prefill_s, int64_t generated, double decode_s);
  Counter* prompt_tokens;
  Counter* generation_tokens;
  Counter* cached_tokens;
  Gauge* queue_depth;
  Gauge* running;
  Gauge* open_connections;
  Counter* refused_connections;
  uint64_t nonce = 0;
  std::atomic<uint64_t> next_id{1};
  std::atomic<int> connections{0};

  std::mutex worker_totals_mutex;
  std::map<std::string, double> worker_totals;  // guarded: last cumulative value per series
  std::set<std::string> scraped_workers;        // guarded: workers a /metrics scrape has shown

  std::mutex throughput_mutex;
  double prompt_tokens_sum = 0, prefill_seconds_sum = 0;     // guarded by throughput_mutex
  double generation_tokens_sum = 0, decode_seconds_sum = 0;  // guarded by throughput_mutex

  std::mutex clients_mutex;
  std::map<std::string, int> clients;  // guarded by clients_mutex: open connections per client

  // Requests submitted to the backend whose final event has not arrived.
  std::mutex mutex;
  std::condition_variable drained;
  bool open = true;               // guarded by mutex; false once Stop() began
  std::set<uint64_t> in_backend;  // guarded by mutex
};

class Session;

// One generation request (one of its n choices). Created and mostly touched
// on its session's strand; OnBackendEvent runs on a backend thread.
struct RequestState {
  std::shared_ptr<Core> core;
  std::shared_ptr<Session> session;  // guarded by core->mutex; reset when the request ends
  uint64_t id = 0;
  int index = 0;         // which of the request's choices (prompt_index * n + j)
  int prompt_index = 0;  // which prompt of a batched completion it answers
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
  // Logprobs of the tokens so far (when asked for); a stream sends
  // [logprobs_sent, end) with its next chunk.
  std::vector<LogprobEntry> logprobs;
  size_t logprobs_sent = 0;
  size_t logprob_offset = 0;  // completions text_offset of logprobs[logprobs_sent]
  UsageCounts usage;
  std::optional<TimePoint> last_token_at;
  std::optional<TimePoint> admitted_at;  // left the admission queue
  std::optional<TimePoint> first_token_at;

  // `session` is read on backend threads: take and drop it under core->mutex.
  std::shared_ptr<Session> GetSession();
  void DetachSession();
  void ReleaseSlot();
  // Backend thread: events arrive in order, one at a time.
  void OnBackendEvent(const std::shared_ptr<RequestState>& self, const TokenEvent& ev);
};

class Session : public std::enable_shared_from_this<Session> {
 public:
  // `probe_only`: the client is over its connection limit; this connection
  // answers /health and /metrics and refuses the rest with 429, then closes.
  Session(tcp::socket socket, std::shared_ptr<Core> core, std::string client,
          bool probe_only = false);
  ~Session();

  void Run();
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
  // What the response must know about the request it answers.
  struct RequestInfo {
    unsigned version = 11;
    bool keep_alive = false;
    bool head = false;  // HEAD: the response carries no content
  };

  // --- session.cc: the connection ---
  void DoRead();
  void OnHeader(beast::error_code ec);
  void OnRead(beast::error_code ec);
  void Handle();
  std::optional<std::string> Authenticate();  // tenant, or nullopt after answering 401
  void HandleMetrics();
  void HandleHealth();

  void SendJson(http::status status, const nlohmann::json& body, bool keep_alive = true,
                HttpHeaders headers = {});
  void SendText(http::status status, std::string body, std::string content_type, bool keep_alive,
                HttpHeaders headers = {});
  void SendNoContent(HttpHeaders headers);
  // CORS headers (ServerOptions::cors_allow_origin); `allow` = the methods of
  // a preflight answer (OPTIONS), null for an ordinary response.
  template <typename Response>
  void AddCors(Response& res, const char* allow = nullptr) const;
  void SendError(const HttpError& e);
  void SendError(const ApiError& e) { SendError(HttpError{e, {}, false}); }
  template <typename Response>
  void WriteResponse(std::shared_ptr<Response> res, bool keep_alive);
  void AfterResponse(bool keep_alive);
  // After a response with Connection: close: reads and drops what the client
  // still sends (bounded in time and bytes), then closes.
  void Linger();

  void StartWatch();
  void OnWatch(beast::error_code ec, size_t n);
  void ClientGone();

  void QueueOut(OutItem item);
  void PumpWrites();
  void Close();

  // --- completion.cc: one generation and its n choices ---
  void HandleCompletion(Endpoint endpoint, std::string tenant);
  void Emit(RequestState& r, const std::string& piece);
  // The stream's logprobs for the tokens not sent yet (null when none asked).
  nlohmann::json TakeStreamLogprobs(RequestState& r);
  void Finish(const std::shared_ptr<RequestState>& r, const TokenEvent& ev);
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

  beast::tcp_stream stream_;
  std::shared_ptr<Core> core_;
  const std::string client_;  // remote address, for the per-client connection limit
  const bool probe_only_;     // over the per-client limit: /health and /metrics only
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  http::request<http::string_body> req_;
  RequestInfo info_;
  std::string endpoint_label_ = "other";

  // The choices (n of them, in index order) of the generation in progress;
  // empty when none. A choice leaves the list when it ends.
  std::vector<std::shared_ptr<RequestState>> active_;
  std::vector<ChoiceResult> results_;      // per choice, for the non-streaming answer
  UsageCounts total_usage_;                // completion tokens summed over the finished choices
  std::vector<UsageCounts> prompt_usage_;  // per prompt: its prompt and cached tokens (once)
  UsageCounts TotalUsage() const;
  bool stream_started_ = false;  // the SSE header is queued
  bool watching_ = false;        // a disconnect-watch read is pending
  bool resume_read_ = false;     // start the next request read when the watch returns
  bool client_gone_ = false;
  bool closed_ = false;

  std::array<char, 4096> linger_buffer_;
  size_t lingered_ = 0;

  std::deque<OutItem> out_;
  size_t out_bytes_ = 0;
  bool writing_ = false;
  bool stream_keep_alive_ = false;
  std::shared_ptr<http::response<http::empty_body>> stream_header_;
  std::shared_ptr<http::response_serializer<http::empty_body>> stream_serializer_;
};

}  // namespace kvrelay::coordinator::internal
