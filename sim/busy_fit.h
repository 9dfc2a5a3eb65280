// The disaggregated roles' busy_alpha (ServingOverhead::busy_alpha) fitted by
// simulation: `kvrelay sim calibrate` measures each role's slowdown next to
// the other role (1P+1D on one host: the decode beside a closed-loop
// background load that keeps the prefill worker busy; the prefill queued
// behind a request that then decodes, BusyProbe::pairs), and the busy_alpha
// written is the one with which the simulator, given the rest of the
// profile, reproduces that slowdown in the same scenario.
//
// Why not in closed form (1 / s = share / (1 + alpha x others)): part of the
// measured slowdown is what the simulator models already, separately: the
// serving processes' CPU (Profile::serving_cpu) on the shared cores, the
// KV hand-off waiting for the decode worker's step boundary, the decode
// step's batch of two. Charged to alpha as well, it was counted twice (run M
// of round 7: the 1P+1D TTFT p90 over-predicted by 13-19 % at every rate).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "sim/profile.h"
#include "sim/workload.h"

namespace kvrelay::sim {

// One of the measurements: a foreground client sending `fg_prompts`
// requests one at a time, starting at fg_start_s, beside a background client
// doing the same with its own shape from t = 0 (1P+1D, shared host).
//
// Or, with `pairs`, the way requests queue in serving: fg_prompts pairs of
// requests (fg_in / fg_out), the second pair_gap_s after the first (during
// its prefill, so it waits for it and then prefills while the first one
// decodes), pair_period_s between pairs (the cluster drained by then); no
// background. The figure: the median over the pairs of the second one's
// first token less the first one's (one prefill next to a fresh decode),
// against the median TTFT of the pairs' first ones (a prefill alone: each
// arrives at an idle cluster). Both come from the same pairs, so a host
// whose speed moves within minutes moves both.
struct BusyProbe {
  int64_t fg_prompts = 24, fg_in = 128, fg_out = 32;
  int64_t bg_prompts = 40, bg_in = 16, bg_out = 1024;
  double fg_start_s = 0.5;  // the background busy by then (calibrate waits for its CPU)
  bool tpot = false;        // the figure compared: the foreground's TPOT p50 (else TTFT p50)
  bool pairs = false;
  double pair_gap_s = 0.05, pair_period_s = 2.0;
};

// The pairs probe's workload (open loop, in arrival order), as `kvrelay bench
// serve --trace` replays it and as the simulator runs it.
std::vector<SimRequest> PairTrace(const BusyProbe& probe);

// From a pairs run (its requests' arrivals and first-token times, in
// workload order; a pair with a time missing, NaN, is left out): the median
// of each pair's second first token less its first, the median TTFT of the
// pairs' first ones, and slowdown = gap / lead_ttft (0 when either is 0).
// With `tpots` (each request's TPOT, workload order; <= 0 or NaN: none) also
// the decode's side of the same pairs: the first one decodes while the
// second one prefills, the second one decodes alone once that is done, so
// decode_slowdown = the median TPOT of the pairs' first ones over that of
// their second ones (0 without both).
struct PairFigures {
  double gap_s = 0, lead_ttft_s = 0, slowdown = 0, decode_slowdown = 0;
  size_t pairs = 0;
};
PairFigures PairsFigures(const std::vector<double>& arrivals,
                         const std::vector<double>& first_tokens,
                         const std::vector<double>& tpots = {});

// What of an alone TTFT does not hold the prefill worker (ServingOverhead::
// ttft_s: HTTP, routing, the first token's way back), from two alone TTFTs
// of the same minutes, a short prompt's and a long one's, and the step
// model's prefill of each: TTFT = outside + k x model, k (the serving path's
// scale of the engine's prefill, which drifts with the host) solved from the
// two. Unlike a long TTFT less a back-to-back gap (two ~700 ms figures
// minutes apart for a few-ms difference: 0 to 101 ms between calibrations),
// the short prompt's TTFT is mostly the outside part, so the host's drift
// moves it little. 0 at least; without a usable pair (long_model_s not above
// short_model_s, or the long TTFT not above the short one), the short
// prompt's TTFT less its model at k = 1.
double TtftOutsideWorker(double short_ttft_s, double short_model_s, double long_ttft_s,
                         double long_model_s);

// The foreground's figure next to the background over its figure alone (or
// the pairs' PairFigures::slowdown), as simulated with `profile` (its jitter
// left out: the figures are medians of a handful of requests whose draws
// differ between the two runs) on a host of `cores` cores, heartbeats every
// 0.5 s.
Result<double> SimulatedSlowdown(const Profile& profile, const BusyProbe& probe, int cores);

struct BusyFit {
  double prefill_alpha = 0, decode_alpha = 0;
  double prefill_slowdown = 0, decode_slowdown = 0;  // simulated with them
  std::string log;                                   // one line per round
};

// Sets profile->prefill.busy_alpha and decode.busy_alpha (each in [0, 4]) so
// that the simulated slowdowns of `prefill_probe` (the prefill next to a
// decode: calibrate's is a pairs probe) and `decode_probe` (a TPOT) are the
// measured ones:
// each by bisection (the slowdown grows with its role's alpha), the other
// held, alternating over three rounds (each scenario depends a little on the
// other role's alpha too). An alpha of 0 when the simulator reaches the
// measured slowdown without it.
Result<BusyFit> FitRoleBusyAlphas(Profile* profile, const BusyProbe& prefill_probe,
                                  double prefill_measured, const BusyProbe& decode_probe,
                                  double decode_measured, int cores);

// A TP group's terms for the shared host's fluid model (TpCost: cores,
// share_weight, busy_alpha, prefill_busy_alpha) from two probes on `cores`
// cores: the group's TPOT next to one busy core (slowdown decode_s) and the
// prefill worker's TTFT next to the group kept busy (prefill_s), both beside
// one process that wants one core. `cores_alone` is what the group's ranks
// keep busy alone (their CPU over their stepping time); it includes their
// spinning in the collectives, which gives way to a process that wants the
// core, so on an oversubscribed host the group is given the demand and the
// weight with which the max-min fair share (FairLevel) reproduces both
// slowdowns (no alphas): the prefill's share L = cores / (1 + weight) = 1 /
// prefill_s, the group's weight x L / demand = 1 / decode_s. The demand
// stays at most cores_alone (what is left of the group's slowdown is its
// busy_alpha; a slowdown below 1 counts as 1). When the two fit on the host
// the shares are whole and the slowdowns are the alphas.
struct TpSharing {
  double cores = 0, share_weight = 1, busy_alpha = 0, prefill_busy_alpha = 0;
};
TpSharing FitTpSharing(double cores, double cores_alone, double decode_s, double prefill_s);

}  // namespace kvrelay::sim
