// `kvrelay bench engine`: llama-bench-style throughput of the CPU engine on a
// GGUF model, measured on the real forward pass (engine/runtime/forward.h):
//   pp<P>  one sequence, P random prompt tokens in one step (logits for the last)
//   tg<G>  one sequence generating G tokens one step at a time from an empty cache
//   decode at batch B: B sequences, each one token per step, for --batch-steps steps
// Each figure is the median of --reps timed runs after one warm-up run, in
// tokens per second. --profile adds the matmul-only time of one decode token
// (all layer matrices + LM head, same pool) to show where the time goes.
// --context C starts every timed pass after C positions already in the cache
// (computed once, untimed; decode sequences share those blocks read-only, as
// prefix-cache hits do), so prefill and decode cost can be measured as a
// function of cached context. --json OUT writes the medians in seconds (the
// cluster simulator's `kvrelay sim calibrate` reads them).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "cli/command.h"
#include "common/flags.h"
#include "common/thread_pool.h"
#include "engine/kernels/matmul.h"
#include "engine/kv_cache/kv_cache.h"
#include "engine/runtime/forward.h"
#include "engine/runtime/model.h"

namespace kvrelay::cli {
namespace {

using engine::BlockId;
using engine::ForwardOutput;
using engine::ForwardPass;
using engine::LogitRows;
using engine::MakeSeqStep;
using engine::SeqStep;

struct Stats {
  double median = 0, min = 0, max = 0;
};

Stats Summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v.front(), v.back()};
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

class Bench {
 public:
  Bench(const engine::Model& model, engine::KvBlockPool* kv, ThreadPool* threads, uint32_t seed)
      : model_(model), kv_(kv), fwd_(model, kv, threads), rng_(seed) {}

  // `context` (a multiple of the block size) positions are computed once into
  // shared blocks every sequence's table starts with; the timed passes start there.
  Status SetContext(int64_t context) {
    const int bt = kv_->layout().block_tokens;
    context_ = context;
    for (int64_t i = 0; i < context / bt; ++i) {
      ASSIGN_OR_RETURN(BlockId id, kv_->Allocate());
      context_blocks_.push_back(id);
    }
    if (context == 0) return Status::Ok();
    const std::vector<int32_t> toks = RandomTokens(context);
    SeqStep s = MakeSeqStep(context_blocks_, 0, toks, LogitRows::kLast);
    return fwd_.Run(std::span<const SeqStep>(&s, 1), &out_);
  }
  void FreeContext() {
    for (BlockId id : context_blocks_) kv_->Release(id);
    context_blocks_.clear();
  }

  Status AllocSeqs(int n, int64_t tokens) {
    const int bt = kv_->layout().block_tokens;
    blocks_.assign(n, {});
    for (auto& b : blocks_) {
      b = context_blocks_;
      for (int64_t i = 0; i < (tokens + bt - 1) / bt; ++i) {
        ASSIGN_OR_RETURN(BlockId id, kv_->Allocate());
        b.push_back(id);
      }
    }
    return Status::Ok();
  }
  void FreeSeqs() {
    for (auto& b : blocks_) {
      for (size_t i = context_blocks_.size(); i < b.size(); ++i) kv_->Release(b[i]);
    }
    blocks_.clear();
  }

  std::vector<int32_t> RandomTokens(int64_t n) {
    std::uniform_int_distribution<int32_t> d(0, model_.config().vocab - 1);
    std::vector<int32_t> t(n);
    for (auto& x : t) x = d(rng_);
    return t;
  }

  // Seconds for one prompt of n tokens in one step.
  Result<double> Prefill(int64_t n) {
    const std::vector<int32_t> toks = RandomTokens(n);
    SeqStep s = MakeSeqStep(blocks_[0], context_, toks, LogitRows::kLast);
    const double t0 = Now();
    RETURN_IF_ERROR(fwd_.Run(std::span<const SeqStep>(&s, 1), &out_));
    return Now() - t0;
  }

  // Seconds for `steps` decode steps of `batch` sequences from an empty cache.
  Result<double> Decode(int batch, int steps) {
    std::vector<std::vector<int32_t>> toks(batch);
    for (auto& t : toks) t = RandomTokens(1);
    std::vector<SeqStep> seqs(batch);
    const double t0 = Now();
    for (int step = 0; step < steps; ++step) {
      for (int b = 0; b < batch; ++b) {
        seqs[b] = MakeSeqStep(blocks_[b], context_ + step, toks[b], LogitRows::kLast);
      }
      RETURN_IF_ERROR(fwd_.Run(seqs, &out_));
      // Greedy next token keeps the data path realistic (logits are read).
      const int vocab = model_.config().vocab;
      for (int b = 0; b < batch; ++b) {
        const float* row = out_.Row(b, vocab);
        toks[b][0] = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
      }
    }
    return Now() - t0;
  }

 private:
  const engine::Model& model_;
  engine::KvBlockPool* kv_;
  ForwardPass fwd_;
  std::mt19937 rng_;
  std::vector<std::vector<BlockId>> blocks_;
  std::vector<BlockId> context_blocks_;
  int64_t context_ = 0;
  ForwardOutput out_;
};

// Runs fn once to warm up and `reps` times timed; returns tokens/s stats.
template <typename Fn>
Result<Stats> Measure(int reps, double tokens, Fn fn) {
  ASSIGN_OR_RETURN(double warm, fn());
  (void)warm;
  std::vector<double> tps;
  for (int r = 0; r < reps; ++r) {
    ASSIGN_OR_RETURN(double s, fn());
    tps.push_back(tokens / s);
  }
  return Summarize(tps);
}

void Print(const char* what, const Stats& s) {
  std::printf("%-22s %10.2f tok/s   (min %.2f, max %.2f)\n", what, s.median, s.min, s.max);
}

// Matmul-only time of one decode token: every layer matrix and the LM head.
double MatMulOnlySeconds(const engine::Model& model, ThreadPool* threads, int reps,
                         double* lm_head_s) {
  const auto& c = model.config();
  std::vector<float> x(std::max<int64_t>(c.ffn_dim, c.d_model) * 4, 0.1f);
  std::vector<float> y(std::max<int64_t>(c.vocab, c.ffn_dim));
  std::vector<double> total, head;
  for (int r = 0; r < reps + 1; ++r) {
    const double t0 = Now();
    for (const auto& l : model.layers()) {
      for (const engine::GgufTensor* w :
           {l.wq, l.wk, l.wv, l.wo, l.ffn_gate, l.ffn_up, l.ffn_down}) {
        engine::MatMul(*w, x.data(), 1, y.data(), threads);
      }
    }
    const double t1 = Now();
    engine::MatMul(model.lm_head(), x.data(), 1, y.data(), threads);
    const double t2 = Now();
    if (r > 0) {
      total.push_back(t2 - t0);
      head.push_back(t2 - t1);
    }
  }
  *lm_head_s = Summarize(head).median;
  return Summarize(total).median;
}

const FlagSpec kSpec = {
    "kvrelay bench engine",
    "Prompt processing and token generation speed of the engine (llama-bench's pp/tg),\n"
    "and batched decode throughput.",
    "",
    0,
    {{"model", "models/SmolLM2-135M-Instruct.Q4_1.gguf", "GGUF model path"},
     {"threads", std::to_string(ThreadPool::DefaultThreads()), "compute threads"},
     {"reps", "5", "repetitions (median reported)"},
     {"pp", "512", "prompt tokens"},
     {"tg", "128", "generated tokens"},
     {"batches", "4,16,64", "batch sizes of the batched decode run"},
     {"batch-steps", "16", "decode steps per batch size"},
     {"seed", "1", "prompt seed"},
     {"context", "0", "positions already cached before each timed pass (multiple of 16)"},
     {"kv-dtype", "f32", "KV cache dtype: f32|f16|bf16|int8|kivi4|kivi2"},
     {"json", "", "also write the medians (seconds) as JSON to this file"},
     {"skip-batches", "", "skip the batched decode run", true},
     {"profile", "", "add the matmul-only time of one decode token", true}}};

int Run(const std::vector<std::string>& args) {
  int exit_code = 0;
  auto flags = ParseCommandFlags(args, kSpec, &exit_code);
  if (!flags) return exit_code;
  const std::string path = flags->Get("model", "models/SmolLM2-135M-Instruct.Q4_1.gguf");
  auto threads_f = flags->GetInt("threads", ThreadPool::DefaultThreads());
  auto reps_f = flags->GetInt("reps", 5);
  auto pp_f = flags->GetInt("pp", 512);
  auto tg_f = flags->GetInt("tg", 128);
  auto steps_f = flags->GetInt("batch-steps", 16);
  auto seed_f = flags->GetInt("seed", 1);
  auto context_f = flags->GetInt("context", 0);
  for (const auto* r : {&threads_f, &reps_f, &pp_f, &tg_f, &steps_f, &seed_f, &context_f}) {
    if (!r->ok()) {
      std::fprintf(stderr, "bench engine: %s\n", r->status().ToString().c_str());
      return 2;
    }
  }
  const int threads = static_cast<int>(*threads_f), reps = static_cast<int>(*reps_f);
  const int64_t pp = *pp_f, tg = *tg_f;
  const int steps = static_cast<int>(*steps_f);
  const int64_t context = *context_f;
  if (context < 0 || context % 16 != 0) {
    std::fprintf(stderr, "bench engine: --context must be a non-negative multiple of 16\n");
    return 2;
  }
  if (threads < 1 || reps < 1 || pp < 1 || tg < 1 || steps < 1) {
    std::fprintf(stderr,
                 "bench engine: --threads, --reps, --pp, --tg, --batch-steps must be >= 1\n");
    return 2;
  }
  std::vector<int> batches;
  if (!flags->Has("skip-batches")) {
    std::string list = flags->Get("batches", "4,16,64");
    size_t pos = 0;
    while (pos <= list.size()) {
      const size_t comma = std::min(list.find(',', pos), list.size());
      const int b = std::atoi(list.substr(pos, comma - pos).c_str());
      if (b < 1 || b > 4096) {
        std::fprintf(stderr, "bench engine: bad --batches entry in '%s'\n", list.c_str());
        return 2;
      }
      batches.push_back(b);
      pos = comma + 1;
    }
  }

  engine::ModelLoadOptions lo;
  lo.load_tokenizer = false;
  auto model = engine::Model::Load(path, lo);
  if (!model.ok()) {
    std::fprintf(stderr, "bench engine: %s\n", model.status().ToString().c_str());
    return 1;
  }
  const auto& m = **model;
  const int bt = 16;
  int64_t max_seqs = 1;
  for (int b : batches) max_seqs = std::max<int64_t>(max_seqs, b);
  const int64_t need_blocks = context / bt + std::max<int64_t>((std::max(pp, tg) + bt - 1) / bt,
                                                               max_seqs * ((steps + bt - 1) / bt));
  engine::KvBlockPool::Options po;
  auto kv_dtype = engine::ParseKvDtype(flags->Get("kv-dtype", "f32"));
  if (!kv_dtype.ok()) {
    std::fprintf(stderr, "bench engine: %s\n", kv_dtype.status().ToString().c_str());
    return 2;
  }
  po.layout = m.MakeKvLayout(*kv_dtype, bt);
  po.capacity_bytes = (need_blocks + 2) * po.layout.BlockBytes();
  auto kv = engine::KvBlockPool::Create(po);
  if (!kv.ok()) {
    std::fprintf(stderr, "bench engine: %s\n", kv.status().ToString().c_str());
    return 1;
  }
  ThreadPool pool(threads, "bench");
  Bench bench(m, kv->get(), &pool, static_cast<uint32_t>(*seed_f));

  std::printf("model %s, threads %d, kernels %s, reps %d (median after 1 warm-up)\n", path.c_str(),
              threads, std::string(engine::KernelPathName(engine::ResolvedKernelPath())).c_str(),
              reps);
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "bench engine: %s\n", s.ToString().c_str());
    return 1;
  };
  char label[64];
  nlohmann::json report = {{"model", path},
                           {"threads", threads},
                           {"reps", reps},
                           {"context", context},
                           {"decode", nlohmann::json::array()}};
  if (Status s = bench.SetContext(context); !s.ok()) return fail(s);
  if (Status s = bench.AllocSeqs(1, std::max(pp, tg)); !s.ok()) return fail(s);
  auto pps = Measure(reps, pp, [&] { return bench.Prefill(pp); });
  if (!pps.ok()) return fail(pps.status());
  std::snprintf(label, sizeof(label), "pp%lld", static_cast<long long>(pp));
  Print(label, *pps);
  report["prefill"] = {{"tokens", pp}, {"median_s", pp / pps->median}};
  auto tgs = Measure(reps, tg, [&] { return bench.Decode(1, static_cast<int>(tg)); });
  if (!tgs.ok()) return fail(tgs.status());
  std::snprintf(label, sizeof(label), "tg%lld", static_cast<long long>(tg));
  Print(label, *tgs);
  report["tg"] = {{"tokens", tg}, {"median_step_s", 1.0 / tgs->median}};
  bench.FreeSeqs();
  double batch1 = 0;
  for (int b : batches) {
    if (Status s = bench.AllocSeqs(b, steps); !s.ok()) return fail(s);
    if (batch1 == 0) {
      auto one = Measure(reps, steps, [&] { return bench.Decode(1, steps); });
      if (!one.ok()) return fail(one.status());
      batch1 = one->median;
      report["decode"].push_back(
          {{"batch", 1}, {"steps", steps}, {"median_step_s", 1.0 / one->median}});
      std::snprintf(label, sizeof(label), "decode batch 1 x%d", steps);
      Print(label, *one);
    }
    auto st = Measure(reps, static_cast<double>(b) * steps, [&] { return bench.Decode(b, steps); });
    if (!st.ok()) return fail(st.status());
    std::snprintf(label, sizeof(label), "decode batch %d x%d", b, steps);
    Print(label, *st);
    std::printf("%-22s %10.2fx\n", "  vs batch 1", st->median / batch1);
    report["decode"].push_back({{"batch", b}, {"steps", steps}, {"median_step_s", b / st->median}});
    bench.FreeSeqs();
  }
  if (flags->Has("profile")) {
    double head = 0;
    const double mm = MatMulOnlySeconds(m, &pool, reps, &head);
    const double step = 1.0 / tgs->median;
    int64_t weight_bytes = m.lm_head().nbytes;
    for (const auto& l : m.layers()) {
      for (const auto* w : {l.wq, l.wk, l.wv, l.wo, l.ffn_gate, l.ffn_up, l.ffn_down}) {
        weight_bytes += w->nbytes;
      }
    }
    std::printf("profile of one decode token (tg median step %.3f ms):\n", step * 1e3);
    std::printf("  matmuls (all layers + lm head)  %.3f ms (%.0f%%), of which lm head %.3f ms\n",
                mm * 1e3, 100 * mm / step, head * 1e3);
    std::printf("  everything else (attention, norms, rope, sync)  %.3f ms\n", (step - mm) * 1e3);
    std::printf("  weights read per token %.1f MB -> matmul-only %.2f GB/s\n", weight_bytes / 1e6,
                weight_bytes / mm / 1e9);
  }
  bench.FreeContext();
  if (flags->Has("json")) {
    std::ofstream f(flags->Get("json"));
    f << report.dump(2) << "\n";
    if (!f) {
      std::fprintf(stderr, "bench engine: cannot write %s\n", flags->Get("json").c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace

KVRELAY_COMMAND(bench_engine, "bench engine",
                "bench engine --model M [--threads T] [--reps 5] [--pp 512] [--tg 128] "
                "[--batches 4,16,64] [--batch-steps 16] [--context C] [--kv-dtype f32] [--json "
                "OUT] [--profile]",
                Run);

}  // namespace kvrelay::cli
