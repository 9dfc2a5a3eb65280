#include "engine/runtime/cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "engine/kernels/gelu.h"
#include "engine/kernels/matmul.h"
#include "engine/kernels/ops.h"
#include "engine/runtime/forward.h"

namespace kvrelay::engine {
namespace {

// Runs fn over [0, n) on the pool, or inline without one.
void ParallelFor(ThreadPool* pool, int64_t n, const std::function<void(int64_t, int64_t, int)>& fn,
                 int64_t grain = 1) {
  if (n <= 0) return;
  if (pool == nullptr || pool->num_threads() <= 1 || n <= grain) {
    fn(0, n, 0);
  } else {
    pool->ParallelFor(n, fn, grain);
  }
}

void AddBias(float* y, const std::vector<float>& b, int64_t n_tokens) {
  if (b.empty()) return;
  const int64_t n = static_cast<int64_t>(b.size());
  for (int64_t t = 0; t < n_tokens; ++t) {
    float* row = y + t * n;
    for (int64_t i = 0; i < n; ++i) row[i] += b[i];
  }
}

// Rotates `n_heads` heads of one token in place with llama.cpp's arithmetic
// (engine/kernels/ops.h: float angles, FMA as ggml's rope).
void ApplyRope(float* x, int n_heads, int head_dim, int rope_dim, RopeLayout layout, float base,
               int64_t pos) {
  float cosv[512], sinv[512];  // rope_dim <= head_dim <= 1024 is checked at load
  RopeAnglesGgml(pos, base, rope_dim, cosv, sinv);
  for (int h = 0; h < n_heads; ++h) {
    RopeRotate(x + static_cast<int64_t>(h) * head_dim, rope_dim / 2, layout != RopeLayout::kNormal,
               cosv, sinv);
  }
}

const std::vector<float>& NormWeights(const LayerWeights& w, LayerNorm which) {
  switch (which) {
    case LayerNorm::kAttn:
      return w.attn_norm_w;
    case LayerNorm::kFfn:
      return w.ffn_norm_w;
    case LayerNorm::kPostAttn:
      return w.post_attn_norm_w;
    case LayerNorm::kPostFfn:
      break;
  }
  return w.post_ffn_norm_w;
}

}  // namespace

void RmsNorm(const float* x, const float* w, int n, float eps, float* y) {
  RmsNormFast(x, w, n, eps, y);  // llama.cpp's arithmetic (engine/kernels/ops.h)
}

CpuKernels::CpuKernels(const Model& model, KvBlockPool* pool, KvCacheGroups groups,
                       ThreadPool* threads)
    : model_(model), pool_(pool), groups_(std::move(groups)), threads_(threads) {}

std::vector<float>& CpuKernels::Buf(Act a) {
  switch (a) {
    case Act::kX:
      return x_;
    case Act::kXn:
      return xn_;
    case Act::kAttn:
      return attn_;
    case Act::kProj:
      return proj_;
    case Act::kFfn:
      return gate_;  // the activation is computed in place of the gate
    case Act::kFull:
      break;
  }
  return full_;
}

Status CpuKernels::RunStep(std::span<const SeqStep> seqs, const StepShape& shape,
                           std::span<const int64_t> logit_rows, std::span<const BackendPick> picks,
                           ForwardOutput* out, const std::function<void(int layer)>& layer_hook,
                           const std::function<Status()>& body) {
  if (!picks.empty()) return FailedPrecondition("the CPU kernel table does not pick tokens");
  const ModelConfig& c = model_.config();
  const int64_t T = shape.tokens;
  const int d = c.d_model, qd = c.q_dim(), kvd = c.kv_dim();
  x_.resize(T * d);
  xn_.resize(T * d);
  q_.resize(T * qd);
  k_.resize(T * kvd);
  v_.resize(T * kvd);
  attn_.resize(T * qd);
  proj_.resize(T * d);
  gate_.resize(T * c.ffn_dim);
  up_.resize(T * c.ffn_dim);
  tok_seq_.resize(T);
  tok_pos_.resize(T);
  int64_t t = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    for (size_t i = 0; i < seqs[s].tokens.size(); ++i, ++t) {
      tok_seq_[t] = static_cast<int64_t>(s);
      tok_pos_[t] = seqs[s].cache_len + static_cast<int64_t>(i);
    }
  }
  seqs_ = seqs;
  rows_ = logit_rows;
  out_ = out;
  hook_ = &layer_hook;
  T_ = T;
  Status st = body();
  seqs_ = {};
  rows_ = {};
  out_ = nullptr;
  hook_ = nullptr;
  return st;
}

Status CpuKernels::Embed(float scale) {
  const int d = model_.config().d_model;
  int64_t t = 0;
  for (const SeqStep& q : seqs_) {
    for (int32_t tok : q.tokens) GetRow(model_.token_embd(), tok, x_.data() + (t++) * d);
  }
  // gemma3: embeddings times sqrt(d_model) (ggml_scale, one float multiply).
  if (scale != 1.0f) {
    for (int64_t i = 0; i < T_ * d; ++i) x_[i] *= scale;
  }
  return Status::Ok();
}

Status CpuKernels::RmsNorm(int layer, LayerNorm which, Act in, Act out) {
  const ModelConfig& c = model_.config();
  const int d = c.d_model;
  const float* w = NormWeights(model_.layers()[layer], which).data();
  const float* x = Buf(in).data();
  float* y = Buf(out).data();
  ParallelFor(threads_, T_, [&](int64_t a, int64_t b, int) {
    for (int64_t t = a; t < b; ++t) engine::RmsNorm(x + t * d, w, d, c.rms_eps, y + t * d);
  });
  return Status::Ok();
}

Status CpuKernels::ProjectQkv(int layer) {
  const LayerWeights& w = model_.layers()[layer];
  // One activation quantization and one parallel section for Q, K and V.
  const GgufTensor* ws[] = {w.wq, w.wk, w.wv};
  float* ys[] = {q_.data(), k_.data(), v_.data()};
  MatMulShared(ws, xn_.data(), T_, ys, threads_);
  AddBias(q_.data(), w.bq, T_);
  AddBias(k_.data(), w.bk, T_);
  AddBias(v_.data(), w.bv, T_);
  return Status::Ok();
}

Status CpuKernels::QkNorm(int layer) {
  const ModelConfig& c = model_.config();
  const LayerWeights& w = model_.layers()[layer];
  const int qd = c.q_dim(), kvd = c.kv_dim();
  // RMSNorm of every Q and K head before RoPE (llama.cpp's order).
  ParallelFor(threads_, T_, [&](int64_t a, int64_t b, int) {
    for (int64_t t = a; t < b; ++t) {
      for (int h = 0; h < c.n_heads; ++h) {
        float* qh = q_.data() + t * qd + static_cast<int64_t>(h) * c.head_dim;
        engine::RmsNorm(qh, w.q_norm_w.data(), c.head_dim, c.rms_eps, qh);
      }
      for (int h = 0; h < c.n_kv_heads; ++h) {
        float* kh = k_.data() + t * kvd + static_cast<int64_t>(h) * c.head_dim;
        engine::RmsNorm(kh, w.k_norm_w.data(), c.head_dim, c.rms_eps, kh);
      }
    }
  });
  return Status::Ok();
}

Status CpuKernels::RopeWriteKv(int layer, float rope_base, float q_scale) {
  const ModelConfig& c = model_.config();
  const int qd = c.q_dim(), kvd = c.kv_dim();
  ParallelFor(threads_, T_, [&](int64_t a, int64_t b, int) {
    for (int64_t t = a; t < b; ++t) {
      ApplyRope(q_.data() + t * qd, c.n_heads, c.head_dim, c.rope_dim, c.rope_layout, rope_base,
                tok_pos_[t]);
      ApplyRope(k_.data() + t * kvd, c.n_kv_heads, c.head_dim, c.rope_dim, c.rope_layout, rope_base,
                tok_pos_[t]);
    }
  });
  if (q_scale != 0.0f) {
    for (int64_t i = 0; i < T_ * qd; ++i) q_[i] *= q_scale;
  }
  // K/V of the new tokens into the pool (owner thread only: the pool is
  // thread-compatible).
  const int B = pool_->layout().block_tokens;
  const int slot = groups_.slot_of[layer];
  for (int64_t t = 0; t < T_; ++t) {
    const SeqStep& q = seqs_[tok_seq_[t]];
    const int64_t pos = tok_pos_[t];
    pool_->WriteToken(TableOf(q, layer)[pos / B], slot, static_cast<int>(pos % B),
                      k_.data() + t * kvd, v_.data() + t * kvd);
  }
  return Status::Ok();
}

Status CpuKernels::LayerDone(int layer) {
  if (*hook_) (*hook_)(layer);
  return Status::Ok();
}

Status CpuKernels::Project(int layer, LayerMatrix which, Act in, Act out, bool accumulate) {
  const LayerWeights& w = model_.layers()[layer];
  const GgufTensor& m = which == LayerMatrix::kOut ? *w.wo : *w.ffn_down;
  std::vector<float>& y = Buf(out);
  if (!accumulate) {
    MatMul(m, Buf(in).data(), T_, y.data(), threads_);
    return Status::Ok();
  }
  // The product, then the residual add: llama.cpp's two operations.
  const int64_t n = T_ * model_.config().d_model;
  acc_.resize(n);
  MatMul(m, Buf(in).data(), T_, acc_.data(), threads_);
  for (int64_t i = 0; i < n; ++i) y[i] += acc_[i];
  return Status::Ok();
}

Status CpuKernels::ProjectGateUp(int layer) {
  const LayerWeights& w = model_.layers()[layer];
  const GgufTensor* ws[] = {w.ffn_gate, w.ffn_up};
  float* ys[] = {gate_.data(), up_.data()};
  MatMulShared(ws, xn_.data(), T_, ys, threads_);
  return Status::Ok();
}

Status CpuKernels::GatedActivation(ModelConfig::FfnAct act) {
  const int n = model_.config().ffn_dim;
  ParallelFor(threads_, T_, [&](int64_t a, int64_t b, int) {
    for (int64_t t = a; t < b; ++t) {
      float* g = gate_.data() + t * n;
      if (act == ModelConfig::FfnAct::kGeluTanh) {
        GeluTanhMulGgml(g, up_.data() + t * n, n, g);  // ggml's fp16 table
      } else {
        SiluMul(g, up_.data() + t * n, n, g);  // exp as llama.cpp's
      }
    }
  });
  return Status::Ok();
}

Status CpuKernels::Add(Act dst, Act src) {
  float* y = Buf(dst).data();
  const float* x = Buf(src).data();
  const int64_t n = T_ * model_.config().d_model;
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
  return Status::Ok();
}

Status CpuKernels::AllReduce(Act a) {
  return collective_->AllReduceSum(Buf(a).data(), T_ * model_.config().d_model);
}

Status CpuKernels::GatherColumns(Act local, const std::vector<UnitRange>& widths) {
  const int64_t T = T_;
  const int64_t full = widths.back().end;
  const int64_t mine = widths[model_.shard().rank].size();
  gathered_.resize(T * full);
  RETURN_IF_ERROR(collective_->AllGather(Buf(local).data(), T * mine, gathered_.data(), T * full));
  full_.resize(T * full);
  // gathered_ is rank 0's [T x w0] block, then rank 1's [T x w1], ...
  for (const UnitRange& r : widths) {
    const float* src = gathered_.data() + T * r.begin;
    const int64_t w = r.size();
    for (int64_t t = 0; t < T; ++t) {
      std::copy(src + t * w, src + (t + 1) * w, full_.data() + t * full + r.begin);
    }
  }
  return Status::Ok();
}

Status CpuKernels::FinalNorm() {
  const ModelConfig& c = model_.config();
  const int d = c.d_model;
  for (size_t r = 0; r < rows_.size(); ++r) {
    engine::RmsNorm(x_.data() + rows_[r] * d, model_.output_norm().data(), d, c.rms_eps,
                    xn_.data() + static_cast<int64_t>(r) * d);
  }
  return Status::Ok();
}

Status CpuKernels::Logits(float softcap) {
  const ModelConfig& c = model_.config();
  const int64_t R = static_cast<int64_t>(rows_.size());
  if (R == 0) return Status::Ok();
  out_->logits.resize(R * c.vocab);
  MatMul(model_.lm_head(), xn_.data(), R, out_->logits.data(), threads_);
  if (softcap > 0.0f) {
    // As llama.cpp: scale by 1/c, tanh, scale by c (three float ops).
    const float inv = 1.0f / softcap;
    for (float& v : out_->logits) v = std::tanh(v * inv) * softcap;
  }
  return Status::Ok();
}

Status CpuKernels::Attend(int layer, int window, float scale) {
  const std::span<const SeqStep> seqs = seqs_;
  const ModelConfig& c = model_.config();
  const int B = pool_->layout().block_tokens;
  const int slot = groups_.slot_of[layer];
  const int hd = c.head_dim, kvh = c.n_kv_heads, group = c.n_heads / c.n_kv_heads;
  const int qd = c.q_dim();
  const size_t S = seqs.size();
  // Per (sequence, kv head): one K and one V row pointer table per block.
  // f32 pools are read in place (HeadSlabF32); other dtypes are decoded into
  // kv_scratch_ first.
  const bool in_place = pool_->layout().dtype == KvDtype::kF32;
  std::vector<int64_t> ptr_off(S + 1, 0), kv_off(S + 1, 0), tok_off(S + 1, 0);
  int64_t max_len = 0;
  for (size_t s = 0; s < S; ++s) {
    const int64_t len = seqs[s].cache_len + static_cast<int64_t>(seqs[s].tokens.size());
    const int64_t nb = (len + B - 1) / B;
    max_len = std::max(max_len, len);
    ptr_off[s + 1] = ptr_off[s] + kvh * nb;
    kv_off[s + 1] = kv_off[s] + (in_place ? 0 : 2 * kvh * nb * B * hd);
    tok_off[s + 1] = tok_off[s] + static_cast<int64_t>(seqs[s].tokens.size());
  }
  kv_scratch_.resize(kv_off[S]);
  kptr_.resize(ptr_off[S]);
  vptr_.resize(ptr_off[S]);
  // f32 pools only fill pointer tables (cheap): run that on this thread and
  // save a pool hand-off per layer; decoding other dtypes is worth a loop.
  const std::function<void(int64_t, int64_t, int)> fill = [&](int64_t a, int64_t b, int) {
    for (int64_t item = a; item < b; ++item) {
      const size_t s = item / kvh;
      const int h = static_cast<int>(item % kvh);
      const SeqStep& q = seqs[s];
      const std::vector<BlockId>& table = TableOf(q, layer);
      const int64_t len = q.cache_len + static_cast<int64_t>(q.tokens.size());
      const int64_t nb = (len + B - 1) / B;
      const float** kp = kptr_.data() + ptr_off[s] + h * nb;
      const float** vp = vptr_.data() + ptr_off[s] + h * nb;
      float* kbuf = kv_scratch_.data() + kv_off[s] + 2 * h * nb * B * hd;
      float* vbuf = kbuf + nb * B * hd;
      // Blocks wholly before the first new token's window are never read
      // (AttendRowGgml reads positions >= j0 only): not decoded, no pointer.
      const int64_t first_j0 = window > 0 ? std::max<int64_t>(0, q.cache_len - window + 1) : 0;
      for (int64_t blk = 0; blk < nb; ++blk) {
        if ((blk + 1) * B <= first_j0) {
          kp[blk] = nullptr;
          vp[blk] = nullptr;
          continue;
        }
        const BlockId id = table[blk];
        if (in_place) {
          kp[blk] = pool_->HeadSlabF32(id, slot, false, h);
          vp[blk] = pool_->HeadSlabF32(id, slot, true, h);
        } else {
          const int n = static_cast<int>(std::min<int64_t>(B, len - blk * B));
          pool_->ReadHead(id, slot, h, n, kbuf + blk * B * hd, vbuf + blk * B * hd);
          kp[blk] = kbuf + blk * B * hd;
          vp[blk] = vbuf + blk * B * hd;
        }
      }
    }
  };
  if (in_place) {
    fill(0, static_cast<int64_t>(S) * kvh, 0);
  } else {
    ParallelFor(threads_, static_cast<int64_t>(S) * kvh, fill);
  }

  // Decode rows (one new token) over a long context are split over the
  // context (flash-decoding's partition, with AttendRowGgml's bits:
  // engine/kernels/ops.h AttendScoresGgml): scores in chunks of kSplitChunk
  // positions, aligned at position 0 (so the split depends only on positions,
  // never on the batch or the thread count), then one softmax per row, then
  // the values in slices of 32 head elements. Every item covers the `group`
  // query heads of one KV head, so each chunk of K and each slice of V is
  // read from memory once for the group and reused from cache.
  constexpr int64_t kSplitChunk = 256;
  constexpr int64_t kSplitMinKeys = 512;
  struct SplitRow {
    int32_t s;
    int64_t j0, j1;
    int64_t score_off;  // this sequence's group x len scores in split_scores
  };
  std::vector<SplitRow> split_rows;
  std::vector<char> is_split(S, 0);
  int64_t split_floats = 0;
  if (AttendSplitSupported(B, hd)) {
    for (size_t s = 0; s < S; ++s) {
      if (seqs[s].tokens.size() != 1) continue;
      const int64_t pos = seqs[s].cache_len;
      const int64_t j0 = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      if (pos + 1 - j0 < kSplitMinKeys) continue;
      is_split[s] = 1;
      split_rows.push_back({static_cast<int32_t>(s), j0, pos + 1, split_floats});
      split_floats += static_cast<int64_t>(c.n_heads) * (pos + 1);
    }
  }
  // Owner-thread scratch; the pool's threads use it through these pointers
  // (a thread_local named inside the lambdas would be their own copy).
  thread_local std::vector<float> split_scores_buf, split_max_buf;
  if (static_cast<int64_t>(split_scores_buf.size()) < split_floats) {
    split_scores_buf.resize(split_floats);
  }
  float* const split_scores = split_scores_buf.data();

  // Work items of the first pass: for whole rows, (sequence, KV head, tile of
  // new tokens) covering the group's query heads (tiled attention; row by row:
  // one query head per item); (split row, kv head, chunk) for split rows.
  // Tiles of about kTileRows rows: the K/V chunks of a tile stay in cache while
  // every row of it uses them (ops.h AttendTileGgml).
  constexpr int64_t kTileRows = 48;
  const bool tiled = tiled_attention_;
  const int64_t tile_tokens = tiled ? std::max<int64_t>(1, kTileRows / group) : 16;
  struct Item {
    int32_t s, head;  // whole rows: head is the kv head (tiled) or query head;
                      // split items: s indexes split_rows, head is the kv head
    int64_t i0, i1;   // split items: the chunk [i0, i1) of positions
    bool split;
  };
  std::vector<Item> items;
  for (size_t s = 0; s < S; ++s) {
    if (is_split[s]) continue;
    const int64_t n = static_cast<int64_t>(seqs[s].tokens.size());
    for (int h = 0; h < (tiled ? kvh : c.n_heads); ++h) {
      for (int64_t i0 = 0; i0 < n; i0 += tile_tokens) {
        items.push_back({static_cast<int32_t>(s), h, i0, std::min(n, i0 + tile_tokens), false});
      }
    }
  }
  // The longest tiles first (the pool hands out contiguous runs of items, so
  // a heavy last run would leave the other threads idle); the order changes
  // who computes a row, never its bits.
  std::stable_sort(items.begin(), items.end(), [&](const Item& x, const Item& y) {
    return seqs[x.s].cache_len + x.i1 > seqs[y.s].cache_len + y.i1;
  });
  // Chunk maxima: [split row][query head][chunk index].
  std::vector<int64_t> max_off(split_rows.size() + 1, 0);
  for (size_t r = 0; r < split_rows.size(); ++r) {
    const SplitRow& row = split_rows[r];
    const int64_t first = row.j0 / kSplitChunk, last = (row.j1 - 1) / kSplitChunk;
    max_off[r + 1] = max_off[r] + c.n_heads * (last - first + 1);
    for (int kvh_i = 0; kvh_i < kvh; ++kvh_i) {
      for (int64_t ch = first; ch <= last; ++ch) {
        items.push_back(
            {static_cast<int32_t>(r), kvh_i, ch * kSplitChunk, (ch + 1) * kSplitChunk, true});
      }
    }
  }
  if (static_cast<int64_t>(split_max_buf.size()) < max_off.back()) {
    split_max_buf.resize(max_off.back());
  }
  float* const split_max = split_max_buf.data();
  const auto split_seq_q = [&](const SplitRow& row, int head) {
    return q_.data() + tok_off[row.s] * qd + static_cast<int64_t>(head) * hd;
  };
  const int64_t tile_rows = tile_tokens * group;
  ParallelFor(threads_, static_cast<int64_t>(items.size()), [&](int64_t a, int64_t b, int) {
    // Per-thread scratch that only grows (each pool thread its own).
    thread_local std::vector<float> scores, acc, tile_scratch;
    thread_local std::vector<AttendTileRow> tile;
    if (static_cast<int64_t>(scores.size()) < max_len) scores.resize(max_len);
    if (static_cast<int64_t>(acc.size()) < 8 * hd) acc.resize(8 * hd);
    if (tiled) {
      const int64_t need = AttendTileScratchFloats(tile_rows, max_len, hd);
      if (static_cast<int64_t>(tile_scratch.size()) < need) tile_scratch.resize(need);
    }
    for (int64_t it = a; it < b; ++it) {
      const Item& item = items[it];
      if (item.split) {
        const SplitRow& row = split_rows[item.s];
        const int64_t len = row.j1;
        const int64_t nb = (len + B - 1) / B;
        const float* const* kp = kptr_.data() + ptr_off[row.s] + item.head * nb;
        const int64_t first = row.j0 / kSplitChunk, ch = item.i0 / kSplitChunk;
        const int64_t chunks = max_off[item.s + 1] - max_off[item.s];
        for (int g = 0; g < group; ++g) {
          const int h = item.head * group + g;
          split_max[max_off[item.s] + h * (chunks / c.n_heads) + (ch - first)] =
              AttendScoresGgml(split_seq_q(row, h), kp, B, hd, row.j0, row.j1, item.i0, item.i1,
                               scale, split_scores + row.score_off + h * len);
        }
        continue;
      }
      const SeqStep& q = seqs[item.s];
      const int64_t len = q.cache_len + static_cast<int64_t>(q.tokens.size());
      const int kv_head = tiled ? item.head : item.head / group;
      const int64_t nb = (len + B - 1) / B;
      const float* const* kp = kptr_.data() + ptr_off[item.s] + kv_head * nb;
      const float* const* vp = vptr_.data() + ptr_off[item.s] + kv_head * nb;
      // llama.cpp's attention arithmetic for batches of 2+ tokens, used for
      // every row so results never depend on how tokens are batched
      // (docs/ENGINE_NUMERICS.md); the tile gives each row those very bits.
      if (tiled) {
        tile.clear();
        for (int64_t i = item.i0; i < item.i1; ++i) {
          const int64_t t = tok_off[item.s] + i;
          const int64_t pos = q.cache_len + i;
          const int64_t j0 = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
          for (int g = 0; g < group; ++g) {
            const int64_t off = t * qd + static_cast<int64_t>(kv_head * group + g) * hd;
            tile.push_back({q_.data() + off, attn_.data() + off, j0, pos + 1});
          }
        }
        AttendTileGgml(tile, kp, vp, B, hd, scale, tile_scratch.data());
        continue;
      }
      for (int64_t i = item.i0; i < item.i1; ++i) {
        const int64_t t = tok_off[item.s] + i;
        const int64_t pos = q.cache_len + i;
        const int64_t j0 = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
        const float* qv = q_.data() + t * qd + static_cast<int64_t>(item.head) * hd;
        float* o = attn_.data() + t * qd + static_cast<int64_t>(item.head) * hd;
        AttendRowGgml(qv, kp, vp, B, hd, j0, pos + 1, scale, /*single_token=*/false, scores.data(),
                      acc.data(), o);
      }
    }
  });
  if (split_rows.empty()) return Status::Ok();

  // Softmax of every split row (query head), the max over its chunks' maxima.
  const int64_t n_split = static_cast<int64_t>(split_rows.size());
  ParallelFor(threads_, n_split * c.n_heads, [&](int64_t a, int64_t b, int) {
    for (int64_t it = a; it < b; ++it) {
      const SplitRow& row = split_rows[it / c.n_heads];
      const int h = static_cast<int>(it % c.n_heads);
      const int64_t chunks = (max_off[it / c.n_heads + 1] - max_off[it / c.n_heads]) / c.n_heads;
      const float* m = split_max + max_off[it / c.n_heads] + h * chunks;
      float mx = -INFINITY;
      for (int64_t i = 0; i < chunks; ++i) mx = std::max(mx, m[i]);
      AttendSoftmaxGgml(split_scores + row.score_off + h * row.j1, row.j0, row.j1, mx);
    }
  });
  // Values: (split row, kv head, slice of 32 head elements), the group's heads in turn.
  const int slices = hd / 32;
  ParallelFor(threads_, n_split * kvh * slices, [&](int64_t a, int64_t b, int) {
    for (int64_t it = a; it < b; ++it) {
      const SplitRow& row = split_rows[it / (kvh * slices)];
      const int kv_head = static_cast<int>(it / slices % kvh);
      const int e0 = static_cast<int>(it % slices) * 32;
      const int64_t nb = (row.j1 + B - 1) / B;
      const float* const* vp = vptr_.data() + ptr_off[row.s] + kv_head * nb;
      for (int g = 0; g < group; ++g) {
        const int h = kv_head * group + g;
        float* o = attn_.data() + tok_off[row.s] * qd + static_cast<int64_t>(h) * hd;
        AttendValuesGgml(split_scores + row.score_off + h * row.j1, vp, B, hd, row.j0, row.j1, e0,
                         e0 + 32, o);
      }
    }
  });
  return Status::Ok();
}

}  // namespace kvrelay::engine
