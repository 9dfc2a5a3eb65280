// The HTTP edge by RFC 9110 / 9112 (issues #21, #14): framing the server
// refuses, HEAD / OPTIONS / 405 / 100-continue, Connection: close exactly when
// the server closes, per-client connection limits, prompts that can never
// fit, and admission by predicted queue wait. Real sockets on 127.0.0.1
// (and 127.0.0.2 as a second client), the fake backend of fakes.h.
#include <gtest/gtest.h>
#include <unistd.h>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "common/http_client.h"
#include "coordinator/http/admission.h"
#include "coordinator/http/server.h"
#include "tests/testing/skip.h"
#include "tests/unit/coordinator/fakes.h"

namespace kvrelay::coordinator {
namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using nlohmann::json;
using testing::ByteCodec;
using testing::FakeBackend;

class HttpEdgeTest : public ::testing::Test {
 protected:
  void StartServer(ServerOptions options = {}, FakeBackend::Options backend_options = {}) {
    backend_ = std::make_unique<FakeBackend>(backend_options);
    options.port = 0;
    options.model_name = "test-model";
    options.header_timeout_ms = 5000;
    auto server = Server::Create(std::move(options), backend_.get(), &codec_, &metrics_);
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(*server);
    ASSERT_TRUE(server_->Start().ok());
  }
  void TearDown() override {
    if (server_) server_->Stop();
    server_.reset();
    backend_.reset();
  }

  // A connection from `from` (127.0.0.1 or another loopback address).
  std::unique_ptr<tcp::socket> Connect(const std::string& from = "127.0.0.1") {
    auto s = std::make_unique<tcp::socket>(ioc_);
    s->open(tcp::v4());
    s->bind({net::ip::make_address(from), 0});
    s->connect({net::ip::make_address("127.0.0.1"), server_->port()});
    return s;
  }

  // Reads one response with Beast's client parser (skip: a response to HEAD).
  struct Response {
    int status = 0;
    std::map<std::string, std::string> headers;  // lower-case names
    std::string body;
    bool ok = false;
    std::string error;
  };
  Response Read(tcp::socket& s, beast::flat_buffer& buf, bool head = false) {
    http::response_parser<http::string_body> p;
    p.skip(head);
    p.body_limit(1 << 20);
    beast::error_code ec;
    http::read(s, buf, p, ec);
    Response r;
    if (ec) {
      r.error = ec.message();
      return r;
    }
    r.ok = true;
    r.status = static_cast<int>(p.get().result_int());
    for (const auto& f : p.get()) {
      std::string name(f.name_string());
      for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      r.headers[name] = std::string(f.value());
    }
    r.body = p.get().body();
    return r;
  }
  // True when the server closed the connection: the next read sees EOF with
  // nothing buffered (`buf` holds what was read beyond the last response).
  static bool ServerClosed(tcp::socket& s, beast::flat_buffer& buf) {
    if (buf.size() > 0) return false;
    char c;
    beast::error_code ec;
    s.read_some(net::buffer(&c, 1), ec);
    return ec == net::error::eof || ec == net::error::connection_reset;
  }
  static void Send(tcp::socket& s, const std::string& bytes) { net::write(s, net::buffer(bytes)); }
  static std::string Post(const std::string& target, const std::string& body,
                          const std::string& extra = "") {
    return "POST " + target + " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + extra +
           "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  }
  static json Chat(const std::string& content, int max_tokens = 8) {
    return json{{"model", "test-model"},
                {"messages", {{{"role", "user"}, {"content", content}}}},
                {"max_tokens", max_tokens}};
  }

  net::io_context ioc_;
  ByteCodec codec_;
  MetricsRegistry metrics_;
  std::unique_ptr<FakeBackend> backend_;
  std::unique_ptr<Server> server_;
};

// #14: "Transfer-Encoding: gzip" left the body to be parsed as a second
// request (request smuggling). Any coding but exactly "chunked" is a 400 and
// the connection closes; the smuggled request is never answered.
TEST_F(HttpEdgeTest, TransferEncodingOtherThanChunkedIs400AndCloses) {
  StartServer();
  for (const char* te : {"xchunked", "gzip", "chunked, identity", "identity", "chunked, gzip"}) {
    SCOPED_TRACE(te);
    auto s = Connect();
    const std::string smuggled = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
    Send(*s, std::string("POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: ") + te +
                 "\r\n\r\n" + smuggled);
    beast::flat_buffer buf;
    Response r = Read(*s, buf);
    ASSERT_TRUE(r.ok) << r.error;
    EXPECT_EQ(r.status, 400);
    EXPECT_EQ(r.headers["connection"], "close");
    EXPECT_NE(r.body.find("Transfer-Encoding"), std::string::npos) << r.body;
    EXPECT_TRUE(ServerClosed(*s, buf)) << "a second response followed";
  }
  // Two Transfer-Encoding fields, and a 1.1 request without Host: 400 + close.
  for (const std::string& req :
       {std::string("POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                    "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
        std::string("GET /health HTTP/1.1\r\n\r\n")}) {
    auto s = Connect();
    Send(*s, req);
    beast::flat_buffer buf;
    Response r = Read(*s, buf);
    ASSERT_TRUE(r.ok) << r.error;
    EXPECT_EQ(r.status, 400);
    EXPECT_EQ(r.headers["connection"], "close");
    EXPECT_TRUE(ServerClosed(*s, buf));
  }
  // Exactly "chunked" (any case) is a body like any other.
  auto s = Connect();
  const std::string body = Chat("hi", 2).dump();
  char size[16];
  std::snprintf(size, sizeof(size), "%zx", body.size());
  Send(*s, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: Chunked\r\n\r\n" +
               std::string(size) + "\r\n" + body + "\r\n0\r\n\r\n");
  beast::flat_buffer buf;
  Response r = Read(*s, buf);
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(backend_->submitted().size(), 1u);
}

// #21: HEAD gets the GET's status and headers and no content, so the next
// response on the connection is not poisoned; 405 carries Allow (and no
// content for HEAD); OPTIONS is 204 with Allow and no Content-Length.
TEST_F(HttpEdgeTest, HeadOptionsAndAllowKeepTheConnectionFramed) {
  StartServer();
  auto s = Connect();
  beast::flat_buffer buf;
  for (const char* path : {"/health", "/metrics", "/v1/models", "/v1/models/test-model"}) {
    SCOPED_TRACE(path);
    Send(*s, std::string("GET ") + path + " HTTP/1.1\r\nHost: x\r\n\r\n");
    Response get = Read(*s, buf);
    ASSERT_TRUE(get.ok) << get.error;
    Send(*s, std::string("HEAD ") + path + " HTTP/1.1\r\nHost: x\r\n\r\n");
    Response head = Read(*s, buf, /*head=*/true);
    ASSERT_TRUE(head.ok) << head.error;
    EXPECT_EQ(head.status, get.status);
    EXPECT_EQ(head.status, 200);
    EXPECT_EQ(head.headers["content-type"], get.headers["content-type"]);
    EXPECT_FALSE(head.headers["content-length"].empty());
    if (std::string(path) != "/metrics") {  // metrics change between the two calls
      EXPECT_EQ(head.headers["content-length"], get.headers["content-length"]);
    }
    EXPECT_EQ(buf.size(), 0u) << "HEAD response carried content";
  }
  // Unknown model id: 404.
  Send(*s, "GET /v1/models/other HTTP/1.1\r\nHost: x\r\n\r\n");
  Response missing = Read(*s, buf);
  EXPECT_EQ(missing.status, 404);
  EXPECT_EQ(json::parse(missing.body)["error"]["code"], "model_not_found");
  // 405 with Allow, for HEAD without content.
  Send(*s, "HEAD /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n");
  Response h405 = Read(*s, buf, true);
  EXPECT_EQ(h405.status, 405);
  EXPECT_EQ(h405.headers["allow"], "POST, OPTIONS");
  EXPECT_EQ(buf.size(), 0u);
  Send(*s, "DELETE /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n");
  Response d405 = Read(*s, buf);
  EXPECT_EQ(d405.status, 405);
  EXPECT_EQ(d405.headers["allow"], "GET, HEAD, OPTIONS");
  EXPECT_EQ(json::parse(d405.body)["error"]["code"], "method_not_allowed");
  Send(*s, "OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n");
  Response opt = Read(*s, buf);
  EXPECT_EQ(opt.status, 204);
  EXPECT_EQ(opt.headers["allow"], "POST, OPTIONS");
  EXPECT_EQ(opt.headers.count("content-length"), 0u);
  // Still one healthy keep-alive connection.
  Send(*s, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  Response last = Read(*s, buf);
  EXPECT_EQ(last.status, 200);
  EXPECT_EQ(last.headers.count("connection"), 0u);
}

// Expect: 100-continue gets the interim response before the body is sent.
TEST_F(HttpEdgeTest, ExpectContinueGetsInterimResponse) {
  StartServer();
  auto s = Connect();
  const std::string body = Chat("hi", 2).dump();
  Send(*s,
       "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
       "Content-Length: " +
           std::to_string(body.size()) + "\r\n\r\n");
  std::string interim(25, '\0');
  net::read(*s, net::buffer(interim));
  EXPECT_EQ(interim, "HTTP/1.1 100 Continue\r\n\r\n");
  Send(*s, body);
  beast::flat_buffer buf;
  Response r = Read(*s, buf);
  EXPECT_EQ(r.status, 200) << r.body;
}

// Connection: close exactly when the server closes: asked for by the client,
// and after a 413 the server cannot frame past.
TEST_F(HttpEdgeTest, ConnectionCloseExactlyWhenTheServerCloses) {
  ServerOptions o;
  o.max_body_bytes = 1024;
  StartServer(o);
  {
    auto s = Connect();
    Send(*s, Post("/v1/chat/completions", Chat("hi", 2).dump(), "Connection: close\r\n"));
    beast::flat_buffer buf;
    Response r = Read(*s, buf);
    EXPECT_EQ(r.status, 200);
    EXPECT_EQ(r.headers["connection"], "close");
    EXPECT_TRUE(ServerClosed(*s, buf));
  }
  {
    auto s = Connect();
    Send(*s, Post("/v1/chat/completions", Chat(std::string(2000, 'x')).dump()));
    beast::flat_buffer buf;
    Response r = Read(*s, buf);
    EXPECT_EQ(r.status, 413);
    EXPECT_EQ(r.headers["connection"], "close");
    EXPECT_TRUE(ServerClosed(*s, buf));
  }
}

// #14: one client holding every connection locked everyone out (/health
// included). Past its own limit (and a few connections that serve only
// /health and /metrics) a client is refused with 429; others get in.
TEST_F(HttpEdgeTest, OneClientCannotTakeEveryConnection) {
  ServerOptions o;
  o.max_connections = 16;
  o.max_connections_per_client = 4;
  StartServer(o);
  constexpr int kProbes = kHealthConnectionsPerClient;
  static_assert(4 + kProbes < 16, "the test needs room for another client");
  std::vector<std::unique_ptr<tcp::socket>> hog;
  for (int i = 0; i < 4 + kProbes + 1; ++i) hog.push_back(Connect("127.0.0.1"));
  // The first four are served; the next ones answer only /health and
  // /metrics; the last was refused on accept.
  int served = 0, refused = 0;
  for (auto& s : hog) {
    Send(*s, "GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n");
    beast::flat_buffer buf;
    Response r = Read(*s, buf);
    if (!r.ok) continue;  // refused and reset before the request was read
    if (r.status == 429) {
      ++refused;
      EXPECT_EQ(r.headers["connection"], "close");
      EXPECT_FALSE(r.headers["retry-after"].empty());
      EXPECT_EQ(json::parse(r.body)["error"]["code"], "too_many_connections");
    } else {
      EXPECT_EQ(r.status, 200);
      ++served;
    }
  }
  EXPECT_EQ(served, 4);
  EXPECT_GE(refused, kProbes);
  // Another client still gets /health and a completion.
  auto other = Connect("127.0.0.2");
  Send(*other, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
  beast::flat_buffer buf;
  Response health = Read(*other, buf);
  ASSERT_TRUE(health.ok) << health.error;
  EXPECT_EQ(health.status, 200);
  Send(*other, Post("/v1/chat/completions", Chat("hi", 2).dump()));
  EXPECT_EQ(Read(*other, buf).status, 200);
  EXPECT_EQ(
      metrics_.GetCounter("kvrelay_refused_connections_total", "", {{"model_name", "test-model"}})
          ->value(),
      kProbes + 1);
}

// #46 finding 6c: a client at its connection limit (1,024 by default) got
// 429 for /health too, so a monitor sharing its address saw the server as
// down. /health and /metrics are exempt; anything else is still refused.
TEST_F(HttpEdgeTest, HealthAndMetricsAreServedPastThePerClientLimit) {
  ServerOptions o;
  o.max_connections = 64;
  o.max_connections_per_client = 4;
  StartServer(o);
  std::vector<std::unique_ptr<tcp::socket>> held;
  for (int i = 0; i < 4; ++i) {
    held.push_back(Connect("127.0.0.1"));
    Send(*held.back(), "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
    beast::flat_buffer buf;
    Response r = Read(*held.back(), buf);
    ASSERT_EQ(r.status, 200);
    EXPECT_NE(r.headers["connection"], "close");  // kept: the limit is held
  }
  for (const char* target : {"/health", "/metrics"}) {
    SCOPED_TRACE(target);
    auto probe = Connect("127.0.0.1");
    Send(*probe, std::string("GET ") + target + " HTTP/1.1\r\nHost: x\r\n\r\n");
    beast::flat_buffer buf;
    Response r = Read(*probe, buf);
    ASSERT_TRUE(r.ok) << r.error;
    EXPECT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(r.headers["connection"], "close");  // one answer, then the slot goes back
    EXPECT_TRUE(ServerClosed(*probe, buf));
  }
  auto probe = Connect("127.0.0.1");
  Send(*probe, Post("/v1/chat/completions", Chat("hi", 2).dump()));
  beast::flat_buffer buf;
  Response r = Read(*probe, buf);
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_EQ(r.status, 429);
  EXPECT_EQ(json::parse(r.body)["error"]["code"], "too_many_connections");
  EXPECT_FALSE(r.headers["retry-after"].empty());
  EXPECT_TRUE(backend_->submitted().empty());
}

// #46 finding 6b: admission refuses by default (no opt-in) when the predicted
// queue wait passes 2 s, and Retry-After comes from the estimate, also
// before any request finished (the running ones' age bounds the hold time).
TEST(AdmissionDelayTest, RefusesByDefaultWithRetryAfterFromTheEstimate) {
  EXPECT_EQ(ServerOptions{}.max_queue_delay_ms, kDefaultMaxQueueDelayMs);
  TimePoint now{};
  AdmissionQueue::Options o;
  o.max_running = 1;
  o.now = [&] { return now; };
  AdmissionQueue q(o);
  int started = 0;
  auto start = [&] { ++started; };
  ASSERT_TRUE(q.Enqueue(1, start).ok());
  ASSERT_TRUE(q.Enqueue(2, start).ok());  // queued behind 1
  // Nothing finished yet, but 1 has held its slot 25 s: the next waiter
  // (second in line) waits at least 2 x 25 s = 50 s > 2 s.
  now += std::chrono::seconds(25);
  AdmissionQueue::Refusal refusal;
  Status st = q.Enqueue(3, start, &refusal);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st.ToString();
  EXPECT_EQ(refusal.reason, AdmissionQueue::Refusal::kQueueDelay);
  EXPECT_EQ(refusal.retry_after_seconds, 48);  // back when within the bound: 50 s - 2 s
  // Measured: 1 held 25 s; 2 runs. The next waits 25 s: back in 23 s.
  q.Release(1);
  EXPECT_EQ(started, 2);
  st = q.Enqueue(4, start, &refusal);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st.ToString();
  EXPECT_EQ(refusal.retry_after_seconds, 23);
  EXPECT_EQ(q.queued(), 0);
}

// #46 finding 6b: with slots to spare (the default 64), requests wait inside
// the backend where the slot queue cannot see them; the interval between
// first tokens while some request waited for one predicts a newcomer's time
// to its first token, and only a request with others ahead is refused.
TEST(AdmissionDelayTest, FirstTokenIntervalsPredictTheWaitInsideTheBackend) {
  TimePoint now{};
  AdmissionQueue::Options o;  // 64 slots, the default 2 s bound
  o.now = [&] { return now; };
  AdmissionQueue q(o);
  ASSERT_EQ(o.max_queue_delay_ms, 2000);
  int started = 0;
  auto start = [&] { ++started; };
  for (uint64_t id = 1; id <= 4; ++id) ASSERT_TRUE(q.Enqueue(id, start).ok());
  now += std::chrono::milliseconds(500);
  q.FirstToken(1);
  now += std::chrono::milliseconds(500);
  q.FirstToken(2);
  q.FirstToken(2);  // a second call for the same request teaches nothing
  EXPECT_DOUBLE_EQ(q.FirstTokenIntervalMs(), 500);
  // 3 and 4 are ahead: (2 + 1) x 500 ms = 1.5 s, then 2 s: both within the bound.
  EXPECT_DOUBLE_EQ(q.PredictedQueueDelayMs(), 1500);
  ASSERT_TRUE(q.Enqueue(5, start).ok());
  ASSERT_TRUE(q.Enqueue(6, start).ok());
  // 3..6 ahead: 5 x 500 ms = 2.5 s > 2 s, though 58 slots are free.
  AdmissionQueue::Refusal refusal;
  Status st = q.Enqueue(7, start, &refusal);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st.ToString();
  EXPECT_EQ(refusal.reason, AdmissionQueue::Refusal::kQueueDelay);
  EXPECT_EQ(refusal.retry_after_seconds, 1);
  EXPECT_EQ(started, 6);
  // Requests that end without a first token are no longer ahead of anyone.
  for (uint64_t id = 1; id <= 6; ++id) q.Release(id);
  EXPECT_DOUBLE_EQ(q.PredictedQueueDelayMs(), 0);
  // An idle spell is not a wait: 60 s later one request waits 100 ms.
  now += std::chrono::seconds(60);
  ASSERT_TRUE(q.Enqueue(8, start).ok());
  now += std::chrono::milliseconds(100);
  q.FirstToken(8);
  EXPECT_NEAR(q.FirstTokenIntervalMs(), (0.95 * (0.95 * 500 + 500) + 100) / (0.95 * 1.95 + 1),
              1e-9);
}

// Requests prefilled in one batch get their first tokens together: the
// interval between first tokens is short, but a request's own prefill takes
// what one with nothing ahead took, and the prediction adds that.
TEST(AdmissionDelayTest, AnOwnPrefillCostsWhatOneWithNothingAheadTook) {
  TimePoint now{};
  AdmissionQueue::Options o;
  o.now = [&] { return now; };
  AdmissionQueue q(o);
  auto start = [] {};
  for (uint64_t id = 1; id <= 3; ++id) ASSERT_TRUE(q.Enqueue(id, start).ok());  // 1: nothing ahead
  now += std::chrono::milliseconds(900);
  for (uint64_t id = 1; id <= 3; ++id) q.FirstToken(id);  // one batch
  const double gap = 0.95 * 0.95 * 900 / (0.95 * 0.95 + 0.95 + 1);
  EXPECT_NEAR(q.FirstTokenIntervalMs(), gap, 1e-9);
  ASSERT_TRUE(q.Enqueue(4, start).ok());
  ASSERT_TRUE(q.Enqueue(5, start).ok());
  // 4 and 5 ahead: 2 x the interval + the 900 ms of 1's own prefill.
  EXPECT_NEAR(q.PredictedQueueDelayMs(), 2 * gap + 900, 1e-9);
}

// Nothing ahead, nothing refused: an idle cluster admits a request whatever
// its predicted wait (a long prompt alone is slow, not queued).
TEST(AdmissionDelayTest, NothingAheadIsNeverRefused) {
  TimePoint now{};
  AdmissionQueue::Options o;
  o.now = [&] { return now; };
  AdmissionQueue q(o);
  auto start = [] {};
  ASSERT_TRUE(q.Enqueue(1, start).ok());
  now += std::chrono::seconds(10);
  q.FirstToken(1);                        // a 10 s prefill
  ASSERT_TRUE(q.Enqueue(2, start).ok());  // 1 decodes: nothing waits for a first token
  AdmissionQueue::Refusal refusal;
  Status st = q.Enqueue(3, start, &refusal);  // 2 is ahead: (1 + 1) x 10 s
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st.ToString();
  EXPECT_EQ(refusal.retry_after_seconds, 18);
  q.FirstToken(2);
  EXPECT_TRUE(q.Enqueue(4, start).ok());
}

// #14: a prompt that can never fit the KV pool of any worker is the client's
// error (400), not "no capacity, retry" (503 + Retry-After forever).
TEST_F(HttpEdgeTest, PromptThatCanNeverFitIs400) {
  StartServer();  // the fake worker: 100 blocks of 16 tokens = 1600 tokens
  // What the engine answers for such a request.
  backend_->SetSubmitStatus(ResourceExhausted("needs 102 KV blocks but the pool has only 100"));
  HttpCallSpec spec;
  spec.method = "POST";
  spec.port = server_->port();
  spec.target = "/v1/chat/completions";
  spec.body = Chat(std::string(1500, 'x'), 200).dump();  // 1520 + 200 tokens > 1600
  auto never = HttpCall(spec);
  ASSERT_TRUE(never.ok());
  EXPECT_EQ(never->status, 400) << never->body;
  json e = json::parse(never->body);
  EXPECT_EQ(e["error"]["code"], "context_length_exceeded");
  EXPECT_EQ(e["error"]["type"], "invalid_request_error");
  EXPECT_EQ(never->headers.count("retry-after"), 0u);
  // One that fits but finds no room now is still 503 + Retry-After.
  spec.body = Chat("hi", 8).dump();
  auto busy = HttpCall(spec);
  ASSERT_TRUE(busy.ok());
  EXPECT_EQ(busy->status, 503);
  EXPECT_FALSE(busy->headers["retry-after"].empty());
  EXPECT_TRUE(backend_->submitted().empty());
}

// #14: with --max-queue-delay-ms, a request whose predicted queue wait is
// over the bound is refused at once (429, Retry-After from the queue) instead
// of waiting for a first token that comes too late.
TEST_F(HttpEdgeTest, PredictedQueueDelayOverTheBoundIs429) {
  ServerOptions o;
  o.max_running = 1;
  o.max_queue = 16;
  o.max_queue_delay_ms = 50;
  FakeBackend::Options bo;
  bo.token_interval = std::chrono::milliseconds(25);  // 13 tokens: a request holds >= 300 ms
  StartServer(o, bo);
  HttpCallSpec spec;
  spec.method = "POST";
  spec.port = server_->port();
  spec.target = "/v1/chat/completions";
  spec.body = Chat("hi", 64).dump();
  auto first = HttpCall(spec);  // teaches the queue how long a request holds its slot
  ASSERT_TRUE(first.ok());
  ASSERT_EQ(first->status, 200);
  backend_->SetHang(true);
  auto running = Connect();
  Send(*running, Post("/v1/chat/completions", Chat("one", 64).dump()));  // holds the slot
  ASSERT_TRUE(backend_->WaitForSubmits(2));
  auto refused = HttpCall(spec);
  ASSERT_TRUE(refused.ok());
  EXPECT_EQ(refused->status, 429) << refused->body;
  EXPECT_EQ(json::parse(refused->body)["error"]["code"], "queue_delay_exceeded");
  EXPECT_EQ(refused->headers["retry-after"], "1");  // ~300 ms predicted - 50 ms bound
  EXPECT_EQ(backend_->submitted().size(), 2u);
  backend_->SetHang(false);
}

// #46 finding 6b through the server: with the default 64 slots, a request
// that waits for its first token inside the backend makes the next one's
// predicted wait pass the bound: 429 at once, though 63 slots are free.
TEST_F(HttpEdgeTest, WaitInsideTheBackendPastTheBoundIs429) {
  ServerOptions o;
  o.max_queue_delay_ms = 500;
  StartServer(o);
  // Teach the queue a wait: one request's first token comes >= 300 ms after
  // it was admitted (the sleep is the wait being measured, not a sync).
  backend_->SetHang(true);
  auto first = Connect();
  Send(*first, Post("/v1/chat/completions", Chat("first", 2).dump()));
  ASSERT_TRUE(backend_->WaitForSubmits(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  backend_->SetHang(false);
  beast::flat_buffer buf;
  Response r = Read(*first, buf);
  ASSERT_TRUE(r.ok) << r.error;
  ASSERT_EQ(r.status, 200);
  backend_->SetHang(true);
  auto a = Connect();
  Send(*a, Post("/v1/chat/completions", Chat("one", 2).dump()));  // nothing ahead: admitted
  ASSERT_TRUE(backend_->WaitForSubmits(2));
  // One ahead, 63 slots free: (1 + 1) x >= 300 ms > 500 ms.
  HttpCallSpec spec;
  spec.method = "POST";
  spec.port = server_->port();
  spec.target = "/v1/chat/completions";
  spec.body = Chat("hi", 2).dump();
  spec.timeout_ms = 10'000;
  auto refused = HttpCall(spec);
  ASSERT_TRUE(refused.ok()) << refused.status().ToString();
  EXPECT_EQ(refused->status, 429) << refused->body;
  EXPECT_EQ(json::parse(refused->body)["error"]["code"], "queue_delay_exceeded");
  EXPECT_FALSE(refused->headers["retry-after"].empty());
  EXPECT_EQ(backend_->submitted().size(), 2u);
  backend_->SetHang(false);
}

// #18: without max_tokens a request gets what fits (the default, lowered to
// the room left in the context and the KV pool; 0 = all of it, as vLLM),
// instead of being refused.
TEST_F(HttpEdgeTest, NoMaxTokensGetsWhatFits) {
  ServerOptions o;
  o.max_context_tokens = 1000;
  o.limits.max_tokens_default = 0;  // all the room
  StartServer(o);                   // the fake worker holds 1600 tokens: the context is the bound
  HttpCallSpec spec;
  spec.method = "POST";
  spec.port = server_->port();
  spec.target = "/v1/completions";
  spec.body = json{{"model", "test-model"}, {"prompt", std::string(900, 'x')}}.dump();
  auto r = HttpCall(spec);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 200) << r->body;
  ASSERT_EQ(backend_->submitted().size(), 1u);
  EXPECT_EQ(backend_->submitted()[0].sampling.max_tokens, 100);
  // A prompt that fills the context leaves no room: 400.
  spec.body = json{{"model", "test-model"}, {"prompt", std::string(1000, 'x')}}.dump();
  r = HttpCall(spec);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 400) << r->body;
  EXPECT_EQ(json::parse(r->body)["error"]["code"], "context_length_exceeded");
}

TEST_F(HttpEdgeTest, NoMaxTokensDefaultIsLoweredToTheKvPool) {
  ServerOptions o;
  o.limits.max_tokens_default = 256;
  StartServer(o);  // 1600-token pool, no context bound
  HttpCallSpec spec;
  spec.method = "POST";
  spec.port = server_->port();
  spec.target = "/v1/completions";
  spec.body = json{{"model", "test-model"}, {"prompt", std::string(1500, 'x')}}.dump();
  auto r = HttpCall(spec);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 200) << r->body;
  ASSERT_EQ(backend_->submitted().size(), 1u);
  EXPECT_EQ(backend_->submitted()[0].sampling.max_tokens, 100);
}

// #18: the /metrics exposition passes Prometheus' own linter: counters end in
// _total, every series has HELP and TYPE, names and units as it expects.
TEST_F(HttpEdgeTest, MetricsPassPromtool) {
  if (std::system("command -v promtool >/dev/null 2>&1") != 0) {
    KVRELAY_SKIP_OR_FAIL()
        << "promtool not installed (scripts/install-deps.sh installs 'prometheus')";
  }
  StartServer();
  HttpCallSpec spec;
  spec.method = "POST";
  spec.port = server_->port();
  spec.target = "/v1/chat/completions";
  spec.body = Chat("hi", 4).dump();
  ASSERT_EQ(HttpCall(spec)->status, 200);
  spec.method = "GET";
  spec.target = "/metrics";
  spec.body.clear();
  auto metrics = HttpCall(spec);
  ASSERT_TRUE(metrics.ok());
  ASSERT_EQ(metrics->status, 200);
  char path[] = "/tmp/kvrelay-metrics-XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(write(fd, metrics->body.data(), metrics->body.size()),
            static_cast<ssize_t>(metrics->body.size()));
  close(fd);
  std::string out;
  FILE* p = popen(("promtool check metrics < " + std::string(path) + " 2>&1").c_str(), "r");
  ASSERT_NE(p, nullptr);
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int rc = pclose(p);
  unlink(path);
  EXPECT_EQ(rc, 0) << out << "\n" << metrics->body;
  EXPECT_EQ(out, "") << metrics->body;
  for (const char* counter :
       {"kvrelay_worker_prefix_hit_tokens_total{", "kvrelay_worker_transfer_bytes_total{",
        "kvrelay_worker_transfer_seconds_total{"}) {
    EXPECT_NE(metrics->body.find(counter), std::string::npos) << counter;
  }
  EXPECT_NE(metrics->body.find("# TYPE kvrelay_worker_transfer_bytes_total counter"),
            std::string::npos);
}

TEST(AdmissionDelayTest, PredictsFromHoldTimesAndComputesRetryAfter) {
  TimePoint now{};
  AdmissionQueue q({/*max_running=*/2, /*max_queue=*/10, /*max_queue_delay_ms=*/3000,
                    /*retry_after_seconds=*/1, [&] { return now; }});
  int started = 0;
  auto start = [&] { ++started; };
  // No hold measured yet: nothing is predicted, the queue is the only bound.
  ASSERT_TRUE(q.Enqueue(1, start).ok());
  ASSERT_TRUE(q.Enqueue(2, start).ok());
  ASSERT_TRUE(q.Enqueue(3, start).ok());  // queued
  EXPECT_EQ(q.PredictedQueueDelayMs(), 0);
  now += std::chrono::seconds(4);
  q.Release(1);  // held 4 s; 3 starts
  EXPECT_EQ(q.MeanHoldMs(), 4000);
  EXPECT_EQ(started, 3);
  // Both slots busy, none queued: the next waits about 4 s / 2 slots = 2 s.
  EXPECT_DOUBLE_EQ(q.PredictedQueueDelayMs(), 2000);
  ASSERT_TRUE(q.Enqueue(4, start).ok());  // 2 s <= 3 s: queued
  // One waiter ahead: 2 * 2 s = 4 s > 3 s: refused, back in ceil(1 s).
  AdmissionQueue::Refusal refusal;
  Status st = q.Enqueue(5, start, &refusal);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(refusal.reason, AdmissionQueue::Refusal::kQueueDelay);
  EXPECT_EQ(refusal.retry_after_seconds, 1);
  EXPECT_EQ(q.queued(), 1);
}

}  // namespace
}  // namespace kvrelay::coordinator
