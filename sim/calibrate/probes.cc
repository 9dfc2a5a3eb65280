// See probes.h.
#include "sim/calibrate/probes.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "engine/kv_cache/kv_cache.h"
#include "engine/runtime/model.h"
#include "sim/busy_fit.h"
#include "sim/stats.h"
#include "sim/workload.h"

namespace kvrelay::sim::calibrate {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// x with `digits` decimals, for the profile's source lines.
std::string Fixed(double x, int digits) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, x);
  return buf;
}

struct Sample {
  double seqs, tokens, attn, decode_attn, ctx_attn, seconds;
  std::string what;
  int decode_batch = 0;  // a decode-only step of this many sequences (0: a prefill)
};

// The step model's inputs for the bench engine measurements of one --json report.
void EngineSamples(const json& j, std::vector<Sample>* out) {
  const double ctx = j.value("context", 0.0);
  if (j.contains("prefill")) {
    const double n = j["prefill"].value("tokens", 0.0);
    out->push_back({1, n, n * (n + 1) / 2, 0, n * ctx, j["prefill"].value("median_s", 0.0),
                    "prefill " + std::to_string(static_cast<int>(n)) + " tok, ctx " +
                        std::to_string(static_cast<int>(ctx))});
  }
  for (const auto& d : j.value("decode", json::array())) {
    const double b = d.value("batch", 1.0), k = d.value("steps", 1.0);
    out->push_back({b, b, 0, b * (ctx + (k + 1) / 2), 0, d.value("median_step_s", 0.0),
                    "decode batch " + std::to_string(static_cast<int>(b)) + ", ctx " +
                        std::to_string(static_cast<int>(ctx)),
                    static_cast<int>(b)});
  }
}

// Fits latency + bytes / bandwidth through (bytes, seconds) points.
Result<LinkCost> FitLink(const std::vector<std::pair<double, double>>& pts,
                         const std::string& source) {
  std::vector<double> a, b, w;
  for (const auto& [bytes, s] : pts) {
    a.insert(a.end(), {1.0, bytes});
    b.push_back(s);
    w.push_back(1.0 / (s * s));
  }
  ASSIGN_OR_RETURN(auto x, NonNegativeLeastSquares(a, 2, b, w));
  if (x[1] <= 0) return Internal("link fit: no bandwidth term (" + source + ")");
  return LinkCost{x[0], 1.0 / x[1], source};
}

// The short prompts of ttft_s's probe.
constexpr int kShortPrompt = 4;

// The source line of a topology's low-load serving terms.
std::string ServeSource(const ProbeOptions& opt, const std::string& topo) {
  return "kvrelay bench serve --max-concurrency 1 --input-len " + std::to_string(opt.input_len) +
         " --output-len " + std::to_string(opt.output_len) + " on kvrelay launch (" + topo + ", " +
         std::to_string(opt.threads) + " thread per worker, KV " + opt.kv_dtype +
         "), p50 vs the step model, " + opt.date;
}

}  // namespace

Result<Profile> BaseProfile(const ProbeOptions& opt, int64_t kv_capacity_mb) {
  ASSIGN_OR_RETURN(const engine::KvDtype dtype, engine::ParseKvDtype(opt.kv_dtype));
  engine::ModelLoadOptions lo;
  lo.load_tokenizer = false;
  ASSIGN_OR_RETURN(auto m, engine::Model::Load(opt.model, lo));
  Profile p;
  p.hardware = opt.hardware;
  p.model = fs::path(opt.model).filename().string();
  p.measured_at = opt.date;
  const engine::KvLayout layout = m->MakeKvLayout(dtype, 16);
  p.layers = layout.layers;
  p.block_tokens = 16;
  p.kv_bytes_per_token = layout.BlockBytes() / 16;
  p.kv_pool_blocks = kv_capacity_mb * (1 << 20) / layout.BlockBytes();
  return p;
}

Result<StepCost> RunEngineSweep(const ProbeOptions& opt) {
  const std::string& model = opt.model;
  const std::string& kv_dtype = opt.kv_dtype;
  const std::string& date = opt.date;
  const std::string th = std::to_string(opt.threads);
  const std::string rp = std::to_string(opt.reps);
  StepCost step;
  std::vector<std::vector<std::string>> runs = {
      // Batches 2, 3 and 8 too: a decode-only step is not linear in a small
      // batch (StepCost::decode_batch_s).
      {"--pp", "32", "--tg", "16", "--batches", "2,3,4,8,16,64", "--batch-steps", "16", "--context",
       "0"},
      {"--pp", "128", "--tg", "16", "--batches", "4,16", "--batch-steps", "16", "--context", "256"},
      {"--pp", "256", "--tg", "8", "--skip-batches", "--context", "0"}};
  if (!opt.quick) {
    runs.push_back({"--pp", "512", "--tg", "8", "--skip-batches", "--context", "0"});
    runs.push_back(
        {"--pp", "64", "--tg", "16", "--batches", "4", "--batch-steps", "16", "--context", "768"});
  }
  std::vector<Sample> samples;
  for (const auto& r : runs) {
    const std::string path = TempPath("engine.json");
    std::vector<std::string> a = {"bench",  "engine", "--model",    model,    "--threads", th,
                                  "--reps", rp,       "--kv-dtype", kv_dtype, "--json",    path};
    a.insert(a.end(), r.begin(), r.end());
    auto o = RunSelf(a, 900);
    if (!o.ok()) return o.status();
    auto j = ReadJson(path);
    fs::remove(path);
    if (!j.ok()) return j.status();
    EngineSamples(*j, &samples);
    // tg: batch 1 from the context, averaged over its steps.
    const double ctx = j->value("context", 0.0), k = (*j)["tg"].value("tokens", 1.0);
    samples.push_back({1, 1, 0, ctx + (k + 1) / 2, 0, (*j)["tg"].value("median_step_s", 0.0),
                       "decode batch 1, ctx " + std::to_string(static_cast<int>(ctx)), 1});
  }
  {
    std::vector<double> a, b, w;
    for (const auto& s : samples) {
      a.insert(a.end(), {1.0, s.seqs, s.tokens, s.attn, s.decode_attn, s.ctx_attn});
      b.push_back(s.seconds);
      w.push_back(1.0 / (s.seconds * s.seconds));  // relative error
    }
    auto x = sim::NonNegativeLeastSquares(a, 6, b, w);
    if (!x.ok()) return x.status();
    step = {(*x)[0],
            (*x)[1],
            (*x)[2],
            (*x)[3],
            (*x)[4],
            (*x)[5],
            "kvrelay bench engine --threads " + th + " --reps " + rp +
                " (pp 32/256/512 at context 0, 128 at 256, 64 at 768; decode batch 1/2/3/4/8/16/64 "
                "at context 0, 1/4/16 at 256, 1/4 at 768), non-negative least squares weighted by "
                "1/t^2, " +
                date + ", " + opt.hardware,
            {},
            ""};
    std::fprintf(opt.log,
                 "step model: %.3f ms + %.3f ms/seq + %.4f ms/token + %.3g ms/(in-chunk pair) + "
                 "%.3g ms/(cached-context pair) + %.3g ms/(decode pair)\n",
                 step.base_s * 1e3, step.per_seq_s * 1e3, step.per_token_s * 1e3,
                 step.per_attn_s * 1e3, step.per_ctx_attn_s * 1e3, step.per_decode_attn_s * 1e3);
    // Decode-only steps by batch size: each size's measurements less the
    // fitted decode attention, weighted by 1/t^2 as above.
    std::map<int, std::pair<double, double>> by_batch;  // sum w x, sum w
    for (const auto& s : samples) {
      if (s.decode_batch < 1) continue;
      const double w = 1.0 / (s.seconds * s.seconds);
      auto& acc = by_batch[s.decode_batch];
      acc.first += w * (s.seconds - step.per_decode_attn_s * s.decode_attn);
      acc.second += w;
    }
    std::string sizes;
    for (const auto& [b, acc] : by_batch) {
      if (acc.first / acc.second > 0) step.decode_batch_s[b] = acc.first / acc.second;
      sizes += (sizes.empty() ? "" : "/") + std::to_string(b);
    }
    step.decode_batch_source =
        "kvrelay bench engine --threads " + th + " --reps " + rp + " batched decode (batches " +
        sizes +
        ") and tg (batch 1): per batch size, the weighted (1/t^2) mean of each measured step "
        "less per_decode_attn_s x its decode pairs, " +
        date + ", " + opt.hardware;
    std::fprintf(opt.log, "%-32s %12s %12s %8s %12s\n", "measurement", "measured ms", "model ms",
                 "error", "by batch ms");
    for (const auto& s : samples) {
      const double m2 = step.Seconds(s.seqs, s.tokens, s.attn, s.decode_attn, s.ctx_attn);
      std::fprintf(opt.log, "%-32s %12.3f %12.3f %+7.1f%%", s.what.c_str(), s.seconds * 1e3,
                   m2 * 1e3, 100 * (m2 - s.seconds) / s.seconds);
      if (s.decode_batch > 0) {
        const double m3 = step.DecodeOnlySeconds(s.decode_batch, s.decode_attn);
        std::fprintf(opt.log, " %12.3f (%+.1f%%)", m3 * 1e3, 100 * (m3 - s.seconds) / s.seconds);
      }
      std::fprintf(opt.log, "\n");
    }
    std::fprintf(opt.log, "decode-only step by batch (less decode attention):");
    for (const auto& [b, sec] : step.decode_batch_s)
      std::fprintf(opt.log, " %d: %.3f ms", b, sec * 1e3);
    std::fprintf(opt.log, "\n");
  }
  return step;
}

Result<HostContention> RunContentionProbe(const ProbeOptions& opt) {
  const std::string& model = opt.model;
  const std::string& kv_dtype = opt.kv_dtype;
  const std::string& date = opt.date;
  const std::string th = std::to_string(opt.threads);
  HostContention c = {0, 0, "not measured (--skip-contention or fewer than 2 cores): none"};
  {
    const std::vector<std::string> base = {"bench",      "engine",    "--model",
                                           model,        "--threads", th,
                                           "--kv-dtype", kv_dtype,    "--skip-batches"};
    auto with = [&](std::vector<std::string> a, const std::vector<std::string>& more) {
      a.insert(a.end(), more.begin(), more.end());
      return a;
    };
    const auto decode_fg = with(base, {"--pp", "16", "--tg", "64", "--reps", "3"});
    const auto prefill_fg = with(base, {"--pp", "128", "--tg", "1", "--reps", "5"});
    // Backgrounds long enough for any foreground (minutes), and finite.
    const auto prefill_bg = with(base, {"--pp", "512", "--tg", "1", "--reps", "200"});
    const auto decode_bg = with(base, {"--pp", "16", "--tg", "1024", "--reps", "30"});
    // The foreground's median (decode step or prefill pass) and its CPU
    // seconds in all, with `bg` running next to it when given.
    struct Timed {
      double median_s = 0, cpu_s = 0;
    };
    auto timed = [&](const std::vector<std::string>& fg, const std::vector<std::string>* bg,
                     bool decode) -> Result<Timed> {
      pid_t pid = -1;
      if (bg) {
        // Running (model loaded, computing) before the foreground starts.
        ASSIGN_OR_RETURN(pid, StartBusy(*bg));
      }
      const std::string path = TempPath("contention.json");
      Timed t;
      auto o = RunSelf(with(fg, {"--json", path}), 600, false, &t.cpu_s);
      StopBusy(pid);
      if (!o.ok()) return o.status();
      ASSIGN_OR_RETURN(json j, ReadJson(path));
      fs::remove(path);
      t.median_s =
          decode ? j["tg"].value("median_step_s", 0.0) : j["prefill"].value("median_s", 0.0);
      return t;
    };
    // The slowdown is read from the foreground's CPU time, not its wall
    // time: cache and memory-bandwidth interference make the same work take
    // more CPU, while other load on the machine (which the simulator does not
    // model) only delays it. On a quiet machine the two agree.
    std::vector<double> dr, pr;
    for (int round = 0; round < 2; ++round) {
      auto ds = timed(decode_fg, nullptr, true);
      auto dc = timed(decode_fg, &prefill_bg, true);
      auto ps = timed(prefill_fg, nullptr, false);
      auto pc = timed(prefill_fg, &decode_bg, false);
      for (const Status& st : {ds.status(), dc.status(), ps.status(), pc.status()}) {
        if (!st.ok()) return st;
      }
      if (ds->cpu_s > 0 && ps->cpu_s > 0) {
        dr.push_back(dc->cpu_s / ds->cpu_s);
        pr.push_back(pc->cpu_s / ps->cpu_s);
      }
      std::fprintf(
          opt.log,
          "contention round %d: decode (tg 64 x4) alone %.3f ms/step, %.2f s CPU; next to a "
          "prefill %.3f ms/step, %.2f s CPU. prefill (pp 128 x6) alone %.1f ms, %.2f s CPU; next "
          "to a decode %.1f ms, %.2f s CPU\n",
          round + 1, ds->median_s * 1e3, ds->cpu_s, dc->median_s * 1e3, dc->cpu_s,
          ps->median_s * 1e3, ps->cpu_s, pc->median_s * 1e3, pc->cpu_s);
    }
    if (!dr.empty()) {
      auto mean = [](const std::vector<double>& v) {
        double sum = 0;
        for (double x : v) sum += x;
        return sum / static_cast<double>(v.size());
      };
      c.decode_alpha = std::max(0.0, mean(dr) - 1);
      c.prefill_alpha = std::max(0.0, mean(pr) - 1);
      c.source =
          "kvrelay bench engine --threads " + th +
          " alone and next to a second bench engine process (decode tg 64 next to pp 512; pp "
          "128 next to tg 1024): the foreground's CPU seconds (model load included), the "
          "mean ratio of 2 rounds - 1 (0 at least), " +
          date;
      std::fprintf(opt.log, "contention: decode_alpha %.3f, prefill_alpha %.3f\n", c.decode_alpha,
                   c.prefill_alpha);
    }
  }
  return c;
}

Result<LinkCost> RunTransferProbe(const ProbeOptions& opt) {
  const std::string& date = opt.date;
  auto o = RunSelf({"bench", "transfer", "--backend", "tcp", "--min-bytes", "65536", "--max-bytes",
                    "16777216", "--no-overlap", "--no-raw"},
                   600);
  if (!o.ok()) return o.status();
  std::vector<std::pair<double, double>> pts;
  std::istringstream in(*o);
  std::string line;
  const std::regex row(R"(^\s*(\d+)\s+([0-9.]+)\s+([0-9.]+)\s+\d+%)");
  std::smatch mt;
  while (std::getline(in, line)) {
    if (std::regex_search(line, mt, row)) {
      const double n = std::stod(mt[1]), gbps = std::stod(mt[3]);
      if (gbps > 0) pts.push_back({n, n / (gbps * 1e9)});
    }
  }
  if (pts.size() < 2) return DataLoss("bench transfer printed no bandwidth table");
  auto l = FitLink(pts,
                   "kvrelay bench transfer --backend tcp --min-bytes 65536 --max-bytes "
                   "16777216 (forked receiver on this machine), latency + bytes/bandwidth "
                   "fit, " +
                       date);
  if (!l.ok()) return l.status();
  const LinkCost link = *l;
  std::fprintf(opt.log, "tcp: %.1f us + bytes / %.2f GB/s\n", link.latency_s * 1e6,
               link.bytes_per_s / 1e9);
  return link;
}

Result<LinkCost> RunStoreRestoreProbe(const ProbeOptions& opt, int64_t kv_bytes_per_token) {
  const std::string& model = opt.model;
  const std::string& kv_dtype = opt.kv_dtype;
  const std::string& date = opt.date;
  const std::string th = std::to_string(opt.threads);

  std::vector<std::pair<double, double>> pts;
  for (int seen : {256, 1024}) {
    auto o = RunSelf({"bench", "prefix", "--model", model, "--prompt-tokens",
                      std::to_string(seen + 16), "--seen-tokens", std::to_string(seen), "--reps",
                      "2", "--threads", th, "--kv-dtype", kv_dtype},
                     900);
    if (!o.ok()) return o.status();
    std::smatch mt;
    const std::regex re(R"(median restore only: ram ([0-9.]+) s, rocksdb ([0-9.]+) s)");
    if (!std::regex_search(*o, mt, re)) return DataLoss("bench prefix printed no restore time");
    pts.push_back(
        {static_cast<double>(seen) * static_cast<double>(kv_bytes_per_token), std::stod(mt[2])});
  }
  auto l = FitLink(pts,
                   "kvrelay bench prefix --seen-tokens 256/1024 (RocksDB after restart, "
                   "cold page cache), latency + bytes/bandwidth fit, " +
                       date);
  if (!l.ok()) return l.status();
  const LinkCost link = *l;
  std::fprintf(opt.log, "prefix store restore: %.2f ms + bytes / %.1f MB/s\n", link.latency_s * 1e3,
               link.bytes_per_s / 1e6);
  return link;
}

namespace {

// What every topology's serving probes share.
struct ServingSetup {
  const std::vector<std::string>& serve;  // the low-load bench serve run; ends with --seed S
  const std::string& pair_trace;          // the pairs probe's trace file
  double short_model_s;                   // the short prompts' prefill by the step model
};

// Slowdown probes: a run next to a background load, its p50 `metric`
// against the mean of the alone runs just before and just after it (fresh
// prompts each), so the machine's drift over the minutes of the calibration
// does not enter the ratio. Runs: alone, then per probe: busy, alone.
struct Probe {
  Background load;
  const char* metric;  // "ttft_ms" / "tpot_ms"
};

// One topology's bench serve runs, in order, and where its probes are.
struct TopologyRuns {
  bool tp = false, roles = false;  // which probes run
  std::vector<Probe> probes;
  std::vector<Background> bg;
  std::vector<std::vector<std::string>> runs;
  size_t short_before = SIZE_MAX, pairs_at = SIZE_MAX;
};

TopologyRuns PlanTopologyRuns(const ProbeOptions& opt, const Topology& t, const ServingSetup& setup,
                              const BusyProbe& dec_probe) {
  const std::string& model = opt.model;
  const std::string& kv_dtype = opt.kv_dtype;
  const std::string th = std::to_string(opt.threads);
  const int rounds = opt.rounds;
  const std::vector<std::string>& serve = setup.serve;
  const std::string& pair_trace = setup.pair_trace;
  // The TP 2 group runs a second time next to a process that keeps one
  // core busy (a prefill bench engine), as the prefill worker does.
  const bool tp = t.tp > 1 && UsableCores() >= 2;
  // 1P+1D runs the roles' probes (their busy_alpha): the decode next to
  // a second load generator through the same coordinator that keeps the
  // prefill worker computing long prompts one after another, and the
  // prefill's pairs (fresh prompts: the first run's are in its prefix
  // cache).
  const bool roles = t.colocated == 0 && t.tp == 1 && UsableCores() >= 2;
  auto with_seed = [&](int seed) {
    std::vector<std::string> a = serve;
    a.back() = std::to_string(seed);  // serve ends with --seed S
    return a;
  };
  // A second bench serve through the same coordinator, one request at a
  // time, that keeps `process` busy.
  auto busy_load = [](const sim::BusyProbe& b, int seed, const char* process) {
    return Background{
        SIZE_MAX,
        {"bench", "serve", "--url", "{url}", "--rate", "inf", "--max-concurrency", "1",
         "--num-prompts", std::to_string(b.bg_prompts), "--input-len", std::to_string(b.bg_in),
         "--output-len", std::to_string(b.bg_out), "--seed", std::to_string(seed)},
        process};
  };
  std::vector<Probe> probes;
  // `rounds` each (one such pair moved by x1.2 between two calibrations
  // an hour apart): the TP group's TPOT next to a core kept busy; the
  // decode role's TPOT next to the busy prefill worker.
  for (int rep = 0; tp && rep < rounds; ++rep) {
    probes.push_back({{SIZE_MAX,
                       {"bench", "engine", "--model", model, "--threads", th, "--kv-dtype",
                        kv_dtype, "--pp", "512", "--tg", "1", "--reps", "200", "--skip-batches"},
                       ""},
                      "tpot_ms"});
  }
  for (int rep = 0; roles && rep < rounds; ++rep) {
    probes.push_back({busy_load(dec_probe, 7002 + 10 * rep, "kvrelay-prefill"), "tpot_ms"});
  }
  std::vector<Background> bg;
  std::vector<std::vector<std::string>> runs = {serve};
  int seed = 4243;
  for (Probe& pr : probes) {
    pr.load.run = runs.size();
    bg.push_back(pr.load);
    runs.push_back(with_seed(seed++));
    runs.push_back(with_seed(seed++));
  }
  // The prefill's pairs probe (1P+1D, and the TP topology for the
  // prefill next to a TP group): the pairs trace `rounds` times. On 1P+1D
  // a run of kShortPrompt-token prompts, one at a time, comes before and
  // after them: their TTFT is mostly what of a TTFT is not the worker's
  // (HTTP, routing, the first token's way back; ServingOverhead::ttft_s,
  // not charged to the next prompt's wait), set against the pairs' first
  // ones (alone, in the same minutes) by sim::TtftOutsideWorker.
  auto short_run = [&] {
    return std::vector<std::string>{"--rate",
                                    "inf",
                                    "--max-concurrency",
                                    "1",
                                    "--num-prompts",
                                    opt.quick ? "8" : "24",
                                    "--input-len",
                                    std::to_string(kShortPrompt),
                                    "--output-len",
                                    "2",
                                    "--seed",
                                    std::to_string(seed++)};
  };
  const size_t short_before = roles ? runs.size() : SIZE_MAX;
  if (roles) runs.push_back(short_run());
  const size_t pairs_at = roles || tp ? runs.size() : SIZE_MAX;
  for (int rep = 0; (roles || tp) && rep < rounds; ++rep) {
    runs.push_back({"--trace", pair_trace, "--seed", std::to_string(seed++)});
  }
  if (roles) runs.push_back(short_run());
  return TopologyRuns{tp,           roles,   std::move(probes), std::move(bg), std::move(runs),
                      short_before, pairs_at};
}

// A slowdown probe's busy figure, the mean of its two alone ones, and their ratio.
struct Slowdown {
  double busy = 0, alone = 0, s = 0;
};

// The roles' probes on 1P+1D, into *fig and *p: the decode role's TPOT next
// to the busy prefill worker (`dec`, the medians of its rounds) and the
// prefill's pairs (their busy_source; the busy_alpha is fitted later,
// FitTpAndRoleTerms), and the short prompts' TTFT against the pairs' first
// ones (ServingOverhead::ttft_s). alone_fallback_ttft_s: the low-load run's
// TTFT p50, for when the pairs have no lead TTFT.
void FitRoleProbes(const ProbeOptions& opt, const Topology& t, const std::vector<ServeRun>& r,
                   const TopologyRuns& plan, const Slowdown& dec, const PairFigures& pairs,
                   double alone_fallback_ttft_s, double short_model_s, ServingFigures* fig,
                   Profile* profile) {
  const std::string& kv_dtype = opt.kv_dtype;
  const std::string& date = opt.date;
  const std::string th = std::to_string(opt.threads);
  const int rounds = opt.rounds;
  Profile& p = *profile;
  const double prefill_s = fig->prefill_s;
  const BusyProbe& pre_probe = fig->pre_probe;
  double& short_ttft_s = fig->short_ttft_s;
  double& ttft_outside_s = fig->ttft_outside_s;
  std::pair<double, double>& role_slowdown = fig->role_slowdown;
  const size_t short_before = plan.short_before, pairs_at = plan.pairs_at;
  // s = busy / alone of the role's figure; the busy_alpha that makes the
  // simulator reproduce it is fitted once the rest of the profile is
  // (below, sim::FitRoleBusyAlphas).
  const double tpot_alone = dec.alone, tpot_busy = dec.busy, sd = dec.s;
  const double sp = pairs.slowdown;
  if (sp > 0 && sd > 0) {
    role_slowdown = {sp, sd};
    const std::string how = "kvrelay bench serve --max-concurrency 1 --input-len " +
                            std::to_string(opt.input_len) + " --output-len " +
                            std::to_string(opt.output_len) + " on kvrelay launch (1P+1D, " + th +
                            " thread per worker, KV " + kv_dtype +
                            ") next to a second bench serve (--max-concurrency 1) that keeps ";
    // The figure each busy_source gives: "<metric> p50 <busy> ms vs <alone> alone (xs; ...)".
    auto source = [&](const char* metric, int digits, double busy, double alone, double s,
                      const char* keeps) {
      char fig[200];
      std::snprintf(fig, sizeof(fig),
                    "%s p50 %.*f ms vs %.*f alone (x%.3f; medians of %d rounds, each "
                    "against the alone runs just before and after it)",
                    metric, digits, busy, digits, alone, s, rounds);
      return how + keeps + ": " + fig +
             ", busy_alpha = what makes the simulator reproduce that slowdown in that "
             "scenario with the rest of this profile (sim/busy_fit.h), " +
             date;
    };
    p.prefill.busy_source =
        "kvrelay bench serve --trace of " + std::to_string(pre_probe.fg_prompts) + " pairs (" +
        std::to_string(opt.input_len) + " in / " + std::to_string(opt.output_len) +
        " out, the second " + Fixed(pre_probe.pair_gap_s * 1e3, 0) + " ms after the first, pairs " +
        Fixed(pre_probe.pair_period_s, 1) + " s apart; " + std::to_string(rounds) +
        " rounds) on kvrelay launch (1P+1D, " + th + " thread per worker, KV " + kv_dtype +
        "): the second's first token less the first's, median " + Fixed(pairs.gap_s * 1e3, 1) +
        " ms, against the first's TTFT, median " + Fixed(pairs.lead_ttft_s * 1e3, 1) +
        " ms (a prefill alone, in the same runs): x" + Fixed(sp, 3) +
        ", busy_alpha = what makes the simulator reproduce that in that scenario with the "
        "rest of this profile (sim/busy_fit.h), " +
        date;
    p.decode.busy_source = source("TPOT", 2, tpot_busy, tpot_alone, sd,
                                  "the prefill worker busy (--input-len 512 --output-len 1)");
  }
  std::fprintf(opt.log,
               "%-14s decode next to a busy prefill worker: TPOT p50 %.2f ms (alone %.2f, x%.3f)\n",
               t.name.c_str(), tpot_busy, tpot_alone, sd);
  // The short prompts' TTFTs (before and after the pairs, pooled)
  // against the pairs' first ones: sim::TtftOutsideWorker.
  std::vector<double> shorts;
  for (const size_t run : {short_before, pairs_at + static_cast<size_t>(rounds)}) {
    for (const json& q : r[run].report["requests"]) {
      if (q.value("ok", false) && q.value("ttft_ms", 0.0) > 0) {
        shorts.push_back(q.value("ttft_ms", 0.0) / 1e3);
      }
    }
  }
  short_ttft_s = sim::Percentile(&shorts, 0.5);
  const double alone_ttft_s = pairs.lead_ttft_s > 0 ? pairs.lead_ttft_s : alone_fallback_ttft_s;
  ttft_outside_s = sim::TtftOutsideWorker(short_ttft_s, short_model_s, alone_ttft_s, prefill_s);
  std::fprintf(
      opt.log,
      "%-14s %d-token prompts alone: TTFT p50 %.1f ms (engine model %.1f); %d-token: %.1f ms "
      "(the pairs' first ones; engine model %.1f) -> %.1f ms of a TTFT outside the prefill "
      "worker\n",
      t.name.c_str(), kShortPrompt, short_ttft_s * 1e3, short_model_s * 1e3,
      static_cast<int>(opt.input_len), alone_ttft_s * 1e3, prefill_s * 1e3, ttft_outside_s * 1e3);
}

// One topology's serving runs and what they measure, into *fig and *p.
Status ProbeTopology(const ProbeOptions& opt, const Topology& t, const ServingSetup& setup,
                     ServingFigures* fig, Profile* profile) {
  const std::string& model = opt.model;
  const std::string& kv_dtype = opt.kv_dtype;
  const int rounds = opt.rounds;
  Profile& p = *profile;
  const double short_model_s = setup.short_model_s;
  const double prefill_s = fig->prefill_s, decode_s = fig->decode_s;
  const BusyProbe& dec_probe = fig->dec_probe;
  std::vector<ServePoint>& pts = fig->pts;
  std::vector<double>& decode_cores = fig->decode_cores;
  double& tp_busy_slowdown = fig->tp_busy_slowdown;
  double& tp_engine_slowdown = fig->tp_engine_slowdown;
  double& tp_prefill_slowdown = fig->tp_prefill_slowdown;
  double& ttft_outside_s = fig->ttft_outside_s;
  TopologyRuns plan = PlanTopologyRuns(opt, t, setup, dec_probe);
  const bool tp = plan.tp, roles = plan.roles;
  const std::vector<Probe>& probes = plan.probes;
  const std::vector<std::vector<std::string>>& runs = plan.runs;
  const std::vector<Background>& bg = plan.bg;
  const size_t pairs_at = plan.pairs_at;
  auto r = ServeRuns(t, model, opt.threads, kv_dtype, opt.input_len, runs, bg);
  if (!r.ok()) return r.status();
  auto p50 = [&](size_t run, const char* what) { return (*r)[run].report[what].value("p50", 0.0); };
  auto slowdown = [&](size_t i) {
    const char* m = probes[i].metric;
    Slowdown d{p50(2 * i + 1, m), (p50(2 * i, m) + p50(2 * i + 2, m)) / 2, 0};
    d.s = d.alone > 0 ? d.busy / d.alone : 0;
    return d;
  };
  // Over the probe's rounds (probes 0 .. rounds - 1): the medians of the
  // busy figures, of the alone ones and of the ratios (one round's slow
  // spell does not move a median of four).
  auto median_of_rounds = [&] {
    std::vector<double> busy, alone, s;
    for (int i = 0; i < rounds; ++i) {
      const Slowdown d = slowdown(static_cast<size_t>(i));
      busy.push_back(d.busy);
      alone.push_back(d.alone);
      s.push_back(d.s);
    }
    return Slowdown{sim::Percentile(&busy, 0.5), sim::Percentile(&alone, 0.5),
                    sim::Percentile(&s, 0.5)};
  };
  // The pairs probe from its rounds (runs pairs_at ..), pooled:
  // sim::PairsFigures of their arrivals, first tokens and TPOTs.
  auto pair_times = [&](size_t run, std::vector<double>* arrivals, std::vector<double>* firsts,
                        std::vector<double>* tpots) {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    for (const json& q : (*r)[run].report["requests"]) {
      const bool ok = q.value("ok", false) && q.value("ttft_ms", 0.0) > 0;
      const double start = q.value("start_s", 0.0), tpot_ms = RequestTpotMs(q);
      arrivals->push_back(start);
      firsts->push_back(ok ? start + q.value("ttft_ms", 0.0) / 1e3 : nan);
      tpots->push_back(ok && tpot_ms > 0 ? tpot_ms / 1e3 : nan);
    }
    if (firsts->size() % 2 == 1) {  // (a trace of pairs: cannot happen)
      arrivals->pop_back();
      firsts->pop_back();
      tpots->pop_back();
    }
  };
  sim::PairFigures pairs;
  if (pairs_at != SIZE_MAX) {
    std::vector<double> arrivals, firsts, tpots;
    for (int rep = 0; rep < rounds; ++rep) {
      pair_times(pairs_at + static_cast<size_t>(rep), &arrivals, &firsts, &tpots);
    }
    pairs = sim::PairsFigures(arrivals, firsts, tpots);
    std::fprintf(
        opt.log,
        "%-14s pairs: the second's first token %.1f ms after the first's, the first's TTFT "
        "%.1f ms (medians of %zu pairs): a queued prefill next to a fresh decode x%.3f; the "
        "first's TPOT over the second's (a decode next to that prefill): x%.3f\n",
        t.name.c_str(), pairs.gap_s * 1e3, pairs.lead_ttft_s * 1e3, pairs.pairs, pairs.slowdown,
        pairs.decode_slowdown);
  }
  if (roles) {
    FitRoleProbes(opt, t, *r, plan, median_of_rounds(), pairs, p50(0, "ttft_ms") / 1e3,
                  short_model_s, fig, &p);
  }
  if (tp) {
    const Slowdown core = median_of_rounds();
    // The group's slowdown next to the prefill worker is the pairs'
    // (the first one decodes while the prefill worker computes the
    // second and streams its KV to both ranks): x1.22-1.37 in runs where
    // a bench engine beside it gave x1.11-1.21, and validation round
    // 13's TP 2 requests that decoded beside a busy prefill worker were
    // 8-42 % slower than simulated with the latter (docs/BENCHMARKS.md,
    // round 14). The bench engine's is the fallback (no pairs with TPOTs).
    tp_busy_slowdown = pairs.decode_slowdown > 0 ? pairs.decode_slowdown : core.s;
    tp_engine_slowdown = core.s;
    // Of the prefill worker's own time (the figure less what of the
    // first's TTFT is outside the worker, from 1P+1D's short prompts).
    const double own = pairs.lead_ttft_s - ttft_outside_s;
    tp_prefill_slowdown = own > 0 ? pairs.gap_s / own : 0;
    std::fprintf(opt.log,
                 "%-14s next to a bench engine prefill: TPOT p50 %.2f ms (alone %.2f, x%.3f); next "
                 "to the prefill worker (pairs): x%.3f (used)\n",
                 t.name.c_str(), core.busy, core.alone, core.s, tp_busy_slowdown);
  }
  const json& j = r->front().report;
  const auto& cpu = r->front().cpu_s;
  // The TP topology's variation is not kept (its roles' are 1P+1D's);
  // sim validate re-measures each topology's own.
  if (t.tp == 1) FitJitter(t, j, &p);
  pts.push_back({j["ttft_ms"].value("p50", 0.0) / 1e3, j["tpot_ms"].value("p50", 0.0) / 1e3});
  double tokens = 0;
  for (const auto& q : j["requests"]) tokens += q.value("output_tokens", 0.0);
  auto cpu_of = [&](const char* name) {
    auto it = cpu.find(name);
    return it == cpu.end() ? 0.0 : it->second;
  };
  // One request at a time: the decode processes step from the first
  // token to the last of each request and wait otherwise. Their cores
  // while stepping, pooled over every alone
  // run of this topology (runs 0, 2, .., one each side of every busy run):
  // one run's figure moved from 1.12 to 1.43 cores between calibrations.
  double alone_cpu = 0, alone_wall = 0;
  for (size_t i = 0; i <= 2 * probes.size(); i += 2) {
    for (const auto& q : (*r)[i].report["requests"]) {
      alone_wall += (q.value("e2e_ms", 0.0) - q.value("ttft_ms", 0.0)) / 1e3;
    }
    auto it = (*r)[i].cpu_s.find("kvrelay-decode");
    if (it != (*r)[i].cpu_s.end()) alone_cpu += it->second;
  }
  decode_cores.push_back(alone_wall > 0 ? alone_cpu / alone_wall : 0);
  std::fprintf(opt.log,
               "%-14s low load: TTFT p50 %.1f ms (engine model %.1f), TPOT p50 %.2f ms (engine "
               "model %.2f); CPU per output token: coordinator %.3f ms, decode %.2f ms (%.2f cores "
               "while decoding, %zu alone runs pooled)\n",
               t.name.c_str(), pts.back().ttft_s * 1e3, prefill_s * 1e3, pts.back().tpot_s * 1e3,
               decode_s * 1e3, tokens > 0 ? cpu_of("kvrelay-coordin") / tokens * 1e3 : 0,
               tokens > 0 ? cpu_of("kvrelay-decode") / tokens * 1e3 : 0, decode_cores.back(),
               probes.size() + 1);
  return Status::Ok();
}

}  // namespace

Result<ServingFigures> RunServingPathProbes(const ProbeOptions& opt, Profile* profile) {
  Profile& p = *profile;
  {
    const auto [prefill_s, decode_s] = LowLoadModel(p, opt.input_len, opt.output_len);
    // The short prompts' prefill by the step model.
    const double short_model_s =
        p.step.Seconds(1, kShortPrompt, kShortPrompt * (kShortPrompt + 1) / 2.0);
    const std::vector<std::string> serve = {"--rate",
                                            "inf",
                                            "--max-concurrency",
                                            "1",
                                            "--num-prompts",
                                            opt.quick ? "4" : "24",
                                            "--input-len",
                                            std::to_string(opt.input_len),
                                            "--output-len",
                                            std::to_string(opt.output_len),
                                            "--seed",
                                            "4242"};
    // The roles' two probes (run below, then simulated for their busy_alpha):
    // pairs of this run's requests, the second one queued behind the first
    // and then prefilling while the first one decodes (sim::BusyProbe::
    // pairs: the way a prefill meets a decode in serving; a prefill next to
    // a decode worker kept busy by long outputs from a second client was
    // slowed x1.11-1.15 where the queued ones of the validation runs were
    // slowed x1.00-1.03), and this run's requests beside long prompts that
    // keep the prefill worker busy.
    sim::BusyProbe pre_probe, dec_probe;
    pre_probe.fg_prompts = opt.quick ? 2 : 12;  // pairs, per round
    dec_probe.fg_prompts = opt.quick ? 4 : 24;
    pre_probe.fg_in = dec_probe.fg_in = opt.input_len;
    pre_probe.fg_out = dec_probe.fg_out = opt.output_len;
    pre_probe.pairs = true;
    // A pair (two prefills back to back, then the second one's decode) is
    // over before the next one arrives, or the next pair's first one is not
    // alone: 1.75 x the step model's pair (the serving path adds ~15 %), 2 s
    // at least, in half seconds. (An AVX2-only host takes ~1.95 s a pair, so
    // 2 s pairs overlapped and the fit went to its bound.)
    {
      const double pair_s = 2 * prefill_s + static_cast<double>(opt.output_len) * decode_s;
      pre_probe.pair_period_s = std::max(2.0, std::ceil(2 * 1.75 * pair_s) / 2);
    }
    dec_probe.bg_prompts = 400, dec_probe.bg_in = 512, dec_probe.bg_out = 1;
    dec_probe.tpot = true;
    const std::string pair_trace = TempPath("pairs.csv");
    if (Status st = sim::SaveTrace(pair_trace, sim::PairTrace(pre_probe)); !st.ok()) {
      return st;
    }
    ServingFigures fig{prefill_s, decode_s, {}, {}, 0, 0, 0, 0, 0, {0, 0}, pre_probe, dec_probe};
    const ServingSetup setup{serve, pair_trace, short_model_s};
    for (const auto& t : Topologies(opt.colocated)) {
      RETURN_IF_ERROR(ProbeTopology(opt, t, setup, &fig, &p));
    }
    return fig;
  }
}

TpSharing FitServingPathTerms(const ProbeOptions& opt, const ServingFigures& fig,
                              Profile* profile) {
  Profile& p = *profile;
  const auto& [prefill_s, decode_s, pts, decode_cores, tp_busy_slowdown, tp_engine_slowdown,
               tp_prefill_slowdown, short_ttft_s, ttft_outside_s, role_slowdown, pre_probe,
               dec_probe] = fig;
  auto source = [&](const std::string& topo) { return ServeSource(opt, topo); };
  {
    const auto& topos = Topologies(opt.colocated);
    FitServingTerms(topos[0], pts[0], prefill_s, decode_s, false, &p);
    p.colocated.source = source(topos[0].name);
    p.prefill.ttft_s = ttft_outside_s;
    FitServingTerms(topos[1], pts[1], prefill_s, decode_s, false, &p);
    p.prefill.source = source("1P+1D") + "; step_scale 1 (its steps have no decode part)";
    if (short_ttft_s > 0) {
      p.prefill.source +=
          "; ttft_s (what of a TTFT does not hold the prefill worker) = "
          "sim::TtftOutsideWorker of the median TTFT of " +
          std::to_string(kShortPrompt) +
          "-token prompts sent one at a time (--output-len 2, a run before and "
          "one after the pairs probe: " +
          Fixed(short_ttft_s * 1e3, 1) + " ms) and the pairs' first ones (alone, between them)";
    }
    p.decode.source = source("1P+1D");
    // The TP 2 group's terms (sim::FitTpSharing): its ranks' CPU over its
    // stepping time (at most 2; 2 when not measurable), and the demand,
    // share_weight and alphas with which the fluid model reproduces both TP
    // probes: its TPOT next to a busy core, the prefill's TTFT next to it.
    const double n_cores = UsableCores();
    const double tp_cores = decode_cores[2] > 0.05 ? std::min(2.0, decode_cores[2]) : 2.0;
    sim::TpSharing sharing;
    sharing.cores = decode_cores[2] > 0.05 ? tp_cores : 0.0;
    sharing.prefill_busy_alpha = -1;
    // The prefill's pairs slowdown is of first-token gaps: the worker's own.
    if (tp_busy_slowdown > 0 && tp_prefill_slowdown > 0) {
      sharing = sim::FitTpSharing(n_cores, tp_cores, tp_busy_slowdown, tp_prefill_slowdown);
    }
    std::fprintf(
        opt.log,
        "TP 2 group: %.2f cores from its CPU, TPOT x%.3f next to the prefill worker, the prefill "
        "worker's own time x%.3f next to it -> cores %.3f, share_weight %.3f, busy_alpha %.3f, "
        "prefill_busy_alpha "
        "%.3f\n",
        decode_cores[2], tp_busy_slowdown, tp_prefill_slowdown, sharing.cores, sharing.share_weight,
        sharing.busy_alpha, sharing.prefill_busy_alpha);
    return sharing;
  }
}

Result<ServingCpu> RunServingCpuProbe(const ProbeOptions& opt) {
  const std::string& model = opt.model;
  const std::string& kv_dtype = opt.kv_dtype;
  const std::string& date = opt.date;
  const std::string th = std::to_string(opt.threads);
  {
    const Topology& t = Topologies(opt.colocated)[0];
    const std::string n = opt.quick ? "16" : "48";
    auto run_with = [&](const char* out_len, const char* seed) {
      return std::vector<std::string>{"--rate",
                                      "inf",
                                      "--max-concurrency",
                                      "2",
                                      "--num-prompts",
                                      n,
                                      "--input-len",
                                      std::to_string(opt.input_len),
                                      "--output-len",
                                      out_len,
                                      "--seed",
                                      seed};
    };
    std::map<std::string, double> idle;
    auto r =
        ServeRuns(t, model, opt.threads, kv_dtype, opt.input_len,
                  {run_with(std::to_string(opt.output_len).c_str(), "5151"), run_with("2", "5252")},
                  {}, &idle);
    if (!r.ok()) return r.status();
    auto fit = [&](auto cpu_of_run, double idle_per_s, double* per_request, double* per_token) {
      std::vector<double> a, b, w;
      for (const ServeRun& run : *r) {
        a.push_back(run.report.value("completed", 0.0));
        a.push_back(run.report.value("total_output_tokens", 0.0));
        b.push_back(std::max(0.0, cpu_of_run(run) - idle_per_s * run.wall_s));
        w.push_back(1.0);
      }
      auto x = sim::NonNegativeLeastSquares(a, 2, b, w);
      if (!x.ok()) return x.status();
      *per_request = std::max(0.0, (*x)[0]);  // no "-0" from the refit
      *per_token = std::max(0.0, (*x)[1]);
      return Status::Ok();
    };
    ServingCpu s;
    const double coord_idle = idle.count("kvrelay-coordin") ? idle["kvrelay-coordin"] : 0.0;
    Status st = fit(
        [](const ServeRun& run) {
          auto it = run.cpu_s.find("kvrelay-coordin");
          return it == run.cpu_s.end() ? 0.0 : it->second;
        },
        coord_idle, &s.coordinator_per_request_s, &s.coordinator_per_token_s);
    if (st.ok()) {
      st = fit([](const ServeRun& run) { return run.client_cpu_s; }, 0.0, &s.client_per_request_s,
               &s.client_per_token_s);
    }
    if (!st.ok()) return st;
    char line[400];
    std::snprintf(line, sizeof(line),
                  "coordinator %.3f s + %.3f s CPU, client %.3f s + %.3f s CPU over %s "
                  "requests of %lld / 2 output tokens (wall %.1f s + %.1f s); coordinator "
                  "idle %.4f cores",
                  (*r)[0].cpu_s["kvrelay-coordin"], (*r)[1].cpu_s["kvrelay-coordin"],
                  (*r)[0].client_cpu_s, (*r)[1].client_cpu_s, n.c_str(),
                  static_cast<long long>(opt.output_len), (*r)[0].wall_s, (*r)[1].wall_s,
                  coord_idle);
    s.source = "kvrelay bench serve --rate inf --max-concurrency 2 --num-prompts " + n +
               " --input-len " + std::to_string(opt.input_len) + " --output-len " +
               std::to_string(opt.output_len) + " and 2 on kvrelay launch (" + t.name +
               "): the coordinator's CPU (/proc, 10 ms ticks) less its idle CPU over the "
               "same wall time, the client's (getrusage); per request and per output token "
               "solved from the two runs: " +
               line + ", " + date;
    std::fprintf(
        opt.log,
        "serving path CPU: coordinator %.2f ms/request + %.3f ms/output token, client %.2f "
        "ms/request + %.3f ms/output token (%s)\n",
        s.coordinator_per_request_s * 1e3, s.coordinator_per_token_s * 1e3,
        s.client_per_request_s * 1e3, s.client_per_token_s * 1e3, line);
    return s;
  }
}

Status FitTpAndRoleTerms(const ProbeOptions& opt, const ServingFigures& fig,
                         const TpSharing& sharing, Profile* profile) {
  Profile& p = *profile;
  const auto& [prefill_s, decode_s, pts, decode_cores, tp_busy_slowdown, tp_engine_slowdown,
               tp_prefill_slowdown, short_ttft_s, ttft_outside_s, role_slowdown, pre_probe,
               dec_probe] = fig;
  const int rounds = opt.rounds;
  const auto& topos = Topologies(opt.colocated);
  auto source = [&](const std::string& topo) { return ServeSource(opt, topo); };
  {
    sim::TpCost& tp2 = p.tp[2];
    tp2.source = source("1P+1D TP2") +
                 "; TP 2 step / TP 1 step; cores = the ranks' CPU seconds (/proc) over the "
                 "decode time (" +
                 Fixed(decode_cores[2], 3) +
                 " alone, its alone runs pooled); cores, share_weight and the alphas reproduce "
                 "(sim::FitTpSharing) the "
                 "group's TPOT next to the prefill worker and the prefill's next to the "
                 "group, both from the prefill role's pairs probe on this topology (" +
                 std::to_string(rounds) +
                 " rounds pooled; see prefill.busy_source): the median TPOT of the pairs' first "
                 "ones, which decode while the second ones prefill, over that of the second "
                 "ones: x" +
                 Fixed(tp_busy_slowdown, 3) +
                 " (next to a bench engine prefill that keeps a core busy instead: x" +
                 Fixed(tp_engine_slowdown, 3) + ", the median of " + std::to_string(rounds) +
                 " rounds, not used); a queued prefill next to the group's fresh decode: x" +
                 Fixed(tp_prefill_slowdown, 3);
    tp2.cores = sharing.cores;
    tp2.busy_alpha = sharing.busy_alpha;
    tp2.share_weight = sharing.share_weight;
    tp2.prefill_busy_alpha = sharing.prefill_busy_alpha;
    FitServingTerms(topos[2], pts[2], prefill_s, decode_s, false, &p);
    // 4c. The roles' busy_alpha, now that every other term is known: the
    //     scenarios of the probes above, simulated.
    if (role_slowdown.first > 0) {
      auto fit = sim::FitRoleBusyAlphas(&p, pre_probe, role_slowdown.first, dec_probe,
                                        role_slowdown.second, UsableCores());
      if (!fit.ok()) return fit.status();
      std::fprintf(opt.log, "roles' busy_alpha fitted by simulating their probes:\n%s",
                   fit->log.c_str());
    }
  }
  return Status::Ok();
}

}  // namespace kvrelay::sim::calibrate
