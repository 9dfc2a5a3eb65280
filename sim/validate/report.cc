// See report.h.
#include "sim/validate/report.h"

#include <cstdarg>
#include <cstdio>
#include <map>

namespace kvrelay::sim::validate {

using calibrate::Topology;

namespace {

// printf onto *out.
__attribute__((format(printf, 2, 3))) void Appendf(std::string* out, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char buf[512];
  va_list again;
  va_copy(again, ap);
  const int n = std::vsnprintf(buf, sizeof(buf), fmt, ap);
  if (n >= 0 && static_cast<size_t>(n) < sizeof(buf)) {
    out->append(buf, static_cast<size_t>(n));
  } else if (n >= 0) {
    std::string big(static_cast<size_t>(n) + 1, '\0');
    std::vsnprintf(big.data(), big.size(), fmt, again);
    out->append(big.data(), static_cast<size_t>(n));
  }
  va_end(again);
  va_end(ap);
}

// With --per-request: each request of the row's first repeat, real vs
// simulated, where the simulator put them and the CPU the run spent.
void AppendPerRequest(const Compared& row, std::string* text) {
  std::string& out = *text;
  const json& j = row.real.front();
  const auto& sr = row.sim.front().requests;
  for (size_t i = 0; i < sr.size() && i < j["requests"].size(); ++i) {
    const json& q = j["requests"][i];
    Appendf(&out, "    req %2zu at %7.3f s: TTFT %7.1f/%7.1f ms  TPOT %6.2f/%6.2f ms\n", i,
            q.value("start_s", 0.0), q.value("ttft_ms", 0.0), sr[i].ttft_s() * 1e3,
            calibrate::RequestTpotMs(q), sr[i].tpot_s() * 1e3);
  }
  std::map<int, int> by_worker;
  for (const auto& t : sr) ++by_worker[t.prefill_worker];
  Appendf(&out, "    simulated requests per (prefill/colocated) worker:");
  for (const auto& [wk, cnt] : by_worker) Appendf(&out, " #%d %d", wk, cnt);
  Appendf(&out, "\n");
  if (!j.contains("cluster_cpu_s")) return;
  Appendf(&out, "    CPU during the run:");
  for (const auto& c : j["cluster_cpu_s"]) {
    Appendf(&out, " %s %.2f s", c[0].get<std::string>().c_str(), c[1].get<double>());
  }
  if (j.contains("client_cpu_s")) Appendf(&out, " client %.2f s", j.value("client_cpu_s", 0.0));
  Appendf(&out, "; simulated: workers %.2f s (solo), serving path %.2f s\n",
          row.sim.front().worker_cpu_s, row.sim.front().serving_cpu_s);
}

}  // namespace

std::string FormatRetimed(const Topology& t, const PointPlan& plan, const RetimeResult& r) {
  std::string out;
  const size_t n_rates = plan.rates.size();
  for (size_t k = 0; k < r.points.size(); ++k) {
    const Retimed& p = r.points[k];
    if (!p.refit) continue;
    Appendf(&out,
            "%-14s rate %.2f repeat %zu re-timed at low load (%s): TTFT p50 %.1f ms, TPOT p50 "
            "%.2f ms -> %s %.3f (profile %.3f, %+.1f%%), prefill_scale %.3f (profile %.3f, "
            "%+.1f%%)\n",
            t.name.c_str(), plan.rates[k % n_rates], k / n_rates + 1,
            plan.per_point ? "before and after" : "before the repeat", p.low.ttft_s * 1e3,
            p.low.tpot_s * 1e3, r.step_name, p.step, p.step_given,
            100 * (p.step / p.step_given - 1), p.prefill, p.prefill_given,
            100 * (p.prefill / p.prefill_given - 1));
  }
  return out;
}

// The comparison table; the rows' --json report.
std::string FormatTable(const std::vector<Compared>& rows, bool per_request) {
  std::string out;
  Appendf(&out, "\n%-14s %5s | %-23s | %-23s | %-23s | %-23s | %-21s\n", "topology", "rate",
          "TTFT p50 real/sim ms", "TTFT p90 real/sim ms", "TPOT p50 real/sim ms",
          "TPOT p90 real/sim ms", "out tok/s real/sim");
  for (const auto& row : rows) {
    Appendf(&out, "%-14s %5.2f |", row.topology.c_str(), row.rate);
    for (int k = 0; k < kMetrics; ++k) {
      const double real = row.real_m[k], sim = row.sim_m[k];
      Appendf(&out, " %7.1f/%7.1f %+5.0f%% |", real, sim,
              real != 0 ? 100 * (sim - real) / real : 0);
    }
    Appendf(&out, "\n");
    if (per_request) AppendPerRequest(row, &out);
  }
  return out;
}

// The real system against itself, per cell: (max - min) / median of its
// repeats. A cell whose error is within its own spread is within noise.
std::string FormatSpreads(const std::vector<Compared>& rows, size_t repeats) {
  std::string out;
  Appendf(&out,
          "\nreal repeat spread per cell ((max - min) / median over %lld repeats; * = the "
          "cell's error exceeds 15%% but not this spread)\n",
          static_cast<long long>(repeats));
  Appendf(&out, "%-14s %5s | %9s | %9s | %9s | %9s | %9s\n", "topology", "rate", "TTFT p50",
          "TTFT p90", "TPOT p50", "TPOT p90", "out tok/s");
  for (const auto& row : rows) {
    Appendf(&out, "%-14s %5.2f |", row.topology.c_str(), row.rate);
    for (int k = 0; k < kMetrics; ++k) {
      const double err = RelErr(row.sim_m[k], row.real_m[k]);
      Appendf(&out, " %7.0f%%%s |", 100 * row.real_spread[k],
              err > 0.15 && err <= row.real_spread[k] ? "*" : " ");
    }
    Appendf(&out, "\n");
  }
  return out;
}

}  // namespace kvrelay::sim::validate
