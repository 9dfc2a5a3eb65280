// `kvrelay bench prefix`: time to first token (TTFT) of a prompt whose first
// --seen-tokens tokens were computed before, three ways:
//   (a) recompute: a fresh engine computes the whole prompt;
//   (b) ram:       a fresh engine (empty pool) first restores the seen prefix
//                  from the host-RAM tier (kv_store::HostRamTier), then prefills
//                  the rest;
//   (c) rocksdb:   the same from the RocksDB tier after a restart: the tier is
//                  closed, the page cache of its files is dropped
//                  (posix_fadvise DONTNEED after the flush; kept with
//                  --warm-page-cache, as a worker's prefetch leaves it), the DB reopened
//                  (open time reported apart), and a fresh engine restores from it.
// TTFT runs from the request's arrival (restore included) to the first sampled
// token. Every rep uses a new random prefix (so no rep hits an earlier one) and
// checks that (b) and (c) sample the same first token as (a) and report the
// restored tokens as cached. Medians over --reps.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cli/command.h"
#include "common/flags.h"
#include "engine/runtime/engine.h"
#include "engine/runtime/model.h"
#include "kv_store/host_ram_tier.h"
#include "kv_store/rocksdb_tier.h"
#include "kv_store/tiered_cache.h"

namespace kvrelay::cli {
namespace {

namespace fs = std::filesystem;
using engine::BlockId;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct FirstToken {
  int32_t token = -1;
  int64_t cached = 0;
};

// Submits `prompt` (greedy, one token) and steps until its first token.
Result<FirstToken> RunToFirstToken(engine::Engine* e, const std::vector<int32_t>& prompt,
                                   engine::RequestId id, const std::string& salt) {
  engine::RequestSpec spec;
  spec.id = id;
  spec.prompt = prompt;
  spec.sampling.max_tokens = 1;
  spec.tenant_salt = salt;
  RETURN_IF_ERROR(e->Submit(std::move(spec)));
  FirstToken out;
  for (int steps = 0; steps < 100000; ++steps) {
    ASSIGN_OR_RETURN(auto events, e->Step());
    for (const auto& ev : events) {
      if (ev.id != id) continue;
      if (!ev.error.ok()) return ev.error;
      if (ev.token >= 0) {
        out.token = ev.token;
        out.cached = ev.cached_prompt_tokens;
      }
      if (ev.finished) {
        if (out.token < 0) return Internal("request finished without a token");
        return out;
      }
    }
  }
  return Internal("no first token after 100000 steps");
}

void DropPageCache(const fs::path& dir) {
  std::error_code ec;
  for (auto& e : fs::recursive_directory_iterator(dir, ec)) {
    if (!e.is_regular_file()) continue;
    int fd = ::open(e.path().c_str(), O_RDONLY);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

const FlagSpec kSpec = {
    "kvrelay bench prefix",
    "Prefill with and without a prefix cache hit (memory, RocksDB store cold and warm).",
    "",
    0,
    {{"model", "models/SmolLM2-135M-Instruct.Q4_1.gguf", "GGUF model path"},
     {"prompt-tokens", "2048", "prompt length"},
     {"seen-tokens", "1920", "leading tokens already cached"},
     {"reps", "3", "repetitions (median reported)"},
     {"dir", "$TMPDIR/kvrelay_bench_prefix", "RocksDB store directory"},
     {"threads", "0", "compute threads (0 = all cores)"},
     {"kv-dtype", "f32", "KV cache dtype"},
     {"seal", "", "seal the RocksDB blocks (AES-256-GCM, as a worker does with its cluster key)",
      true},
     {"warm-page-cache", "",
      "keep the store's pages in the page cache across the restart (as a worker's prefetch "
      "at open leaves them) instead of dropping them",
      true}}};

int Run(const std::vector<std::string>& args) {
  int exit_code = 0;
  auto flags_or = ParseCommandFlags(args, kSpec, &exit_code);
  if (!flags_or) return exit_code;
  const Flags& flags = *flags_or;
  auto fail = [](const Status& s) {
    std::fprintf(stderr, "bench prefix: %s\n", s.ToString().c_str());
    return 1;
  };
  const std::string model_path = flags.Get("model", "models/SmolLM2-135M-Instruct.Q4_1.gguf");
  auto prompt_tokens = flags.GetInt("prompt-tokens", 2048);
  auto seen_tokens = flags.GetInt("seen-tokens", 1920);
  auto reps = flags.GetInt("reps", 3);
  auto threads = flags.GetInt("threads", 0);
  const bool warm_page_cache = flags.Has("warm-page-cache");
  if (!prompt_tokens.ok()) return fail(prompt_tokens.status());
  if (!seen_tokens.ok()) return fail(seen_tokens.status());
  if (!reps.ok()) return fail(reps.status());
  if (!threads.ok()) return fail(threads.status());
  if (*seen_tokens <= 0 || *seen_tokens >= *prompt_tokens || *reps <= 0) {
    return fail(InvalidArgument("need 0 < --seen-tokens < --prompt-tokens and --reps > 0"));
  }
  auto dtype = engine::ParseKvDtype(flags.Get("kv-dtype", "f32"));
  if (!dtype.ok()) return fail(dtype.status());
  const fs::path dir =
      flags.Get("dir", (fs::temp_directory_path() / "kvrelay_bench_prefix").string());

  auto model_or = engine::Model::Load(model_path);
  if (!model_or.ok()) return fail(model_or.status());
  std::shared_ptr<const engine::Model> model(std::move(model_or).value());
  const engine::KvLayout layout = model->MakeKvLayout(*dtype, 16);
  const int64_t kv_bytes =
      static_cast<int64_t>(2.5 * static_cast<double>(*prompt_tokens) * layout.BytesPerToken()) +
      64 * layout.BlockBytes();

  engine::EngineOptions eo;
  eo.kv_dtype = *dtype;
  eo.kv_capacity_bytes = kv_bytes;
  eo.threads = static_cast<int>(*threads);
  eo.max_step_tokens = 512;
  eo.max_running = 4;
  // This tool persists and restores whole prompts through PersistPrefix /
  // RestorePrefix into one table of every layer; a model whose KV cache
  // splits into groups loads through TieredCache::LoadMissing, the worker's
  // path, and is refused here.
  auto new_engine = [&]() -> Result<std::unique_ptr<engine::Engine>> {
    ASSIGN_OR_RETURN(std::unique_ptr<engine::Engine> e, engine::Engine::Create(eo, model));
    if (e->kv_groups().size() > 1) {
      return Unimplemented("bench prefix restores one KV cache group; this model has " +
                           e->kv_groups().DebugString());
    }
    return e;
  };

  fs::remove_all(dir);
  kv_store::RocksDbTier::Options disk_opts;
  disk_opts.path = dir.string();
  disk_opts.max_queue_blocks = 4096;
  disk_opts.max_queue_bytes = 4LL << 30;
  disk_opts.verify_value_checksums = false;  // as the prefill worker opens its store
  auto ram = kv_store::HostRamTier::Create({.capacity_bytes = 4LL << 30}).value();

  // The worker's disk blocks are sealed (kv_store/block_seal.h); --seal
  // measures that path, with a bench-only secret.
  kv_store::TieredCache::Options disk_cache_opts;
  if (flags.Has("seal")) {
    auto sealer = kv_store::BlockSealer::Create("kvrelay bench prefix: not a real cluster key");
    if (!sealer.ok()) return fail(sealer.status());
    disk_cache_opts.sealer = *sealer;
  }
  const std::string salt = "bench";
  const int vocab = model->config().vocab;
  std::vector<double> ttft_a, ttft_b, ttft_c, restore_b, restore_c, open_c;
  std::printf("model %s, prompt %lld tokens, %lld seen, kv %s, %.0f KiB per block\n",
              model_path.c_str(), static_cast<long long>(*prompt_tokens),
              static_cast<long long>(*seen_tokens),
              std::string(engine::KvDtypeName(*dtype)).c_str(),
              static_cast<double>(layout.BlockBytes()) / 1024.0);
  for (int64_t rep = 0; rep < *reps; ++rep) {
    std::mt19937 rng(static_cast<uint32_t>(1234 + rep));
    std::vector<int32_t> seen(static_cast<size_t>(*seen_tokens));
    for (auto& t : seen) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
    auto with_tail = [&](uint32_t seed) {
      std::vector<int32_t> p = seen;
      std::mt19937 r(seed);
      while (static_cast<int64_t>(p.size()) < *prompt_tokens) {
        p.push_back(static_cast<int32_t>(r() % static_cast<uint32_t>(vocab)));
      }
      return p;
    };
    const std::vector<int32_t> earlier = with_tail(static_cast<uint32_t>(100 + rep));
    const std::vector<int32_t> prompt = with_tail(static_cast<uint32_t>(200 + rep));

    // The earlier request: computed once, its blocks persisted to both tiers.
    {
      auto e = new_engine();
      if (!e.ok()) return fail(e.status());
      auto r = RunToFirstToken(e->get(), earlier, 1, salt);
      if (!r.ok()) return fail(r.status());
      auto disk = kv_store::RocksDbTier::Open(disk_opts);
      if (!disk.ok()) return fail(disk.status());
      kv_store::TieredCache cache(disk_cache_opts, ram.get(), disk->get());
      auto n = cache.PersistPrefix((*e)->pool(), seen, model->fingerprint(), salt);
      if (!n.ok()) return fail(n.status());
      Status durable = (*disk)->WaitDurable(Deadline::AfterMs(120000));
      if (!durable.ok()) return fail(durable);
    }  // the tier closes here (flushes memtables)
    // A worker reads its store into the page cache at open (prefetch_bytes);
    // --warm-page-cache measures that case, the default a cold disk.
    if (!warm_page_cache) DropPageCache(dir);

    // (a) recompute.
    FirstToken ref;
    {
      auto e = new_engine();
      if (!e.ok()) return fail(e.status());
      const double t0 = Now();
      auto r = RunToFirstToken(e->get(), prompt, 2, salt);
      ttft_a.push_back(Now() - t0);
      if (!r.ok()) return fail(r.status());
      ref = *r;
    }
    // (b) restore from host RAM, then prefill the rest.
    {
      auto e = new_engine();
      if (!e.ok()) return fail(e.status());
      kv_store::TieredCache cache({}, ram.get(), nullptr);
      std::vector<BlockId> table;
      const double t0 = Now();
      auto restored = cache.RestorePrefix((*e)->pool(), prompt, model->fingerprint(), salt, &table);
      if (!restored.ok()) return fail(restored.status());
      for (BlockId b : table) (*e)->pool()->Release(b);
      restore_b.push_back(Now() - t0);
      auto r = RunToFirstToken(e->get(), prompt, 3, salt);
      ttft_b.push_back(Now() - t0);
      if (!r.ok()) return fail(r.status());
      if (*restored != *seen_tokens || r->cached < *restored || r->token != ref.token) {
        std::fprintf(
            stderr,
            "bench prefix: ram restore mismatch: restored %d, cached %lld, token %d vs %d\n",
            *restored, static_cast<long long>(r->cached), r->token, ref.token);
        return 1;
      }
    }
    // (c) restart: reopen the DB (cold page cache), restore from disk.
    {
      const double o0 = Now();
      auto disk = kv_store::RocksDbTier::Open(disk_opts);
      if (!disk.ok()) return fail(disk.status());
      open_c.push_back(Now() - o0);
      auto e = new_engine();
      if (!e.ok()) return fail(e.status());
      kv_store::TieredCache cache(disk_cache_opts, nullptr, disk->get());
      std::vector<BlockId> table;
      const double t0 = Now();
      auto restored = cache.RestorePrefix((*e)->pool(), prompt, model->fingerprint(), salt, &table);
      if (!restored.ok()) return fail(restored.status());
      for (BlockId b : table) (*e)->pool()->Release(b);
      restore_c.push_back(Now() - t0);
      auto r = RunToFirstToken(e->get(), prompt, 4, salt);
      ttft_c.push_back(Now() - t0);
      if (!r.ok()) return fail(r.status());
      if (*restored != *seen_tokens || r->cached < *restored || r->token != ref.token) {
        std::fprintf(
            stderr,
            "bench prefix: disk restore mismatch: restored %d, cached %lld, token %d vs %d\n",
            *restored, static_cast<long long>(r->cached), r->token, ref.token);
        return 1;
      }
    }
    std::printf(
        "rep %lld: ttft recompute %.3f s, ram %.3f s (restore %.3f), rocksdb %.3f s (restore %.3f, "
        "open %.3f)\n",
        static_cast<long long>(rep), ttft_a.back(), ttft_b.back(), restore_b.back(), ttft_c.back(),
        restore_c.back(), open_c.back());
  }
  const double a = Median(ttft_a), b = Median(ttft_b), c = Median(ttft_c);
  std::printf(
      "median TTFT: (a) recompute %.3f s | (b) host RAM %.3f s (%.1fx) | (c) RocksDB after restart "
      "%.3f s (%.1fx)\n",
      a, b, a / b, c, a / c);
  std::printf("median restore only: ram %.3f s, rocksdb %.3f s; median DB open %.3f s\n",
              Median(restore_b), Median(restore_c), Median(open_c));
  fs::remove_all(dir);
  return 0;
}

}  // namespace

KVRELAY_COMMAND(bench_prefix, "bench prefix",
                "bench prefix --model PATH [--prompt-tokens 2048] [--seen-tokens 1920] [--reps 3] "
                "[--dir DIR] [--threads N] [--kv-dtype f32] [--seal]",
                Run);

}  // namespace kvrelay::cli
