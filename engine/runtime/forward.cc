#include "engine/runtime/forward.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "engine/kernels/gelu.h"
#include "engine/kernels/matmul.h"
#include "engine/kernels/ops.h"

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

}  // namespace

void RmsNorm(const float* x, const float* w, int n, float eps, float* y) {
  RmsNormFast(x, w, n, eps, y);  // llama.cpp's arithmetic (engine/kernels/ops.h)
}

ForwardPass::ForwardPass(const Model& model, KvBlockPool* pool, ThreadPool* threads)
    : ForwardPass(model, pool, KvCacheGroups::One(model.config().n_layers), threads) {}

ForwardPass::ForwardPass(const Model& model, KvBlockPool* pool, KvCacheGroups groups,
                         ThreadPool* threads)
    : model_(model), pool_(pool), groups_(std::move(groups)), threads_(threads) {
  // Column ranges of every rank's head outputs and FFN activations.
  const TensorParallelShard& shard = model_.shard();
  const ModelConfig& full = model_.full_config();
  const int ffn_unit = full.ffn_dim / model_.ffn_units();
  for (int r = 0; r < shard.size; ++r) {
    // The model loaded, so its shard (and every rank's) is a valid one.
    const UnitRange h =
        shard.size == 1
            ? UnitRange{0, full.n_heads}
            : ShardAttentionHeads(full.n_heads, full.n_kv_heads, shard.size, r).value().q;
    q_cols_.push_back({h.begin * full.head_dim, h.end * full.head_dim});
    const UnitRange f = SplitUnits(model_.ffn_units(), shard.size, r);
    ffn_cols_.push_back({f.begin * ffn_unit, f.end * ffn_unit});
  }
}

Status ForwardPass::Run(std::span<const SeqStep> seqs, ForwardOutput* out,
                        const std::function<void(int layer)>& layer_hook) {
  const ModelConfig& c = model_.config();
  const KvLayout& kl = pool_->layout();
  if (groups_.n_layers() != c.n_layers || kl.layers != groups_.layers_per_block() ||
      kl.kv_heads != c.n_kv_heads || kl.head_dim != c.head_dim) {
    return InvalidArgument("KV pool layout does not match the model");
  }
  if (c.head_dim > 1024) return Unimplemented("head_dim > 1024 is not supported");
  const int B = kl.block_tokens;
  ASSIGN_OR_RETURN(const StepShape shape, CheckStep(seqs, B, pool_->total_blocks(), c.vocab));
  RETURN_IF_ERROR(CheckGroups(seqs));
  const int64_t T = shape.tokens;
  out->logits.clear();
  out->row_begin.assign(1, 0);
  if (T == 0) return Status::Ok();

  const TensorParallelShard& shard = model_.shard();
  if (shard.size > 1 && (collective_ == nullptr || collective_->size() != shard.size ||
                         collective_->rank() != shard.rank)) {
    return FailedPrecondition("model shard " + std::to_string(shard.rank) + " of " +
                              std::to_string(shard.size) +
                              " needs the collective of its tensor-parallel group");
  }
  const bool exact_tp = shard.size > 1 && shard.mode == TpMode::kExact;
  const bool reduce_tp = shard.size > 1 && shard.mode == TpMode::kReduce;
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
  {
    int64_t t = 0;
    for (size_t s = 0; s < seqs.size(); ++s) {
      for (size_t i = 0; i < seqs[s].tokens.size(); ++i, ++t) {
        tok_seq_[t] = static_cast<int64_t>(s);
        tok_pos_[t] = seqs[s].cache_len + static_cast<int64_t>(i);
      }
    }
  }
  // Embeddings.
  {
    int64_t t = 0;
    for (const SeqStep& q : seqs) {
      for (int32_t tok : q.tokens) GetRow(model_.token_embd(), tok, x_.data() + (t++) * d);
    }
    // gemma3: embeddings times sqrt(d_model) (ggml_scale, one float multiply).
    if (c.embed_scale != 1.0f) {
      for (int64_t i = 0; i < T * d; ++i) x_[i] *= c.embed_scale;
    }
  }

  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& w = model_.layers()[l];
    ParallelFor(threads_, T, [&](int64_t a, int64_t b, int) {
      for (int64_t t = a; t < b; ++t) {
        RmsNorm(x_.data() + t * d, w.attn_norm_w.data(), d, c.rms_eps, xn_.data() + t * d);
      }
    });
    {
      // One activation quantization and one parallel section for Q, K and V.
      const GgufTensor* ws[] = {w.wq, w.wk, w.wv};
      float* ys[] = {q_.data(), k_.data(), v_.data()};
      MatMulShared(ws, xn_.data(), T, ys, threads_);
    }
    AddBias(q_.data(), w.bq, T);
    AddBias(k_.data(), w.bk, T);
    AddBias(v_.data(), w.bv, T);
    if (c.gemma_norms) {
      // gemma3: RMSNorm of every Q and K head before RoPE (llama.cpp's order).
      ParallelFor(threads_, T, [&](int64_t a, int64_t b, int) {
        for (int64_t t = a; t < b; ++t) {
          for (int h = 0; h < c.n_heads; ++h) {
            float* qh = q_.data() + t * qd + static_cast<int64_t>(h) * c.head_dim;
            RmsNorm(qh, w.q_norm_w.data(), c.head_dim, c.rms_eps, qh);
          }
          for (int h = 0; h < c.n_kv_heads; ++h) {
            float* kh = k_.data() + t * kvd + static_cast<int64_t>(h) * c.head_dim;
            RmsNorm(kh, w.k_norm_w.data(), c.head_dim, c.rms_eps, kh);
          }
        }
      });
    }
    const float rope_base = c.LayerRopeBase(l);
    ParallelFor(threads_, T, [&](int64_t a, int64_t b, int) {
      for (int64_t t = a; t < b; ++t) {
        ApplyRope(q_.data() + t * qd, c.n_heads, c.head_dim, c.rope_dim, c.rope_layout, rope_base,
                  tok_pos_[t]);
        ApplyRope(k_.data() + t * kvd, c.n_kv_heads, c.head_dim, c.rope_dim, c.rope_layout,
                  rope_base, tok_pos_[t]);
      }
    });
    if (c.q_scale != 0.0f) {
      // gemma3: Q times 1/sqrt(query_pre_attn_scalar) after RoPE; the softmax
      // then runs with scale 1 (ggml_scale on Qcur, kq_scale = 1 in llama.cpp).
      for (int64_t i = 0; i < T * qd; ++i) q_[i] *= c.q_scale;
    }
    // K/V of the new tokens into the pool (owner thread only: the pool is
    // thread-compatible).
    const int slot = groups_.slot_of[l];
    for (int64_t t = 0; t < T; ++t) {
      const SeqStep& q = seqs[tok_seq_[t]];
      const int64_t pos = tok_pos_[t];
      pool_->WriteToken(TableOf(q, l)[pos / B], slot, static_cast<int>(pos % B),
                        k_.data() + t * kvd, v_.data() + t * kvd);
    }
    Attention(l, seqs);
    // After this step's attention of the layer: what the hook does to the
    // layer's bytes (a sender seals a KIVI layer, quantizing its staged rows)
    // must not change what this step reads, or the K/V of the layers above
    // would differ from a run without the hook.
    if (layer_hook) layer_hook(l);
    if (exact_tp) {
      RETURN_IF_ERROR(
          GatherColumns(attn_.data(), q_cols_, T, &attn_full_).WithContext("attention"));
      MatMul(*w.wo, attn_full_.data(), T, proj_.data(), threads_);
    } else {
      MatMul(*w.wo, attn_.data(), T, proj_.data(), threads_);
    }
    if (reduce_tp) {
      RETURN_IF_ERROR(collective_->AllReduceSum(proj_.data(), T * d).WithContext("attention"));
    }
    if (c.gemma_norms) PostNorm(w.post_attn_norm_w, T);
    for (int64_t i = 0; i < T * d; ++i) x_[i] += proj_[i];
    ParallelFor(threads_, T, [&](int64_t a, int64_t b, int) {
      for (int64_t t = a; t < b; ++t) {
        RmsNorm(x_.data() + t * d, w.ffn_norm_w.data(), d, c.rms_eps, xn_.data() + t * d);
      }
    });
    {
      const GgufTensor* ws[] = {w.ffn_gate, w.ffn_up};
      float* ys[] = {gate_.data(), up_.data()};
      MatMulShared(ws, xn_.data(), T, ys, threads_);
    }
    ParallelFor(threads_, T, [&](int64_t a, int64_t b, int) {
      for (int64_t t = a; t < b; ++t) {
        float* g = gate_.data() + t * c.ffn_dim;
        if (c.ffn_act == ModelConfig::FfnAct::kGeluTanh) {
          GeluTanhMulGgml(g, up_.data() + t * c.ffn_dim, c.ffn_dim, g);  // ggml's fp16 table
        } else {
          SiluMul(g, up_.data() + t * c.ffn_dim, c.ffn_dim, g);  // exp as llama.cpp's
        }
      }
    });
    if (exact_tp) {
      RETURN_IF_ERROR(GatherColumns(gate_.data(), ffn_cols_, T, &ffn_full_).WithContext("ffn"));
      MatMul(*w.ffn_down, ffn_full_.data(), T, proj_.data(), threads_);
    } else {
      MatMul(*w.ffn_down, gate_.data(), T, proj_.data(), threads_);
    }
    if (reduce_tp)
      RETURN_IF_ERROR(collective_->AllReduceSum(proj_.data(), T * d).WithContext("ffn"));
    if (c.gemma_norms) PostNorm(w.post_ffn_norm_w, T);
    for (int64_t i = 0; i < T * d; ++i) x_[i] += proj_[i];
  }

  // Final norm + LM head for the requested positions only.
  std::vector<int64_t> rows;
  {
    int64_t t = 0;
    for (const SeqStep& q : seqs) {
      const int64_t n = static_cast<int64_t>(q.tokens.size());
      if (q.logits == LogitRows::kAll) {
        for (int64_t i = 0; i < n; ++i) rows.push_back(t + i);
      } else if (q.logits == LogitRows::kLast) {
        rows.push_back(t + n - 1);
      }
      t += n;
      out->row_begin.push_back(static_cast<int64_t>(rows.size()));
    }
  }
  if (rows.empty()) return Status::Ok();
  const int64_t R = static_cast<int64_t>(rows.size());
  for (int64_t r = 0; r < R; ++r) {
    RmsNorm(x_.data() + rows[r] * d, model_.output_norm().data(), d, c.rms_eps, xn_.data() + r * d);
  }
  out->logits.resize(R * c.vocab);
  MatMul(model_.lm_head(), xn_.data(), R, out->logits.data(), threads_);
  if (c.final_logit_softcap > 0.0f) {
    // As llama.cpp: scale by 1/c, tanh, scale by c (three float ops).
    const float inv = 1.0f / c.final_logit_softcap;
    for (float& v : out->logits) v = std::tanh(v * inv) * c.final_logit_softcap;
  }
  return Status::Ok();
}

Status ForwardPass::CheckGroups(std::span<const SeqStep> seqs) const {
  const int B = pool_->layout().block_tokens;
  const size_t extra = static_cast<size_t>(groups_.size() - 1);
  for (size_t s = 0; s < seqs.size(); ++s) {
    const SeqStep& q = seqs[s];
    if (q.group_blocks.size() != extra) {
      return InvalidArgument(
          "sequence " + std::to_string(s) + ": " + std::to_string(q.group_blocks.size() + 1) +
          " block tables for a KV cache of " + std::to_string(extra + 1) + " groups");
    }
    const int64_t nb = (q.end() + B - 1) / B;
    for (size_t g = 1; g <= extra; ++g) {
      const std::vector<BlockId>& table = q.group_blocks[g - 1];
      if (static_cast<int64_t>(table.size()) < nb) {
        return InvalidArgument("sequence " + std::to_string(s) + ": group " + std::to_string(g) +
                               " block table of " + std::to_string(table.size()) +
                               " blocks cannot hold " + std::to_string(q.end()) + " positions");
      }
      for (int64_t b = groups_.DroppableBlocks(static_cast<int>(g), q.cache_len, B); b < nb; ++b) {
        const BlockId id = table[static_cast<size_t>(b)];
        if (id < 0 || id >= pool_->total_blocks()) {
          return InvalidArgument("sequence " + std::to_string(s) + ": group " + std::to_string(g) +
                                 " has bad block id " + std::to_string(id) + " at block " +
                                 std::to_string(b));
        }
      }
    }
  }
  return Status::Ok();
}

void ForwardPass::PostNorm(const std::vector<float>& weight, int64_t T) {
  const ModelConfig& c = model_.config();
  const int d = c.d_model;
  ParallelFor(threads_, T, [&](int64_t a, int64_t b, int) {
    for (int64_t t = a; t < b; ++t) {
      RmsNorm(proj_.data() + t * d, weight.data(), d, c.rms_eps, proj_.data() + t * d);
    }
  });
}

Status ForwardPass::GatherColumns(const float* local, const std::vector<UnitRange>& widths,
                                  int64_t T, std::vector<float>* out) {
  const int64_t full = widths.back().end;
  const int64_t mine = widths[model_.shard().rank].size();
  gathered_.resize(T * full);
  RETURN_IF_ERROR(collective_->AllGather(local, T * mine, gathered_.data(), T * full));
  out->resize(T * full);
  // gathered_ is rank 0's [T x w0] block, then rank 1's [T x w1], ...
  for (const UnitRange& r : widths) {
    const float* src = gathered_.data() + T * r.begin;
    const int64_t w = r.size();
    for (int64_t t = 0; t < T; ++t) {
      std::copy(src + t * w, src + (t + 1) * w, out->data() + t * full + r.begin);
    }
  }
  return Status::Ok();
}

void ForwardPass::Attention(int layer, std::span<const SeqStep> seqs) {
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
  const int layer_window = c.LayerWindow(layer);
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
      const int64_t first_j0 =
          layer_window > 0 ? std::max<int64_t>(0, q.cache_len - layer_window + 1) : 0;
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

  // q_scale != 0: Q was already scaled (gemma3), the softmax uses 1.
  const float scale = c.q_scale != 0.0f ? 1.0f : 1.0f / std::sqrt(static_cast<float>(hd));
  const int window = c.LayerWindow(layer);

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
  if (split_rows.empty()) return;

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
}

}  // namespace kvrelay::engine
