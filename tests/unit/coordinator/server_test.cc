// The HTTP server in one process: real sockets on 127.0.0.1, a fake backend.
#include "coordinator/http/server.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <future>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "common/http_client.h"
#include "coordinator/http/sse.h"
#include "tests/unit/coordinator/fakes.h"

namespace kvrelay::coordinator {
namespace {

using nlohmann::json;
using testing::ByteCodec;
using testing::FakeBackend;

// Every series of the server carries the model's name (#18).
const MetricLabels kModelLabel = {{"model_name", "test-model"}};

class ServerTest : public ::testing::Test {
 protected:
  void StartServer(ServerOptions options = {}, FakeBackend::Options backend_options = {}) {
    backend_ = std::make_unique<FakeBackend>(backend_options);
    options.port = 0;
    options.model_name = "test-model";
    if (options.header_timeout_ms == ServerOptions().header_timeout_ms)
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

  HttpCallResult Call(const std::string& method, const std::string& target,
                      const std::string& body = "",
                      std::vector<std::pair<std::string, std::string>> headers = {}) {
    HttpCallSpec spec;
    spec.method = method;
    spec.port = server_->port();
    spec.target = target;
    spec.body = body;
    spec.headers = std::move(headers);
    spec.timeout_ms = 10000;
    if (!body.empty()) spec.headers.push_back({"Content-Type", "application/json"});
    auto r = HttpCall(spec);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : HttpCallResult{};
  }
  json CallJson(const std::string& target, const json& body, int expect_status,
                std::vector<std::pair<std::string, std::string>> headers = {}) {
    HttpCallResult r = Call("POST", target, body.dump(), std::move(headers));
    EXPECT_EQ(r.status, expect_status) << r.body;
    return json::parse(r.body, nullptr, false);
  }
  // SSE data payloads of a streaming call.
  std::vector<std::string> CallStream(const std::string& target, const json& body,
                                      HttpCallResult* result = nullptr) {
    HttpCallResult r = Call("POST", target, body.dump());
    if (result) *result = r;
    SseParser parser;
    EXPECT_TRUE(parser.Feed(r.body));
    std::vector<std::string> events;
    while (auto e = parser.Next()) events.push_back(*e);
    return events;
  }

  // A raw connection that sends a request and is then held (or dropped).
  std::unique_ptr<boost::asio::ip::tcp::socket> SendRaw(const std::string& target,
                                                        const json& body) {
    auto sock = std::make_unique<boost::asio::ip::tcp::socket>(raw_ioc_);
    sock->connect({boost::asio::ip::make_address("127.0.0.1"), server_->port()});
    std::string b = body.dump();
    std::string req = "POST " + target +
                      " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
                      std::to_string(b.size()) + "\r\n\r\n" + b;
    boost::asio::write(*sock, boost::asio::buffer(req));
    return sock;
  }

  static json Chat(const std::string& content, int max_tokens = 64) {
    return json{{"model", "test-model"},
                {"messages", {{{"role", "user"}, {"content", content}}}},
                {"max_tokens", max_tokens}};
  }

  boost::asio::io_context raw_ioc_;
  ByteCodec codec_;
  MetricsRegistry metrics_;
  std::unique_ptr<FakeBackend> backend_;
  std::unique_ptr<Server> server_;
};

TEST_F(ServerTest, CorsHeadersOnlyWhenConfigured) {
  StartServer();
  HttpCallResult plain = Call("GET", "/v1/models");
  ASSERT_EQ(plain.status, 200);
  EXPECT_EQ(plain.headers.count("access-control-allow-origin"), 0u);
  server_->Stop();
  server_.reset();

  ServerOptions o;
  o.cors_allow_origin = "https://app.example";
  StartServer(o);
  HttpCallResult models = Call("GET", "/v1/models");
  ASSERT_EQ(models.status, 200);
  EXPECT_EQ(models.headers["access-control-allow-origin"], "https://app.example");
  EXPECT_EQ(models.headers["vary"], "Origin");
  // A browser's preflight for a JSON POST with an API key.
  HttpCallResult pre = Call("OPTIONS", "/v1/chat/completions", "",
                            {{"Origin", "https://app.example"},
                             {"Access-Control-Request-Method", "POST"},
                             {"Access-Control-Request-Headers", "authorization, content-type"}});
  EXPECT_EQ(pre.status, 204);
  EXPECT_EQ(pre.headers["access-control-allow-origin"], "https://app.example");
  EXPECT_EQ(pre.headers["access-control-allow-methods"], "POST, OPTIONS");
  EXPECT_NE(pre.headers["access-control-allow-headers"].find("Authorization"), std::string::npos);
  // Errors and streams carry it too.
  EXPECT_EQ(Call("GET", "/nowhere").headers["access-control-allow-origin"], "https://app.example");
  json req = Chat("hi");
  req["stream"] = true;
  HttpCallResult stream = Call("POST", "/v1/chat/completions", req.dump());
  EXPECT_EQ(stream.status, 200);
  EXPECT_EQ(stream.headers["access-control-allow-origin"], "https://app.example");
}

TEST_F(ServerTest, ModelsHealthAndMetrics) {
  StartServer();
  HttpCallResult models = Call("GET", "/v1/models");
  ASSERT_EQ(models.status, 200);
  json m = json::parse(models.body);
  EXPECT_EQ(m["object"], "list");
  EXPECT_EQ(m["data"][0]["id"], "test-model");
  EXPECT_EQ(Call("GET", "/health").status, 200);
  backend_->SetHealthy(false);
  HttpCallResult unhealthy = Call("GET", "/health");
  EXPECT_EQ(unhealthy.status, 503);
  EXPECT_NE(unhealthy.body.find("unhealthy"), std::string::npos);
  backend_->SetHealthy(true);

  CallJson("/v1/chat/completions", Chat("hi"), 200);
  HttpCallResult metrics = Call("GET", "/metrics");
  ASSERT_EQ(metrics.status, 200);
  EXPECT_NE(metrics.headers["content-type"].find("text/plain"), std::string::npos);
  for (const char* name :
       {"kvrelay_time_to_first_token_seconds_count{model_name=\"test-model\"} 1",
        "kvrelay_inter_token_latency_seconds_count{model_name=\"test-model\"} 12",
        "kvrelay_e2e_request_latency_seconds_count{model_name=\"test-model\"} 1",
        "kvrelay_generation_tokens_total{model_name=\"test-model\"} 13",
        "kvrelay_queue_depth{model_name=\"test-model\"} 0",
        "kvrelay_running_requests{model_name=\"test-model\"} 0",
        "kvrelay_worker_kv_utilization{model_name=\"test-model\",worker=\"fake-0\"} 0.25",
        "kvrelay_prefix_cache_hit_tokens_total", "kvrelay_worker_transfer_bytes",
        // #18: per-phase and per-request size histograms, llama.cpp-style throughput.
        "kvrelay_request_prefill_time_seconds_count{model_name=\"test-model\"} 1",
        "kvrelay_request_decode_time_seconds_count{model_name=\"test-model\"} 1",
        "kvrelay_request_prompt_tokens_count{model_name=\"test-model\"} 1",
        "kvrelay_request_generation_tokens_count{model_name=\"test-model\"} 1",
        "kvrelay_request_generation_tokens_bucket{model_name=\"test-model\",le=\"10\"} 0",
        "kvrelay_request_generation_tokens_bucket{model_name=\"test-model\",le=\"20\"} 1",
        "# TYPE kvrelay_prompt_tokens_per_second gauge",
        "# TYPE kvrelay_generation_tokens_per_second gauge"}) {
    EXPECT_NE(metrics.body.find(name), std::string::npos) << name << "\n" << metrics.body;
  }
  EXPECT_EQ(Call("POST", "/health").status, 405);
  EXPECT_EQ(Call("GET", "/v1/chat/completions").status, 405);
}

TEST_F(ServerTest, PromptArrayIsOneChoicePerPromptAndN) {
  FakeBackend::Options bo;
  bo.cached_tokens = 1;
  StartServer({}, bo);
  // Three prompts x n = 2: choices 2i and 2i + 1 answer prompt i; usage counts each prompt once.
  json c = CallJson("/v1/completions",
                    {{"model", "test-model"},
                     {"prompt", {"ab", "cde", "f"}},
                     {"n", 2},
                     {"max_tokens", 5},
                     {"seed", 3}},
                    200);
  ASSERT_EQ(c["choices"].size(), 6u);
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(c["choices"][i]["index"], i);
    EXPECT_EQ(c["choices"][i]["text"], "Hello");
  }
  EXPECT_EQ(c["usage"]["prompt_tokens"], 2 + 3 + 1);
  EXPECT_EQ(c["usage"]["completion_tokens"], 6 * 5);
  EXPECT_EQ(c["usage"]["prompt_tokens_details"]["cached_tokens"], 3);  // 1 per prompt
  auto sub = backend_->submitted();
  ASSERT_EQ(sub.size(), 6u);
  std::multiset<std::string> prompts;
  std::set<uint64_t> seeds;
  for (const auto& g : sub) {
    prompts.insert(std::string(g.prompt.begin(), g.prompt.end()));
    seeds.insert(g.sampling.seed);
  }
  EXPECT_EQ(prompts, (std::multiset<std::string>{"ab", "ab", "cde", "cde", "f", "f"}));
  EXPECT_EQ(seeds.size(), 6u);  // every choice samples on its own
  // Streamed: every chunk carries its choice index, each index ends once.
  json req = {
      {"model", "test-model"}, {"prompt", {"ab", "cde"}}, {"max_tokens", 3}, {"stream", true}};
  HttpCallResult st = Call("POST", "/v1/completions", req.dump());
  ASSERT_EQ(st.status, 200);
  std::map<int, int> finished;
  std::istringstream lines(st.body);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("data: {", 0) != 0) continue;
    json chunk = json::parse(line.substr(6));
    for (const auto& ch : chunk["choices"]) {
      if (!ch["finish_reason"].is_null()) ++finished[ch["index"].get<int>()];
    }
  }
  EXPECT_EQ(finished, (std::map<int, int>{{0, 1}, {1, 1}}));
}

TEST_F(ServerTest, NonStreamingChatAndCompletion) {
  FakeBackend::Options bo;
  bo.cached_tokens = 4;
  StartServer({}, bo);
  json r = CallJson("/v1/chat/completions", Chat("hi"), 200);
  EXPECT_EQ(r["object"], "chat.completion");
  EXPECT_EQ(r["model"], "test-model");
  EXPECT_EQ(r["id"].get<std::string>().rfind("chatcmpl-", 0), 0u);
  EXPECT_GT(r["created"].get<int64_t>(), 1600000000);
  EXPECT_EQ(r["choices"][0]["message"]["content"], "Hello, world!");
  EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
  // "user: hi\nassistant: " is 20 byte-tokens.
  EXPECT_EQ(r["usage"]["prompt_tokens"], 20);
  EXPECT_EQ(r["usage"]["completion_tokens"], 13);
  EXPECT_EQ(r["usage"]["total_tokens"], 33);
  EXPECT_EQ(r["usage"]["prompt_tokens_details"]["cached_tokens"], 4);
  auto sub = backend_->submitted();
  ASSERT_EQ(sub.size(), 1u);
  EXPECT_EQ(std::string(sub[0].prompt.begin(), sub[0].prompt.end()), "user: hi\nassistant: ");
  EXPECT_EQ(sub[0].sampling.max_tokens, 64);

  json c = CallJson("/v1/completions",
                    {{"model", "test-model"},
                     {"prompt", "abc"},
                     {"max_tokens", 5},
                     {"temperature", 0},
                     {"seed", 7}},
                    200);
  EXPECT_EQ(c["object"], "text_completion");
  EXPECT_EQ(c["choices"][0]["text"], "Hello");
  EXPECT_EQ(c["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(c["usage"]["prompt_tokens"], 3);
  sub = backend_->submitted();
  ASSERT_EQ(sub.size(), 2u);
  EXPECT_EQ(sub[1].sampling.temperature, 0.0f);
  EXPECT_EQ(sub[1].sampling.seed, 7u);
}

// n > 1: one backend request per choice (seeds s, s+1, ...), one response
// with choices indexed 0..n-1, completion tokens summed, prompt counted once.
TEST_F(ServerTest, NChoicesNonStreaming) {
  StartServer();
  json body = Chat("hi");
  body["n"] = 3;
  body["seed"] = 100;
  json r = CallJson("/v1/chat/completions", body, 200);
  ASSERT_EQ(r["choices"].size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(r["choices"][i]["index"], i);
    EXPECT_EQ(r["choices"][i]["message"]["content"], "Hello, world!");
    EXPECT_EQ(r["choices"][i]["finish_reason"], "stop");
  }
  EXPECT_EQ(r["usage"]["prompt_tokens"], 20);
  EXPECT_EQ(r["usage"]["completion_tokens"], 3 * 13);
  auto sub = backend_->submitted();
  ASSERT_EQ(sub.size(), 3u);
  std::set<uint64_t> seeds, ids;
  for (const auto& g : sub) {
    seeds.insert(g.sampling.seed);
    ids.insert(g.id);
  }
  EXPECT_EQ(seeds, (std::set<uint64_t>{100, 101, 102}));
  EXPECT_EQ(ids.size(), 3u);
}

TEST_F(ServerTest, NChoicesStreamingIndexesEveryChunkAndEndsOnce) {
  StartServer();
  json body = Chat("hi");
  body["n"] = 2;
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  HttpCallResult raw;
  auto events = CallStream("/v1/chat/completions", body, &raw);
  EXPECT_EQ(raw.status, 200);
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events.back(), "[DONE]");
  EXPECT_EQ(std::count(events.begin(), events.end(), "[DONE]"), 1);
  std::map<int, std::string> text;
  std::map<int, int> finishes;
  for (size_t i = 0; i + 2 < events.size(); ++i) {
    json e = json::parse(events[i]);
    ASSERT_EQ(e["choices"].size(), 1u) << events[i];
    const int index = e["choices"][0]["index"];
    if (e["choices"][0]["delta"].contains("content")) {
      text[index] += e["choices"][0]["delta"]["content"].get<std::string>();
    }
    if (!e["choices"][0]["finish_reason"].is_null()) ++finishes[index];
  }
  EXPECT_EQ(text[0], "Hello, world!");
  EXPECT_EQ(text[1], "Hello, world!");
  EXPECT_EQ(finishes[0], 1);
  EXPECT_EQ(finishes[1], 1);
  json usage = json::parse(events[events.size() - 2]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 26);
}

// Without a seed every request still gets one, so a cluster backend (which
// would otherwise use seed 0) samples differently per request.
TEST_F(ServerTest, UnseededRequestsGetDistinctSeeds) {
  StartServer();
  CallJson("/v1/chat/completions", Chat("a"), 200);
  CallJson("/v1/chat/completions", Chat("b"), 200);
  auto sub = backend_->submitted();
  ASSERT_EQ(sub.size(), 2u);
  EXPECT_NE(sub[0].sampling.seed, sub[1].sampling.seed);
}

TEST_F(ServerTest, StopStringEndsGenerationAndCancelsBackend) {
  StartServer();
  json body = Chat("hi");
  body["stop"] = {", w"};
  json r = CallJson("/v1/chat/completions", body, 200);
  EXPECT_EQ(r["choices"][0]["message"]["content"], "Hello");
  EXPECT_EQ(r["choices"][0]["finish_reason"], "stop");
  auto sub = backend_->submitted();
  ASSERT_EQ(sub.size(), 1u);
  EXPECT_TRUE(backend_->WaitForCancel(sub[0].id));
}

TEST_F(ServerTest, StreamingChatWithUsageAndDone) {
  FakeBackend::Options bo;
  bo.reply =
      "h\xC3\xA9llo \xE4\xBD\xA0\xE5\xA5\xBD";  // "héllo 你好": multi-byte chars split over tokens
  StartServer({}, bo);
  json body = Chat("hi");
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  HttpCallResult raw;
  auto events = CallStream("/v1/chat/completions", body, &raw);
  EXPECT_EQ(raw.status, 200);
  EXPECT_EQ(raw.headers["content-type"], "text/event-stream");
  EXPECT_EQ(raw.headers["transfer-encoding"], "chunked");
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events.back(), "[DONE]");
  std::string text;
  std::string id;
  for (size_t i = 0; i + 3 < events.size(); ++i) {
    json e = json::parse(events[i]);
    EXPECT_EQ(e["object"], "chat.completion.chunk");
    if (i == 0) {
      EXPECT_EQ(e["choices"][0]["delta"]["role"], "assistant");
      id = e["id"];
    }
    EXPECT_EQ(e["id"], id);
    EXPECT_TRUE(e["choices"][0]["finish_reason"].is_null());
    std::string piece = e["choices"][0]["delta"]["content"];
    EXPECT_EQ(piece.find("\xEF\xBF\xBD"), std::string::npos) << "a character was split";
    text += piece;
  }
  EXPECT_EQ(text, bo.reply);
  json fin = json::parse(events[events.size() - 3]);
  EXPECT_EQ(fin["choices"][0]["finish_reason"], "stop");
  json usage = json::parse(events[events.size() - 2]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], static_cast<int>(bo.reply.size()));
  EXPECT_EQ(usage["usage"]["prompt_tokens"], 20);
}

TEST_F(ServerTest, StreamingCompletionWithoutUsage) {
  StartServer();
  auto events =
      CallStream("/v1/completions",
                 {{"model", "test-model"}, {"prompt", "x"}, {"max_tokens", 3}, {"stream", true}});
  ASSERT_EQ(events.size(), 5u);  // 3 tokens, finish chunk, [DONE]
  std::string text;
  for (int i = 0; i < 3; ++i)
    text += json::parse(events[i])["choices"][0]["text"].get<std::string>();
  EXPECT_EQ(text, "Hel");
  json fin = json::parse(events[3]);
  EXPECT_EQ(fin["object"], "text_completion");
  EXPECT_EQ(fin["choices"][0]["finish_reason"], "length");
  EXPECT_FALSE(fin.contains("usage"));
  EXPECT_EQ(events[4], "[DONE]");
}

TEST_F(ServerTest, StreamIsDeliveredIncrementally) {
  FakeBackend::Options bo;
  bo.reply = "0123456789";
  bo.token_interval = std::chrono::milliseconds(30);
  StartServer({}, bo);
  json body = Chat("hi");
  body["stream"] = true;
  HttpCallSpec spec;
  spec.method = "POST";
  spec.port = server_->port();
  spec.target = "/v1/chat/completions";
  spec.body = body.dump();
  int reads = 0;
  std::string all;
  auto r = HttpCall(spec, [&](std::string_view bytes) {
    ++reads;
    all.append(bytes);
    return true;
  });
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_NE(all.find("[DONE]"), std::string::npos);
  // Ten tokens 30 ms apart: the server flushes each and the client hands each
  // over as it arrives, not once at the end.
  EXPECT_GE(reads, 3);
}

TEST_F(ServerTest, ClientDisconnectMidStreamCancelsRequest) {
  ServerOptions o;
  o.max_running = 1;
  StartServer(o);
  backend_->SetHang(true);
  json body = Chat("hi");
  body["stream"] = true;
  auto sock = SendRaw("/v1/chat/completions", body);
  ASSERT_TRUE(backend_->WaitForSubmits(1));
  // The response header arrives before any token.
  char buf[256];
  size_t n = sock->read_some(boost::asio::buffer(buf));
  EXPECT_NE(std::string(buf, n).find("text/event-stream"), std::string::npos);
  uint64_t id = backend_->submitted()[0].id;
  EXPECT_TRUE(backend_->cancelled().empty());
  sock->close();
  ASSERT_TRUE(backend_->WaitForCancel(id));
  // The admission slot came back: with max_running=1 a new request is served.
  backend_->SetHang(false);
  json r = CallJson("/v1/chat/completions", Chat("again", 2), 200);
  EXPECT_EQ(r["choices"][0]["message"]["content"], "He");
}

// A client that leaves while 3 choices run cancels all of them, and their
// admission slots come back (max_running = 3, then a new request is served).
TEST_F(ServerTest, ClientDisconnectCancelsEveryChoice) {
  ServerOptions o;
  o.max_running = 3;
  StartServer(o);
  backend_->SetHang(true);
  json body = Chat("hi");
  body["n"] = 3;
  auto sock = SendRaw("/v1/chat/completions", body);
  ASSERT_TRUE(backend_->WaitForSubmits(3));
  sock->close();
  for (const auto& g : backend_->submitted()) ASSERT_TRUE(backend_->WaitForCancel(g.id));
  backend_->SetHang(false);
  json r = CallJson("/v1/chat/completions", Chat("again", 2), 200);
  EXPECT_EQ(r["choices"][0]["message"]["content"], "He");
}

// One choice failing fails the response and cancels the other choices.
TEST_F(ServerTest, OneFailedChoiceFailsTheResponse) {
  StartServer();
  backend_->SetFailAfter(3);
  json body = Chat("hi");
  body["n"] = 2;
  json r = CallJson("/v1/chat/completions", body, 500);
  EXPECT_TRUE(r.contains("error")) << r.dump();
}

TEST_F(ServerTest, ClientDisconnectDuringNonStreamingRequestCancels) {
  StartServer();
  backend_->SetHang(true);
  auto sock = SendRaw("/v1/completions", {{"model", "test-model"}, {"prompt", "x"}});
  ASSERT_TRUE(backend_->WaitForSubmits(1));
  sock->close();
  ASSERT_TRUE(backend_->WaitForCancel(backend_->submitted()[0].id));
}

TEST_F(ServerTest, QueueFullGets429WithRetryAfterAndQueuedRequestsRun) {
  ServerOptions o;
  o.max_running = 1;
  o.max_queue = 1;
  o.retry_after_seconds = 3;
  StartServer(o);
  backend_->SetHang(true);
  auto first = SendRaw("/v1/chat/completions", Chat("one", 2));  // running
  ASSERT_TRUE(backend_->WaitForSubmits(1));
  auto queued = std::async(std::launch::async, [&] {  // waits in the queue
    return Call("POST", "/v1/chat/completions", Chat("two", 2).dump());
  });
  // Wait until the second request is queued (bounded by the test timeout).
  for (int i = 0; i < 500 && metrics_.GetGauge("kvrelay_queue_depth", "", kModelLabel)->value() < 1;
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(metrics_.GetGauge("kvrelay_queue_depth", "", kModelLabel)->value(), 1);
  HttpCallResult refused = Call("POST", "/v1/chat/completions", Chat("three").dump());
  EXPECT_EQ(refused.status, 429);
  EXPECT_EQ(refused.headers["retry-after"], "3");
  json err = json::parse(refused.body);
  EXPECT_EQ(err["error"]["code"], "queue_full");
  EXPECT_EQ(backend_->submitted().size(), 1u);  // the refused one never reached the backend
  backend_->SetHang(false);
  HttpCallResult second = queued.get();
  EXPECT_EQ(second.status, 200);
  EXPECT_EQ(json::parse(second.body)["choices"][0]["message"]["content"], "He");
}

TEST_F(ServerTest, QueuedRequestOutlivesTheHeaderTimeout) {
  ServerOptions o;
  o.max_running = 1;
  o.header_timeout_ms = 200;  // reading a request; must not cut a queued one
  StartServer(o);
  backend_->SetHang(true);
  auto first = SendRaw("/v1/chat/completions", Chat("one", 2));
  ASSERT_TRUE(backend_->WaitForSubmits(1));
  auto queued = std::async(std::launch::async, [&] {
    return Call("POST", "/v1/chat/completions", Chat("two", 2).dump());
  });
  // Three header timeouts pass while the second request waits for a slot.
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  EXPECT_EQ(metrics_.GetGauge("kvrelay_queue_depth", "", kModelLabel)->value(), 1);
  backend_->SetHang(false);
  HttpCallResult second = queued.get();
  EXPECT_EQ(second.status, 200);
  EXPECT_EQ(backend_->submitted().size(), 2u);
}

TEST_F(ServerTest, ApiKeysAuthenticateAndSaltPerTenant) {
  ServerOptions o;
  o.api_keys.Add("sk-alice", "alice");
  o.api_keys.Add("sk-bob", "bob");
  o.prefix_hasher = [](std::span<const int32_t> tokens, std::string_view salt) {
    PrefixBlockHash h{};
    h[0] = static_cast<uint8_t>(tokens.size());
    h[1] = salt.empty() ? 0 : static_cast<uint8_t>(salt[0]);
    return std::vector<PrefixBlockHash>{h};
  };
  StartServer(o);
  json missing = CallJson("/v1/chat/completions", Chat("hi"), 401);
  EXPECT_EQ(missing["error"]["code"], "invalid_api_key");
  EXPECT_NE(missing["error"]["message"].get<std::string>().find("Authorization"),
            std::string::npos);
  CallJson("/v1/chat/completions", Chat("hi"), 401, {{"Authorization", "Bearer sk-mallory"}});
  CallJson("/v1/chat/completions", Chat("hi"), 401, {{"Authorization", "sk-alice"}});
  EXPECT_EQ(Call("GET", "/v1/models").status, 401);
  EXPECT_EQ(Call("GET", "/health").status, 200);  // probes need no key
  CallJson("/v1/chat/completions", Chat("hi"), 200, {{"Authorization", "Bearer sk-alice"}});
  CallJson("/v1/chat/completions", Chat("hi"), 200, {{"Authorization", "Bearer sk-bob"}});
  auto sub = backend_->submitted();
  ASSERT_EQ(sub.size(), 2u);
  EXPECT_EQ(sub[0].tenant_salt, "alice");
  EXPECT_EQ(sub[1].tenant_salt, "bob");
  ASSERT_EQ(sub[0].prefix_blocks.size(), 1u);
  EXPECT_EQ(sub[0].prefix_blocks[0][1], 'a');
  EXPECT_EQ(sub[1].prefix_blocks[0][1], 'b');
  EXPECT_NE(sub[0].prefix_blocks[0], sub[1].prefix_blocks[0]);
}

TEST_F(ServerTest, ClientErrors) {
  ServerOptions o;
  o.max_body_bytes = 1024;
  o.max_prompt_tokens = 30;
  StartServer(o);
  json unknown =
      CallJson("/v1/chat/completions",
               {{"model", "gpt-4"}, {"messages", {{{"role", "user"}, {"content", "x"}}}}}, 404);
  EXPECT_EQ(unknown["error"]["code"], "model_not_found");
  EXPECT_EQ(unknown["error"]["param"], "model");
  EXPECT_EQ(Call("GET", "/v2/nothing").status, 404);

  HttpCallResult big = Call("POST", "/v1/chat/completions", Chat(std::string(4096, 'x')).dump());
  EXPECT_EQ(big.status, 413);
  // #18: a context overflow is a 400 (context_length_exceeded), as OpenAI answers it.
  json prompt_big = CallJson("/v1/chat/completions", Chat(std::string(100, 'x')), 400);
  EXPECT_EQ(prompt_big["error"]["code"], "context_length_exceeded");

  HttpCallResult malformed = Call("POST", "/v1/chat/completions", "{\"model\": ");
  EXPECT_EQ(malformed.status, 400);
  EXPECT_NE(malformed.body.find("not valid JSON"), std::string::npos);
  json bad_type = CallJson("/v1/chat/completions",
                           {{"model", "test-model"},
                            {"messages", {{{"role", "user"}, {"content", "x"}}}},
                            {"temperature", "x"}},
                           400);
  EXPECT_EQ(bad_type["error"]["param"], "temperature");
  EXPECT_EQ(bad_type["error"]["type"], "invalid_request_error");
  EXPECT_TRUE(backend_->submitted().empty());
  EXPECT_EQ(Call("GET", "/health").status, 200);  // the server survived all of it
}

TEST_F(ServerTest, BackendRefusalIs503AndFailureIs500) {
  StartServer();
  backend_->SetSubmitStatus(ResourceExhausted("no KV blocks"));
  HttpCallResult r = Call("POST", "/v1/chat/completions", Chat("hi").dump());
  EXPECT_EQ(r.status, 503);
  EXPECT_EQ(json::parse(r.body)["error"]["code"], "no_capacity");
  EXPECT_FALSE(r.headers["retry-after"].empty());
  backend_->SetSubmitStatus(Status::Ok());
  backend_->SetFailAfter(2);
  json err = CallJson("/v1/chat/completions", Chat("hi"), 500);
  EXPECT_NE(err["error"]["message"].get<std::string>().find("injected failure"), std::string::npos);
  // Streaming: the error arrives as an SSE error event, then [DONE].
  json body = Chat("hi");
  body["stream"] = true;
  auto events = CallStream("/v1/chat/completions", body);
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events.back(), "[DONE]");
  EXPECT_TRUE(json::parse(events[events.size() - 2]).contains("error"));
}

TEST_F(ServerTest, ManyConcurrentStreamsAllComplete) {
  ServerOptions o;
  o.max_running = 4;
  o.max_queue = 64;
  o.threads = 2;
  StartServer(o);
  std::vector<std::future<std::string>> futures;
  for (int i = 0; i < 16; ++i) {
    futures.push_back(std::async(std::launch::async, [&] {
      json body = Chat("hi");
      body["stream"] = true;
      std::string text;
      for (const auto& e : CallStream("/v1/chat/completions", body)) {
        if (e == "[DONE]") break;
        json j = json::parse(e);
        if (!j["choices"].empty() && j["choices"][0]["delta"].contains("content")) {
          text += j["choices"][0]["delta"]["content"].get<std::string>();
        }
      }
      return text;
    }));
  }
  for (auto& f : futures) EXPECT_EQ(f.get(), "Hello, world!");
  EXPECT_EQ(backend_->active(), 0u);
}

}  // namespace
}  // namespace kvrelay::coordinator
