// See compare.h.
#include "sim/validate/compare.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "sim/stats.h"

namespace kvrelay::sim::validate {

using calibrate::RequestTpotMs;

double RelErr(double sim, double real) {
  return real != 0 ? std::fabs(sim - real) / std::fabs(real) : (sim == 0 ? 0 : 1);
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

void RealMetrics(const json& j, double* m) {
  m[0] = j["ttft_ms"].value("p50", 0.0);
  m[1] = j["ttft_ms"].value("p90", 0.0);
  m[2] = j["tpot_ms"].value("p50", 0.0);
  m[3] = j["tpot_ms"].value("p90", 0.0);
  m[4] = j.value("output_token_throughput", 0.0);
}

void SimMetrics(const SimResult& r, double* m) {
  m[0] = r.ttft_ms.p50;
  m[1] = r.ttft_ms.p90;
  m[2] = r.tpot_ms.p50;
  m[3] = r.tpot_ms.p90;
  m[4] = r.output_token_throughput;
}

void Pooled::AddReal(const json& report) {
  for (const auto& q : report["requests"]) {
    if (!q.value("ok", true)) continue;
    ttft.push_back(q.value("ttft_ms", 0.0));
    tpot.push_back(RequestTpotMs(q));
  }
}

void Pooled::AddSim(const SimResult& r) {
  for (const auto& t : r.requests) {
    if (t.rejected || t.finish_s < 0) continue;
    ttft.push_back(t.ttft_s() * 1e3);
    tpot.push_back(t.tpot_s() * 1e3);
  }
}

void Pooled::Quantiles(double* m) {
  m[0] = Percentile(&ttft, 50);
  m[1] = Percentile(&ttft, 90);
  m[2] = Percentile(&tpot, 50);
  m[3] = Percentile(&tpot, 90);
}

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

std::vector<SimRequest> ReplayOf(const json& j, int64_t in, int64_t out) {
  std::vector<SimRequest> w;
  for (const auto& q : j["requests"]) {
    const int64_t p = q.value("prompt_tokens", 0), o = q.value("output_tokens", 0);
    w.push_back({q.value("start_s", 0.0), p > 0 ? p : in, o > 0 ? o : out, -1, 0});
  }
  return w;
}

SamplingFloor ComputeSamplingFloor(const std::vector<Compared>& rows) {
  SamplingFloor f;
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
      f.max = std::max(f.max, e);
      f.within += e <= 0.15;
      es.push_back(e);
      ++f.cells;
    }
  }
  f.median = Median(es);
  return f;
}

std::vector<AloneDrift> ComputeAloneDrift(const std::vector<Compared>& rows) {
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
  std::vector<AloneDrift> out;
  for (const auto& t : order) {
    out.push_back({t, ttft_ratio[t].size(), Median(ttft_ratio[t]), Median(tpot_ratio[t])});
  }
  return out;
}

json RowReport(const Compared& row) {
  json e = {{"topology", row.topology}, {"rate", row.rate}, {"repeats", row.real.size()}};
  for (int k = 0; k < kMetrics; ++k) {
    const double real = row.real_m[k], sim = row.sim_m[k];
    e[kMetricNames[k]] = {{"real", real},
                          {"sim", sim},
                          {"rel_err", RelErr(sim, real)},
                          {"real_spread", row.real_spread[k]}};
  }
  // Per request, real vs simulated (the first repeat): where the model misses.
  json per = json::array();
  const json& j = row.real.front();
  const auto& sr = row.sim.front().requests;
  for (size_t i = 0; i < sr.size() && i < j["requests"].size(); ++i) {
    const json& q = j["requests"][i];
    per.push_back({{"start_s", q.value("start_s", 0.0)},
                   {"ttft_ms", {q.value("ttft_ms", 0.0), sr[i].ttft_s() * 1e3}},
                   {"tpot_ms", {RequestTpotMs(q), sr[i].tpot_s() * 1e3}}});
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
  return e;
}

}  // namespace kvrelay::sim::validate
