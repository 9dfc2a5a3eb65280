// `kvrelay bench kv`: what each KV cache dtype costs and what it changes, on
// the real model and the real forward pass (engine/runtime/forward.h):
//   bytes/token   KvLayout::BytesPerToken() of the model (scales included)
//   ppl           chunked perplexity of --file: each chunk of --ctx tokens is
//                 evaluated from an empty cache in one step, the second half
//                 of it is scored (as llama.cpp's perplexity does)
//   top-1 agree   teacher-forced greedy agreement with f32: f32 generates --gen
//                 tokens greedily after a prompt (the first --prompt-tokens of
//                 the file); every dtype then decodes the same tokens one step
//                 at a time, and we count the steps where its argmax equals
//                 f32's next token
//   first diff    the first step where they differ (--gen if none)
//   write/read    CPU ns per (token, layer) of WriteToken and per (token, head,
//                 layer) of ReadHead of K+V on a 1024-token pool (thread CPU time)
#include <time.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cli/command.h"
#include "common/flags.h"
#include "common/thread_pool.h"
#include "engine/kv_cache/kv_cache.h"
#include "engine/runtime/forward.h"
#include "engine/runtime/model.h"
#include "engine/tokenizer/tokenizer.h"

namespace kvrelay::cli {
namespace {

using engine::BlockId;
using engine::ForwardOutput;
using engine::ForwardPass;
using engine::KvBlockPool;
using engine::KvDtype;
using engine::LogitRows;
using engine::MakeSeqStep;
using engine::SeqStep;

double ThreadCpuNs() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) * 1e9 + static_cast<double>(t.tv_nsec);
}

int32_t ArgMax(const float* row, int n) {
  return static_cast<int32_t>(std::max_element(row, row + n) - row);
}

// A pool of `tokens` capacity for one sequence, and its block table.
struct OneSeq {
  std::unique_ptr<KvBlockPool> pool;
  std::vector<BlockId> blocks;

  static Result<OneSeq> Make(const engine::Model& model, KvDtype dtype, int block_tokens,
                             int64_t tokens) {
    KvBlockPool::Options o;
    o.layout = model.MakeKvLayout(dtype, block_tokens);
    const int64_t nblocks = (tokens + block_tokens - 1) / block_tokens;
    // KIVI staging: every layer of one block (the sequence's tail) plus slack.
    const int64_t slot = 2LL * o.layout.kv_heads * block_tokens * o.layout.head_dim * 4;
    o.staging_bytes = 2 * o.layout.layers * slot;
    o.capacity_bytes = nblocks * o.layout.BlockBytes() + o.staging_bytes;
    OneSeq s;
    ASSIGN_OR_RETURN(s.pool, KvBlockPool::Create(o));
    for (int64_t i = 0; i < nblocks; ++i) {
      ASSIGN_OR_RETURN(BlockId id, s.pool->Allocate());
      s.blocks.push_back(id);
    }
    return s;
  }
};

struct Row {
  KvDtype dtype;
  double bytes_per_token = 0;
  double ppl = 0;
  int64_t scored = 0;
  int64_t agree = 0, gen = 0, first_diff = 0;
  double write_ns = 0, read_ns = 0;
};

// Mean NLL over the second half of every chunk.
Status Perplexity(const engine::Model& model, KvDtype dtype, ThreadPool* threads,
                  const std::vector<int32_t>& text, int64_t ctx, int64_t chunks, Row* row) {
  const int vocab = model.config().vocab;
  double nll = 0;
  int64_t count = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    ASSIGN_OR_RETURN(OneSeq s, OneSeq::Make(model, dtype, 16, ctx));
    ForwardPass fwd(model, s.pool.get(), threads);
    std::span<const int32_t> tokens(text.data() + c * ctx, static_cast<size_t>(ctx));
    SeqStep seq = MakeSeqStep(s.blocks, 0, tokens, LogitRows::kAll);
    ForwardOutput out;
    RETURN_IF_ERROR(fwd.Run(std::span<const SeqStep>(&seq, 1), &out));
    for (int64_t i = ctx / 2; i + 1 < ctx; ++i) {
      const float* r = out.Row(i, vocab);
      const float mx = *std::max_element(r, r + vocab);
      double sum = 0;
      for (int v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(r[v] - mx));
      nll += std::log(sum) + mx - r[tokens[i + 1]];
      ++count;
    }
  }
  row->ppl = std::exp(nll / static_cast<double>(count));
  row->scored = count;
  return Status::Ok();
}

// Greedy decode of `gen` tokens after `prompt`. With `forced` empty it
// generates (f32 reference) into `*generated`; otherwise it feeds `forced` and
// counts argmax agreement.
Status Decode(const engine::Model& model, KvDtype dtype, ThreadPool* threads,
              const std::vector<int32_t>& prompt, int64_t gen, const std::vector<int32_t>& forced,
              std::vector<int32_t>* generated, Row* row) {
  const int vocab = model.config().vocab;
  ASSIGN_OR_RETURN(OneSeq s,
                   OneSeq::Make(model, dtype, 16, static_cast<int64_t>(prompt.size()) + gen));
  ForwardPass fwd(model, s.pool.get(), threads);
  ForwardOutput out;
  SeqStep seq = MakeSeqStep(s.blocks, 0, prompt, LogitRows::kLast);
  RETURN_IF_ERROR(fwd.Run(std::span<const SeqStep>(&seq, 1), &out));
  int64_t cache = static_cast<int64_t>(prompt.size());
  row->agree = 0;
  row->gen = gen;
  row->first_diff = gen;
  for (int64_t i = 0; i < gen; ++i) {
    const int32_t top = ArgMax(out.Row(0, vocab), vocab);
    int32_t next = top;
    if (forced.empty()) {
      generated->push_back(top);
    } else {
      next = forced[i];
      if (top == next) {
        ++row->agree;
      } else if (row->first_diff == gen) {
        row->first_diff = i;
      }
    }
    if (i + 1 == gen) break;
    SeqStep step =
        MakeSeqStep(s.blocks, cache, std::span<const int32_t>(&next, 1), LogitRows::kLast);
    RETURN_IF_ERROR(fwd.Run(std::span<const SeqStep>(&step, 1), &out));
    ++cache;
  }
  return Status::Ok();
}

// CPU time of the pool's hot path on a 1024-token context of random K/V.
Status MicroBench(const engine::Model& model, KvDtype dtype, Row* row) {
  ASSIGN_OR_RETURN(OneSeq s, OneSeq::Make(model, dtype, 16, 1024));
  const engine::KvLayout& l = s.pool->layout();
  std::vector<float> k(l.kv_heads * l.head_dim), v(k.size());
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (float& x : k) x = nd(rng);
  for (float& x : v) x = nd(rng);
  auto write_all = [&] {
    for (BlockId b : s.blocks)
      for (int t = 0; t < l.block_tokens; ++t)
        for (int layer = 0; layer < l.layers; ++layer)
          s.pool->WriteToken(b, layer, t, k.data(), v.data());
  };
  write_all();  // touch the memory once
  const double t0 = ThreadCpuNs();
  write_all();
  const double t1 = ThreadCpuNs();
  std::vector<float> ko(l.block_tokens * l.head_dim), vo(ko.size());
  float sink = 0;
  const int reps = 3;
  for (int r = 0; r < reps; ++r)
    for (int layer = 0; layer < l.layers; ++layer)
      for (int h = 0; h < l.kv_heads; ++h)
        for (BlockId b : s.blocks) {
          s.pool->ReadHead(b, layer, h, l.block_tokens, ko.data(), vo.data());
          sink += ko[1];
        }
  const double t2 = ThreadCpuNs();
  const double tokens = static_cast<double>(s.blocks.size()) * l.block_tokens;
  row->write_ns = (t1 - t0) / (tokens * l.layers);
  row->read_ns = (t2 - t1) / (reps * tokens * l.layers * l.kv_heads) + (sink == 12345.f ? 1 : 0);
  return Status::Ok();
}

const FlagSpec kSpec = {
    "kvrelay bench kv",
    "KV cache dtypes side by side: perplexity, greedy agreement, bytes per token, speed.",
    "",
    0,
    {{"model", "models/SmolLM2-135M-Instruct.Q4_1.gguf", "GGUF model path"},
     {"file", "", "text file for the perplexity run (required)"},
     {"ctx", "512", "tokens per perplexity chunk"},
     {"chunks", "4", "perplexity chunks"},
     {"gen", "512", "greedy tokens compared against f32"},
     {"prompt-tokens", "64", "prompt length of the greedy run"},
     {"dtypes", "f32,f16,bf16,int8,kivi4,kivi2", "dtypes to compare (f32 always included)"},
     {"threads", std::to_string(ThreadPool::DefaultThreads()), "compute threads"}}};

int Run(const std::vector<std::string>& args) {
  int exit_code = 0;
  auto flags = ParseCommandFlags(args, kSpec, &exit_code);
  if (!flags) return exit_code;
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "bench kv: %s\n", s.ToString().c_str());
    return 1;
  };
  const std::string path = flags->Get("model", "models/SmolLM2-135M-Instruct.Q4_1.gguf");
  const std::string file = flags->Get("file");
  if (file.empty()) return fail(InvalidArgument("--file TEXT is required"));
  int64_t nums[5];
  const char* names[5] = {"ctx", "chunks", "gen", "prompt-tokens", "threads"};
  const int64_t defaults[5] = {512, 4, 512, 64, ThreadPool::DefaultThreads()};
  for (int i = 0; i < 5; ++i) {
    auto r = flags->GetInt(names[i], defaults[i]);
    if (!r.ok()) return fail(r.status());
    if (*r < 1) return fail(InvalidArgument(std::string("--") + names[i] + " must be >= 1"));
    nums[i] = *r;
  }
  const int64_t ctx = nums[0], chunks = nums[1], gen = nums[2], prompt_tokens = nums[3];
  if (ctx < 4) return fail(InvalidArgument("--ctx must be >= 4"));
  std::vector<KvDtype> dtypes;
  {
    std::stringstream ss(flags->Get("dtypes", "f32,f16,bf16,int8,kivi4,kivi2"));
    std::string item;
    while (std::getline(ss, item, ',')) {
      auto d = engine::ParseKvDtype(item);
      if (!d.ok()) return fail(d.status());
      dtypes.push_back(*d);
    }
    if (dtypes.empty() || dtypes[0] != KvDtype::kF32) dtypes.insert(dtypes.begin(), KvDtype::kF32);
  }

  auto model = engine::Model::Load(path);
  if (!model.ok()) return fail(model.status());
  const engine::Model& m = **model;
  if (m.tokenizer() == nullptr) return fail(FailedPrecondition("model has no tokenizer"));
  std::ifstream in(file, std::ios::binary);
  if (!in) return fail(NotFound("cannot read --file " + file));
  std::stringstream buf;
  buf << in.rdbuf();
  const std::vector<int32_t> text = m.tokenizer()->Encode(buf.str(), false, false);
  if (static_cast<int64_t>(text.size()) < std::max(ctx * chunks, prompt_tokens)) {
    return fail(InvalidArgument(file + " has " + std::to_string(text.size()) + " tokens; need " +
                                std::to_string(std::max(ctx * chunks, prompt_tokens))));
  }
  ThreadPool threads(static_cast<int>(nums[4]), "bench-kv");
  const std::vector<int32_t> prompt(text.begin(), text.begin() + prompt_tokens);

  std::vector<Row> rows;
  std::vector<int32_t> reference;
  for (KvDtype d : dtypes) {
    Row row;
    row.dtype = d;
    row.bytes_per_token = m.MakeKvLayout(d, 16).BytesPerToken();
    if (Status s = Perplexity(m, d, &threads, text, ctx, chunks, &row); !s.ok()) return fail(s);
    if (d == KvDtype::kF32) {
      if (Status s = Decode(m, d, &threads, prompt, gen, {}, &reference, &row); !s.ok())
        return fail(s);
    }
    if (Status s = Decode(m, d, &threads, prompt, gen, reference, nullptr, &row); !s.ok())
      return fail(s);
    if (Status s = MicroBench(m, d, &row); !s.ok()) return fail(s);
    std::fprintf(stderr, "bench kv: %s done (ppl %.4f, agree %lld/%lld)\n",
                 std::string(engine::KvDtypeName(d)).c_str(), row.ppl,
                 static_cast<long long>(row.agree), static_cast<long long>(row.gen));
    rows.push_back(row);
  }
  std::printf(
      "model %s, file %s: %zu tokens; ppl over %lld chunks of %lld (second halves, %lld "
      "tokens scored); top-1 agreement over %lld greedy tokens after a %lld-token prompt\n\n",
      path.c_str(), file.c_str(), text.size(), static_cast<long long>(chunks),
      static_cast<long long>(ctx), static_cast<long long>(rows[0].scored),
      static_cast<long long>(gen), static_cast<long long>(prompt_tokens));
  std::printf(
      "| dtype | bytes/token | vs f32 | ppl | ppl vs f32 | top-1 agree | first diff | "
      "WriteToken ns | ReadHead ns |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const Row& r : rows) {
    std::printf(
        "| %s | %.0f | %.3fx | %.4f | %+.2f%% | %.2f%% (%lld/%lld) | %lld | %.0f | %.0f |\n",
        std::string(engine::KvDtypeName(r.dtype)).c_str(), r.bytes_per_token,
        r.bytes_per_token / rows[0].bytes_per_token, r.ppl, 100.0 * (r.ppl / rows[0].ppl - 1.0),
        100.0 * static_cast<double>(r.agree) / static_cast<double>(r.gen),
        static_cast<long long>(r.agree), static_cast<long long>(r.gen),
        static_cast<long long>(r.first_diff), r.write_ns, r.read_ns);
  }
  return 0;
}

}  // namespace

KVRELAY_COMMAND(bench_kv, "bench kv",
                "bench kv --file TEXT [--model PATH] [--ctx 512] [--chunks 4] [--gen 512] "
                "[--prompt-tokens 64] [--dtypes f32,f16,bf16,int8,kivi4,kivi2] [--threads N]",
                Run);

}  // namespace kvrelay::cli
