// The coordinator's HTTP edge as a fuzz target (issue #14): bytes as a client
// sends them on one connection, through the server's own request reading
// (coordinator/http/http_request.h: the Beast parser under the server's limits,
// its header checks, its answer to a failed read, its routing), and each
// request body through the OpenAI JSON mapping (ParseCompletionRequest for
// /v1/chat/completions or /v1/completions: messages, prompts, sampling
// fields, stop, logit_bias, response_format with its schema compiled, tools
// and tool_choice), and the error answers through the JSON the server writes.
//
// Input: byte 0 selects how the stream is cut into reads (as TCP delivers
// it), which endpoint a body goes to when the path names neither, and the
// limits (the server's defaults or small ones, so the 413 / 431 paths are
// reached); the rest is the connection's bytes, requests back to back.
//
// Invariants (abort when broken): no crash, leak or UB (ASan/UBSan); every
// refusal is a 4xx with a message and closes when the framing is not
// trusted; a delivered body never exceeds the body limit and, without
// chunked coding, has exactly its Content-Length; an accepted generation
// request respects ApiLimits (n, prompts x n, stop strings, max_tokens,
// temperature, top_p) and names the endpoint it was parsed for.
#include <algorithm>
#include <boost/beast/http/error.hpp>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

#include "coordinator/http/http_request.h"
#include "coordinator/openai/openai_api.h"
#include "fuzz_targets.h"

namespace kvrelay::fuzz {
namespace {

namespace http = boost::beast::http;
using coordinator::ApiError;
using coordinator::CompletionParams;
using coordinator::Endpoint;
using coordinator::HttpError;
using coordinator::RequestLimits;
using coordinator::RequestParser;

constexpr int kMaxRequestsPerInput = 16;

void Check(bool ok) {
  if (!ok) std::abort();
}

// What the server does with an error: the status it answers and the body it
// serializes (DumpJson replaces invalid UTF-8 from the input).
void Answer(const ApiError& e) {
  Check(e.http_status >= 400 && e.http_status < 500);
  Check(!e.message.empty());
  Check(!coordinator::DumpJson(coordinator::ErrorToJson(e)).empty());
}

void CheckAccepted(const CompletionParams& p, Endpoint endpoint,
                   const coordinator::ApiLimits& limits) {
  Check(p.endpoint == endpoint);
  Check(p.n >= 1 && p.n <= limits.max_n);
  Check(p.batch_size() * p.n <= limits.max_n);
  Check(static_cast<int>(p.stop.size()) <= limits.max_stop_strings);
  for (const std::string& s : p.stop) {
    Check(!s.empty() && static_cast<int>(s.size()) <= limits.max_stop_string_bytes);
  }
  if (p.max_tokens_given) Check(p.max_tokens >= 1 && p.max_tokens <= limits.max_tokens_limit);
  Check(p.sampling.temperature >= 0.0f && p.sampling.temperature <= 2.0f);
  Check(p.sampling.top_p > 0.0f && p.sampling.top_p <= 1.0f);
  if (endpoint == Endpoint::kChatCompletions) Check(!p.messages.empty());
}

// One delivered request, as Session::Handle and HandleCompletion take it.
void HandleBody(const http::request<http::string_body>& req, Endpoint fallback) {
  const std::string_view path =
      coordinator::RequestPath(std::string_view(req.target().data(), req.target().size()));
  const Endpoint endpoint = coordinator::CompletionEndpoint(path).value_or(fallback);
  const coordinator::ApiLimits limits;
  CompletionParams params;
  if (auto err = coordinator::ParseCompletionRequest(endpoint, req.body(), limits, &params)) {
    return Answer(*err);
  }
  CheckAccepted(params, endpoint, limits);
  if (params.tool_choice != coordinator::ToolChoice::kNone) {
    // The answer side of tools: the model's text (here the body) read for calls.
    const nlohmann::json calls =
        coordinator::ExtractToolCalls(req.body(), params.tool_choice, "fuzz");
    Check(!coordinator::DumpJson(calls).empty());
  }
}

}  // namespace

int FuzzHttpRequest(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  const std::string_view stream(reinterpret_cast<const char*>(data) + 1, size - 1);
  const Endpoint fallback = (mode & 4) ? Endpoint::kCompletions : Endpoint::kChatCompletions;
  RequestLimits limits;  // the server's defaults
  if (mode & 8) limits = RequestLimits{512, 256};
  // Reads of 1..N bytes (N from the mode), as a socket may deliver them.
  const size_t max_read = (mode & 3) == 0 ? stream.size() + 1 : size_t{1} << (2 * (mode & 3));

  std::string buffer;  // received and not yet consumed (the session's flat_buffer)
  size_t pos = 0;
  for (int request = 0; request < kMaxRequestsPerInput; ++request) {
    RequestParser parser;
    coordinator::ConfigureRequestParser(limits, &parser);
    boost::beast::error_code ec;
    bool header_checked = false;
    bool need_more = buffer.empty();
    int idle_puts = 0;
    // Beast's read loop (http::async_read_header, then http::async_read):
    // put what is buffered; need_more reads again; the peer's end is put_eof
    // once the parser got some of a message, else end_of_stream.
    while (!parser.is_done()) {
      if (need_more) {
        if (pos == stream.size()) {
          if (parser.got_some()) {
            parser.put_eof(ec);
            if (!ec) Check(parser.is_done());
          } else {
            ec = http::error::end_of_stream;
          }
          break;
        }
        const size_t n = std::min(max_read, stream.size() - pos);
        buffer.append(stream.substr(pos, n));
        pos += n;
        need_more = false;
      }
      const bool header_was_done = parser.is_header_done();
      const size_t used = parser.put(boost::asio::buffer(buffer.data(), buffer.size()), ec);
      buffer.erase(0, used);
      if (ec == http::error::need_more) {
        ec = {};
        need_more = true;
      } else if (ec) {
        break;
      } else if (used == 0 && header_was_done == parser.is_header_done() && !parser.is_done() &&
                 !buffer.empty()) {
        // A put that neither consumes nor advances nor asks for more: the
        // server's read would spin on it.
        Check(++idle_puts < 4);
      } else {
        idle_puts = 0;
      }
      if (buffer.empty()) need_more = true;  // read_some reads when nothing is buffered
      if (parser.is_header_done() && !header_checked) {
        header_checked = true;
        if (auto err = coordinator::CheckRequestHeader(parser.get())) {
          Check(err->close);
          Answer(err->api);
          return 0;  // the server answers and closes
        }
      }
    }
    if (ec) {
      if (auto err = coordinator::ReadError(ec, limits)) {
        Check(err->close);
        Answer(err->api);
      }
      return 0;
    }
    const auto& req = parser.get();
    Check(req.body().size() <= limits.max_body_bytes);
    if (!parser.chunked() && parser.content_length()) {
      Check(req.body().size() == *parser.content_length());
    }
    HandleBody(req, fallback);
    if (!req.keep_alive()) return 0;
    if (pos == stream.size() && buffer.empty()) return 0;
  }
  return 0;
}

std::vector<std::string> HttpRequestSeeds() {
  auto post = [](std::string path, std::string body, std::string extra = "") {
    return "POST " + path + " HTTP/1.1\r\nHost: c\r\nContent-Type: application/json\r\n" + extra +
           "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  };
  auto chunked = [](std::string path, std::string body, std::string te = "chunked") {
    std::string out =
        "POST " + path + " HTTP/1.1\r\nHost: c\r\nTransfer-Encoding: " + te + "\r\n\r\n";
    for (size_t i = 0; i < body.size(); i += 17) {
      const std::string piece = body.substr(i, 17);
      char len[16];
      std::snprintf(len, sizeof(len), "%zx", piece.size());
      out += std::string(len) + "\r\n" + piece + "\r\n";
    }
    return out + "0\r\n\r\n";
  };
  const std::string chat =
      R"({"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"hi"}],)"
      R"("max_tokens":8,"temperature":0.7,"top_p":0.9,"stop":["\n","END"],"n":2,"seed":3,)"
      R"("stream":true,"stream_options":{"include_usage":true},"logprobs":true,"top_logprobs":2})";
  const std::string parts =
      R"({"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},)"
      R"({"type":"text","text":"b"}]}],"max_completion_tokens":4,"logit_bias":{"12":-100}})";
  const std::string tools =
      R"({"model":"m","messages":[{"role":"user","content":"weather?"}],"tools":[{"type":"function",)"
      R"("function":{"name":"get_weather","description":"d","parameters":{"type":"object",)"
      R"("properties":{"city":{"type":"string"},"days":{"type":"integer"}},"required":["city"]}}}],)"
      R"("tool_choice":"required"})";
  const std::string named =
      R"({"model":"m","messages":[{"role":"user","content":"x"},{"role":"assistant","content":null,)"
      R"("tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]},)"
      R"({"role":"tool","tool_call_id":"c1","content":"42"}],"tools":[{"type":"function",)"
      R"("function":{"name":"f","parameters":{"type":"object","properties":{}}}}],)"
      R"("tool_choice":{"type":"function","function":{"name":"f"}}})";
  const std::string schema =
      R"({"model":"m","messages":[{"role":"user","content":"json"}],"response_format":)"
      R"({"type":"json_schema","json_schema":{"name":"r","strict":true,"schema":{"type":"object",)"
      R"("properties":{"a":{"type":"array","items":{"enum":["x","y"]},"maxItems":3},)"
      R"("b":{"type":"number"},"c":{"type":"boolean"}},)"
      R"("required":["a"],"additionalProperties":false}}}})";
  const std::string json_object =
      R"({"model":"m","messages":[{"role":"user","content":"j"}],"response_format":{"type":"json_object"}})";
  const std::string completion =
      R"({"model":"m","prompt":"Once upon","max_tokens":5,"echo":true,"stop":"\n","top_k":40,)"
      R"("min_p":0.05,"repetition_penalty":1.1,"presence_penalty":0.5,"frequency_penalty":-0.5})";
  const std::string batch =
      R"({"model":"m","prompt":[[1,2,3],[4,5]],"n":2,"logprobs":3,"best_of":1,"ignore_eos":true})";
  const std::string prompts = R"({"model":"m","prompt":["a","b","c"],"suffix":null})";
  const std::string chat_path = "/v1/chat/completions", cmpl_path = "/v1/completions";
  // byte 0 = the mode (see FuzzHttpRequest); 0 = one read, 1 = reads of 4 bytes.
  std::vector<std::string> s = {
      std::string(1, '\0') + post(chat_path, chat),
      std::string(1, '\1') + post(chat_path, parts, "Expect: 100-continue\r\n"),
      std::string(1, '\0') + post(chat_path, tools),
      std::string(1, '\2') + post(chat_path, named),
      std::string(1, '\0') + post(chat_path, schema),
      std::string(1, '\0') + post("http://c:8000/v1/chat/completions?x=1", json_object),
      std::string(1, '\0') + post(cmpl_path, completion),
      std::string(1, '\0') + post(cmpl_path, batch) + post(cmpl_path, prompts),
      std::string(1, '\1') + chunked(chat_path, chat),
      std::string(1, '\0') + chunked(cmpl_path, completion, " Chunked "),
      // The malformed Transfer-Encoding cases of the issue.
      // The issue's: a body that is itself a request, behind codings the
      // server must refuse rather than read the body as the next request.
      std::string(1, '\0') +
          "POST /v1/completions HTTP/1.1\r\nHost: c\r\nTransfer-Encoding: "
          "xchunked\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: c\r\n\r\n",
      std::string(1, '\0') + chunked(chat_path, chat, "gzip"),
      std::string(1, '\0') + chunked(chat_path, chat, "chunked, identity"),
      std::string(1, '\0') + chunked(chat_path, chat, "gzip, chunked"),
      std::string(1, '\0') + chunked(chat_path, chat, "chunked, gzip"),
      std::string(1, '\0') + chunked(chat_path, chat, "identity"),
      std::string(1, '\0') + chunked(chat_path, chat, "chunked\r\nTransfer-Encoding: chunked"),
      std::string(1, '\0') + chunked(chat_path, chat, "chunked\r\nContent-Length: 3"),
      std::string(1, '\0') +
          "POST /v1/completions HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n"
          "5\r\nhello\r\n0\r\n\r\n",
      std::string(1, '\0') + post(chat_path, chat, "Transfer-Encoding: chunked\r\n"),
      std::string(1, '\0') +
          "POST /v1/completions HTTP/1.1\r\nHost: c\r\nContent-Length: 4\r\n"
          "Content-Length: 5\r\n\r\nabcde",
      std::string(1, '\0') + "POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}",
      std::string(1, '\0') + post(chat_path, chat, "Expect: 200-ok\r\n"),
      // Past the small limits (mode 8): a 413 and a 431.
      std::string(1, '\x08') + post(chat_path, std::string(600, ' ') + chat),
      std::string(1, '\x08') + post(chat_path, chat, "X-Pad: " + std::string(300, 'p') + "\r\n"),
      std::string(1, '\0') +
          "GET /health HTTP/1.1\r\nHost: c\r\n\r\nGET /v1/models HTTP/1.1\r\n"
          "Host: c\r\nConnection: close\r\n\r\n",
      std::string(1, '\0') + post(chat_path, R"({"model":"m","messages":[],"n":99,"bogus":1})"),
      std::string(1, '\0') + post(chat_path, std::string(80, '[') + std::string(80, ']')),
  };
  return s;
}

}  // namespace kvrelay::fuzz

#ifdef KVRELAY_LIBFUZZER_ENTRY
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return kvrelay::fuzz::FuzzHttpRequest(data, size);
}
#endif
