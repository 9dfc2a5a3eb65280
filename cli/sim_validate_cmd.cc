// kvrelay sim validate --model M --profile P: runs the real single-host
// topologies with this binary's `bench serve`, replays the same arrivals in
// the simulator and compares TTFT / TPOT p50 and p90 and throughput. The
// work is sim/validate/'s; this file parses the flags and prints.

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cli/command.h"
#include "common/clock.h"
#include "common/flags.h"
#include "sim/calibrate/serve_harness.h"
#include "sim/profile.h"
#include "sim/validate/compare.h"
#include "sim/validate/points.h"
#include "sim/validate/report.h"

namespace kvrelay::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using sim::calibrate::Topology;
using namespace sim::validate;  // NOLINT(build/namespaces): the command's library

constexpr char kSimValidateUsage[] =
    "sim validate --model M --profile P [--rates 0.5,1,1.5] [--seconds-per-point 40 | "
    "--num-prompts N] [--min-prompts 16] [--repeats 1] [--input-len 128] [--output-len 32] "
    "[--topologies colocated,1p1d,1p1d-tp2] [--save-real DIR | --from-real DIR] "
    "[--phases 8] [--retime-every point|repeat [--retime-lows 2] | --no-retime] [--no-jitter] "
    "[--per-request] "
    "[--json OUT]";

int Fail(const Status& s) {
  std::fprintf(stderr, "sim validate: %s\n", s.ToString().c_str());
  return 1;
}

// The command's flags, checked.
struct ValidateArgs {
  ValidateArgs(Flags f, sim::Profile p) : flags(std::move(f)), profile(std::move(p)) {}
  Flags flags;
  sim::Profile profile;  // --profile, without its jitter with --no-jitter
  std::string model, which, save_dir, from_dir;
  PointPlan plan;
  sim::validate::ServeSetup setup;
  int64_t phases = 8, colocated = 2;
  bool no_jitter = false, per_request = false;
};

// The flags, or the exit status after printing why not.
std::optional<ValidateArgs> ParseValidateArgs(const std::vector<std::string>& args, int* code) {
  *code = 2;
  auto f = Flags::Parse(
      args,
      {"model", "profile", "rates", "num-prompts", "seconds-per-point", "min-prompts", "repeats",
       "phases", "input-len", "output-len", "threads", "kv-dtype", "colocated", "json",
       "topologies", "save-real", "from-real", "retime-every", "retime-lows"},
      {"help", "per-request", "no-retime", "no-jitter"});
  if (!f.ok()) {
    std::fprintf(stderr, "sim validate: %s\n", f.status().message().c_str());
    return std::nullopt;
  }
  if (!f->Has("profile")) {
    std::fprintf(stderr, "sim validate: --profile PATH is required (kvrelay sim calibrate)\n");
    return std::nullopt;
  }
  auto profile = sim::LoadProfile(f->Get("profile"));
  if (!profile.ok()) {
    *code = Fail(profile.status());
    return std::nullopt;
  }
  if (f->Has("no-jitter")) DropJitter(&*profile);
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
    if (!s.ok()) {
      *code = Fail(s);
      return std::nullopt;
    }
  }
  if (*repeats < 1 || *repeats > 9 || *phases < 1 || *phases > 64 || *n < 0 || !(*seconds > 0) ||
      *min_prompts < 1 || *retime_lows < 2 || *retime_lows > 64) {
    std::fprintf(stderr,
                 "sim validate: --repeats in [1, 9], --phases in [1, 64], --num-prompts >= 0, "
                 "--seconds-per-point > 0, --min-prompts >= 1, --retime-lows in [2, 64]\n");
    return std::nullopt;
  }
  if (f->Has("save-real") && f->Has("from-real")) {
    std::fprintf(stderr, "sim validate: --save-real and --from-real exclude each other\n");
    return std::nullopt;
  }
  ValidateArgs a(*f, std::move(*profile));
  std::stringstream ss(f->Get("rates", "0.5,1,1.5"));
  std::string tok;
  while (std::getline(ss, tok, ',')) {
    char* end = nullptr;
    const double r = std::strtod(tok.c_str(), &end);
    if (end == tok.c_str() || !(r > 0)) {
      std::fprintf(stderr, "sim validate: bad --rates entry '%s'\n", tok.c_str());
      return std::nullopt;
    }
    a.plan.rates.push_back(r);
  }
  a.model = f->Get("model", "models/SmolLM2-135M-Instruct.Q4_1.gguf");
  a.which = f->Get("topologies", "colocated,1p1d,1p1d-tp2");
  a.save_dir = f->Get("save-real");
  a.from_dir = f->Get("from-real");
  if (!a.save_dir.empty()) {
    std::error_code ec;
    fs::create_directories(a.save_dir, ec);
    if (ec) {
      *code = Fail(InvalidArgument("cannot create " + a.save_dir + ": " + ec.message()));
      return std::nullopt;
    }
  }
  a.plan.repeats = static_cast<size_t>(*repeats);
  a.plan.num_prompts = *n;
  a.plan.seconds_per_point = *seconds;
  a.plan.min_prompts = *min_prompts;
  a.plan.input_len = *in;
  a.plan.output_len = *out;
  a.plan.retime_lows = *retime_lows;
  a.setup = {a.model, static_cast<int>(*threads), f->Get("kv-dtype", "f16")};
  a.phases = *phases;
  a.colocated = *colocated;
  a.no_jitter = f->Has("no-jitter");
  a.per_request = f->Has("per-request");
  // Re-timing (the default): low-load runs next to each point re-fit the
  // topology's serving-path terms and variation (sim/validate/points.h); on
  // this kind of host the serving path's speed drifts by up to ~25 % within
  // minutes. The table with the profile as given is printed as well.
  a.plan.retime = !f->Has("no-retime");
  const std::string every = f->Get("retime-every", "point");
  if (every != "point" && every != "repeat") {
    std::fprintf(stderr, "sim validate: --retime-every is point or repeat\n");
    return std::nullopt;
  }
  a.plan.per_point = every == "point";
  return a;
}

double PrintCellsWithin(const CellsWithin& c, const char* what) {
  std::printf("%s: cells within 15%%: %lld of %lld; max relative error %.3f\n", what,
              static_cast<long long>(c.within), static_cast<long long>(c.cells), c.max_err);
  return c.max_err;
}

// Everything after the table; writes --json.
void PrintSummary(const ValidateArgs& a, const std::vector<Compared>& rows, const json& report,
                  double wall_s, const std::string& load_start) {
  std::printf("requests alone in the cluster, real / simulated (medians; the profile's drift):");
  for (const AloneDrift& d : ComputeAloneDrift(rows)) {
    std::printf(" %s n=%zu TTFT %+.1f%% TPOT %+.1f%%;", d.topology.c_str(), d.n,
                100 * (d.ttft_ratio - 1), 100 * (d.tpot_ratio - 1));
  }
  std::printf("\n");
  if (a.plan.repeats > 1) std::fputs(FormatSpreads(rows, a.plan.repeats).c_str(), stdout);
  const SamplingFloor floor = ComputeSamplingFloor(rows);
  std::printf(
      "sampling floor (the real runs' even vs odd requests of each point, TTFT/TPOT cells): "
      "%lld of %lld within 15%%; median %.3f, max %.3f\n",
      static_cast<long long>(floor.within), static_cast<long long>(floor.cells), floor.median,
      floor.max);
  // Each repeat's own percentiles, medians over the repeats: p90s of 20-60
  // requests, which swing far more from repeat to repeat than the pooled ones.
  const double max_by_repeat =
      PrintCellsWithin(CountCellsWithin(
                           rows, [](const Compared& r) { return r.real_by_repeat_m; },
                           [](const Compared& r) { return r.sim_by_repeat_m; }),
                       "median over the repeats of each repeat's own figures (not pooled)");
  // The serving terms as sim calibrate measured them, not re-timed: how much
  // of the error is the machine's drift since then.
  const double max_as_given =
      PrintCellsWithin(CountCellsWithin(
                           rows, [](const Compared& r) { return r.real_m; },
                           [](const Compared& r) { return r.sim_as_given_m; }),
                       "with the profile as given (serving terms not re-timed)");
  if (!a.plan.retime) std::printf("(--no-retime: the table above is the profile as given)\n");
  std::vector<double> errs, spreads;
  double max_err = 0;
  for (const auto& row : rows) {
    for (int k = 0; k < kMetrics; ++k) {
      errs.push_back(RelErr(row.sim_m[k], row.real_m[k]));
      max_err = std::max(max_err, errs.back());
      spreads.push_back(row.real_spread[k]);
    }
  }
  const double median_err = Median(errs);
  const auto within = std::count_if(errs.begin(), errs.end(), [](double x) { return x <= 0.15; });
  if (a.from_dir.empty()) {
    std::printf("%s; real runs from %s (start) to %s (end)\n", sim::calibrate::UtcNow().c_str(),
                load_start.c_str(), sim::calibrate::LoadLine().c_str());
  }
  std::printf("cells within 15%%: %lld of %zu; median relative error %.3f; %.0f s\n",
              static_cast<long long>(within), errs.size(), median_err, wall_s);
  if (a.plan.repeats > 1) {
    std::printf(
        "real run-to-run spread over %lld repeats ((max - min) / median): median %.3f, max %.3f\n",
        static_cast<long long>(a.plan.repeats), Median(spreads),
        *std::max_element(spreads.begin(), spreads.end()));
  }
  if (a.flags.Has("json")) {
    std::ofstream o(a.flags.Get("json"));
    o << json{{"profile", a.flags.Get("profile")},
              {"date", sim::calibrate::UtcNow()},
              {"cpu", sim::calibrate::CpuModel()},
              {"rows", report},
              {"median_relative_error", median_err},
              {"retimed", a.plan.retime},
              {"retime_every", a.plan.retime ? (a.plan.per_point ? "point" : "repeat") : "none"},
              {"max_relative_error_as_given", max_as_given},
              {"max_relative_error_by_repeat", max_by_repeat},
              {"max_relative_error", max_err}}
             .dump(2)
      << "\n";
  }
  std::printf("max relative error: %.3f\n", max_err);
}

int RunValidate(const std::vector<std::string>& args) {
  if (PrintHelpIfAsked(args, kSimValidateUsage)) return 0;
  int code = 0;
  auto parsed = ParseValidateArgs(args, &code);
  if (!parsed) return code;
  ValidateArgs& a = *parsed;
  const sim::Profile& profile = a.profile;
  std::vector<Compared> rows;
  const auto& topos = sim::calibrate::Topologies(static_cast<int>(a.colocated));
  const char* keys[] = {"colocated", "1p1d", "1p1d-tp2"};
  const TimePoint t0 = Clock::now();
  const std::string load_start = sim::calibrate::LoadLine();
  for (size_t ti = 0; ti < topos.size(); ++ti) {
    if (("," + a.which + ",").find("," + std::string(keys[ti]) + ",") == std::string::npos)
      continue;
    const Topology& t = topos[ti];
    auto runs = a.from_dir.empty() ? RunRealPoints(t, keys[ti], a.plan, a.setup, a.save_dir)
                                   : LoadRealRuns(a.from_dir, keys[ti], a.plan);
    if (!runs.ok()) return Fail(runs.status());
    a.plan.per_point = runs->per_point;  // what a saved set has
    const RetimeResult timed = RetimePoints(profile, t, *runs, a.plan, a.no_jitter);
    std::fputs(FormatRetimed(t, a.plan, timed).c_str(), stdout);
    auto points = SimulatePoints(t, *runs, timed, profile, a.plan, a.phases);
    if (!points.ok()) return Fail(points.status());
    for (auto& row : *points) rows.push_back(std::move(row));
  }
  const double wall_s = SecondsSince(t0);
  std::fputs(FormatTable(rows, a.per_request).c_str(), stdout);
  json report = json::array();
  for (const auto& row : rows) report.push_back(RowReport(row));
  PrintSummary(a, rows, report, wall_s, load_start);
  return 0;
}

}  // namespace

KVRELAY_COMMAND(sim_validate, "sim validate", kSimValidateUsage, RunValidate);

}  // namespace kvrelay::cli
