// kvrelay bench serve: an open-loop load generator for any OpenAI-compatible
// server. Requests arrive as a seeded Poisson process, stream their output,
// and are timed per token:
//   TTFT  time to the first streamed text;   ITL  gaps between text chunks;
//   TPOT  (e2e - TTFT) / (output tokens - 1); E2E  request start to [DONE].
// Prompts are token-id lists (exact lengths, no tokenizer needed here), with
// an optional prefix of --shared-prefix tokens common to every prompt (or, with
// --prefix-groups G, one of G such prefixes picked at random per prompt).
// With --trace FILE (the cluster simulator's trace format, sim/workload.h)
// it replays that file's arrival times, prompt and output lengths and prefix
// groups instead.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cli/command.h"
#include "common/clock.h"
#include "common/flags.h"
#include "common/http_client.h"
#include "coordinator/http/sse.h"
#include "sim/workload.h"

namespace kvrelay::cli {
namespace {

using nlohmann::json;

struct RequestOutcome {
  bool ok = false;
  int http_status = 0;       // 0: no HTTP response
  bool retry_after = false;  // a refusal carried Retry-After
  std::string error;
  double start_s = 0;  // since the benchmark start
  double ttft_s = 0;
  double e2e_s = 0;
  int output_tokens = 0;
  int prompt_tokens = 0;
  int cached_tokens = 0;
  std::vector<double> itl_s;
};

struct Stats {
  double mean = 0, p50 = 0, p90 = 0, p99 = 0;
};

// Linear interpolation between closest ranks (numpy's default).
double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  double pos = q / 100.0 * static_cast<double>(v.size() - 1);
  size_t lo = static_cast<size_t>(std::floor(pos));
  size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

Stats Summarize(const std::vector<double>& v_ms) {
  Stats s;
  if (v_ms.empty()) return s;
  double sum = 0;
  for (double x : v_ms) sum += x;
  s.mean = sum / static_cast<double>(v_ms.size());
  s.p50 = Percentile(v_ms, 50);
  s.p90 = Percentile(v_ms, 90);
  s.p99 = Percentile(v_ms, 99);
  return s;
}

json StatsJson(const Stats& s) {
  return json{{"mean", s.mean}, {"p50", s.p50}, {"p90", s.p90}, {"p99", s.p99}};
}

RequestOutcome RunOne(const HttpUrl& url, const std::string& api_key, const json& body,
                      int timeout_ms, TimePoint bench_start) {
  RequestOutcome out;
  TimePoint start = Clock::now();
  out.start_s = std::chrono::duration<double>(start - bench_start).count();
  HttpCallSpec spec;
  spec.method = "POST";
  spec.host = url.host;
  spec.port = url.port;
  spec.target = url.path + "/v1/completions";
  spec.body = body.dump();
  spec.headers = {{"Content-Type", "application/json"}, {"Accept", "text/event-stream"}};
  if (!api_key.empty()) spec.headers.push_back({"Authorization", "Bearer " + api_key});
  spec.timeout_ms = timeout_ms;

  coordinator::SseParser parser;
  std::optional<TimePoint> last_chunk;
  bool done = false;
  std::string error;
  std::string raw_prefix;  // the start of a non-SSE (error) body
  auto on_body = [&](std::string_view bytes) {
    if (raw_prefix.size() < 2048) raw_prefix.append(bytes.substr(0, 2048 - raw_prefix.size()));
    if (!parser.Feed(bytes)) {
      error = "SSE event too large";
      return false;
    }
    while (auto ev = parser.Next()) {
      TimePoint now = Clock::now();
      if (*ev == "[DONE]") {
        done = true;
        continue;
      }
      json j = json::parse(*ev, nullptr, false);
      if (j.is_discarded()) {
        error = "bad JSON in stream";
        return false;
      }
      if (j.contains("error")) {
        error = j["error"].value("message", "error event");
        continue;
      }
      if (j.contains("usage") && j["usage"].is_object()) {
        out.output_tokens = j["usage"].value("completion_tokens", 0);
        out.prompt_tokens = j["usage"].value("prompt_tokens", 0);
        if (j["usage"].contains("prompt_tokens_details") &&
            j["usage"]["prompt_tokens_details"].is_object()) {
          out.cached_tokens = j["usage"]["prompt_tokens_details"].value("cached_tokens", 0);
        }
      }
      if (!j.contains("choices") || !j["choices"].is_array() || j["choices"].empty()) continue;
      const json& c = j["choices"][0];
      bool has_text =
          c.contains("text") && c["text"].is_string() && !c["text"].get<std::string>().empty();
      if (!has_text) continue;
      if (!last_chunk) {
        out.ttft_s = std::chrono::duration<double>(now - start).count();
      } else {
        out.itl_s.push_back(std::chrono::duration<double>(now - *last_chunk).count());
      }
      last_chunk = now;
    }
    return true;
  };
  auto result = HttpCall(spec, on_body);
  out.e2e_s = SecondsSince(start);
  if (!result.ok()) {
    out.error = error.empty() ? result.status().ToString() : error;
    return out;
  }
  out.http_status = result->status;
  out.retry_after = result->headers.count("retry-after") > 0;
  if (result->status != 200) {
    out.error = "HTTP " + std::to_string(result->status) + ": " + raw_prefix.substr(0, 300);
    return out;
  }
  if (!error.empty()) {
    out.error = error;
    return out;
  }
  if (!done || !last_chunk) {
    out.error = done ? "no tokens streamed" : "stream ended without [DONE]";
    return out;
  }
  if (out.output_tokens == 0) out.output_tokens = static_cast<int>(out.itl_s.size()) + 1;
  out.ok = true;
  return out;
}

const FlagSpec kSpec = {
    "kvrelay bench serve",
    "Load test of a running OpenAI-compatible server (random-token prompts, streamed chat\n"
    "completions): throughput, TTFT, TPOT and goodput against the SLOs.",
    "",
    0,
    {{"url", "http://127.0.0.1:8080", "server base URL"},
     {"model", "", "model name (default: the server's first /v1/models entry)"},
     {"api-key", "", "bearer token"},
     {"rate", "inf", "requests per second, Poisson arrivals (inf = all at once)"},
     {"num-prompts", "100", "requests to send"},
     {"input-len", "128", "prompt tokens per request"},
     {"output-len", "64", "max_tokens per request"},
     {"shared-prefix", "0", "leading prompt tokens shared within a prefix group"},
     {"prefix-groups", "1", "distinct shared prefixes"},
     {"max-concurrency", "256", "requests in flight at most"},
     {"ttft-slo-ms", "0", "TTFT objective for goodput (0 = none)"},
     {"tpot-slo-ms", "0", "TPOT objective for goodput (0 = none)"},
     {"timeout-s", "600", "per-request timeout"},
     {"seed", "0", "prompt generator seed"},
     {"vocab-min", "1000", "smallest random token id"},
     {"vocab-max", "30000", "largest random token id (exclusive)"},
     {"trace", "",
      "replay this trace (arrival_s,prompt_tokens,output_tokens[,prefix_group[,prefix_tokens]]"
      " per line, as kvrelay sim reads) in place of --rate, --num-prompts, --input-len, "
      "--output-len and the prefix flags"},
     {"json", "", "also write the results as JSON to this file"}}};

int BenchServe(const std::vector<std::string>& args) {
  int exit_code = 0;
  auto flags = ParseCommandFlags(args, kSpec, &exit_code);
  if (!flags) return exit_code;
  auto get_int = [&](const char* name, int64_t fallback, int64_t lo, int64_t hi) -> int64_t {
    auto v = flags->GetInt(name, fallback);
    if (!v.ok() || *v < lo || *v > hi) {
      std::fprintf(stderr, "bench serve: --%s must be an integer in [%lld, %lld]\n", name,
                   static_cast<long long>(lo), static_cast<long long>(hi));
      std::exit(2);
    }
    return *v;
  };
  auto get_double = [&](const char* name, double fallback) -> double {
    auto v = flags->GetDouble(name, fallback);
    if (!v.ok() || !(*v >= 0)) {
      std::fprintf(stderr, "bench serve: --%s must be a non-negative number\n", name);
      std::exit(2);
    }
    return *v;
  };
  auto url = ParseHttpUrl(flags->Get("url", "http://127.0.0.1:8080"));
  if (!url.ok()) {
    std::fprintf(stderr, "bench serve: --url: %s\n", url.status().message().c_str());
    return 2;
  }
  const double rate =
      flags->Get("rate", "inf") == "inf" ? 0.0 : get_double("rate", 0);  // 0 = all at once
  std::vector<sim::SimRequest> trace;
  if (flags->Has("trace")) {
    auto t = sim::LoadTrace(flags->Get("trace"));
    if (!t.ok() || t->empty() || t->size() > 1'000'000) {
      std::fprintf(stderr, "bench serve: --trace %s: %s\n", flags->Get("trace").c_str(),
                   t.ok() ? "1 to 1,000,000 requests" : t.status().message().c_str());
      return 2;
    }
    trace = std::move(*t);
    // The bounds of --input-len / --output-len, per request (every prompt is
    // built before the first is sent).
    for (size_t i = 0; i < trace.size(); ++i) {
      if (trace[i].prompt_tokens > 1'000'000 || trace[i].output_tokens > 1'000'000) {
        std::fprintf(stderr,
                     "bench serve: --trace %s: request %zu: prompt and output tokens must be "
                     "<= 1000000\n",
                     flags->Get("trace").c_str(), i + 1);
        return 2;
      }
    }
  }
  const int64_t num_prompts = trace.empty() ? get_int("num-prompts", 100, 1, 1'000'000)
                                            : static_cast<int64_t>(trace.size());
  const int64_t input_len = get_int("input-len", 128, 1, 1'000'000);
  const int64_t output_len = get_int("output-len", 64, 1, 1'000'000);
  const int64_t shared_prefix = get_int("shared-prefix", 0, 0, input_len);
  // Distinct shared prefixes (e.g. several system prompts or documents); each
  // prompt takes one at random, so a prefix-aware router can keep each group
  // on the worker that already caches it.
  const int64_t prefix_groups = get_int("prefix-groups", 1, 1, 100'000);
  const double ttft_slo_ms = get_double("ttft-slo-ms", 0);
  const double tpot_slo_ms = get_double("tpot-slo-ms", 0);
  const uint64_t seed = static_cast<uint64_t>(get_int("seed", 0, 0, INT64_MAX));
  const int64_t max_concurrency = get_int("max-concurrency", 256, 1, 4096);
  const int timeout_ms = static_cast<int>(get_int("timeout-s", 600, 1, 86400) * 1000);
  const int64_t vocab_min = get_int("vocab-min", 1000, 0, INT32_MAX);
  const int64_t vocab_max = get_int("vocab-max", 30000, vocab_min + 1, INT32_MAX);
  std::string model = flags->Get("model");
  const std::string api_key = flags->Get("api-key");

  if (model.empty()) {  // ask the server
    HttpCallSpec spec;
    spec.host = url->host;
    spec.port = url->port;
    spec.target = url->path + "/v1/models";
    if (!api_key.empty()) spec.headers.push_back({"Authorization", "Bearer " + api_key});
    spec.timeout_ms = 10'000;
    auto r = HttpCall(spec);
    json j = r.ok() ? json::parse(r->body, nullptr, false) : json();
    if (!r.ok() || r->status != 200 || !j.is_object() || !j.contains("data") || j["data"].empty()) {
      std::fprintf(stderr, "bench serve: cannot list models at %s (pass --model)\n",
                   flags->Get("url", "http://127.0.0.1:8080").c_str());
      return 1;
    }
    model = j["data"][0].value("id", "");
  }

  // Prompts and arrival times, all from the seed.
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> tok(static_cast<int32_t>(vocab_min),
                                             static_cast<int32_t>(vocab_max));
  std::vector<std::vector<int32_t>> prefixes(static_cast<size_t>(prefix_groups));
  for (auto& prefix : prefixes) {
    prefix.resize(static_cast<size_t>(shared_prefix));
    for (auto& t : prefix) t = tok(rng);
  }
  std::uniform_int_distribution<int64_t> pick_group(0, prefix_groups - 1);
  // A trace's prefix groups: each one's shared tokens drawn on first use, as
  // long as the longest prefix_tokens any of its requests asks for.
  std::map<int64_t, std::vector<int32_t>> trace_prefixes;
  for (const auto& q : trace) {
    if (q.prefix_group < 0) continue;
    auto& prefix = trace_prefixes[q.prefix_group];
    while (static_cast<int64_t>(prefix.size()) < q.prefix_tokens) prefix.push_back(tok(rng));
  }
  std::vector<json> bodies;
  std::vector<double> arrival_s;
  std::exponential_distribution<double> gap(rate > 0 ? rate : 1.0);
  double t = 0;
  for (int64_t i = 0; i < num_prompts; ++i) {
    std::vector<int32_t> prompt;
    int64_t prompt_len = input_len, max_tokens = output_len;
    if (!trace.empty()) {
      const sim::SimRequest& q = trace[static_cast<size_t>(i)];
      prompt_len = q.prompt_tokens;
      max_tokens = q.output_tokens;
      if (q.prefix_group >= 0) {
        const auto& prefix = trace_prefixes[q.prefix_group];
        prompt.assign(prefix.begin(), prefix.begin() + q.prefix_tokens);
      }
    } else {
      prompt = prefixes[static_cast<size_t>(pick_group(rng))];
    }
    while (static_cast<int64_t>(prompt.size()) < prompt_len) prompt.push_back(tok(rng));
    bodies.push_back(json{{"model", model},
                          {"prompt", prompt},
                          {"max_tokens", max_tokens},
                          {"ignore_eos", true},
                          {"temperature", 0},
                          {"stream", true},
                          {"stream_options", {{"include_usage", true}}}});
    if (!trace.empty()) {
      arrival_s.push_back(trace[static_cast<size_t>(i)].arrival_s);
      continue;
    }
    arrival_s.push_back(t);
    if (rate > 0) t += gap(rng);
  }

  if (!trace.empty()) {
    std::fprintf(stderr, "bench serve: %lld prompts of the trace %s to %s\n",
                 static_cast<long long>(num_prompts), flags->Get("trace").c_str(),
                 flags->Get("url", "http://127.0.0.1:8080").c_str());
  } else {
    std::fprintf(
        stderr,
        "bench serve: %lld prompts (%lld in / %lld out, shared prefix %lld) at %s req/s to %s\n",
        static_cast<long long>(num_prompts), static_cast<long long>(input_len),
        static_cast<long long>(output_len), static_cast<long long>(shared_prefix),
        rate > 0 ? std::to_string(rate).c_str() : "inf",
        flags->Get("url", "http://127.0.0.1:8080").c_str());
  }
  std::vector<RequestOutcome> outcomes(static_cast<size_t>(num_prompts));
  std::atomic<int64_t> next{0};
  const TimePoint bench_start = Clock::now();
  auto worker = [&] {
    while (true) {
      int64_t i = next.fetch_add(1);
      if (i >= num_prompts) return;
      // Open loop: wait for this request's arrival time (a schedule, not a sync).
      std::this_thread::sleep_until(bench_start + std::chrono::duration_cast<Clock::duration>(
                                                      std::chrono::duration<double>(arrival_s[i])));
      outcomes[i] = RunOne(*url, api_key, bodies[i], timeout_ms, bench_start);
    }
  };
  std::vector<std::thread> threads;
  for (int64_t i = 0; i < std::min(num_prompts, max_concurrency); ++i) threads.emplace_back(worker);
  for (auto& th : threads) th.join();
  const double duration = SecondsSince(bench_start);

  std::vector<double> ttft, tpot, itl, e2e;
  int64_t completed = 0, out_tokens = 0, in_tokens = 0, cached = 0, good = 0, shed = 0;
  std::vector<std::string> errors;
  for (const auto& o : outcomes) {
    if (!o.ok) {
      // Admission control's refusals (429/503 with Retry-After): shed, counted apart.
      if ((o.http_status == 429 || o.http_status == 503) && o.retry_after) {
        ++shed;
        continue;
      }
      if (errors.size() < 5) errors.push_back(o.error);
      continue;
    }
    ++completed;
    out_tokens += o.output_tokens;
    in_tokens += o.prompt_tokens;
    cached += o.cached_tokens;
    ttft.push_back(o.ttft_s * 1000);
    e2e.push_back(o.e2e_s * 1000);
    double tp = o.output_tokens > 1 ? (o.e2e_s - o.ttft_s) * 1000 / (o.output_tokens - 1) : 0;
    tpot.push_back(tp);
    for (double x : o.itl_s) itl.push_back(x * 1000);
    bool meets = (ttft_slo_ms <= 0 || o.ttft_s * 1000 <= ttft_slo_ms) &&
                 (tpot_slo_ms <= 0 || tp <= tpot_slo_ms);
    if (meets) ++good;
  }
  json report = {
      {"url", flags->Get("url", "http://127.0.0.1:8080")},
      {"model", model},
      {"rate", rate > 0 ? json(rate) : json("inf")},
      {"num_prompts", num_prompts},
      {"input_len", input_len},
      {"output_len", output_len},
      {"shared_prefix", shared_prefix},
      {"prefix_groups", prefix_groups},
      {"seed", seed},
      {"max_concurrency", max_concurrency},
      {"duration_s", duration},
      {"completed", completed},
      {"failed", num_prompts - completed},  // shed ones included
      {"shed", shed},
      {"errors", errors},
      {"total_input_tokens", in_tokens},
      {"total_output_tokens", out_tokens},
      {"cached_prompt_tokens", cached},
      {"request_throughput", completed / duration},
      {"output_token_throughput", static_cast<double>(out_tokens) / duration},
      {"total_token_throughput", static_cast<double>(in_tokens + out_tokens) / duration},
      {"ttft_ms", StatsJson(Summarize(ttft))},
      {"tpot_ms", StatsJson(Summarize(tpot))},
      {"itl_ms", StatsJson(Summarize(itl))},
      {"e2e_ms", StatsJson(Summarize(e2e))},
      {"ttft_slo_ms", ttft_slo_ms},
      {"tpot_slo_ms", tpot_slo_ms},
      {"good_requests", good},
      {"goodput_rps", static_cast<double>(good) / duration},
      {"slo_attainment",
       num_prompts > 0 ? static_cast<double>(good) / static_cast<double>(num_prompts) : 0.0},
      // Goodput over the requests admission control let in (not shed).
      {"slo_attainment_admitted",
       num_prompts - shed > 0 ? static_cast<double>(good) / static_cast<double>(num_prompts - shed)
                              : 0.0},
  };
  // Per request, in workload order (the cluster simulator replays these
  // arrival times: `kvrelay sim validate`).
  json per_request = json::array();
  for (const auto& o : outcomes) {
    per_request.push_back({{"ok", o.ok},
                           {"http_status", o.http_status},
                           {"retry_after", o.retry_after},
                           {"start_s", o.start_s},
                           {"ttft_ms", o.ttft_s * 1000},
                           {"e2e_ms", o.e2e_s * 1000},
                           {"prompt_tokens", o.prompt_tokens},
                           {"output_tokens", o.output_tokens},
                           {"cached_tokens", o.cached_tokens},
                           // Gaps between streamed chunks: where a model of
                           // the server misses, token by token.
                           {"itl_ms", [&o] {
                              json a = json::array();
                              for (double x : o.itl_s) a.push_back(x * 1000);
                              return a;
                            }()}});
  }
  if (!trace.empty()) report["trace"] = flags->Get("trace");  // its lengths, not --input-len's
  report["requests"] = std::move(per_request);
  auto line = [&](const char* name, const Stats& s) {
    std::printf("%-8s mean %9.2f  p50 %9.2f  p90 %9.2f  p99 %9.2f ms\n", name, s.mean, s.p50, s.p90,
                s.p99);
  };
  std::printf("completed %lld / %lld in %.2f s (%lld failed)\n", static_cast<long long>(completed),
              static_cast<long long>(num_prompts), duration,
              static_cast<long long>(num_prompts - completed));
  std::printf(
      "throughput: %.3f req/s, %.1f output tok/s, %.1f total tok/s; cached prompt tokens %lld\n",
      completed / duration, out_tokens / duration, (in_tokens + out_tokens) / duration,
      static_cast<long long>(cached));
  line("TTFT", Summarize(ttft));
  line("TPOT", Summarize(tpot));
  line("ITL", Summarize(itl));
  line("E2E", Summarize(e2e));
  std::printf("goodput: %.3f req/s (%lld of %lld within SLO ttft<=%.0fms tpot<=%.0fms)\n",
              good / duration, static_cast<long long>(good), static_cast<long long>(num_prompts),
              ttft_slo_ms, tpot_slo_ms);
  if (shed > 0) {
    std::printf("shed: %lld refused by admission control (429/503 with Retry-After)\n",
                static_cast<long long>(shed));
  }
  for (const auto& e : errors) std::printf("error: %s\n", e.c_str());
  if (flags->Has("json")) {
    std::ofstream f(flags->Get("json"));
    f << report.dump(2) << "\n";
    if (!f) {
      std::fprintf(stderr, "bench serve: cannot write %s\n", flags->Get("json").c_str());
      return 1;
    }
  }
  return completed == num_prompts ? 0 : 1;
}

}  // namespace

KVRELAY_COMMAND(bench_serve, "bench serve",
                "bench serve --url URL --rate R --num-prompts N --input-len I --output-len O "
                "[--shared-prefix L [--prefix-groups G]] [--trace FILE] [--ttft-slo-ms X "
                "--tpot-slo-ms Y] [--json "
                "OUT] [--model NAME] "
                "[--seed S] [--api-key K] [--max-concurrency C]",
                BenchServe);

}  // namespace kvrelay::cli
