// See points.h.
#include "sim/validate/points.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <utility>

#include "sim/cluster_sim.h"

namespace kvrelay::sim::validate {

namespace fs = std::filesystem;
using calibrate::Topology;
using nlohmann::json;

int64_t PointPlan::PromptsAt(double rate) const {
  return num_prompts > 0 ? num_prompts
                         : std::max<int64_t>(min_prompts, std::llround(rate * seconds_per_point));
}

std::vector<size_t> PointPlan::LowsOf(size_t k) const {
  if (!per_point) return {k / rates.size()};
  const int64_t half = std::max<int64_t>(1, retime_lows / 2);
  const int64_t lo = std::max<int64_t>(0, static_cast<int64_t>(k) + 1 - half);
  const int64_t hi =
      std::min<int64_t>(static_cast<int64_t>(points()), static_cast<int64_t>(k) + half);
  std::vector<size_t> v;
  for (int64_t i = lo; i <= hi; ++i) v.push_back(static_cast<size_t>(i));
  return v;
}

std::string RealRunPath(const std::string& dir, const std::string& key, double rate, size_t rep) {
  char name[96];
  std::snprintf(name, sizeof(name), "%s-rate%g-rep%lld.json", key.c_str(), rate,
                static_cast<long long>(rep));
  return (fs::path(dir) / name).string();
}

std::string LowRunPath(const std::string& dir, const std::string& key, size_t i) {
  return (fs::path(dir) / (key + "-low-" + std::to_string(i) + ".json")).string();
}

std::string LowRepRunPath(const std::string& dir, const std::string& key, size_t rep) {
  return (fs::path(dir) / (key + "-low-rep" + std::to_string(rep) + ".json")).string();
}

Result<RealRuns> LoadRealRuns(const std::string& dir, const std::string& key,
                              const PointPlan& plan) {
  const size_t n_rates = plan.rates.size(), n_points = plan.points();
  RealRuns runs;
  runs.reals.resize(n_points);
  for (size_t k = 0; k < n_points; ++k) {
    ASSIGN_OR_RETURN(runs.reals[k], calibrate::ReadJson(RealRunPath(
                                        dir, key, plan.rates[k % n_rates], k / n_rates)));
  }
  runs.per_point = fs::exists(LowRunPath(dir, key, 0));
  const size_t want = runs.per_point ? n_points + 1 : plan.repeats;
  for (size_t i = 0; plan.retime && i < want; ++i) {
    const std::string path = runs.per_point ? LowRunPath(dir, key, i) : LowRepRunPath(dir, key, i);
    if (!fs::exists(path)) break;
    ASSIGN_OR_RETURN(json j, calibrate::ReadJson(path));
    runs.lows.push_back(std::move(j));
  }
  if (runs.lows.size() != want) runs.lows.clear();
  return runs;
}

Result<RealRuns> RunRealPoints(const Topology& t, const std::string& key, const PointPlan& plan,
                               const ServeSetup& setup, const std::string& save_dir) {
  const size_t n_rates = plan.rates.size(), n_points = plan.points();
  const std::string in = std::to_string(plan.input_len), out = std::to_string(plan.output_len);
  RealRuns runs;
  runs.per_point = plan.per_point;
  runs.reals.resize(n_points);
  // Repeats interleaved (rate 1, 2, 3, 1, 2, 3, ...) so a slow spell of
  // the machine does not fall on one point's every repeat.
  std::vector<std::vector<std::string>> serve;
  std::vector<bool> is_low;
  auto add_low = [&](size_t i) {
    serve.push_back({"--rate", "inf", "--max-concurrency", "1", "--num-prompts", "24",
                     "--input-len", in, "--output-len", out, "--seed",
                     std::to_string(500 + 1000 * i)});
    is_low.push_back(true);
  };
  for (size_t k = 0; k < n_points; ++k) {
    const size_t rep = k / n_rates, ri = k % n_rates;
    if (plan.retime && (plan.per_point || ri == 0)) add_low(plan.per_point ? k : rep);
    char rate[32];
    std::snprintf(rate, sizeof(rate), "%g", plan.rates[ri]);
    serve.push_back({"--rate", rate, "--num-prompts",
                     std::to_string(plan.PromptsAt(plan.rates[ri])), "--input-len", in,
                     "--output-len", out,
                     // Other prompts per repeat: the same seed again would
                     // be a prefix-cache hit on a colocated worker (seen: a
                     // TTFT of 11 ms instead of 150 in repeats 2 and 3).
                     "--seed", std::to_string(ri + 1 + 1000 * rep)});
    is_low.push_back(false);
  }
  if (plan.retime && plan.per_point) add_low(n_points);
  ASSIGN_OR_RETURN(auto real, calibrate::ServeRuns(t, setup.model, setup.threads, setup.kv_dtype,
                                                   plan.input_len, serve));
  size_t k = 0;
  for (size_t i = 0; i < real.size(); ++i) {
    json& j = is_low[i] ? runs.lows.emplace_back() : runs.reals[k++];
    j = std::move(real[i].report);
    if (save_dir.empty()) continue;
    const std::string path =
        is_low[i] ? (plan.per_point ? LowRunPath(save_dir, key, runs.lows.size() - 1)
                                    : LowRepRunPath(save_dir, key, runs.lows.size() - 1))
                  : RealRunPath(save_dir, key, plan.rates[(k - 1) % n_rates], (k - 1) / n_rates);
    std::ofstream o(path);
    o << j.dump() << "\n";
    if (!o) return DataLoss("cannot write " + path);
  }
  return runs;
}

void DropJitter(Profile* q) {
  for (auto* o : {&q->colocated, &q->prefill, &q->decode}) {
    o->ttft_jitter.clear();
    o->tpot_jitter.clear();
  }
}

RetimeResult RetimePoints(const Profile& given, const Topology& t, const RealRuns& runs,
                          const PointPlan& plan, bool no_jitter) {
  const bool colo = t.colocated > 0;
  auto scales = [&](const Profile& q) {
    const double step =
        colo ? q.colocated.step_scale : (t.tp > 1 ? q.Tp(t.tp).step_scale : q.decode.step_scale);
    return std::pair{step, colo ? q.colocated.prefill_scale : q.prefill.prefill_scale};
  };
  const auto [low_prefill_s, low_decode_s] =
      calibrate::LowLoadModel(given, plan.input_len, plan.output_len);
  PointPlan layout = plan;
  layout.per_point = runs.per_point;
  RetimeResult r;
  r.step_name = colo ? "step_scale" : (t.tp > 1 ? "tp step_scale" : "decode step_scale");
  r.timed.assign(plan.points(), given);
  r.points.resize(plan.points());
  for (size_t k = 0; k < plan.points() && !runs.lows.empty(); ++k) {
    std::vector<const json*> around;
    for (size_t i : layout.LowsOf(k)) around.push_back(&runs.lows[i]);
    const json low_run = PoolLowLoad(around);
    const calibrate::ServePoint low{low_run["ttft_ms"].value("p50", 0.0) / 1e3,
                                    low_run["tpot_ms"].value("p50", 0.0) / 1e3};
    if (!(low.ttft_s > 0 && low.tpot_s > 0)) continue;  // as given
    calibrate::FitServingTerms(t, low, low_prefill_s, low_decode_s, /*refit_prefill=*/true,
                               &r.timed[k]);
    calibrate::FitJitter(t, low_run, &r.timed[k]);
    if (no_jitter) DropJitter(&r.timed[k]);
    Retimed& p = r.points[k];
    p.refit = true;
    p.low = low;
    std::tie(p.step_given, p.prefill_given) = scales(given);
    std::tie(p.step, p.prefill) = scales(r.timed[k]);
  }
  return r;
}

Result<std::vector<Compared>> SimulatePoints(const Topology& t, const RealRuns& runs,
                                             const RetimeResult& timed, const Profile& given,
                                             const PointPlan& plan, int64_t phases) {
  const size_t n_rates = plan.rates.size();
  std::vector<Compared> rows;
  for (size_t ri = 0; ri < n_rates; ++ri) {
    Compared row;
    row.topology = t.name;
    row.rate = plan.rates[ri];
    Pooled real_pool, sim_pool, given_pool;
    std::vector<double> real_tput, sim_tput, given_tput;
    std::vector<double> rm[kMetrics], sm[kMetrics];  // per repeat
    for (size_t rep = 0; rep < plan.repeats; ++rep) {
      const size_t k = rep * n_rates + ri;
      const json& j = runs.reals[k];
      ClusterConfig c;
      c.colocated = t.colocated;
      c.prefill = t.prefill;
      c.decode = t.decode;
      c.tp = t.tp;
      c.shared_host_cores = calibrate::UsableCores();
      // The router sees heartbeats, every 500 ms (kvrelay launch's default),
      // whose phase against the arrivals is unknown.
      c.heartbeat_s = 0.5;
      const auto replay = ReplayOf(j, plan.input_len, plan.output_len);
      std::vector<double> by_phase[kMetrics];
      for (int64_t ph = 0; ph < phases; ++ph) {
        c.heartbeat_phase_s = c.heartbeat_s * static_cast<double>(ph) / phases;
        SimOptions opts;
        opts.jitter_seed = static_cast<uint64_t>(ph);
        ASSIGN_OR_RETURN(SimResult r, Simulate(timed.timed[k], c, replay, opts));
        double b[kMetrics];
        SimMetrics(r, b);
        for (int m = 0; m < kMetrics; ++m) by_phase[m].push_back(b[m]);
        sim_pool.AddSim(r);
        sim_tput.push_back(r.output_token_throughput);
        if (ph == 0) row.sim.push_back(std::move(r));
        if (runs.lows.empty()) continue;  // timed[k] is the profile as given
        ASSIGN_OR_RETURN(SimResult g, Simulate(given, c, replay, opts));
        given_pool.AddSim(g);
        given_tput.push_back(g.output_token_throughput);
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
    if (runs.lows.empty()) {
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
  return rows;
}

}  // namespace kvrelay::sim::validate
