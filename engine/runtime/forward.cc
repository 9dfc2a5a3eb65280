#include "engine/runtime/forward.h"

#include <cmath>
#include <string>

namespace kvrelay::engine {

ForwardPass::ForwardPass(const Model& model, KvBlockPool* pool, ThreadPool* threads)
    : ForwardPass(model, pool, KvCacheGroups::One(model.config().n_layers), threads) {}

ForwardPass::ForwardPass(const Model& model, KvBlockPool* pool, KvCacheGroups groups,
                         ThreadPool* threads)
    : ForwardPass(model, pool, groups, std::make_unique<CpuKernels>(model, pool, groups, threads)) {
  cpu_ = static_cast<CpuKernels*>(kernels_.get());
}

ForwardPass::ForwardPass(const Model& model, KvBlockPool* pool, KvCacheGroups groups,
                         std::unique_ptr<StepKernels> kernels)
    : model_(model), pool_(pool), groups_(std::move(groups)), kernels_(std::move(kernels)) {
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

void ForwardPass::SetCollective(TpCollective* collective) {
  collective_ = collective;
  kernels_->SetCollective(collective);
}

void ForwardPass::set_tiled_attention(bool on) {
  if (cpu_ != nullptr) cpu_->set_tiled_attention(on);
}

Status ForwardPass::Run(std::span<const SeqStep> seqs, ForwardOutput* out,
                        const std::function<void(int layer)>& layer_hook,
                        std::span<const BackendPick> picks) {
  const ModelConfig& c = model_.config();
  const KvLayout& kl = pool_->layout();
  if (groups_.n_layers() != c.n_layers || kl.layers != groups_.layers_per_block() ||
      kl.kv_heads != c.n_kv_heads || kl.head_dim != c.head_dim) {
    return InvalidArgument("KV pool layout does not match the model");
  }
  if (c.head_dim > 1024) return Unimplemented("head_dim > 1024 is not supported");
  ASSIGN_OR_RETURN(const StepShape shape,
                   CheckStep(seqs, kl.block_tokens, pool_->total_blocks(), c.vocab));
  RETURN_IF_ERROR(CheckGroups(seqs));
  out->logits.clear();
  out->picked.clear();
  out->row_begin.assign(1, 0);
  if (shape.tokens == 0) return Status::Ok();
  const TensorParallelShard& shard = model_.shard();
  if (shard.size > 1 && (collective_ == nullptr || collective_->size() != shard.size ||
                         collective_->rank() != shard.rank)) {
    return FailedPrecondition("model shard " + std::to_string(shard.rank) + " of " +
                              std::to_string(shard.size) +
                              " needs the collective of its tensor-parallel group");
  }
  // The positions whose logits the step returns.
  std::vector<int64_t> rows;
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
  if (!picks.empty() && (!kernels_->PicksTokens() || picks.size() != rows.size())) {
    return InvalidArgument("picks: " + std::to_string(picks.size()) + " for " +
                           std::to_string(rows.size()) + " logit rows on a backend that " +
                           (kernels_->PicksTokens() ? "picks" : "does not pick") + " tokens");
  }
  return kernels_->RunStep(seqs, shape, rows, picks, out, layer_hook, [&] { return Layers(); });
}

Status ForwardPass::Layers() {
  const ModelConfig& c = model_.config();
  StepKernels& k = *kernels_;
  const TensorParallelShard& shard = model_.shard();
  const bool exact_tp = shard.size > 1 && shard.mode == TpMode::kExact;
  const bool reduce_tp = shard.size > 1 && shard.mode == TpMode::kReduce;
  // gemma3 scales Q by 1/sqrt(query_pre_attn_scalar) after RoPE; its softmax
  // then runs with scale 1 (ggml_scale on Qcur, kq_scale = 1 in llama.cpp).
  const float softmax_scale =
      c.q_scale != 0.0f ? 1.0f : 1.0f / std::sqrt(static_cast<float>(c.head_dim));

  // A product's output joins the residual stream: in the product itself
  // (accumulate) unless a tensor-parallel all-reduce or gemma3's post-norm
  // comes between.
  const auto residual = [&](int l, LayerMatrix m, Act in, LayerNorm post,
                            const char* what) -> Status {
    if (!reduce_tp && !c.gemma_norms) return k.Project(l, m, in, Act::kX, /*accumulate=*/true);
    RETURN_IF_ERROR(k.Project(l, m, in, Act::kProj, false));
    if (reduce_tp) RETURN_IF_ERROR(k.AllReduce(Act::kProj).WithContext(what));
    if (c.gemma_norms) RETURN_IF_ERROR(k.RmsNorm(l, post, Act::kProj, Act::kProj));
    return k.Add(Act::kX, Act::kProj);
  };

  RETURN_IF_ERROR(k.Embed(c.embed_scale));
  for (int l = 0; l < c.n_layers; ++l) {
    RETURN_IF_ERROR(k.RmsNorm(l, LayerNorm::kAttn, Act::kX, Act::kXn));
    RETURN_IF_ERROR(k.ProjectQkv(l));
    if (c.gemma_norms) RETURN_IF_ERROR(k.QkNorm(l));
    RETURN_IF_ERROR(k.RopeWriteKv(l, c.LayerRopeBase(l), c.q_scale));
    RETURN_IF_ERROR(k.Attend(l, c.LayerWindow(l), softmax_scale));
    // After this step's attention of the layer: what the hook does to the
    // layer's bytes (a sender seals a KIVI layer, quantizing its staged rows)
    // must not change what this step reads, or the K/V of the layers above
    // would differ from a run without the hook.
    RETURN_IF_ERROR(k.LayerDone(l));
    Act attn = Act::kAttn;
    if (exact_tp) {
      RETURN_IF_ERROR(k.GatherColumns(Act::kAttn, q_cols_).WithContext("attention"));
      attn = Act::kFull;
    }
    RETURN_IF_ERROR(residual(l, LayerMatrix::kOut, attn, LayerNorm::kPostAttn, "attention"));

    RETURN_IF_ERROR(k.RmsNorm(l, LayerNorm::kFfn, Act::kX, Act::kXn));
    RETURN_IF_ERROR(k.ProjectGateUp(l));
    RETURN_IF_ERROR(k.GatedActivation(c.ffn_act));
    Act ffn = Act::kFfn;
    if (exact_tp) {
      RETURN_IF_ERROR(k.GatherColumns(Act::kFfn, ffn_cols_).WithContext("ffn"));
      ffn = Act::kFull;
    }
    RETURN_IF_ERROR(residual(l, LayerMatrix::kDown, ffn, LayerNorm::kPostFfn, "ffn"));
  }
  // Final norm + LM head for the requested positions only.
  RETURN_IF_ERROR(k.FinalNorm());
  return k.Logits(c.final_logit_softcap);
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

}  // namespace kvrelay::engine
