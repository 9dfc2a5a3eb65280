#include "engine/runtime/engine.h"

#include <algorithm>
#include <deque>
#include <map>

#include "common/logging.h"
#include "common/thread_pool.h"
#include "engine/grammar/json_grammar.h"
#include "engine/kv_cache/kv_codec.h"
#include "engine/runtime/compute_backend.h"
#include "engine/runtime/forward.h"
#include "engine/runtime/model.h"
#include "engine/runtime/tensor_parallel.h"
#include "engine/runtime/text_stream.h"

namespace kvrelay::engine {

std::string_view FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kNone:
      return "none";
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kError:
      return "error";
    case FinishReason::kPrefilled:
      return "prefilled";
  }
  return "unknown";
}

Status EngineOptions::Validate() const {
  if (kv_capacity_bytes < 0) return InvalidArgument("EngineOptions.kv_capacity_bytes must be >= 0");
  if (block_tokens < 1 || block_tokens > 4096) {
    return InvalidArgument("EngineOptions.block_tokens must be in [1, 4096]");
  }
  if (threads < 0) return InvalidArgument("EngineOptions.threads must be >= 0");
  if (max_step_tokens < 1) return InvalidArgument("EngineOptions.max_step_tokens must be >= 1");
  if (max_running < 1) return InvalidArgument("EngineOptions.max_running must be >= 1");
  if (max_context < 0) return InvalidArgument("EngineOptions.max_context must be >= 0");
  RETURN_IF_ERROR(ParseDevice(device).status().WithContext("EngineOptions.device"));
  return Status::Ok();
}

namespace {

// One request inside the engine.
struct Sequence {
  RequestSpec spec;
  uint64_t arrival = 0;         // FCFS order (smaller = older)
  std::vector<int32_t> tokens;  // prompt then generated tokens
  int64_t n_prompt = 0;
  int64_t n_generated = 0;
  int64_t n_computed = 0;  // leading tokens whose K/V are in `blocks`
  BlockTable blocks;       // KV cache group 0's table; one reference held per entry
  // Groups 1.. (kv_groups.h), same indexing; a sliding-window group's
  // entries before its window are holes. Empty with one group.
  std::vector<BlockTable> group_tables;
  int64_t n_committed = 0;        // leading blocks registered in the prefix cache
  std::vector<BlockHash> hashes;  // chain hashes of the leading full blocks
  int64_t cached_prompt_tokens = 0;
  std::unique_ptr<Sampler> sampler;
  std::unique_ptr<TextStream> text;
  // Scheduled for the current step.
  int64_t chunk = 0;
};

}  // namespace

class Engine::Impl {
 public:
  Impl(const EngineOptions& options, std::shared_ptr<const Model> model,
       std::unique_ptr<KvBlockPool> pool, KvCacheGroups groups)
      : options_(options),
        model_(std::move(model)),
        pool_(std::move(pool)),
        groups_(std::move(groups)),
        threads_(options.threads > 0 ? options.threads : ThreadPool::DefaultThreads(), "engine") {
    max_context_ = options_.max_context > 0
                       ? std::min<int64_t>(options_.max_context, model_->config().context_length)
                       : model_->config().context_length;
  }

  ~Impl() {
    // The connector stops writing loading blocks before they go back; every
    // block table returns its references as the sequences are destroyed.
    if (connector_ != nullptr) {
      for (auto& [id, s] : loading_) connector_->CancelRemoteLoad(id);
    }
    // backend_ goes before pool_: nothing may reach it through the pool after.
    pool_->SetHostWriteHook(nullptr);
  }

  Status CheckSpec(const RequestSpec& spec) const {
    const std::string name = "request " + std::to_string(spec.id);
    if (Exists(spec.id)) return AlreadyExists(name + " is already live");
    if (spec.prompt.empty()) return InvalidArgument(name + " has an empty prompt");
    const int vocab = model_->config().vocab;
    for (int32_t t : spec.prompt) {
      if (t < 0 || t >= vocab) {
        return InvalidArgument(name + ": token id " + std::to_string(t) +
                               " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
      }
    }
    RETURN_IF_ERROR(spec.sampling.Validate().WithContext(name));
    for (const auto& [t, bias] : spec.sampling.logit_bias) {
      if (t >= vocab) {
        return InvalidArgument(name + ": logit_bias token id " + std::to_string(t) +
                               " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
      }
    }
    if (!spec.sampling.json_schema.empty()) {
      if (model_->tokenizer() == nullptr) {
        return FailedPrecondition(name + ": structured output needs the model's tokenizer");
      }
      RETURN_IF_ERROR(Constraints()->Get(spec.sampling.json_schema).status().WithContext(name));
    }
    const int64_t n = static_cast<int64_t>(spec.prompt.size());
    if (n >= max_context_) {
      return ResourceExhausted(name + ": prompt of " + std::to_string(n) +
                               " tokens does not fit the context of " +
                               std::to_string(max_context_) + " tokens");
    }
    // The most positions whose K/V it will ever hold.
    const int64_t max_len = std::min<int64_t>(n + spec.sampling.max_tokens, max_context_) - 1;
    const int64_t need = MostBlocksHeld(std::max<int64_t>(max_len, n));
    if (need > pool_->total_blocks()) {
      return ResourceExhausted(name + " needs " + std::to_string(need) +
                               " KV blocks but the pool has only " +
                               std::to_string(pool_->total_blocks()));
    }
    return Status::Ok();
  }

  Status Submit(RequestSpec spec) {
    RETURN_IF_ERROR(CheckSpec(spec));
    auto seq = NewSequence(std::move(spec));
    if (seq->spec.mode != RequestMode::kRemotePrompt) {
      waiting_.push_back(std::move(seq));
      return Status::Ok();
    }
    // Decode side: the prompt's blocks are reserved now, held by the request,
    // and filled by the connector. Every group's table covers the whole
    // prompt while it loads; the sliding-window tables drop what is out of
    // the window once it decodes.
    if (connector_ == nullptr) {
      return FailedPrecondition("request " + std::to_string(seq->spec.id) +
                                " needs remote KV but the engine has no connector");
    }
    std::vector<std::vector<BlockId>> tables;
    for (int g = 0; g < groups_.size(); ++g) {
      BlockTable& t = Table(*seq, g);
      ASSIGN_OR_RETURN(t, BlockTable::Allocate(pool_.get(), BlocksFor(seq->n_prompt)));
      tables.push_back(t.ids());
    }
    RETURN_IF_ERROR(connector_->StartRemoteLoad(seq->spec, groups_, tables));
    const RequestId id = seq->spec.id;
    loading_[id] = std::move(seq);
    return Status::Ok();
  }

  // A remote prompt arrived: the sequence decodes on from `first_token`.
  void AdmitLoaded(std::unique_ptr<Sequence> seq, int32_t first_token) {
    if (first_token < 0 || first_token >= model_->config().vocab) {
      pending_events_.push_back(
          FinishEvent(*seq, FinishReason::kError,
                      InvalidArgument("first token " + std::to_string(first_token) +
                                      " is outside the vocabulary")));
      return;
    }
    seq->n_computed = seq->n_prompt;
    if (TokenConstraint* g = seq->sampler->constraint()) {
      // The prefill side sampled it under the same grammar.
      Status st = g->Accept(first_token);
      if (!st.ok()) {
        pending_events_.push_back(
            FinishEvent(*seq, FinishReason::kError, st.WithContext("the remote first token")));
        return;
      }
    }
    bool ignored = false;
    (void)seq->text->Push(first_token, &ignored);  // the prefill side emitted its text
    seq->tokens.push_back(first_token);
    seq->n_generated = 1;
    stats_.generated_tokens += 1;
    TokenEvent ev;
    if (CheckFinished(*seq, first_token, &ev, /*emit_text=*/false)) {
      ev.token = -1;
      pending_events_.push_back(std::move(ev));
      return;  // the blocks go back with seq
    }
    running_.push_back(std::move(seq));
  }

  void PollLoads() {
    if (loading_.empty()) return;
    for (auto& done : connector_->PollRemoteLoads()) {
      auto it = loading_.find(done.request);
      if (it == loading_.end()) continue;  // cancelled meanwhile
      std::unique_ptr<Sequence> seq = std::move(it->second);
      loading_.erase(it);
      if (!done.status.ok()) {
        pending_events_.push_back(FinishEvent(*seq, FinishReason::kError, done.status));
        continue;
      }
      AdmitLoaded(std::move(seq), done.first_token);
    }
  }

  Status Cancel(RequestId id) {
    for (auto* list : {&waiting_, &running_}) {
      for (auto it = list->begin(); it != list->end(); ++it) {
        if ((*it)->spec.id == id) {
          ReleaseBlocks(**it);
          pending_events_.push_back(FinishEvent(**it, FinishReason::kCancelled, Status::Ok()));
          list->erase(it);
          return Status::Ok();
        }
      }
    }
    if (auto it = loading_.find(id); it != loading_.end()) {
      connector_->CancelRemoteLoad(id);  // before the blocks go back
      pending_events_.push_back(FinishEvent(*it->second, FinishReason::kCancelled, Status::Ok()));
      loading_.erase(it);
      return Status::Ok();
    }
    return NotFound("no live request " + std::to_string(id));
  }

  int64_t CancelAll() {
    std::vector<RequestId> ids;
    for (const auto* list : {&waiting_, &running_}) {
      for (const auto& q : *list) ids.push_back(q->spec.id);
    }
    for (const auto& [id, q] : loading_) ids.push_back(id);
    for (RequestId id : ids) (void)Cancel(id);
    return static_cast<int64_t>(ids.size());
  }

  int64_t running_count() const { return static_cast<int64_t>(running_.size()); }
  int64_t queued_count() const { return static_cast<int64_t>(waiting_.size()); }
  int64_t loading_count() const { return static_cast<int64_t>(loading_.size()); }
  bool HasWork() const {
    return !waiting_.empty() || !running_.empty() || !pending_events_.empty();
  }

  Result<std::vector<TokenEvent>> Step();

  // Compiled response grammars for this model's vocabulary (built on first use).
  // Logically const: a cache.
  grammar::ConstraintCache* Constraints() const {
    if (constraints_ == nullptr) {
      const Tokenizer& tok = *model_->tokenizer();
      const int32_t n = tok.vocab_size();
      std::vector<std::string> pieces(n);
      std::vector<bool> usable(n);
      std::vector<int32_t> eog;
      for (int32_t i = 0; i < n; ++i) {
        pieces[i] = tok.TokenToPiece(i);
        const TokenType t = tok.token_type(i);
        usable[i] = t == TokenType::kNormal || t == TokenType::kByte;
        if (tok.IsEndOfGeneration(i)) eog.push_back(i);
      }
      constraints_ = std::make_unique<grammar::ConstraintCache>(
          grammar::TokenVocabulary::Build(pieces, usable, std::move(eog)));
    }
    return constraints_.get();
  }

  Result<std::vector<int64_t>> HeldBlocks(RequestId id) const {
    const Sequence* s = Find(id);
    if (s == nullptr) return NotFound("no live request " + std::to_string(id));
    std::vector<int64_t> held{s->blocks.held()};
    for (const BlockTable& t : s->group_tables) held.push_back(t.held());
    return held;
  }

  EngineOptions options_;
  mutable std::unique_ptr<grammar::ConstraintCache> constraints_;
  std::shared_ptr<const Model> model_;
  std::unique_ptr<KvBlockPool> pool_;
  KvCacheGroups groups_;  // the groups pool_'s blocks serve
  ThreadPool threads_;
  // The one forward pass over the device's kernel table (compute_backend.h).
  std::unique_ptr<ComputeBackend> backend_;
  int64_t max_context_ = 0;
  KvConnector* connector_ = nullptr;    // not owned; may be null
  TensorParallelHooks tp_;              // publish empty unless rank 0 of a TP group
  std::vector<BlockCopy> step_copies_;  // CopyBlock calls of the current step
  Stats stats_;

 private:
  int64_t BlocksFor(int64_t positions) const {
    const int B = options_.block_tokens;
    return (positions + B - 1) / B;
  }

  bool Exists(RequestId id) const { return Find(id) != nullptr; }

  const Sequence* Find(RequestId id) const {
    for (const auto* list : {&waiting_, &running_}) {
      for (const auto& s : *list) {
        if (s->spec.id == id) return s.get();
      }
    }
    auto it = loading_.find(id);
    return it == loading_.end() ? nullptr : it->second.get();
  }

  // The most pool blocks a sequence of `positions` holds at once over all
  // groups: every position's block in a full-attention group, a window and a
  // step's chunk in a sliding-window group.
  int64_t MostBlocksHeld(int64_t positions) const {
    const int64_t full = BlocksFor(positions);
    int64_t need = 0;
    for (int g = 0; g < groups_.size(); ++g) {
      need += groups_.sliding(g)
                  ? std::min(full, groups_.WindowBlocksBound(g, options_.max_step_tokens,
                                                             options_.block_tokens) +
                                       1)  // + a copy-on-write in flight
                  : full;
    }
    return need;
  }

  BlockTable& Table(Sequence& s, int g) {
    return g == 0 ? s.blocks : s.group_tables[static_cast<size_t>(g - 1)];
  }

  // Releases the blocks of s's sliding-window tables that no step from
  // position s.n_computed on reads.
  void DropOutOfWindow(Sequence& s) {
    for (int g = 1; g < groups_.size(); ++g) {
      Table(s, g).DropLeading(groups_.DroppableBlocks(g, s.n_computed, options_.block_tokens));
    }
  }

  // Stats::peak_group_blocks: what s holds per group between steps.
  void NotePeakBlocks(Sequence& s) {
    stats_.peak_group_blocks.resize(static_cast<size_t>(groups_.size()), 0);
    for (int g = 0; g < groups_.size(); ++g) {
      int64_t& peak = stats_.peak_group_blocks[static_cast<size_t>(g)];
      peak = std::max(peak, Table(s, g).held());
    }
  }

  std::unique_ptr<Sequence> NewSequence(RequestSpec spec) {
    auto seq = std::make_unique<Sequence>();
    seq->blocks = BlockTable(pool_.get());
    for (int g = 1; g < groups_.size(); ++g) seq->group_tables.emplace_back(pool_.get());
    seq->arrival = next_arrival_++;
    seq->tokens = spec.prompt;
    seq->n_prompt = static_cast<int64_t>(spec.prompt.size());
    seq->sampler = std::make_unique<Sampler>(spec.sampling);
    if (!spec.sampling.json_schema.empty()) {
      // Submit compiled it already: this is a cache hit.
      auto factory = Constraints()->Get(spec.sampling.json_schema);
      if (factory.ok()) {
        seq->sampler->SetConstraint(std::make_unique<grammar::GrammarMatcher>(*factory));
      }
    }
    const bool text = spec.want_text || !spec.sampling.stop.empty();
    seq->text =
        std::make_unique<TextStream>(text ? model_->tokenizer() : nullptr, spec.sampling.stop);
    seq->spec = std::move(spec);
    return seq;
  }

  void ReleaseBlocks(Sequence& s) {
    s.blocks.Release();
    for (BlockTable& t : s.group_tables) t.Release();
    s.n_computed = 0;
    s.n_committed = 0;
  }

  TokenEvent FinishEvent(const Sequence& s, FinishReason reason, Status error) {
    TokenEvent ev;
    ev.id = s.spec.id;
    ev.kv_transfer_id = s.spec.kv_transfer_id;
    ev.finished = true;
    ev.finish_reason = reason;
    ev.error = std::move(error);
    ev.prompt_tokens = s.n_prompt;
    ev.cached_prompt_tokens = s.cached_prompt_tokens;
    return ev;
  }

  // Fills `ev` for a newly generated token; true when the request is done.
  bool CheckFinished(Sequence& s, int32_t token, TokenEvent* ev, bool emit_text) {
    ev->id = s.spec.id;
    ev->kv_transfer_id = s.spec.kv_transfer_id;
    ev->token = token;
    ev->prompt_tokens = s.n_prompt;
    ev->cached_prompt_tokens = s.cached_prompt_tokens;
    TokenConstraint* grammar = s.sampler->constraint();
    const bool eog = model_->tokenizer() != nullptr &&
                     (!s.spec.sampling.ignore_eos || grammar != nullptr) &&
                     model_->tokenizer()->IsEndOfGeneration(token);
    bool stopped = false;
    std::string text;
    if (!eog) {
      text = s.text->Push(token, &stopped);
    }
    FinishReason reason = FinishReason::kNone;
    // Structured output ends when its JSON value is complete.
    if (eog || stopped || (grammar != nullptr && grammar->Complete())) {
      reason = FinishReason::kStop;
    } else if (s.n_generated >= s.spec.sampling.max_tokens ||
               static_cast<int64_t>(s.tokens.size()) >= max_context_) {
      reason = FinishReason::kLength;
    } else if (s.spec.mode == RequestMode::kPrefillOnly) {
      reason = FinishReason::kPrefilled;
    }
    if (reason != FinishReason::kNone && reason != FinishReason::kPrefilled && !stopped) {
      text += s.text->Flush();
    }
    if (emit_text) ev->text = std::move(text);
    ev->finished = reason != FinishReason::kNone;
    ev->finish_reason = reason;
    return ev->finished;
  }

  // Makes sure s has writable blocks for positions [n_computed, n_computed + chunk).
  // Returns false when the pool has no block to give.
  bool EnsureBlocks(Sequence& s, int64_t chunk) {
    const int B = options_.block_tokens;
    const int64_t need = BlocksFor(s.n_computed + chunk);
    DropOutOfWindow(s);  // before allocating, so the blocks it frees serve this step
    for (int g = 0; g < groups_.size(); ++g) {
      BlockTable& table = Table(s, g);
      while (table.size() < need) {
        auto b = pool_->Allocate();
        if (!b.ok()) return false;
        table.Adopt(*b);
      }
    }
    // Copy-on-write: the block that receives the first new position may be
    // shared (a prefix cache hit covering the whole prompt, or a loaded
    // block that someone else also references). A committed block is
    // immutable in every group.
    const int64_t first = s.n_computed / B;
    for (int64_t i = first; i < need; ++i) {
      const bool committed = i < s.n_committed;
      for (int g = 0; g < groups_.size(); ++g) {
        BlockTable& table = Table(s, g);
        if (pool_->refcount(table[i]) > 1 || committed) {
          auto b = pool_->Allocate();
          if (!b.ok()) return false;
          pool_->CopyBlock(table[i], *b);
          if (tp_.publish) step_copies_.push_back({table[i], *b});
          table.Replace(i, *b);
        }
      }
      if (committed) s.n_committed = i;
    }
    return true;
  }

  // Prefix-cache lookup when a sequence (re)enters the running batch.
  void MatchPrefix(Sequence& s) {
    const int B = options_.block_tokens;
    const int64_t n = static_cast<int64_t>(s.tokens.size());
    s.hashes = HashPrefixBlocks(std::span<const int32_t>(s.tokens.data(), n), B,
                                model_->fingerprint(), s.spec.tenant_salt);
    MatchPoolPrefix(s);
    s.n_committed = s.blocks.size();
    LoadExternalPrefix(s);
    // At least the last token is computed again: its logits are needed.
    s.n_computed = std::min<int64_t>(s.n_committed * B, n - 1);
    if (s.n_generated == 0) {
      s.cached_prompt_tokens = s.n_computed;
      stats_.prompt_tokens_cached += s.n_computed;
    }
  }

  // vLLM's hybrid rule: a hit of k blocks needs group 0's
  // blocks [0, k) and, in a sliding-window group, only the blocks the first
  // recomputed position reads, [DroppableBlocks(p), k) with p =
  // min(k * B, n - 1); the entries before them stay holes. The longest k for
  // which every group holds its part wins.
  // With one group that is the pool's longest run of cached blocks.
  void MatchPoolPrefix(Sequence& s) {
    const int B = options_.block_tokens;
    const int64_t n = static_cast<int64_t>(s.tokens.size());
    const int64_t g0_hits = [&] {
      int64_t k = 0;
      while (k < static_cast<int64_t>(s.hashes.size()) && pool_->IsCached(s.hashes[k])) ++k;
      return k;
    }();
    auto first_needed = [&](int g, int64_t k) {
      return groups_.DroppableBlocks(g, std::min(k * B, n - 1), B);
    };
    auto covered = [&](int64_t k) {
      for (int g = 0; g < groups_.size(); ++g) {
        for (int64_t i = first_needed(g, k); i < k; ++i) {
          if (!pool_->IsCached(GroupBlockHash(s.hashes[i], g))) return false;
        }
      }
      return true;
    };
    int64_t k = g0_hits;
    while (k > 0 && !covered(k)) --k;
    for (int g = 0; g < groups_.size(); ++g) {
      const int64_t lo = first_needed(g, k);
      std::vector<BlockHash> keys;
      for (int64_t i = lo; i < k; ++i) keys.push_back(GroupBlockHash(s.hashes[i], g));
      BlockTable& table = Table(s, g);
      for (int64_t i = 0; i < lo; ++i) table.Adopt(kNoBlock);
      table.Adopt(pool_->MatchPrefix(keys));  // all present: checked above
    }
  }

  // Blocks the pool does not hold but a lower tier does (connector admission
  // side): loaded into fresh blocks owned by `s` from the start, committed.
  void LoadExternalPrefix(Sequence& s) {
    if (connector_ == nullptr) return;
    const int64_t hits = s.n_committed;
    if (hits >= static_cast<int64_t>(s.hashes.size())) return;
    const PrefixLookup prefix{s.tokens, s.hashes, hits, options_.block_tokens};
    const int B = options_.block_tokens;
    const int64_t n_tokens = static_cast<int64_t>(s.tokens.size());
    std::vector<BlockTable> loaded;
    for (int g = 0; g < groups_.size(); ++g) loaded.emplace_back(pool_.get());
    connector_->LoadPrefix(s.spec, prefix, groups_, loaded);
    // The connector's blocks extend the pool's hit under the rule of
    // MatchPoolPrefix, checked here: a hole where a step would read is
    // never admitted.
    const int64_t n = loaded[0].size();
    bool ok = n <= static_cast<int64_t>(s.hashes.size()) - hits;
    for (int g = 0; ok && g < groups_.size(); ++g) {
      const BlockTable& t = loaded[static_cast<size_t>(g)];
      ok = t.size() == n && t.pool() == pool_.get();
      const int64_t from =
          groups_.DroppableBlocks(g, std::min<int64_t>((hits + n) * B, n_tokens - 1), B);
      for (int64_t i = std::max<int64_t>(from, hits); ok && i < hits + n; ++i) {
        ok = t[i - hits] != kNoBlock;
      }
    }
    if (!ok) {
      LOG_ERROR << "KV connector returned an inconsistent prefix for request '" << s.spec.id
                << "'; computing it instead";
      return;  // `loaded` returns every block
    }
    for (int g = 0; g < groups_.size(); ++g) {
      BlockTable& t = loaded[static_cast<size_t>(g)];
      for (int64_t i = 0; i < n; ++i) {
        if (t[i] != kNoBlock) pool_->Commit(t[i], GroupBlockHash(s.hashes[hits + i], g));
      }
      Table(s, g).Append(std::move(t));
    }
    s.n_committed = hits + n;
  }

  // KIVI pools keep a partly written block in f32 staging until it fills.
  // A prompt's partial tail block is quantized when its prompt is done, in
  // every deployment: a prefill worker must quantize it to send it (LayerData),
  // so the decode side continues from those bytes; doing the same here keeps
  // colocated, disaggregated and single-process greedy tokens identical.
  // (No-op for other dtypes and for a full tail block.)
  void QuantizePromptTail(Sequence& s) {
    if (!kvcodec::IsKivi(pool_->layout().dtype)) return;
    const int B = options_.block_tokens;
    if (s.n_computed % B == 0) return;
    const int64_t tail = s.n_computed / B;
    for (int g = 0; g < groups_.size(); ++g) {
      BlockTable& table = Table(s, g);
      if (tail >= table.size() || table[tail] == kNoBlock) continue;
      for (int slot = 0; slot < groups_.layers_per_block(); ++slot) {
        (void)pool_->LayerData(table[tail], slot);
      }
    }
  }

  // Registers every newly full block in the prefix cache.
  void CommitFullBlocks(Sequence& s) {
    const int B = options_.block_tokens;
    const int64_t full = s.n_computed / B;
    if (full <= s.n_committed) return;
    if (static_cast<int64_t>(s.hashes.size()) < full) {
      s.hashes = HashPrefixBlocks(std::span<const int32_t>(s.tokens.data(), full * B), B,
                                  model_->fingerprint(), s.spec.tenant_salt);
    }
    for (int64_t i = s.n_committed; i < full; ++i) {
      for (int g = 0; g < groups_.size(); ++g) {
        const BlockId b = Table(s, g)[i];
        if (b != kNoBlock) pool_->Commit(b, GroupBlockHash(s.hashes[i], g));
      }
    }
    s.n_committed = full;
  }

  // Frees the youngest running sequence's blocks and puts it back in the
  // waiting queue (it will be recomputed). False when nothing can be preempted.
  bool PreemptYoungest(const Sequence* except) {
    auto victim = running_.end();
    for (auto it = running_.begin(); it != running_.end(); ++it) {
      if (it->get() == except) continue;
      if (victim == running_.end() || (*it)->arrival > (*victim)->arrival) victim = it;
    }
    if (victim == running_.end()) return false;
    Preempt(victim);
    return true;
  }

  void Preempt(std::deque<std::unique_ptr<Sequence>>::iterator it) {
    std::unique_ptr<Sequence> s = std::move(*it);
    running_.erase(it);
    ReleaseBlocks(*s);
    s->hashes.clear();
    s->chunk = 0;
    ++stats_.preemptions;
    LOG_INFO << "preempting request '" << s->spec.id << "' (" << s->tokens.size()
             << " tokens) to free KV blocks";
    auto pos = std::find_if(waiting_.begin(), waiting_.end(),
                            [&](const auto& w) { return w->arrival > s->arrival; });
    waiting_.insert(pos, std::move(s));
  }

  void Schedule();

  std::deque<std::unique_ptr<Sequence>> waiting_;           // FCFS by arrival
  std::deque<std::unique_ptr<Sequence>> running_;           // in admission order
  std::map<RequestId, std::unique_ptr<Sequence>> loading_;  // kRemotePrompt, KV on its way
  std::vector<TokenEvent> pending_events_;
  uint64_t next_arrival_ = 0;
};

void Engine::Impl::Schedule() {
  int64_t budget = options_.max_step_tokens;
  for (auto& s : running_) s->chunk = 0;
  // 1. Running sequences: decode tokens, then prefill chunks.
  //    When blocks run out, preempt the youngest (possibly the sequence itself).
  std::vector<Sequence*> order;
  for (auto& s : running_) order.push_back(s.get());
  // Decoding sequences (one pending token) first so a long prefill never
  // stalls the running batch; then prefill chunks, oldest first.
  auto decoding = [](const Sequence* x) {
    return static_cast<int64_t>(x->tokens.size()) - x->n_computed <= 1;
  };
  std::sort(order.begin(), order.end(), [&](const Sequence* a, const Sequence* b) {
    if (decoding(a) != decoding(b)) return decoding(a);
    return a->arrival < b->arrival;
  });
  for (Sequence* s : order) {
    if (budget <= 0) break;
    // Still running? (It may have been preempted below for an older one.)
    auto it =
        std::find_if(running_.begin(), running_.end(), [&](const auto& r) { return r.get() == s; });
    if (it == running_.end()) continue;
    const int64_t pending = static_cast<int64_t>(s->tokens.size()) - s->n_computed;
    const int64_t chunk = std::min<int64_t>(pending, budget);
    bool ok = EnsureBlocks(*s, chunk);
    while (!ok) {
      // Prefer a younger victim; when s is the youngest, preempt s itself.
      Sequence* youngest = nullptr;
      for (auto& r : running_) {
        if (youngest == nullptr || r->arrival > youngest->arrival) youngest = r.get();
      }
      if (youngest == s) break;
      if (youngest->chunk > 0) budget += youngest->chunk;
      PreemptYoungest(nullptr);
      ok = EnsureBlocks(*s, chunk);
    }
    if (!ok) {
      auto self = std::find_if(running_.begin(), running_.end(),
                               [&](const auto& r) { return r.get() == s; });
      Preempt(self);
      continue;
    }
    s->chunk = chunk;
    budget -= chunk;
  }
  // 2. Admit waiting sequences (FCFS) while there is room. No preemption for
  //    admission: a new request waits until blocks free up.
  while (budget > 0 && !waiting_.empty() &&
         static_cast<int64_t>(running_.size()) < options_.max_running) {
    Sequence& s = *waiting_.front();
    MatchPrefix(s);
    const int64_t pending = static_cast<int64_t>(s.tokens.size()) - s.n_computed;
    const int64_t chunk = std::min<int64_t>(pending, budget);
    if (!EnsureBlocks(s, chunk)) {
      ReleaseBlocks(s);
      break;
    }
    s.chunk = chunk;
    budget -= chunk;
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }
}

Result<std::vector<TokenEvent>> Engine::Impl::Step() {
  PollLoads();
  std::vector<TokenEvent> events;
  events.swap(pending_events_);
  step_copies_.clear();
  Schedule();
  std::vector<Sequence*> batch;
  for (auto& s : running_) {
    if (s->chunk > 0) batch.push_back(s.get());
  }
  if (batch.empty()) {
    if (!running_.empty() || !waiting_.empty()) {
      // Nothing could be scheduled (should not happen: Submit rejects what
      // can never fit). Fail the oldest waiting request rather than spin.
      if (running_.empty() && !waiting_.empty()) {
        auto& s = waiting_.front();
        events.push_back(FinishEvent(*s, FinishReason::kError,
                                     ResourceExhausted("no KV blocks available for request")));
        waiting_.pop_front();
      }
    }
    return events;
  }
  ++stats_.steps;
  StepPlan plan;
  plan.copies.swap(step_copies_);
  plan.seqs.resize(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    Sequence& s = *batch[i];
    SeqStep& q = plan.seqs[i];
    q.request = s.spec.id;
    q.cache_len = s.n_computed;
    q.tokens.assign(s.tokens.begin() + s.n_computed, s.tokens.begin() + s.n_computed + s.chunk);
    q.blocks.assign(s.blocks.ids().begin(), s.blocks.ids().begin() + BlocksFor(q.end()));
    for (const BlockTable& t : s.group_tables) {
      q.group_blocks.emplace_back(t.ids().begin(), t.ids().begin() + BlocksFor(q.end()));
    }
    const bool last = q.end() == static_cast<int64_t>(s.tokens.size());
    q.logits = last ? LogitRows::kLast : LogitRows::kNone;
    if (s.n_generated == 0) stats_.prompt_tokens_computed += s.chunk;
  }
  const int vocab = model_->config().vocab;
  // A backend that samples (CUDA) picks every row's token itself when every
  // request of the step lets it: the logits then stay on the device.
  std::vector<BackendPick> picks;
  if (backend_->PicksTokens()) {
    bool all = true;
    for (size_t i = 0; i < batch.size() && all; ++i) {
      if (plan.seqs[i].logits != LogitRows::kNone) all = batch[i]->sampler->BackendCanPick(vocab);
    }
    for (size_t i = 0; i < batch.size() && all; ++i) {
      if (plan.seqs[i].logits != LogitRows::kNone) {
        picks.push_back(batch[i]->sampler->NextPickForBackend());
      }
    }
  }
  ForwardOutput out;
  std::function<void(int)> hook;
  if (connector_ != nullptr) hook = [&](int layer) { connector_->SaveLayer(layer, plan); };
  Status st;
  if (tp_.publish) {
    st = tp_.publish(plan).WithContext("publishing the step to the tensor-parallel group");
  }
  if (st.ok()) {
    st = backend_->Run(plan.seqs, &out, hook, picks);
  }
  if (!st.ok()) {
    LOG_ERROR << "forward step failed: " << st.ToString();
    for (Sequence* s : batch) {
      events.push_back(FinishEvent(*s, FinishReason::kError, st));
      ReleaseBlocks(*s);
    }
    std::erase_if(running_, [&](const auto& r) {
      return std::find(batch.begin(), batch.end(), r.get()) != batch.end();
    });
    return events;
  }
  // Each finished sequence with the index of its own event: the step's
  // events begin with the pending ones, which may hold a stale cancel of the
  // same id (a re-run submitted after its earlier attempt was cancelled).
  std::vector<std::pair<Sequence*, size_t>> done;
  for (size_t i = 0; i < batch.size(); ++i) {
    Sequence& s = *batch[i];
    s.n_computed += s.chunk;
    s.chunk = 0;
    CommitFullBlocks(s);
    DropOutOfWindow(s);
    NotePeakBlocks(s);
    if (plan.seqs[i].logits == LogitRows::kNone) continue;
    if (s.n_generated == 0) QuantizePromptTail(s);
    TokenEvent ev;
    const int32_t token = !out.picked.empty()
                              ? out.picked[static_cast<size_t>(out.row_begin[i])]
                              : s.sampler->Sample(out.logits.data() + out.row_begin[i] * vocab,
                                                  vocab, s.tokens, s.n_generated, &ev.logprobs);
    ev.has_logprobs = s.spec.sampling.logprobs >= 0;
    s.tokens.push_back(token);
    ++s.n_generated;
    ++stats_.generated_tokens;
    if (CheckFinished(s, token, &ev, /*emit_text=*/true)) done.emplace_back(&s, events.size());
    events.push_back(std::move(ev));
  }
  for (auto [s, event] : done) {
    auto it =
        std::find_if(running_.begin(), running_.end(), [&](const auto& r) { return r.get() == s; });
    std::unique_ptr<Sequence> seq = std::move(*it);
    running_.erase(it);
    if (seq->spec.mode == RequestMode::kPrefillOnly && connector_ != nullptr) {
      // Exactly the prompt's blocks (the first token is not in the KV); the
      // connector may keep them, e.g. until their stream is sent.
      seq->blocks.Truncate(BlocksFor(seq->n_prompt));
      (void)connector_->RequestFinished(events[event], seq->blocks);
    }
  }
  return events;
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

Result<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options) {
  RETURN_IF_ERROR(options.Validate());
  if (options.model_path.empty()) return InvalidArgument("EngineOptions.model_path is empty");
  ASSIGN_OR_RETURN(std::unique_ptr<Model> model, Model::Load(options.model_path));
  return Create(options, std::shared_ptr<const Model>(std::move(model)));
}

Result<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options,
                                               std::shared_ptr<const Model> model) {
  RETURN_IF_ERROR(options.Validate());
  if (model == nullptr) return InvalidArgument("Engine::Create: null model");
  ASSIGN_OR_RETURN(DeviceSpec device, ParseDevice(options.device));
  const ModelConfig& c = model->config();
  std::vector<int> windows;
  for (int l = 0; l < c.n_layers; ++l) windows.push_back(c.LayerWindow(l));
  KvCacheGroups groups = KvCacheGroups::FromLayerWindows(windows, options.split_kv_groups);
  KvBlockPool::Options po;
  po.layout = model->MakeKvLayout(options.kv_dtype, options.block_tokens);
  po.layout.layers = groups.layers_per_block();
  po.capacity_bytes = options.kv_capacity_bytes;
  if (po.capacity_bytes == 0) {
    // Room for max_running sequences of the whole context: a block per B
    // tokens in every full-attention group, a window and a step's chunk in
    // every sliding-window group.
    const double per_token = po.layout.BytesPerToken();
    const double context = static_cast<double>(c.context_length);
    double tokens = 0;
    for (int g = 0; g < groups.size(); ++g) {
      tokens +=
          groups.sliding(g)
              ? std::min(context,
                         static_cast<double>(groups.WindowBlocksBound(g, options.max_step_tokens,
                                                                      options.block_tokens) *
                                             options.block_tokens))
              : context;
    }
    const double want = per_token * tokens * options.max_running;
    po.capacity_bytes = static_cast<int64_t>(std::min(want, static_cast<double>(1LL << 30)));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<KvBlockPool> pool, KvBlockPool::Create(po));
  if (groups.size() > 1) LOG_INFO << "KV cache: " << groups.DebugString();
  auto impl = std::make_unique<Impl>(options, std::move(model), std::move(pool), std::move(groups));
  ComputeBackendOptions bo;
  bo.device = device;
  ASSIGN_OR_RETURN(impl->backend_, CreateComputeBackend(bo, *impl->model_, impl->pool_.get(),
                                                        impl->groups_, &impl->threads_));
  if (device.kind != DeviceKind::kCpu) {
    // A device backend copies the pool: host writes it did not make must reach it.
    ComputeBackend* backend = impl->backend_.get();
    impl->pool_->SetHostWriteHook([backend](BlockId b) { backend->InvalidateBlock(b); });
  }
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Status Engine::Submit(RequestSpec spec) { return impl_->Submit(std::move(spec)); }
Status Engine::Cancel(RequestId id) { return impl_->Cancel(id); }
int64_t Engine::CancelAll() { return impl_->CancelAll(); }
Result<std::vector<TokenEvent>> Engine::Step() { return impl_->Step(); }
bool Engine::HasWork() const { return impl_->HasWork(); }
void Engine::SetKvConnector(KvConnector* connector) { impl_->connector_ = connector; }
int64_t Engine::loading() const { return impl_->loading_count(); }
Status Engine::SetTensorParallel(const TensorParallelHooks& hooks) {
  if (hooks.collective == nullptr || !hooks.publish) {
    return InvalidArgument("SetTensorParallel needs a collective and a publish function");
  }
  Status dtype = CheckTensorParallelDtype(impl_->options_.kv_dtype);
  if (!dtype.ok()) return FailedPrecondition(dtype.message());
  if (impl_->model_->shard().size != hooks.collective->size() ||
      impl_->model_->shard().rank != hooks.collective->rank()) {
    return FailedPrecondition(
        "the engine's model shard (rank " + std::to_string(impl_->model_->shard().rank) + " of " +
        std::to_string(impl_->model_->shard().size) + ") does not match the collective (rank " +
        std::to_string(hooks.collective->rank()) + " of " +
        std::to_string(hooks.collective->size()) + ")");
  }
  impl_->tp_ = hooks;
  impl_->backend_->SetCollective(hooks.collective);
  return Status::Ok();
}
KvBlockPool* Engine::pool() { return impl_->pool_.get(); }
const KvCacheGroups& Engine::kv_groups() const { return impl_->groups_; }
Result<std::vector<int64_t>> Engine::HeldBlocks(RequestId id) const {
  return impl_->HeldBlocks(id);
}
const Model& Engine::model() const { return *impl_->model_; }
const EngineOptions& Engine::options() const { return impl_->options_; }
Engine::Stats Engine::stats() const { return impl_->stats_; }
int64_t Engine::running() const { return impl_->running_count(); }
int64_t Engine::queued() const { return impl_->queued_count(); }

}  // namespace kvrelay::engine
