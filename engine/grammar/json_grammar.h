// Constrained decoding for structured output: a JSON schema compiled into a
// byte-level pushdown automaton (JsonGrammar), a trie over the model's token
// bytes (TokenVocabulary), and the per-request matcher that turns the
// automaton's state into a token mask at every step (GrammarMatcher).
//
// What is accepted: compact JSON (no insignificant whitespace) that
// validates against the schema. Supported keywords: type (a name or an array
// of names), properties, required, additionalProperties (false, true or a
// schema; with properties the object is closed to them), items, minItems,
// maxItems, minLength, maxLength, enum, const, and the annotations title,
// description, default, examples, $schema, $id, $comment. Properties are
// written in schema order (optional ones may be left out). Anything else is
// refused by CompileJsonSchema with InvalidArgument naming the keyword and
// where it is, so a schema is never half-enforced.
//
// Tool calls (tool_choice required / a named function) use one extension at
// the top level: {"x-kvrelay-tool-calls": [{"name": N, "parameters": S}]}
// accepts {"name":N,"arguments":<value of S>} for one of the functions.
//
// Masks are computed lazily per automaton state (a DFS over the token trie)
// and cached in the ConstraintFactory, which engines share across requests
// of the same schema. Thread-safe: JsonGrammar and TokenVocabulary are
// immutable; the mask cache is locked; a GrammarMatcher belongs to one
// request.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "engine/runtime/sampler.h"

namespace kvrelay::engine::grammar {

class JsonGrammar;

// The schema text ("{"type":"object"}" for OpenAI's json_object mode).
Result<std::shared_ptr<const JsonGrammar>> CompileJsonSchema(std::string_view schema_text);

// The model's tokens as bytes, for masking.
class TokenVocabulary {
 public:
  // `pieces[i]`: the bytes token i stands for; `usable[i]`: may appear in
  // JSON text (normal and byte tokens; control tokens never do); `eog`: the
  // end-of-generation tokens, allowed once the JSON is complete.
  static std::shared_ptr<const TokenVocabulary> Build(const std::vector<std::string>& pieces,
                                                      const std::vector<bool>& usable,
                                                      std::vector<int32_t> eog);
  int64_t size() const { return vocab_; }
  const std::string& piece(int32_t id) const { return pieces_[id]; }
  bool is_eog(int32_t id) const;

 private:
  friend class ConstraintFactory;
  struct Node {
    int32_t first_child = 0;  // children are nodes_[first_child, first_child + n_children)
    int32_t n_children = 0;
    int32_t first_token = 0;  // tokens ending here: tokens_[first_token, first_token + n_tokens)
    int32_t n_tokens = 0;
    uint8_t byte = 0;
  };
  int64_t vocab_ = 0;
  std::vector<std::string> pieces_;
  std::vector<Node> nodes_;  // nodes_[0] is the root (no byte)
  std::vector<int32_t> tokens_;
  std::vector<int32_t> eog_;
};

// One automaton state: a stack of frames (see json_grammar.cc).
struct GrammarFrame {
  uint32_t node = 0;
  uint8_t phase = 0;
  int32_t a = 0;
  int32_t b = 0;
  int32_t c = 0;
};
using GrammarState = std::vector<GrammarFrame>;

class JsonGrammar {
 public:
  GrammarState Start() const;
  // Feeds one byte; false (state unspecified) when the grammar refuses it.
  bool Feed(GrammarState* state, uint8_t byte) const;
  // The JSON value is complete and nothing more may follow.
  static bool Complete(const GrammarState& state) { return state.empty(); }
  // The text so far is a complete value (e.g. a number that could go on).
  bool CanEnd(const GrammarState& state) const;
  // Convenience for tests: feeds every byte.
  bool FeedAll(GrammarState* state, std::string_view bytes) const;

  struct Node;
  ~JsonGrammar();
  JsonGrammar();

 private:
  friend Result<std::shared_ptr<const JsonGrammar>> CompileJsonSchema(std::string_view);
  friend class SchemaCompiler;
  enum class Step { kOk, kReject, kRefeed };
  Step StepFrame(GrammarState* st, uint8_t byte) const;
  bool PushChild(GrammarState* st, uint32_t node, uint8_t phase = 0) const;
  std::vector<Node> nodes_;
  uint32_t root_ = 0;
};

// A token mask: bit i set = token i allowed.
using TokenMask = std::vector<uint64_t>;

// A schema compiled for one vocabulary, with its mask cache.
class ConstraintFactory {
 public:
  ConstraintFactory(std::shared_ptr<const JsonGrammar> grammar,
                    std::shared_ptr<const TokenVocabulary> vocab)
      : grammar_(std::move(grammar)), vocab_(std::move(vocab)) {}
  const JsonGrammar& grammar() const { return *grammar_; }
  const TokenVocabulary& vocab() const { return *vocab_; }
  // The mask of `state` (computed on first use, then cached).
  std::shared_ptr<const TokenMask> MaskFor(const GrammarState& state) const;
  struct CacheStats {
    int64_t hits = 0;
    int64_t misses = 0;
  };
  CacheStats stats() const;

 private:
  std::shared_ptr<const TokenMask> Compute(const GrammarState& state) const;
  std::shared_ptr<const JsonGrammar> grammar_;
  std::shared_ptr<const TokenVocabulary> vocab_;
  mutable std::mutex mu_;
  mutable std::unordered_map<std::string, std::shared_ptr<const TokenMask>> cache_;  // mu_
  mutable CacheStats stats_;                                                         // mu_
};

// One request's position in the grammar (a TokenConstraint for the Sampler).
class GrammarMatcher : public TokenConstraint {
 public:
  explicit GrammarMatcher(std::shared_ptr<const ConstraintFactory> factory);
  void Mask(float* logits, int64_t vocab) override;
  Status Accept(int32_t token) override;
  bool Complete() const override { return JsonGrammar::Complete(state_); }

 private:
  std::shared_ptr<const ConstraintFactory> factory_;
  GrammarState state_;
};

// Engines keep one: compiled schemas by text (at most `capacity`, least
// recently used dropped), all for the same vocabulary.
class ConstraintCache {
 public:
  ConstraintCache(std::shared_ptr<const TokenVocabulary> vocab, size_t capacity = 32)
      : vocab_(std::move(vocab)), capacity_(capacity) {}
  Result<std::shared_ptr<const ConstraintFactory>> Get(const std::string& schema_text);

 private:
  std::shared_ptr<const TokenVocabulary> vocab_;
  size_t capacity_;
  std::mutex mu_;
  std::list<std::pair<std::string, std::shared_ptr<const ConstraintFactory>>> lru_;  // mu_
};

}  // namespace kvrelay::engine::grammar
