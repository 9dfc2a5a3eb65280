// kvrelay perplexity: standard chunked perplexity of a text file. The token
// stream is cut into chunks of --ctx tokens; each chunk is evaluated from an
// empty KV cache, and the second half of its positions is scored (each token
// predicted with at least ctx/2 tokens of context), as llama.cpp's perplexity.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "cli/command.h"
#include "common/clock.h"
#include "common/flags.h"
#include "common/thread_pool.h"
#include "engine/kv_cache/kv_cache.h"
#include "engine/kv_cache/kv_codec.h"
#include "engine/runtime/forward.h"
#include "engine/runtime/model.h"
#include "engine/tokenizer/tokenizer.h"

namespace kvrelay::cli {
namespace {

using engine::BlockId;
using engine::ForwardOutput;
using engine::ForwardPass;
using engine::KvBlockPool;
using engine::LogitRows;
using engine::MakeSeqStep;
using engine::Model;
using engine::SeqStep;

int Fail(const Status& st) {
  std::fprintf(stderr, "kvrelay perplexity: %s\n", st.ToString().c_str());
  return st.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

const FlagSpec kSpec = {"kvrelay perplexity",
                        "Perplexity of a text file in --ctx-token chunks (llama.cpp's method).",
                        "",
                        0,
                        {{"model", "", "GGUF model path (required)"},
                         {"file", "", "text file to score (required)"},
                         {"ctx", "512", "tokens per chunk (>= 4)"},
                         {"max-chunks", "0", "score at most this many chunks (0 = all)"},
                         {"threads", "0", "compute threads (0 = all cores)"},
                         {"kv-dtype", "f32", "KV cache dtype: f32|f16|bf16|int8|kivi4|kivi2"}}};

int RunPerplexity(const std::vector<std::string>& args) {
  int exit_code = 0;
  auto flags = ParseCommandFlags(args, kSpec, &exit_code);
  if (!flags) return exit_code;
  const Flags& f = *flags;
  if (!f.Has("model") || !f.Has("file"))
    return Fail(InvalidArgument("--model and --file are required"));
  auto ctx = f.GetInt("ctx", 512);
  auto max_chunks = f.GetInt("max-chunks", 0);
  auto threads = f.GetInt("threads", 0);
  if (!ctx.ok()) return Fail(ctx.status());
  if (!max_chunks.ok()) return Fail(max_chunks.status());
  if (!threads.ok()) return Fail(threads.status());
  if (*ctx < 4) return Fail(InvalidArgument("--ctx must be >= 4"));
  auto dtype = engine::ParseKvDtype(f.Get("kv-dtype", "f32"));
  if (!dtype.ok()) return Fail(dtype.status());

  std::ifstream in(f.Get("file"), std::ios::binary);
  if (!in) return Fail(NotFound("cannot read --file '" + f.Get("file") + "'"));
  std::stringstream buf;
  buf << in.rdbuf();
  auto model = Model::Load(f.Get("model"));
  if (!model.ok()) return Fail(model.status());
  const Model& m = **model;
  if (*ctx > m.config().context_length) {
    return Fail(InvalidArgument("--ctx exceeds the model context length " +
                                std::to_string(m.config().context_length)));
  }
  std::vector<int32_t> tokens = m.tokenizer()->Encode(buf.str(), false, false);
  const int64_t n_ctx = *ctx;
  int64_t chunks = static_cast<int64_t>(tokens.size()) / n_ctx;
  if (*max_chunks > 0) chunks = std::min(chunks, *max_chunks);
  if (chunks < 1) {
    return Fail(InvalidArgument("the file has " + std::to_string(tokens.size()) +
                                " tokens, fewer than one chunk of " + std::to_string(n_ctx)));
  }
  KvBlockPool::Options po;
  po.layout = m.MakeKvLayout(*dtype, 16);
  const int64_t blocks = (n_ctx + 15) / 16;
  // KIVI pools carve f32 staging (partially written blocks) out of
  // capacity_bytes; by default an eighth, which left fewer blocks than one
  // chunk needs ("KV pool exhausted"). Size it explicitly on top: every layer
  // of one block (the chunk's tail) plus slack, as bench kv does.
  po.capacity_bytes = blocks * po.layout.BlockBytes();
  if (engine::kvcodec::IsKivi(*dtype)) {
    const int64_t slot = 2LL * po.layout.kv_heads * 16 * po.layout.head_dim * 4;
    po.staging_bytes = 2 * po.layout.layers * slot;
    po.capacity_bytes += po.staging_bytes;
  }
  auto pool = KvBlockPool::Create(po);
  if (!pool.ok()) return Fail(pool.status());
  ThreadPool tp(*threads > 0 ? static_cast<int>(*threads) : ThreadPool::DefaultThreads(), "ppl");
  ForwardPass fwd(m, pool->get(), &tp);
  const int vocab = m.config().vocab;
  const int64_t first = n_ctx / 2;
  const int64_t sub = 256;  // tokens per forward call (bounds activation memory)
  double nll = 0;
  int64_t scored = 0;
  const TimePoint start = Clock::now();
  std::fprintf(stderr, "%zu tokens, %lld chunks of %lld, kv %s\n", tokens.size(),
               static_cast<long long>(chunks), static_cast<long long>(n_ctx),
               std::string(engine::KvDtypeName(*dtype)).c_str());
  for (int64_t c = 0; c < chunks; ++c) {
    std::vector<BlockId> table;
    for (int64_t b = 0; b < blocks; ++b) {
      auto id = (*pool)->Allocate();
      if (!id.ok()) return Fail(id.status());
      table.push_back(*id);
    }
    const int32_t* chunk = tokens.data() + c * n_ctx;
    for (int64_t done = 0; done < n_ctx; done += sub) {
      const int64_t len = std::min(sub, n_ctx - done);
      SeqStep s;
      s.blocks.assign(table.begin(), table.end());
      s.cache_len = done;
      s.tokens.assign(chunk + done, chunk + done + len);
      s.logits = done + len > first ? LogitRows::kAll : LogitRows::kNone;
      ForwardOutput out;
      if (Status st = fwd.Run(std::span<const SeqStep>(&s, 1), &out); !st.ok()) return Fail(st);
      if (s.logits == LogitRows::kNone) continue;
      for (int64_t i = 0; i < len; ++i) {
        const int64_t pos = done + i;  // logits at pos predict token pos + 1
        if (pos < first || pos + 1 >= n_ctx) continue;
        const float* row = out.Row(i, vocab);
        double mx = row[0];
        for (int v = 1; v < vocab; ++v) mx = std::max<double>(mx, row[v]);
        double z = 0;
        for (int v = 0; v < vocab; ++v) z += std::exp(row[v] - mx);
        nll += -(row[chunk[pos + 1]] - mx - std::log(z));
        ++scored;
      }
    }
    for (BlockId b : table) (*pool)->Release(b);
    std::fprintf(stderr, "[%lld] %.4f\n", static_cast<long long>(c + 1), std::exp(nll / scored));
  }
  const double secs = SecondsSince(start);
  std::printf("perplexity %.4f over %lld scored tokens (%lld chunks of %lld, kv %s) in %.1f s\n",
              std::exp(nll / scored), static_cast<long long>(scored),
              static_cast<long long>(chunks), static_cast<long long>(n_ctx),
              std::string(engine::KvDtypeName(*dtype)).c_str(), secs);
  return 0;
}

}  // namespace

KVRELAY_COMMAND(perplexity, "perplexity",
                "perplexity --model M --file TEXT [--kv-dtype D] [--ctx N] [--max-chunks K] "
                "[--threads N]",
                RunPerplexity);

}  // namespace kvrelay::cli
