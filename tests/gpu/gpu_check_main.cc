// kvrelay_gpu_check: the steps of scripts/gpu-check.sh, one subcommand each.
//
//   probe                          "gpu: NAME ..." (exit 0) or "no GPU: why" (exit 3)
//   gen --shape default|7b|gemma3 --out PATH [--layers N] [--threads N]
//   cpu --model PATH [--prompt 16] [--steps 4]   the CPU forward alone (no GPU needed)
//   agree --model PATH [--prompt 32] [--steps 64] [--threads N] [--max-dlogit 0.25]
//         [--max-dlogit-prefill 1.5]
//   bench --model PATH [--batches 1,16,64,256] [--prompt 64] [--steps 16]
//         [--prefill 512] [--hbm-tbps 4.8] [--kv f16|f32] [--gemm-min-tokens 32] [--mirror]
//         [--shares 1,16]              each kernel family's share of a decode step
//   sample                         device sampler vs the CPU Sampler
//   ipc [--mib 64]                 cuda_ipc between this process and a child
//   nccl1                          a 1-rank NCCL communicator and the nccl transport
//
// Every figure printed is measured in this run on the device it names; the
// script records nothing when there is no GPU.
#include <cuda_runtime.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/thread_pool.h"
#include "engine/cuda/cuda_sampler.h"
#include "engine/cuda/device.h"
#include "engine/runtime/compute_backend.h"
#include "engine/runtime/forward.h"
#include "engine/runtime/model.h"
#include "engine/runtime/sampler.h"
#include "kv_transfer/cuda_ipc_transport.h"
#include "tests/gpu/agreement.h"
#include "tests/gpu/synthetic_shapes.h"
#if KVRELAY_WITH_NCCL
#include "engine/cuda/nccl_communicator.h"
#include "kv_transfer/nccl_transport.h"
#endif

extern char** environ;

namespace kvrelay::gpucheck {
namespace {

using engine::BlockId;
using engine::ForwardOutput;
using engine::KvBlockPool;
using engine::LogitRows;
using engine::MakeSeqStep;
using engine::Model;
using engine::SeqStep;

struct Args {
  std::map<std::string, std::string> kv;
  bool Has(const std::string& k) const { return kv.count(k) > 0; }
  std::string Get(const std::string& k, const std::string& def) const {
    auto it = kv.find(k);
    return it == kv.end() ? def : it->second;
  }
  int64_t Int(const std::string& k, int64_t def) const {
    return Has(k) ? std::atoll(kv.at(k).c_str()) : def;
  }
  double Num(const std::string& k, double def) const {
    return Has(k) ? std::atof(kv.at(k).c_str()) : def;
  }
};

Args ParseArgs(int argc, char** argv, int from) {
  Args a;
  for (int i = from; i < argc; ++i) {
    std::string k = argv[i];
    if (k.rfind("--", 0) != 0) continue;
    k = k.substr(2);
    if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
      a.kv[k] = argv[++i];
    } else {
      a.kv[k] = "1";
    }
  }
  return a;
}

int Fail(const Status& s, const char* what) {
  std::printf("FAIL %s: %s\n", what, s.ToString().c_str());
  return 1;
}

int Threads(const Args& a) {
  const int64_t t = a.Int("threads", 0);
  return t > 0 ? static_cast<int>(t)
               : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

Result<std::shared_ptr<const Model>> LoadModel(const std::string& path) {
  engine::ModelLoadOptions lo;
  lo.load_tokenizer = false;
  ASSIGN_OR_RETURN(auto m, Model::Load(path, lo));
  return std::shared_ptr<const Model>(std::move(m));
}

Result<std::unique_ptr<KvBlockPool>> MakePool(const Model& m, engine::KvDtype dtype,
                                              int64_t blocks) {
  KvBlockPool::Options o;
  o.layout = m.MakeKvLayout(dtype, 16);
  o.capacity_bytes = blocks * o.layout.BlockBytes();
  return KvBlockPool::Create(o);
}

Result<std::vector<BlockId>> AllocBlocks(KvBlockPool* pool, int64_t n) {
  std::vector<BlockId> b;
  for (int64_t i = 0; i < n; ++i) {
    ASSIGN_OR_RETURN(BlockId id, pool->Allocate());
    b.push_back(id);
  }
  return b;
}

int64_t Argmax(const float* x, int n) {
  int64_t best = 0;
  for (int i = 1; i < n; ++i) {
    if (x[i] > x[best]) best = i;
  }
  return best;
}

std::vector<int32_t> RandomTokens(int64_t n, int vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return t;
}

int Probe() {
  std::string desc;
  Status s = engine::cuda::UseDevice(0, &desc);
  if (!s.ok()) {
    std::printf("no GPU: %s\n", s.message().c_str());
    return 3;
  }
  size_t free_b = 0, total_b = 0;
  static_cast<void>(engine::cuda::DeviceMemory(&free_b, &total_b));
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  std::printf("gpu: %s, %d device(s), %.1f GiB free, driver %d, runtime %d\n", desc.c_str(),
              engine::cuda::DeviceCount(), static_cast<double>(free_b) / (1ull << 30), driver,
              runtime);
  return 0;
}

int Gen(const Args& a) {
  auto shape = ShapeByName(a.Get("shape", "default"), static_cast<int>(a.Int("layers", 0)));
  if (!shape.ok()) return Fail(shape.status(), "gen");
  const std::string out = a.Get("out", "");
  if (out.empty()) return Fail(InvalidArgument("--out is required"), "gen");
  const auto t0 = std::chrono::steady_clock::now();
  Status s = WriteShapeModel(out, *shape, Threads(a));
  if (!s.ok()) return Fail(s, "gen");
  std::printf("gen: %s -> %s in %.1f s\n", shape->name.c_str(), out.c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return 0;
}

// CUDA vs CPU on the same model and tokens, positions compared on identical
// contexts (each step feeds both backends the same token):
//   1. a prefill of --prompt random tokens, logits of every position (the
//      fp16 tensor-core path when the prompt has >= gemm_min_tokens = 32);
//   2. --steps greedy decode steps fed the CPU's argmax (the quantized GEMV
//      path): the greedy sequences are identical iff every step agrees;
//   3. --steps decode steps fed random tokens (random weights make greedy
//      decoding repetitive, so these add distinct contexts).
// The metric of docs/gpu-numerics.md: per phase a per-logit bound eps
// (--max-dlogit for the GEMV decode phases, --max-dlogit-prefill for the fp16
// tensor-core prefill); every position whose CPU top-2 gap exceeds 2 * eps
// must agree on top-1 (100%), and no logit may be off by more than eps.
// Closer positions are near-ties (random weights have many) and are only
// counted.
int Agree(const Args& a) {
  auto model = LoadModel(a.Get("model", ""));
  if (!model.ok()) return Fail(model.status(), "agree: load");
  const Model& m = **model;
  const int vocab = m.config().vocab;
  const int64_t P = a.Int("prompt", 32), steps = a.Int("steps", 64);
  const int64_t n_blocks = (P + 2 * steps + 15) / 16;
  auto cpu_pool = MakePool(m, engine::KvDtype::kF32, n_blocks + 1);
  auto gpu_pool = MakePool(m, engine::KvDtype::kF32, n_blocks + 1);
  if (!cpu_pool.ok() || !gpu_pool.ok()) return Fail(cpu_pool.status(), "agree: pool");
  ThreadPool threads(Threads(a), "cpu");
  engine::ForwardPass cpu(m, cpu_pool->get(), &threads);
  engine::ComputeBackendOptions bo;
  bo.device = {engine::DeviceKind::kCuda, 0};
  auto gpu = engine::CreateComputeBackend(bo, m, gpu_pool->get(), nullptr);
  if (!gpu.ok()) return Fail(gpu.status(), "agree: cuda backend");
  auto cb = AllocBlocks(cpu_pool->get(), n_blocks);
  auto gb = AllocBlocks(gpu_pool->get(), n_blocks);
  if (!cb.ok() || !gb.ok()) return Fail(cb.status(), "agree: blocks");

  const double eps_decode = a.Num("max-dlogit", 0.25);
  const double eps_prefill = a.Num("max-dlogit-prefill", 1.5);
  Agreement ph[3];
  ph[0].eps = eps_prefill;
  ph[1].eps = ph[2].eps = eps_decode;
  double sum_d = 0, max_abs = 0;
  int64_t n_d = 0;
  auto compare = [&](Agreement& p, const float* c, const float* g) {
    for (int i = 0; i < vocab; ++i) {
      sum_d += std::fabs(static_cast<double>(c[i]) - g[i]);
      max_abs = std::max(max_abs, std::fabs(static_cast<double>(c[i])));
    }
    n_d += vocab;
    return p.Add(c, g, vocab);
  };
  auto step = [&](int64_t cache_len, std::span<const int32_t> toks, LogitRows lg, ForwardOutput* co,
                  ForwardOutput* go) {
    SeqStep c = MakeSeqStep(*cb, cache_len, toks, lg);
    SeqStep g = MakeSeqStep(*gb, cache_len, toks, lg);
    Status st = cpu.Run(std::span<const SeqStep>(&c, 1), co);
    if (st.ok()) st = (*gpu)->Run(std::span<const SeqStep>(&g, 1), go);
    return st;
  };
  std::vector<int32_t> prompt = RandomTokens(P, vocab, 42);
  ForwardOutput co, go;
  Status st = step(0, prompt, LogitRows::kAll, &co, &go);
  if (!st.ok()) return Fail(st, "agree: prefill");
  for (int64_t r = 0; r < P; ++r) compare(ph[0], co.Row(r, vocab), go.Row(r, vocab));
  int32_t token = static_cast<int32_t>(Argmax(co.Row(P - 1, vocab), vocab));
  int64_t first_diff = -1;
  std::vector<int32_t> random = RandomTokens(steps, vocab, 43);
  for (int64_t s = 0; s < 2 * steps; ++s) {
    const bool greedy = s < steps;
    std::vector<int32_t> one = {greedy ? token : random[s - steps]};
    st = step(P + s, one, LogitRows::kLast, &co, &go);
    if (!st.ok()) return Fail(st, "agree: decode");
    const bool ok = compare(ph[greedy ? 1 : 2], co.Row(0, vocab), go.Row(0, vocab));
    if (greedy && !ok && first_diff < 0) first_diff = s;
    token = static_cast<int32_t>(Argmax(co.Row(0, vocab), vocab));
  }
  const char* names[3] = {"prefill (fp16 GEMM)", "greedy decode (GEMV)",
                          "random-token decode (GEMV)"};
  bool pass = true;
  for (int i = 0; i < 3; ++i) {
    const Agreement& p = ph[i];
    std::printf(
        "agree: %-27s top-1 %3lld/%-3lld  decisive (gap > %.3f) %3lld/%-3lld  max |dlogit| %.4f "
        "(bound %.3f)\n",
        names[i], static_cast<long long>(p.agree), static_cast<long long>(p.positions), 2 * p.eps,
        static_cast<long long>(p.decisive_agree), static_cast<long long>(p.decisive), p.max_dlogit,
        p.eps);
    pass = pass && p.Pass();
  }
  const std::string diff =
      first_diff < 0 ? "" : " (first difference at step " + std::to_string(first_diff) + ")";
  std::printf("agree: greedy tokens %s over %lld steps%s; mean |dlogit| %.5f, max |logit| %.2f\n",
              first_diff < 0 ? "identical" : "differ", static_cast<long long>(steps), diff.c_str(),
              sum_d / static_cast<double>(n_d), max_abs);
  const int64_t decisive = ph[0].decisive + ph[1].decisive + ph[2].decisive;
  const int64_t decisive_agree = ph[0].decisive_agree + ph[1].decisive_agree + ph[2].decisive_agree;
  const int64_t n = ph[0].positions + ph[1].positions + ph[2].positions;
  std::printf(
      "%s agree: top-1 agreement %lld/%lld at decisive positions (need all), %lld/%lld overall; "
      "every logit within its bound: %s\n",
      pass ? "PASS" : "FAIL", static_cast<long long>(decisive_agree),
      static_cast<long long>(decisive),
      static_cast<long long>(ph[0].agree + ph[1].agree + ph[2].agree), static_cast<long long>(n),
      ph[0].max_dlogit <= ph[0].eps && ph[1].max_dlogit <= ph[1].eps &&
              ph[2].max_dlogit <= ph[2].eps
          ? "yes"
          : "no");
  return pass ? 0 : 1;
}

// The CPU half alone (runs without a GPU): loads the model, prefills and
// decodes a few greedy steps. The dry run uses it to check a generated file.
int Cpu(const Args& a) {
  auto model = LoadModel(a.Get("model", ""));
  if (!model.ok()) return Fail(model.status(), "cpu: load");
  const Model& m = **model;
  const int vocab = m.config().vocab;
  const int64_t P = a.Int("prompt", 16), steps = a.Int("steps", 4);
  auto pool = MakePool(m, engine::KvDtype::kF32, (P + steps + 15) / 16 + 1);
  if (!pool.ok()) return Fail(pool.status(), "cpu: pool");
  ThreadPool threads(Threads(a), "cpu");
  engine::ForwardPass cpu(m, pool->get(), &threads);
  auto blocks = AllocBlocks(pool->get(), (P + steps + 15) / 16);
  if (!blocks.ok()) return Fail(blocks.status(), "cpu: blocks");
  std::vector<int32_t> tokens = RandomTokens(P, vocab, 42);
  std::string out;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t s = 0; s <= steps; ++s) {
    const int64_t begin = s == 0 ? 0 : P + s - 1;
    std::span<const int32_t> step(tokens.data() + begin, s == 0 ? P : 1);
    SeqStep q = MakeSeqStep(*blocks, begin, step, LogitRows::kLast);
    ForwardOutput o;
    Status st = cpu.Run(std::span<const SeqStep>(&q, 1), &o);
    if (!st.ok()) return Fail(st, "cpu: forward");
    tokens.push_back(static_cast<int32_t>(Argmax(o.Row(0, vocab), vocab)));
    out += " " + std::to_string(tokens.back());
  }
  std::printf("cpu: %s\ncpu: greedy tokens%s (%.2f s)\n", m.config().DebugString().c_str(),
              out.c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return 0;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

int64_t WeightBytes(const Model& m) {
  int64_t b = 0;
  for (const engine::LayerWeights& w : m.layers()) {
    for (const engine::GgufTensor* t : {w.wq, w.wk, w.wv, w.wo, w.ffn_gate, w.ffn_up, w.ffn_down}) {
      b += static_cast<int64_t>(t->nbytes);
    }
  }
  return b + static_cast<int64_t>(m.lm_head().nbytes);
}

int Bench(const Args& a) {
  auto model = LoadModel(a.Get("model", ""));
  if (!model.ok()) return Fail(model.status(), "bench: load");
  const Model& m = **model;
  const int vocab = m.config().vocab;
  auto dtype = engine::ParseKvDtype(a.Get("kv", "f16"));
  if (!dtype.ok()) return Fail(dtype.status(), "bench");
  std::vector<int64_t> batches;
  {
    std::string s = a.Get("batches", "1,16,64,256");
    for (size_t p = 0; p < s.size();) {
      const size_t q = s.find(',', p);
      batches.push_back(std::atoll(s.substr(p, q - p).c_str()));
      p = q == std::string::npos ? s.size() : q + 1;
    }
  }
  const int64_t P = a.Int("prompt", 64), steps = a.Int("steps", 16), warm = 2;
  const int64_t prefill = a.Int("prefill", 512);
  const double hbm = a.Num("hbm-tbps", 4.8) * 1e12;
  const int64_t max_b = *std::max_element(batches.begin(), batches.end());
  const int64_t per_seq = (P + steps + warm + 15) / 16;
  auto pool = MakePool(m, *dtype, max_b * per_seq + (prefill + 15) / 16 + 1);
  if (!pool.ok()) return Fail(pool.status(), "bench: pool");
  engine::ComputeBackendOptions bo;
  bo.device = {engine::DeviceKind::kCuda, 0};
  bo.gemm_min_tokens = static_cast<int>(a.Int("gemm-min-tokens", 32));
  bo.mirror_kv_to_host = a.Has("mirror");
  auto gpu = engine::CreateComputeBackend(bo, m, pool->get(), nullptr);
  if (!gpu.ok()) return Fail(gpu.status(), "bench: cuda backend");
  const int64_t wbytes = WeightBytes(m);
  const double kv_per_token = pool->get()->layout().BytesPerToken();
  std::printf(
      "bench: %s, weights %.2f GB read per step, KV %s %.1f KiB/token, HBM roofline %.1f TB/s, "
      "host KV mirror %s, fp16 GEMM from %d tokens\n",
      m.full_config().DebugString().c_str(), wbytes / 1e9,
      std::string(engine::KvDtypeName(*dtype)).c_str(), kv_per_token / 1024, hbm / 1e12,
      bo.mirror_kv_to_host ? "on" : "off", bo.gemm_min_tokens);
  double batch1 = 0;
  for (int64_t b : batches) {
    std::vector<std::vector<BlockId>> tables;
    std::vector<std::vector<int32_t>> prompts;
    for (int64_t s = 0; s < b; ++s) {
      auto t = AllocBlocks(pool->get(), (P + steps + warm + 15) / 16);
      if (!t.ok()) return Fail(t.status(), "bench: blocks");
      tables.push_back(std::move(*t));
      prompts.push_back(RandomTokens(P, vocab, 1000 + s));
    }
    // Prefill in groups of at most 4096 tokens.
    ForwardOutput out;
    for (int64_t s0 = 0; s0 < b;) {
      std::vector<SeqStep> seqs;
      int64_t tok = 0;
      for (; s0 < b && tok + P <= 4096; ++s0, tok += P) {
        seqs.push_back(MakeSeqStep(tables[s0], 0, prompts[s0], LogitRows::kNone));
      }
      Status st = (*gpu)->Run(seqs, &out);
      if (!st.ok()) return Fail(st, "bench: prefill");
    }
    std::vector<double> times;
    std::vector<std::vector<int32_t>> next(b, std::vector<int32_t>(1, 1));
    for (int64_t step = 0; step < warm + steps; ++step) {
      std::vector<SeqStep> seqs;
      for (int64_t s = 0; s < b; ++s) {
        next[s][0] = static_cast<int32_t>((s * 31 + step * 7) % vocab);
        seqs.push_back(MakeSeqStep(tables[s], P + step, next[s], LogitRows::kLast));
      }
      const auto t0 = std::chrono::steady_clock::now();
      Status st = (*gpu)->Run(seqs, &out);
      const double dt =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!st.ok()) return Fail(st, "bench: decode");
      if (step >= warm) times.push_back(dt);
    }
    const double step_s = Median(times);
    const double ctx = static_cast<double>(P + warm + steps / 2);
    const double bytes = static_cast<double>(wbytes) + static_cast<double>(b) * ctx * kv_per_token;
    const double roof = bytes / hbm;
    const double tps = static_cast<double>(b) / step_s;
    if (b == 1) batch1 = tps;
    std::printf(
        "decode batch %4lld: %9.1f tok/s  step %7.3f ms  %.2f GB read/step  roofline %.3f ms  "
        "-> %5.1f%% of HBM roofline%s\n",
        static_cast<long long>(b), tps, step_s * 1e3, bytes / 1e9, roof * 1e3,
        100.0 * roof / step_s,
        batch1 > 0 && b > 1
            ? (" (" + std::to_string(tps / batch1).substr(0, 5) + "x batch 1)").c_str()
            : "");
    for (auto& t : tables) {
      for (BlockId id : t) pool->get()->Release(id);
    }
  }
  // Each kernel family's share of a decode step: the backend enqueues every
  // launch of the family named by KVRELAY_CUDA_DOUBLE twice, and the step's
  // growth over the plain step is the family's cost (graphs replay as usual).
  std::vector<int64_t> share_batches;
  {
    std::string s = a.Get("shares", "1,16");
    for (size_t p = 0; p < s.size();) {
      const size_t q = s.find(',', p);
      const int64_t b = std::atoll(s.substr(p, q - p).c_str());
      if (b > 0 && b <= max_b) share_batches.push_back(b);
      p = q == std::string::npos ? s.size() : q + 1;
    }
  }
  for (int64_t b : share_batches) {
    std::vector<std::vector<BlockId>> tables;
    std::vector<SeqStep> prompts;
    std::vector<std::vector<int32_t>> prompt_tokens;
    for (int64_t s = 0; s < b; ++s) {
      auto t = AllocBlocks(pool->get(), per_seq);
      if (!t.ok()) return Fail(t.status(), "bench: share blocks");
      tables.push_back(std::move(*t));
      prompt_tokens.push_back(RandomTokens(P, vocab, 2000 + s));
    }
    ForwardOutput out;
    for (int64_t s = 0; s < b; ++s) {
      SeqStep q = MakeSeqStep(tables[s], 0, prompt_tokens[s], LogitRows::kNone);
      Status st = (*gpu)->Run(std::span<const SeqStep>(&q, 1), &out);
      if (!st.ok()) return Fail(st, "bench: share prefill");
    }
    // Median step over `steps` decode steps at the same positions each time.
    auto measure = [&](const char* family) -> Result<double> {
      if (family == nullptr) {
        unsetenv("KVRELAY_CUDA_DOUBLE");
      } else {
        setenv("KVRELAY_CUDA_DOUBLE", family, 1);
      }
      std::vector<double> times;
      std::vector<std::vector<int32_t>> next(b, std::vector<int32_t>(1, 1));
      for (int64_t step = 0; step < warm + steps; ++step) {
        std::vector<SeqStep> seqs;
        for (int64_t s = 0; s < b; ++s) {
          next[s][0] = static_cast<int32_t>((s * 31 + step * 7) % vocab);
          seqs.push_back(MakeSeqStep(tables[s], P + step, next[s], LogitRows::kLast));
        }
        const auto t0 = std::chrono::steady_clock::now();
        RETURN_IF_ERROR((*gpu)->Run(seqs, &out));
        if (step >= warm) {
          times.push_back(
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
      }
      return Median(times);
    };
    auto base = measure(nullptr);
    if (!base.ok()) return Fail(base.status(), "bench: share base");
    std::string line;
    double total = 0;
    for (const char* family :
         {"matmul", "quantize", "norm", "rope_kv", "attention", "swiglu", "embed"}) {
      auto t = measure(family);
      if (!t.ok()) return Fail(t.status(), "bench: share");
      const double share = std::max(0.0, (*t - *base) / *base);
      total += share;
      char buf[64];
      std::snprintf(buf, sizeof(buf), "  %s %.1f%%", family, 100.0 * share);
      line += buf;
    }
    unsetenv("KVRELAY_CUDA_DOUBLE");
    std::printf(
        "step shares, decode batch %lld (step %.3f ms):%s  (sum %.1f%%; the rest is "
        "launch gaps, copies and the host)\n",
        static_cast<long long>(b), *base * 1e3, line.c_str(), 100.0 * total);
    for (auto& t : tables) {
      for (BlockId id : t) pool->get()->Release(id);
    }
  }
  if (prefill > 0) {
    auto t = AllocBlocks(pool->get(), (prefill + 15) / 16);
    if (!t.ok()) return Fail(t.status(), "bench: prefill blocks");
    std::vector<int32_t> tokens = RandomTokens(prefill, vocab, 7);
    std::vector<double> times;
    ForwardOutput out;
    for (int rep = 0; rep < 4; ++rep) {
      SeqStep s = MakeSeqStep(*t, 0, tokens, LogitRows::kLast);
      const auto t0 = std::chrono::steady_clock::now();
      Status st = (*gpu)->Run(std::span<const SeqStep>(&s, 1), &out);
      const double dt =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!st.ok()) return Fail(st, "bench: prefill");
      if (rep > 0) times.push_back(dt);
    }
    std::printf("prefill %lld tokens: %.1f tok/s (median of 3, %.2f ms)\n",
                static_cast<long long>(prefill), static_cast<double>(prefill) / Median(times),
                Median(times) * 1e3);
  }
  return 0;
}

int Sample() {
  const int rows = 8, vocab = 32000;
  std::vector<float> logits(static_cast<size_t>(rows) * vocab);
  std::mt19937_64 rng(5);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  for (float& x : logits) x = dist(rng);
  float* d = nullptr;
  if (cudaMalloc(&d, logits.size() * sizeof(float)) != cudaSuccess)
    return Fail(Internal("cudaMalloc"), "sample");
  cudaMemcpy(d, logits.data(), logits.size() * sizeof(float), cudaMemcpyHostToDevice);
  std::vector<engine::cuda::DeviceSampleParams> params(rows);
  std::vector<int32_t> want(rows);
  for (int r = 0; r < rows; ++r) {
    engine::SamplingParams sp;
    sp.seed = 100 + r;
    if (r > 0) {
      sp.temperature = 0.6f + 0.1f * r;
      sp.top_k = r == 7 ? 1000 : 20 * r;
      sp.top_p = r % 2 ? 0.9f : 1.0f;
      sp.min_p = r == 4 ? 0.05f : 0.0f;
    }
    engine::Sampler sampler(sp);
    std::vector<float> row(logits.begin() + static_cast<int64_t>(r) * vocab,
                           logits.begin() + static_cast<int64_t>(r + 1) * vocab);
    want[r] = sampler.Sample(row.data(), vocab, {}, 0);
    std::mt19937_64 u(sp.seed);
    params[r] = {sp.temperature, sp.top_k, sp.top_p, sp.min_p,
                 static_cast<double>(u() >> 11) * (1.0 / 9007199254740992.0)};
  }
  engine::cuda::CudaSampler sampler;
  std::vector<int32_t> got(rows);
  Status st = sampler.Sample(d, rows, vocab, params, got.data(), nullptr);
  cudaFree(d);
  if (!st.ok()) return Fail(st, "sample");
  int same = 0;
  for (int r = 0; r < rows; ++r) same += got[r] == want[r];
  std::printf(
      "%s sample: device picks equal the CPU Sampler's on %d/%d rows (greedy, top-k, top-p, "
      "min-p)\n",
      same == rows ? "PASS" : "FAIL", same, rows);
  return same == rows ? 0 : 1;
}

// cuda_ipc: this process sends `mib` MiB of device memory to a child process
// that receives it into its own device memory with different slice
// boundaries and checks every byte.
constexpr int kIpcHeads = 2;
constexpr int64_t kIpcSlab = 4096;
uint8_t Pattern(size_t i) { return static_cast<uint8_t>((i * 131 + 7) ^ (i >> 9)); }

kv_transfer::TransferDesc IpcDesc(uint8_t* base, int64_t layers_total, int layers_per_slice,
                                  bool device) {
  kv_transfer::TransferDesc d;
  d.peer = 0;
  d.request_id = 77;
  d.tag = 1;
  d.layout = {kIpcHeads, kIpcSlab,
              device ? kv_transfer::MemoryKind::kDevice : kv_transfer::MemoryKind::kHost};
  const int64_t layer_bytes = 2 * kIpcHeads * kIpcSlab;
  for (int64_t l = 0; l < layers_total; l += layers_per_slice) {
    kv_transfer::KvSlice s;
    s.block = static_cast<BlockId>(l);
    s.layer_begin = 0;
    s.layer_end = static_cast<int>(std::min<int64_t>(layers_per_slice, layers_total - l));
    s.head_begin = 0;
    s.head_end = kIpcHeads;
    s.layer_data = base + l * layer_bytes;
    d.slices.push_back(s);
  }
  return d;
}

int IpcChild(int fd, int64_t layers) {
  kv_transfer::CudaIpcTransportOptions o;
  o.rank = 1;
  o.control_fd = fd;
  auto t = kv_transfer::CudaIpcTransport::Create(o);
  if (!t.ok()) return Fail(t.status(), "ipc child");
  const size_t bytes = static_cast<size_t>(layers) * 2 * kIpcHeads * kIpcSlab;
  uint8_t* d = nullptr;
  if (cudaMalloc(&d, bytes) != cudaSuccess) return Fail(Internal("cudaMalloc"), "ipc child");
  cudaMemset(d, 0, bytes);
  kv_transfer::TransferDesc desc =
      IpcDesc(d, layers, 7, true);  // other slice boundaries than the sender's
  auto h = (*t)->PostRecv(desc);
  if (!h.ok()) return Fail(h.status(), "ipc child recv");
  Status st = (*t)->Wait(*h, Deadline::AfterMs(20000));
  if (!st.ok()) return Fail(st, "ipc child wait");
  std::vector<uint8_t> host(bytes);
  cudaMemcpy(host.data(), d, bytes, cudaMemcpyDeviceToHost);
  cudaFree(d);
  for (size_t i = 0; i < bytes; ++i) {
    if (host[i] != Pattern(i)) {
      std::printf("FAIL ipc child: byte %zu is %u, sent %u\n", i, host[i], Pattern(i));
      return 1;
    }
  }
  return 0;
}

int Ipc(const Args& a, const char* self) {
  const int64_t mib = a.Int("mib", 64);
  const int64_t layer_bytes = 2 * kIpcHeads * kIpcSlab;
  const int64_t layers = mib * (1 << 20) / layer_bytes;
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return Fail(Internal("socketpair"), "ipc");
  ::fcntl(sv[0], F_SETFD, FD_CLOEXEC);  // only the child's end is inherited
  // The child is a fresh exec of this binary (a forked CUDA context is unusable).
  const std::string fd_s = std::to_string(sv[1]), layers_s = std::to_string(layers);
  char* argv[] = {const_cast<char*>(self), const_cast<char*>("ipc-child"),
                  const_cast<char*>(fd_s.c_str()), const_cast<char*>(layers_s.c_str()), nullptr};
  pid_t pid = 0;
  if (posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv, environ) != 0) {
    return Fail(Internal("posix_spawn"), "ipc");
  }
  ::close(sv[1]);
  kv_transfer::CudaIpcTransportOptions o;
  o.rank = 0;
  o.control_fd = sv[0];
  auto t = kv_transfer::CudaIpcTransport::Create(o);
  if (!t.ok()) return Fail(t.status(), "ipc");
  const size_t bytes = static_cast<size_t>(layers * layer_bytes);
  std::vector<uint8_t> host(bytes);
  for (size_t i = 0; i < bytes; ++i) host[i] = Pattern(i);
  uint8_t* d = nullptr;
  if (cudaMalloc(&d, bytes) != cudaSuccess) return Fail(Internal("cudaMalloc"), "ipc");
  cudaMemcpy(d, host.data(), bytes, cudaMemcpyHostToDevice);
  Status st = (*t)->RegisterMemory(d, bytes);
  if (!st.ok()) return Fail(st, "ipc register");
  kv_transfer::TransferDesc desc = IpcDesc(d, layers, 4, true);
  desc.peer = 1;
  const auto t0 = std::chrono::steady_clock::now();
  auto h = (*t)->PostSend(desc);
  if (!h.ok()) return Fail(h.status(), "ipc send");
  st = (*t)->Wait(*h, Deadline::AfterMs(20000));
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int status = 0;
  const Deadline child_deadline = Deadline::AfterMs(20000);
  pid_t w = 0;
  while ((w = ::waitpid(pid, &status, WNOHANG)) == 0 && !child_deadline.Expired()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (w == 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    return Fail(DeadlineExceeded("child did not exit"), "ipc");
  }
  cudaFree(d);
  if (!st.ok()) return Fail(st, "ipc send wait");
  const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  std::printf(
      "%s cuda_ipc: %lld MiB device->device between two processes in %.2f ms (%.1f GB/s incl. "
      "handle open), child verified every byte: %s\n",
      ok ? "PASS" : "FAIL", static_cast<long long>(mib), dt * 1e3, bytes / dt / 1e9,
      ok ? "yes" : "no");
  return ok ? 0 : 1;
}

int Nccl1() {
#if KVRELAY_WITH_NCCL
  auto id = engine::cuda::CreateNcclUniqueId();
  if (!id.ok()) return Fail(id.status(), "nccl1");
  engine::cuda::NcclCommunicatorOptions o;
  o.timeout = std::chrono::milliseconds(20000);
  auto comm = engine::cuda::NcclCommunicator::Create(o, *id);
  if (!comm.ok()) return Fail(comm.status(), "nccl1 init");
  std::vector<float> x = {1.5f, -2.0f, 3.25f, 0.0f};
  std::vector<float> want = x;
  Status st = (*comm)->AllReduceSum(x.data(), static_cast<int64_t>(x.size()));
  if (!st.ok()) return Fail(st, "nccl1 all-reduce");
  std::vector<float> g(4);
  st = (*comm)->AllGather(want.data(), 4, g.data(), 4);
  if (!st.ok()) return Fail(st, "nccl1 all-gather");
  bool ok = x == want && g == want;
  // nccl transport: a send to ourselves and its receive.
  auto tr = kv_transfer::NcclTransport::Create({comm->get(), 16});
  if (!tr.ok()) return Fail(tr.status(), "nccl1 transport");
  const size_t bytes = 8 * 2 * kIpcHeads * kIpcSlab;
  uint8_t *src = nullptr, *dst = nullptr;
  cudaMalloc(&src, bytes);
  cudaMalloc(&dst, bytes);
  std::vector<uint8_t> host(bytes);
  for (size_t i = 0; i < bytes; ++i) host[i] = Pattern(i);
  cudaMemcpy(src, host.data(), bytes, cudaMemcpyHostToDevice);
  cudaMemset(dst, 0, bytes);
  kv_transfer::TransferDesc sd = IpcDesc(src, 8, 4, true), rd = IpcDesc(dst, 8, 3, true);
  // A send to ourselves and its receive must be in one NCCL group (groups nest).
  st = (*comm)->GroupStart();
  if (!st.ok()) return Fail(st, "nccl1 group");
  auto hs = (*tr)->PostSend(sd);
  auto hr = hs.ok() ? (*tr)->PostRecv(rd) : Result<kv_transfer::TransferHandle>(hs.status());
  st = (*comm)->GroupEnd();
  if (!st.ok()) return Fail(st, "nccl1 group end");
  if (!hr.ok()) return Fail(hr.status(), "nccl1 post");
  st = (*tr)->Wait(*hr, Deadline::AfterMs(20000));
  if (st.ok()) st = (*tr)->Wait(*hs, Deadline::AfterMs(20000));
  std::vector<uint8_t> back(bytes);
  cudaMemcpy(back.data(), dst, bytes, cudaMemcpyDeviceToHost);
  cudaFree(src);
  cudaFree(dst);
  if (!st.ok()) return Fail(st, "nccl1 transfer");
  ok = ok && back == host;
  std::printf(
      "%s nccl1: 1-rank communicator all-reduce/all-gather exact, nccl transport self send/recv "
      "with re-cut slices: %s\n",
      ok ? "PASS" : "FAIL", back == host ? "bytes equal" : "bytes DIFFER");
  return ok ? 0 : 1;
#else
  std::printf("SKIP nccl1: built without NCCL\n");
  return 0;
#endif
}

}  // namespace
}  // namespace kvrelay::gpucheck

int main(int argc, char** argv) {
  using namespace kvrelay::gpucheck;
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: kvrelay_gpu_check probe|gen|agree|bench|sample|ipc|nccl1 [flags]\n");
    return 2;
  }
  const std::string cmd = argv[1];
  if (cmd == "ipc-child" && argc >= 4) return IpcChild(std::atoi(argv[2]), std::atoll(argv[3]));
  const Args a = ParseArgs(argc, argv, 2);
  if (cmd == "probe") return Probe();
  if (cmd == "gen") return Gen(a);
  if (cmd == "cpu") return Cpu(a);
  // Everything else needs the device.
  std::string desc;
  kvrelay::Status s = kvrelay::engine::cuda::UseDevice(0, &desc);
  if (!s.ok()) {
    std::printf("no GPU: %s (nothing measured)\n", s.message().c_str());
    return 3;
  }
  if (cmd == "agree") return Agree(a);
  if (cmd == "bench") return Bench(a);
  if (cmd == "sample") return Sample();
  if (cmd == "ipc") return Ipc(a, argv[0]);
  if (cmd == "nccl1") return Nccl1();
  std::fprintf(stderr, "unknown command %s\n", cmd.c_str());
  return 2;
}
