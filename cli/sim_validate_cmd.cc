// kvrelay sim validate --model M --profile P: runs the real single-host
// topologies with this binary's `bench serve`, replays the same arrivals in
// the simulator and compares TTFT / TPOT p50 and p90 and throughput.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/sim_support.h"
#include "common/clock.h"
#include "common/flags.h"
#include "sim/cluster_sim.h"
#include "sim/profile.h"
#include "sim/stats.h"
#include "sim/workload.h"

namespace kvrelay::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using namespace simtool;  // NOLINT(build/namespaces): the commands' own toolkit

double RelErr(double sim, double real) {
  return real != 0 ? std::fabs(sim - real) / std::fabs(real) : (sim == 0 ? 0 : 1);
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

constexpr int kMetrics = 5;
constexpr const char* kMetricNames[kMetrics] = {"ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms",
                                                "tpot_p90_ms", "output_tok_s"};

// One (topology, rate) point: its real runs (one per repeat) and their replays.
struct Compared {
  std::string topology;
  double rate = 0;
  std::vector<json> real;
  std::vector<sim::SimResult> sim;  // per repeat, heartbeat phase 0 and jitter seed 0
  // The compared figures: TTFT / TPOT p50 and p90 over the point's requests
  // of every repeat pooled (the simulated ones: of every repeat and phase),
  // and the median output throughput over the repeats (over repeats and
  // phases).
  double real_m[kMetrics] = {}, sim_m[kMetrics] = {};
  double sim_as_given_m[kMetrics] = {};  // the same, with the profile as given
  // Each repeat's own figures, medians over the repeats (the simulated: of
  // the per-phase medians): the statistic before pooling.
  double real_by_repeat_m[kMetrics] = {}, sim_by_repeat_m[kMetrics] = {};
  double real_spread[kMetrics] = {};  // (max - min) / median of the repeats' own figures
};

// The five compared figures of a real run and of its simulation.
void RealMetrics(const json& j, double* m) {
  m[0] = j["ttft_ms"].value("p50", 0.0);
  m[1] = j["ttft_ms"].value("p90", 0.0);
  m[2] = j["tpot_ms"].value("p50", 0.0);
  m[3] = j["tpot_ms"].value("p90", 0.0);
  m[4] = j.value("output_token_throughput", 0.0);
}
void SimMetrics(const sim::SimResult& r, double* m) {
  m[0] = r.ttft_ms.p50;
  m[1] = r.ttft_ms.p90;
  m[2] = r.tpot_ms.p50;
  m[3] = r.tpot_ms.p90;
  m[4] = r.output_token_throughput;
}

// Request latencies pooled over runs, in ms: TTFT and TPOT as bench serve
// computes them ((e2e - TTFT) / (output - 1); 0 for one token).
struct Pooled {
  std::vector<double> ttft, tpot;
  void AddReal(const json& report) {
    for (const auto& q : report["requests"]) {
      if (!q.value("ok", true)) continue;
      ttft.push_back(q.value("ttft_ms", 0.0));
      tpot.push_back(RequestTpotMs(q));
    }
  }
  void AddSim(const sim::SimResult& r) {
    for (const auto& t : r.requests) {
      if (t.rejected || t.finish_s < 0) continue;
      ttft.push_back(t.ttft_s() * 1e3);
      tpot.push_back(t.tpot_s() * 1e3);
    }
  }
  // m[0..3]: TTFT p50, p90, TPOT p50, p90.
  void Quantiles(double* m) {
    m[0] = sim::Percentile(&ttft, 50);
    m[1] = sim::Percentile(&ttft, 90);
    m[2] = sim::Percentile(&tpot, 50);
    m[3] = sim::Percentile(&tpot, 90);
  }
};

// Low-load runs pooled into one report (requests concatenated; TTFT / TPOT
// p50 of them all): what the re-timing fits a point's profile from.
json PoolLowLoad(const std::vector<const json*>& runs) {
  json out = {{"requests", json::array()}};
  Pooled p;
  for (const json* r : runs) {
    for (const auto& q : (*r)["requests"]) out["requests"].push_back(q);
    p.AddReal(*r);
  }
  double m[4];
  p.Quantiles(m);
  out["ttft_ms"] = {{"p50", m[0]}};
  out["tpot_ms"] = {{"p50", m[2]}};
  return out;
}

// The requests of a real run, arriving when bench serve actually sent them
// (workload order kept: index i of the result is request i of the run).
std::vector<sim::SimRequest> ReplayOf(const json& j, int64_t in, int64_t out) {
  std::vector<sim::SimRequest> w;
  for (const auto& q : j["requests"]) {
    const int64_t p = q.value("prompt_tokens", 0), o = q.value("output_tokens", 0);
    w.push_back({q.value("start_s", 0.0), p > 0 ? p : in, o > 0 ? o : out, -1, 0});
  }
  return w;
}

constexpr char kSimValidateUsage[] =
    "sim validate --model M --profile P [--rates 0.5,1,1.5] [--seconds-per-point 40 | "
    "--num-prompts N] [--min-prompts 16] [--repeats 1] [--input-len 128] [--output-len 32] "
    "[--topologies colocated,1p1d,1p1d-tp2] [--save-real DIR | --from-real DIR] "
    "[--phases 8] [--retime-every point|repeat [--retime-lows 2] | --no-retime] [--no-jitter] "
    "[--per-request] "
    "[--json OUT]";

int RunValidate(const std::vector<std::string>& args) {
  if (PrintHelpIfAsked(args, kSimValidateUsage)) return 0;
  auto f = Flags::Parse(
      args,
      {"model", "profile", "rates", "num-prompts", "seconds-per-point", "min-prompts", "repeats",
       "phases", "input-len", "output-len", "threads", "kv-dtype", "colocated", "json",
       "topologies", "save-real", "from-real", "retime-every", "retime-lows"},
      {"help", "per-request", "no-retime", "no-jitter"});
  if (!f.ok()) {
    std::fprintf(stderr, "sim validate: %s\n", f.status().message().c_str());
    return 2;
  }
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "sim validate: %s\n", s.ToString().c_str());
    return 1;
  };
  const std::string model = f->Get("model", "models/SmolLM2-135M-Instruct.Q4_1.gguf");
  if (!f->Has("profile")) {
    std::fprintf(stderr, "sim validate: --profile PATH is required (kvrelay sim calibrate)\n");
    return 2;
  }
  auto profile = sim::LoadProfile(f->Get("profile"));
  if (!profile.ok()) return fail(profile.status());
  // --no-jitter: every request its model's cost (no request-to-request variation).
  auto drop_jitter = [](sim::Profile* q) {
    for (auto* o : {&q->colocated, &q->prefill, &q->decode}) {
      o->ttft_jitter.clear();
      o->tpot_jitter.clear();
    }
  };
  if (f->Has("no-jitter")) drop_jitter(&*profile);
  auto n = f->GetInt("num-prompts", 0);
  // 40 s a point: 20 / 40 / 60 requests at 0.5 / 1 / 1.5 req/s (a p90 of 16
  // spread by up to 58 % between repeats); ~18 minutes with --repeats 3.
  auto seconds = f->GetDouble("seconds-per-point", 40);
  auto min_prompts = f->GetInt("min-prompts", 16);
  auto repeats = f->GetInt("repeats", 1);
  auto phases = f->GetInt("phases", 8);
  auto retime_lows = f->GetInt("retime-lows", 2);
  auto in = f->GetInt("input-len", 128);
  auto out = f->GetInt("output-len", 32);
  auto threads = f->GetInt("threads", 1);
  auto colocated = f->GetInt("colocated", 2);
  for (const Status& s :
       {n.status(), seconds.status(), min_prompts.status(), repeats.status(), phases.status(),
        in.status(), out.status(), threads.status(), colocated.status(), retime_lows.status()}) {
    if (!s.ok()) return fail(s);
  }
  if (*repeats < 1 || *repeats > 9 || *phases < 1 || *phases > 64 || *n < 0 || !(*seconds > 0) ||
      *min_prompts < 1 || *retime_lows < 2 || *retime_lows > 64) {
    std::fprintf(stderr,
                 "sim validate: --repeats in [1, 9], --phases in [1, 64], --num-prompts >= 0, "
                 "--seconds-per-point > 0, --min-prompts >= 1, --retime-lows in [2, 64]\n");
    return 2;
  }
  if (f->Has("save-real") && f->Has("from-real")) {
    std::fprintf(stderr, "sim validate: --save-real and --from-real exclude each other\n");
    return 2;
  }
  std::vector<double> rates;
  {
    std::stringstream ss(f->Get("rates", "0.5,1,1.5"));
    std::string tok;
    while (std::getline(ss, tok, ',')) {
      char* end = nullptr;
      const double r = std::strtod(tok.c_str(), &end);
      if (end == tok.c_str() || !(r > 0)) {
        std::fprintf(stderr, "sim validate: bad --rates entry '%s'\n", tok.c_str());
        return 2;
      }
      rates.push_back(r);
    }
  }
  // Requests per point: the same duration at every rate (unless --num-prompts).
  auto prompts_at = [&](double rate) {
    return *n > 0 ? *n : std::max<int64_t>(*min_prompts, std::llround(rate * *seconds));
  };
  const std::string which = f->Get("topologies", "colocated,1p1d,1p1d-tp2");
  const std::string save_dir = f->Get("save-real"), from_dir = f->Get("from-real");
  if (!save_dir.empty()) {
    std::error_code ec;
    fs::create_directories(save_dir, ec);
    if (ec) return fail(InvalidArgument("cannot create " + save_dir + ": " + ec.message()));
  }
  auto real_path = [&](const std::string& dir, const char* key, size_t ri, size_t rep) {
    char name[96];
    std::snprintf(name, sizeof(name), "%s-rate%g-rep%lld.json", key, rates[ri],
                  static_cast<long long>(rep));
    return (fs::path(dir) / name).string();
  };
  // Low-load runs: KEY-low-I.json around the points (--retime-every point),
  // KEY-low-repR.json before each repeat (--retime-every repeat).
  auto low_path = [&](const std::string& dir, const char* key, size_t i) {
    return (fs::path(dir) / (std::string(key) + "-low-" + std::to_string(i) + ".json")).string();
  };
  auto low_rep_path = [&](const std::string& dir, const char* key, size_t rep) {
    return (fs::path(dir) / (std::string(key) + "-low-rep" + std::to_string(rep) + ".json"))
        .string();
  };
  // Re-timing (the default): next to each point, low-load runs of the
  // topology (calibrate's: bench serve, one request at a time) re-fit the
  // profile's serving-path terms of that topology (FitServingTerms) and its
  // request-to-request variation (FitJitter), and the point is simulated
  // with them. With --retime-every point (the default) one runs before and
  // one after every point, and the point's fit pools the two (48 requests),
  // so a change of the machine's speed during the validation is followed
  // point by point; --retime-every repeat is one run before each repeat's
  // points. On this kind of host the serving path's speed level drifts by up
  // to ~25 % within minutes (sim calibrate's measurement minutes before no
  // longer describes it), which is not what the validation is about; the
  // step model, the batch curve, the contention and busy alphas, the links
  // and the serving CPU stay the profile's, and every compared cell is a
  // loaded run the low-load runs do not contain. The table with the profile
  // as given is printed as well.
  const bool retime = !f->Has("no-retime");
  const std::string every = f->Get("retime-every", "point");
  if (every != "point" && every != "repeat") {
    std::fprintf(stderr, "sim validate: --retime-every is point or repeat\n");
    return 2;
  }
  bool per_point = every == "point";
  const auto [low_prefill_s, low_decode_s] = LowLoadModel(*profile, *in, *out);
  std::vector<Compared> rows;
  const auto& topos = Topologies(static_cast<int>(*colocated));
  const char* keys[] = {"colocated", "1p1d", "1p1d-tp2"};
  const TimePoint t0 = Clock::now();
  const std::string load_start = LoadLine();
  const size_t n_rates = rates.size(), n_reps = static_cast<size_t>(*repeats);
  const size_t n_points = n_rates * n_reps;
  // Point k = rep * n_rates + rate index: its low-load runs (indices into lows).
  // --retime-lows N (per point): the N low-load runs nearest the point, N / 2
  // before it and N / 2 after (fewer at the ends), pooled: 2 follows the
  // machine closest, more are less at the mercy of one run's slow spell.
  auto lows_of = [&](size_t k) -> std::vector<size_t> {
    if (!per_point) return {k / n_rates};
    const int64_t half = std::max<int64_t>(1, *retime_lows / 2);
    const int64_t lo = std::max<int64_t>(0, static_cast<int64_t>(k) + 1 - half);
    const int64_t hi =
        std::min<int64_t>(static_cast<int64_t>(n_points), static_cast<int64_t>(k) + half);
    std::vector<size_t> v;
    for (int64_t i = lo; i <= hi; ++i) v.push_back(static_cast<size_t>(i));
    return v;
  };
  for (size_t ti = 0; ti < topos.size(); ++ti) {
    if (("," + which + ",").find("," + std::string(keys[ti]) + ",") == std::string::npos) continue;
    const Topology& t = topos[ti];
    std::vector<json> reals(n_points);  // point k
    std::vector<json> lows;             // per_point: n_points + 1; else one per repeat
    if (!from_dir.empty()) {
      for (size_t k = 0; k < n_points; ++k) {
        auto j = ReadJson(real_path(from_dir, keys[ti], k % n_rates, k / n_rates));
        if (!j.ok()) return fail(j.status());
        reals[k] = std::move(*j);
      }
      // What the saved set has: low-load runs around every point, before
      // every repeat (older sets), or none (sets from before re-timing).
      per_point = fs::exists(low_path(from_dir, keys[ti], 0));
      const size_t want = per_point ? n_points + 1 : n_reps;
      for (size_t i = 0; retime && i < want; ++i) {
        const std::string path =
            per_point ? low_path(from_dir, keys[ti], i) : low_rep_path(from_dir, keys[ti], i);
        if (!fs::exists(path)) break;
        auto j = ReadJson(path);
        if (!j.ok()) return fail(j.status());
        lows.push_back(std::move(*j));
      }
      if (lows.size() != want) lows.clear();
    } else {
      // Repeats interleaved (rate 1, 2, 3, 1, 2, 3, ...) so a slow spell of
      // the machine does not fall on one point's every repeat.
      std::vector<std::vector<std::string>> serve;
      std::vector<bool> is_low;
      auto add_low = [&](size_t i) {
        serve.push_back({"--rate", "inf", "--max-concurrency", "1", "--num-prompts", "24",
                         "--input-len", std::to_string(*in), "--output-len", std::to_string(*out),
                         "--seed", std::to_string(500 + 1000 * i)});
        is_low.push_back(true);
      };
      for (size_t k = 0; k < n_points; ++k) {
        const size_t rep = k / n_rates, ri = k % n_rates;
        if (retime && (per_point || ri == 0)) add_low(per_point ? k : rep);
        char rate[32];
        std::snprintf(rate, sizeof(rate), "%g", rates[ri]);
        serve.push_back({"--rate", rate, "--num-prompts", std::to_string(prompts_at(rates[ri])),
                         "--input-len", std::to_string(*in), "--output-len", std::to_string(*out),
                         // Other prompts per repeat: the same seed again would
                         // be a prefix-cache hit on a colocated worker (seen: a
                         // TTFT of 11 ms instead of 150 in repeats 2 and 3).
                         "--seed", std::to_string(ri + 1 + 1000 * rep)});
        is_low.push_back(false);
      }
      if (retime && per_point) add_low(n_points);
      auto real =
          ServeRuns(t, model, static_cast<int>(*threads), f->Get("kv-dtype", "f16"), *in, serve);
      if (!real.ok()) return fail(real.status());
      size_t k = 0;
      for (size_t i = 0; i < real->size(); ++i) {
        json& j = is_low[i] ? lows.emplace_back() : reals[k++];
        j = std::move((*real)[i].report);
        if (save_dir.empty()) continue;
        const std::string path =
            is_low[i] ? (per_point ? low_path(save_dir, keys[ti], lows.size() - 1)
                                   : low_rep_path(save_dir, keys[ti], lows.size() - 1))
                      : real_path(save_dir, keys[ti], (k - 1) % n_rates, (k - 1) / n_rates);
        std::ofstream o(path);
        o << j.dump() << "\n";
        if (!o) return fail(DataLoss("cannot write " + path));
      }
    }
    // The profile each point is simulated with: re-timed from its low-load
    // runs (the profile as given without them).
    const bool colo = t.colocated > 0;
    // The two re-fitted scales: the decode step's (colocated: the step's; a
    // TP group's) and the prefill's.
    auto scales = [&](const sim::Profile& q) {
      const double step =
          colo ? q.colocated.step_scale : (t.tp > 1 ? q.Tp(t.tp).step_scale : q.decode.step_scale);
      return std::pair{step, colo ? q.colocated.prefill_scale : q.prefill.prefill_scale};
    };
    const char* step_name =
        colo ? "step_scale" : (t.tp > 1 ? "tp step_scale" : "decode step_scale");
    std::vector<sim::Profile> timed(n_points, *profile);
    for (size_t k = 0; k < n_points && !lows.empty(); ++k) {
      std::vector<const json*> around;
      for (size_t i : lows_of(k)) around.push_back(&lows[i]);
      const json low_run = PoolLowLoad(around);
      const ServePoint low{low_run["ttft_ms"].value("p50", 0.0) / 1e3,
                           low_run["tpot_ms"].value("p50", 0.0) / 1e3};
      if (!(low.ttft_s > 0 && low.tpot_s > 0)) continue;  // as given
      FitServingTerms(t, low, low_prefill_s, low_decode_s, /*refit_prefill=*/true, &timed[k]);
      FitJitter(t, low_run, &timed[k]);
      if (f->Has("no-jitter")) drop_jitter(&timed[k]);
      const auto [step_a, pre_a] = scales(*profile);
      const auto [step_b, pre_b] = scales(timed[k]);
      std::printf(
          "%-14s rate %.2f repeat %zu re-timed at low load (%s): TTFT p50 %.1f ms, TPOT p50 "
          "%.2f ms -> %s %.3f (profile %.3f, %+.1f%%), prefill_scale %.3f (profile %.3f, "
          "%+.1f%%)\n",
          t.name.c_str(), rates[k % n_rates], k / n_rates + 1,
          per_point ? "before and after" : "before the repeat", low.ttft_s * 1e3, low.tpot_s * 1e3,
          step_name, step_b, step_a, 100 * (step_b / step_a - 1), pre_b, pre_a,
          100 * (pre_b / pre_a - 1));
    }
    for (size_t ri = 0; ri < n_rates; ++ri) {
      Compared row;
      row.topology = t.name;
      row.rate = rates[ri];
      Pooled real_pool, sim_pool, given_pool;
      std::vector<double> real_tput, sim_tput, given_tput;
      std::vector<double> rm[kMetrics], sm[kMetrics];  // per repeat
      for (size_t rep = 0; rep < n_reps; ++rep) {
        const size_t k = rep * n_rates + ri;
        const json& j = reals[k];
        sim::ClusterConfig c;
        c.colocated = t.colocated;
        c.prefill = t.prefill;
        c.decode = t.decode;
        c.tp = t.tp;
        c.shared_host_cores = UsableCores();
        // The router sees heartbeats, every 500 ms (kvrelay launch's default),
        // whose phase against the arrivals is unknown: each repeat is
        // simulated at --phases evenly spaced phases, each with its own draws
        // of the request-to-request variation.
        c.heartbeat_s = 0.5;
        const auto replay = ReplayOf(j, *in, *out);
        std::vector<double> by_phase[kMetrics];
        for (int64_t ph = 0; ph < *phases; ++ph) {
          c.heartbeat_phase_s = c.heartbeat_s * static_cast<double>(ph) / *phases;
          sim::SimOptions opts;
          opts.jitter_seed = static_cast<uint64_t>(ph);
          auto r = sim::Simulate(timed[k], c, replay, opts);
          if (!r.ok()) return fail(r.status());
          double b[kMetrics];
          SimMetrics(*r, b);
          for (int m = 0; m < kMetrics; ++m) by_phase[m].push_back(b[m]);
          sim_pool.AddSim(*r);
          sim_tput.push_back(r->output_token_throughput);
          if (ph == 0) row.sim.push_back(std::move(*r));
          if (lows.empty()) continue;  // timed[k] is the profile as given
          auto g = sim::Simulate(*profile, c, replay, opts);
          if (!g.ok()) return fail(g.status());
          given_pool.AddSim(*g);
          given_tput.push_back(g->output_token_throughput);
        }
        double a[kMetrics];
        RealMetrics(j, a);
        for (int m = 0; m < kMetrics; ++m) {
          rm[m].push_back(a[m]);
          sm[m].push_back(Median(by_phase[m]));
        }
        real_pool.AddReal(j);
        real_tput.push_back(a[4]);
        row.real.push_back(j);
      }
      real_pool.Quantiles(row.real_m);
      sim_pool.Quantiles(row.sim_m);
      row.real_m[4] = Median(real_tput);
      row.sim_m[4] = Median(sim_tput);
      if (lows.empty()) {
        std::copy(row.sim_m, row.sim_m + kMetrics, row.sim_as_given_m);
      } else {
        given_pool.Quantiles(row.sim_as_given_m);
        row.sim_as_given_m[4] = Median(given_tput);
      }
      for (int m = 0; m < kMetrics; ++m) {
        row.real_by_repeat_m[m] = Median(rm[m]);
        row.sim_by_repeat_m[m] = Median(sm[m]);
        // How far the real system is from itself over the repeats.
        const auto [lo, hi] = std::minmax_element(rm[m].begin(), rm[m].end());
        row.real_spread[m] =
            row.real_by_repeat_m[m] != 0 ? (*hi - *lo) / std::fabs(row.real_by_repeat_m[m]) : 0;
      }
      rows.push_back(std::move(row));
    }
  }
  const double wall_s = SecondsSince(t0);
  double max_err = 0;
  std::vector<double> errs, spreads;
  std::printf("\n%-14s %5s | %-23s | %-23s | %-23s | %-23s | %-21s\n", "topology", "rate",
              "TTFT p50 real/sim ms", "TTFT p90 real/sim ms", "TPOT p50 real/sim ms",
              "TPOT p90 real/sim ms", "out tok/s real/sim");
  json report = json::array();
  for (const auto& row : rows) {
    std::printf("%-14s %5.2f |", row.topology.c_str(), row.rate);
    json e = {{"topology", row.topology}, {"rate", row.rate}, {"repeats", row.real.size()}};
    for (int k = 0; k < kMetrics; ++k) {
      const double real = row.real_m[k], sim = row.sim_m[k];
      const double err = RelErr(sim, real);
      max_err = std::max(max_err, err);
      errs.push_back(err);
      std::printf(" %7.1f/%7.1f %+5.0f%% |", real, sim, real != 0 ? 100 * (sim - real) / real : 0);
      e[kMetricNames[k]] = {
          {"real", real}, {"sim", sim}, {"rel_err", err}, {"real_spread", row.real_spread[k]}};
      spreads.push_back(row.real_spread[k]);
    }
    std::printf("\n");
    // Per request, real vs simulated (the first repeat): where the model misses.
    json per = json::array();
    const json& j = row.real.front();
    const auto& sr = row.sim.front().requests;
    for (size_t i = 0; i < sr.size() && i < j["requests"].size(); ++i) {
      const json& q = j["requests"][i];
      const double ttft = q.value("ttft_ms", 0.0), tpot = RequestTpotMs(q);
      per.push_back({{"start_s", q.value("start_s", 0.0)},
                     {"ttft_ms", {ttft, sr[i].ttft_s() * 1e3}},
                     {"tpot_ms", {tpot, sr[i].tpot_s() * 1e3}}});
      if (f->Has("per-request")) {
        std::printf("    req %2zu at %7.3f s: TTFT %7.1f/%7.1f ms  TPOT %6.2f/%6.2f ms\n", i,
                    q.value("start_s", 0.0), ttft, sr[i].ttft_s() * 1e3, tpot,
                    sr[i].tpot_s() * 1e3);
      }
    }
    if (f->Has("per-request")) {
      std::map<int, int> by_worker;
      for (const auto& t : sr) ++by_worker[t.prefill_worker];
      std::printf("    simulated requests per (prefill/colocated) worker:");
      for (const auto& [wk, cnt] : by_worker) std::printf(" #%d %d", wk, cnt);
      std::printf("\n");
    }
    if (f->Has("per-request") && j.contains("cluster_cpu_s")) {
      std::printf("    CPU during the run:");
      for (const auto& c : j["cluster_cpu_s"]) {
        std::printf(" %s %.2f s", c[0].get<std::string>().c_str(), c[1].get<double>());
      }
      if (j.contains("client_cpu_s")) std::printf(" client %.2f s", j.value("client_cpu_s", 0.0));
      std::printf("; simulated: workers %.2f s (solo), serving path %.2f s\n",
                  row.sim.front().worker_cpu_s, row.sim.front().serving_cpu_s);
    }
    e["requests"] = per;
    // Every repeat's requests, real vs simulated (phase 0), for offline analysis.
    json by_repeat = json::array();
    for (size_t rep = 0; rep < row.real.size() && rep < row.sim.size(); ++rep) {
      const json& rq = row.real[rep]["requests"];
      const auto& sq = row.sim[rep].requests;
      json one = json::array();
      for (size_t i = 0; i < sq.size() && i < rq.size(); ++i) {
        one.push_back({{"start_s", rq[i].value("start_s", 0.0)},
                       {"ttft_ms", {rq[i].value("ttft_ms", 0.0), sq[i].ttft_s() * 1e3}},
                       {"tpot_ms", {RequestTpotMs(rq[i]), sq[i].tpot_s() * 1e3}},
                       {"itl_ms", rq[i].value("itl_ms", json::array())},
                       // Where the simulator put it and when its prefill ran.
                       {"sim_worker", sq[i].prefill_worker},
                       {"sim_prefill_s", {sq[i].prefill_start_s, sq[i].first_token_s}},
                       {"sim_finish_s", sq[i].finish_s}});
      }
      by_repeat.push_back(std::move(one));
    }
    e["requests_by_repeat"] = std::move(by_repeat);
    if (j.contains("cluster_cpu_s")) e["cluster_cpu_s"] = j["cluster_cpu_s"];
    report.push_back(e);
  }
  // Whether the profile still describes the machine: requests that had the
  // cluster to themselves (no other request in flight at any time during
  // theirs) depend on nothing but the calibrated costs, so their real vs
  // simulated medians show the drift since `sim calibrate` apart from the
  // queueing and contention the other cells test.
  {
    std::map<std::string, std::vector<double>> ttft_ratio, tpot_ratio;
    std::vector<std::string> order;
    for (const auto& row : rows) {
      if (!ttft_ratio.count(row.topology)) order.push_back(row.topology);
      auto& tr = ttft_ratio[row.topology];
      auto& pr = tpot_ratio[row.topology];
      for (size_t rep = 0; rep < row.real.size() && rep < row.sim.size(); ++rep) {
        const json& q = row.real[rep]["requests"];
        const auto& sr = row.sim[rep].requests;
        std::vector<std::pair<double, double>> span;
        for (const auto& x : q) {
          const double s = x.value("start_s", 0.0);
          span.push_back({s, s + x.value("e2e_ms", 0.0) / 1e3});
        }
        for (size_t i = 0; i < span.size() && i < sr.size(); ++i) {
          bool alone = true;
          for (size_t k = 0; k < span.size() && alone; ++k) {
            alone = k == i || span[k].second <= span[i].first || span[k].first >= span[i].second;
          }
          const int o = q[i].value("output_tokens", 0);
          if (!alone || o < 2 || sr[i].ttft_s() <= 0 || sr[i].tpot_s() <= 0) continue;
          const double ttft = q[i].value("ttft_ms", 0.0) / 1e3;
          tr.push_back(ttft / sr[i].ttft_s());
          pr.push_back((q[i].value("e2e_ms", 0.0) / 1e3 - ttft) / (o - 1) / sr[i].tpot_s());
        }
      }
    }
    std::printf("requests alone in the cluster, real / simulated (medians; the profile's drift):");
    for (const auto& t : order) {
      std::printf(" %s n=%zu TTFT %+.1f%% TPOT %+.1f%%;", t.c_str(), ttft_ratio[t].size(),
                  100 * (Median(ttft_ratio[t]) - 1), 100 * (Median(tpot_ratio[t]) - 1));
    }
    std::printf("\n");
  }
  // The real system against itself, per cell: (max - min) / median of its
  // repeats. A cell whose error is within its own spread is within noise.
  if (*repeats > 1) {
    std::printf(
        "\nreal repeat spread per cell ((max - min) / median over %lld repeats; * = the "
        "cell's error exceeds 15%% but not this spread)\n",
        static_cast<long long>(*repeats));
    std::printf("%-14s %5s | %9s | %9s | %9s | %9s | %9s\n", "topology", "rate", "TTFT p50",
                "TTFT p90", "TPOT p50", "TPOT p90", "out tok/s");
    for (const auto& row : rows) {
      std::printf("%-14s %5.2f |", row.topology.c_str(), row.rate);
      for (int k = 0; k < kMetrics; ++k) {
        const double err = RelErr(row.sim_m[k], row.real_m[k]);
        std::printf(" %7.0f%%%s |", 100 * row.real_spread[k],
                    err > 0.15 && err <= row.real_spread[k] ? "*" : " ");
      }
      std::printf("\n");
    }
  }
  // The table's cells against other statistics or another model: how many
  // are within 15 % and the max relative error.
  auto cells_within = [&](auto real_of, auto sim_of, const char* what) {
    double max_e = 0;
    int64_t within = 0, cells = 0;
    for (const auto& row : rows) {
      for (int k = 0; k < kMetrics; ++k) {
        const double e = RelErr(sim_of(row)[k], real_of(row)[k]);
        max_e = std::max(max_e, e);
        within += e <= 0.15;
        ++cells;
      }
    }
    std::printf("%s: cells within 15%%: %lld of %lld; max relative error %.3f\n", what,
                static_cast<long long>(within), static_cast<long long>(cells), max_e);
    return max_e;
  };
  // The sampling floor: the real system against itself, each point's pooled
  // requests split into even and odd ones (the same minutes of the machine,
  // half the requests each). No model can be expected closer to the pooled
  // figures than the halves are to each other, divided by about sqrt(2).
  {
    double max_e = 0;
    int64_t within = 0, cells = 0;
    std::vector<double> es;
    for (const auto& row : rows) {
      Pooled half[2];
      for (const json& j : row.real) {
        json part[2] = {{{"requests", json::array()}}, {{"requests", json::array()}}};
        size_t i = 0;
        for (const auto& q : j["requests"]) part[i++ % 2]["requests"].push_back(q);
        half[0].AddReal(part[0]);
        half[1].AddReal(part[1]);
      }
      double a[4], b[4];
      half[0].Quantiles(a);
      half[1].Quantiles(b);
      for (int k = 0; k < 4; ++k) {
        const double mean = (a[k] + b[k]) / 2;
        const double e = mean != 0 ? std::fabs(a[k] - b[k]) / mean : 0;
        max_e = std::max(max_e, e);
        within += e <= 0.15;
        es.push_back(e);
        ++cells;
      }
    }
    std::printf(
        "sampling floor (the real runs' even vs odd requests of each point, TTFT/TPOT cells): "
        "%lld of %lld within 15%%; median %.3f, max %.3f\n",
        static_cast<long long>(within), static_cast<long long>(cells), Median(es), max_e);
  }
  auto real_pooled = [](const Compared& r) { return r.real_m; };
  // Each repeat's own percentiles, medians over the repeats: p90s of 20-60
  // requests, which swing far more from repeat to repeat than the pooled ones.
  const double max_by_repeat =
      cells_within([](const Compared& r) { return r.real_by_repeat_m; },
                   [](const Compared& r) { return r.sim_by_repeat_m; },
                   "median over the repeats of each repeat's own figures (not pooled)");
  // The serving terms as sim calibrate measured them, not re-timed: how much
  // of the error is the machine's drift since then.
  const double max_as_given = cells_within(
      real_pooled, [](const Compared& r) { return r.sim_as_given_m; },
      "with the profile as given (serving terms not re-timed)");
  if (!retime) std::printf("(--no-retime: the table above is the profile as given)\n");
  const double median_err = Median(errs);
  const auto within = std::count_if(errs.begin(), errs.end(), [](double x) { return x <= 0.15; });
  if (from_dir.empty()) {
    std::printf("%s; real runs from %s (start) to %s (end)\n", UtcNow().c_str(), load_start.c_str(),
                LoadLine().c_str());
  }
  std::printf("cells within 15%%: %lld of %zu; median relative error %.3f; %.0f s\n",
              static_cast<long long>(within), errs.size(), median_err, wall_s);
  if (*repeats > 1) {
    std::printf(
        "real run-to-run spread over %lld repeats ((max - min) / median): median %.3f, max %.3f\n",
        static_cast<long long>(*repeats), Median(spreads),
        *std::max_element(spreads.begin(), spreads.end()));
  }
  if (f->Has("json")) {
    std::ofstream o(f->Get("json"));
    o << json{{"profile", f->Get("profile")},
              {"date", UtcNow()},
              {"cpu", CpuModel()},
              {"rows", report},
              {"median_relative_error", median_err},
              {"retimed", retime},
              {"retime_every", retime ? (per_point ? "point" : "repeat") : "none"},
              {"max_relative_error_as_given", max_as_given},
              {"max_relative_error_by_repeat", max_by_repeat},
              {"max_relative_error", max_err}}
             .dump(2)
      << "\n";
  }
  std::printf("max relative error: %.3f\n", max_err);
  return 0;
}

}  // namespace

KVRELAY_COMMAND(sim_validate, "sim validate", kSimValidateUsage, RunValidate);

}  // namespace kvrelay::cli
