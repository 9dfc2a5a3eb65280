#include "sim/busy_fit.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "sim/cluster_sim.h"
#include "sim/stats.h"

namespace kvrelay::sim {
namespace {

// A probe's workload on 1P+1D (TP 1) on a shared host of `cores`, heartbeats
// every 0.5 s, the profile's jitter left out (the figures are medians of a
// handful of requests whose draws differ between the two runs).
Result<SimResult> SimulateProbe(const Profile& profile, const std::vector<SimRequest>& w,
                                int cores) {
  ClusterConfig c;
  c.shared_host_cores = cores;
  c.heartbeat_s = kDefaultHeartbeatS;
  Profile p = profile;
  for (ServingOverhead* o : {&p.colocated, &p.prefill, &p.decode}) {
    o->ttft_jitter.clear();
    o->tpot_jitter.clear();
  }
  return Simulate(p, c, w);
}

// The foreground's p50 figure (ms) in one simulated run. Each client's first
// request is open-loop, the rest follow their predecessor at once (bench
// serve --max-concurrency 1); the two clients' requests interleaved (bg 0,
// fg 0, bg 1, fg 1, ...) so the open-loop ones keep their arrival order.
Result<double> ForegroundP50(const Profile& profile, const BusyProbe& probe, bool with_background,
                             int cores) {
  std::vector<SimRequest> w;
  std::vector<size_t> foreground;
  int64_t last[2] = {-1, -1};  // each client's latest request
  const int64_t bg = with_background ? probe.bg_prompts : 0;
  for (int64_t i = 0; i < std::max(probe.fg_prompts, bg); ++i) {
    for (int client = 0; client < 2; ++client) {
      const bool fg = client == 1;
      if (i >= (fg ? probe.fg_prompts : bg)) continue;
      SimRequest q;
      q.prompt_tokens = fg ? probe.fg_in : probe.bg_in;
      q.output_tokens = fg ? probe.fg_out : probe.bg_out;
      q.arrival_s = i > 0 ? 0 : (fg && with_background ? probe.fg_start_s : 0);
      q.after = last[client];
      last[client] = static_cast<int64_t>(w.size());
      if (fg) foreground.push_back(w.size());
      w.push_back(q);
    }
  }
  ASSIGN_OR_RETURN(SimResult r, SimulateProbe(profile, w, cores));
  std::vector<double> v;
  for (size_t i : foreground) {
    const RequestTiming& t = r.requests[i];
    if (t.rejected) return Internal("busy probe: a simulated request was refused");
    v.push_back((probe.tpot ? t.tpot_s() : t.ttft_s()) * 1e3);
  }
  return Percentile(&v, 50);
}

// Each request's first-token time in SimulateProbe.
Result<std::vector<double>> FirstTokens(const Profile& profile, const std::vector<SimRequest>& w,
                                        int cores) {
  ASSIGN_OR_RETURN(SimResult r, SimulateProbe(profile, w, cores));
  std::vector<double> firsts;
  for (const RequestTiming& t : r.requests) {
    if (t.rejected) return Internal("busy probe: a simulated request was refused");
    firsts.push_back(t.first_token_s);
  }
  return firsts;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

}  // namespace

std::vector<SimRequest> PairTrace(const BusyProbe& probe) {
  std::vector<SimRequest> w;
  for (int64_t k = 0; k < probe.fg_prompts; ++k) {
    for (double offset : {0.0, probe.pair_gap_s}) {
      SimRequest q;
      q.arrival_s = static_cast<double>(k) * probe.pair_period_s + offset;
      q.prompt_tokens = probe.fg_in;
      q.output_tokens = probe.fg_out;
      w.push_back(q);
    }
  }
  return w;
}

PairFigures PairsFigures(const std::vector<double>& arrivals,
                         const std::vector<double>& first_tokens,
                         const std::vector<double>& tpots) {
  std::vector<double> gaps, leads, first_tpots, second_tpots;
  for (size_t i = 0; i + 1 < first_tokens.size() && i + 1 < arrivals.size(); i += 2) {
    const double a = first_tokens[i], b = first_tokens[i + 1];
    if (std::isnan(a) || std::isnan(b) || std::isnan(arrivals[i])) continue;
    gaps.push_back(b - a);
    leads.push_back(a - arrivals[i]);
    if (i + 1 < tpots.size() && tpots[i] > 0 && tpots[i + 1] > 0) {
      first_tpots.push_back(tpots[i]);
      second_tpots.push_back(tpots[i + 1]);
    }
  }
  PairFigures f;
  f.pairs = gaps.size();
  f.gap_s = Median(std::move(gaps));
  f.lead_ttft_s = Median(std::move(leads));
  f.slowdown = f.gap_s > 0 && f.lead_ttft_s > 0 ? f.gap_s / f.lead_ttft_s : 0;
  const double busy = Median(std::move(first_tpots)), alone = Median(std::move(second_tpots));
  f.decode_slowdown = busy > 0 && alone > 0 ? busy / alone : 0;
  return f;
}

double TtftOutsideWorker(double short_ttft_s, double short_model_s, double long_ttft_s,
                         double long_model_s) {
  double k = 1;
  if (long_model_s > short_model_s && long_ttft_s > short_ttft_s) {
    k = (long_ttft_s - short_ttft_s) / (long_model_s - short_model_s);
  }
  return std::max(0.0, short_ttft_s - k * short_model_s);
}

Result<double> SimulatedSlowdown(const Profile& profile, const BusyProbe& probe, int cores) {
  if (probe.pairs) {
    if (probe.fg_prompts < 1 || cores < 1 || !(probe.pair_gap_s >= 0) ||
        !(probe.pair_period_s > probe.pair_gap_s)) {
      return InvalidArgument(
          "busy probe: pairs need >= 1 pair, >= 1 core and a period above the gap");
    }
    const std::vector<SimRequest> trace = PairTrace(probe);
    ASSIGN_OR_RETURN(auto firsts, FirstTokens(profile, trace, cores));
    std::vector<double> arrivals;
    for (const SimRequest& q : trace) arrivals.push_back(q.arrival_s);
    const PairFigures f = PairsFigures(arrivals, firsts);
    if (!(f.slowdown > 0)) return Internal("busy probe: no pair with a first-token gap");
    return f.slowdown;
  }
  if (probe.fg_prompts < 1 || probe.bg_prompts < 1 || cores < 1 || !(probe.fg_start_s >= 0) ||
      (probe.tpot && probe.fg_out < 2)) {
    return InvalidArgument(
        "busy probe: needs >= 1 request per client, >= 1 core, a start >= 0 and, for a TPOT, "
        ">= 2 output tokens");
  }
  ASSIGN_OR_RETURN(double alone, ForegroundP50(profile, probe, false, cores));
  ASSIGN_OR_RETURN(double busy, ForegroundP50(profile, probe, true, cores));
  if (!(alone > 0)) return Internal("busy probe: the foreground's figure alone is 0");
  return busy / alone;
}

Result<BusyFit> FitRoleBusyAlphas(Profile* profile, const BusyProbe& prefill_probe,
                                  double prefill_measured, const BusyProbe& decode_probe,
                                  double decode_measured, int cores) {
  if (!(prefill_measured > 0) || !(decode_measured > 0)) {
    return InvalidArgument("busy fit: the measured slowdowns must be > 0");
  }
  constexpr double kMaxAlpha = 4;
  BusyFit fit;
  // The alpha of `role` in [0, kMaxAlpha] whose simulated slowdown on
  // `probe` is `measured` (to 1e-4 of alpha), the profile's other terms held.
  auto solve = [&](ServingOverhead& role, const BusyProbe& probe, double measured,
                   double* simulated) -> Status {
    auto at = [&](double alpha) -> Result<double> {
      role.busy_alpha = alpha;
      return SimulatedSlowdown(*profile, probe, cores);
    };
    ASSIGN_OR_RETURN(double s0, at(0));
    if (s0 >= measured) {
      *simulated = s0;
      role.busy_alpha = 0;
      return Status::Ok();
    }
    double lo = 0, hi = kMaxAlpha;
    ASSIGN_OR_RETURN(double s_hi, at(hi));
    if (s_hi <= measured) {
      *simulated = s_hi;
      return Status::Ok();  // busy_alpha = kMaxAlpha: the most the fit gives
    }
    while (hi - lo > 1e-4) {
      const double mid = (lo + hi) / 2;
      ASSIGN_OR_RETURN(double s, at(mid));
      (s < measured ? lo : hi) = mid;
    }
    ASSIGN_OR_RETURN(*simulated, at(hi));
    return Status::Ok();
  };
  for (int round = 1; round <= 3; ++round) {
    RETURN_IF_ERROR(
        solve(profile->prefill, prefill_probe, prefill_measured, &fit.prefill_slowdown));
    RETURN_IF_ERROR(solve(profile->decode, decode_probe, decode_measured, &fit.decode_slowdown));
    char line[240];
    std::snprintf(line, sizeof(line),
                  "round %d: prefill busy_alpha %.4f (simulated x%.3f, measured x%.3f), decode "
                  "busy_alpha %.4f (x%.3f, x%.3f)\n",
                  round, profile->prefill.busy_alpha, fit.prefill_slowdown, prefill_measured,
                  profile->decode.busy_alpha, fit.decode_slowdown, decode_measured);
    fit.log += line;
  }
  // The prefill's slowdown again with the final decode alpha.
  ASSIGN_OR_RETURN(fit.prefill_slowdown, SimulatedSlowdown(*profile, prefill_probe, cores));
  fit.prefill_alpha = profile->prefill.busy_alpha;
  fit.decode_alpha = profile->decode.busy_alpha;
  return fit;
}

TpSharing FitTpSharing(double n, double c_alone, double decode_s, double prefill_s) {
  TpSharing t;
  t.cores = c_alone;
  if (1 + c_alone > n) {
    // A slowdown below 1 (noise) is none: shares of 1.
    const double sp = std::max(1.0, prefill_s), sd = std::max(1.0, decode_s);
    const double w = n * sp - 1;  // the prefill's share n / (1 + w) = 1 / sp
    t.share_weight = w;
    t.cores = std::min(c_alone, w * sd / sp);
  }
  // The share each gets of n cores with these terms, and the alpha that
  // makes up the rest of its slowdown s: 1 / s = share / (1 + alpha x others).
  auto alpha = [](double s, double share, double others) {
    return std::max(0.0, (s * share - 1) / std::max(1e-9, others));
  };
  std::vector<CoreDemand> wants = {{1.0, 1.0}, {t.cores, t.share_weight}};
  const double level = FairLevel(wants, n);
  t.busy_alpha =
      alpha(decode_s, std::min(1.0, t.share_weight * level / t.cores), std::min(1.0, n - t.cores));
  t.prefill_busy_alpha = alpha(prefill_s, std::min(1.0, level), std::min(t.cores, n - 1));
  return t;
}

}  // namespace kvrelay::sim
