// Reading tokenizer.ggml.* metadata from a GGUF file.
#include "engine/gguf/gguf.h"
#include "engine/tokenizer/tokenizer.h"

namespace kvrelay::engine {
namespace {

// Reads an optional token id: absent keeps `*id`; a negative value (-1 is how
// some converters write "none") clears it.
Status ReadId(const GgufFile& g, const std::string& key, int32_t* id) {
  if (g.Find(key) == nullptr) return Status::Ok();
  Result<int64_t> v = g.GetInt(key);
  if (!v.ok()) return v.status().WithContext(key);
  if (*v > INT32_MAX) return InvalidArgument(key + " = " + std::to_string(*v) + " is out of range");
  *id = *v < 0 ? -1 : static_cast<int32_t>(*v);
  return Status::Ok();
}

Status ReadBool(const GgufFile& g, const std::string& key, bool* b) {
  if (g.Find(key) == nullptr) return Status::Ok();
  Result<bool> v = g.GetBool(key);
  if (!v.ok()) return v.status().WithContext(key);
  *b = *v;
  return Status::Ok();
}

}  // namespace

Result<VocabData> Tokenizer::VocabFromGguf(const GgufFile& g) {
  VocabData v;
  ASSIGN_OR_RETURN(v.model, g.GetString("tokenizer.ggml.model"));
  if (g.Find("tokenizer.ggml.pre") != nullptr) {
    ASSIGN_OR_RETURN(v.pre, g.GetString("tokenizer.ggml.pre"));
  }
  ASSIGN_OR_RETURN(v.tokens, g.GetStringArray("tokenizer.ggml.tokens"));
  if (g.Find("tokenizer.ggml.token_type") != nullptr) {
    ASSIGN_OR_RETURN(std::vector<int64_t> types, g.GetIntArray("tokenizer.ggml.token_type"));
    v.token_types.reserve(types.size());
    for (int64_t t : types) {
      if (t < 0 || t > 6)
        return InvalidArgument("tokenizer.ggml.token_type has unknown type " + std::to_string(t));
      v.token_types.push_back(static_cast<TokenType>(t));
    }
  }
  if (g.Find("tokenizer.ggml.scores") != nullptr) {
    ASSIGN_OR_RETURN(v.scores, g.GetFloatArray("tokenizer.ggml.scores"));
  }
  if (g.Find("tokenizer.ggml.merges") != nullptr) {
    ASSIGN_OR_RETURN(v.merges, g.GetStringArray("tokenizer.ggml.merges"));
  }
  // Defaults as llama.cpp: SentencePiece vocabularies use <unk>=0 <s>=1 </s>=2, add
  // BOS and a space prefix; byte-level ones have no BOS unless the pre-tokenizer is
  // Llama-3's.
  if (v.model == "llama") {
    v.unk_id = 0;
    v.bos_id = 1;
    v.eos_id = 2;
    v.add_bos = true;
    v.add_space_prefix = true;
  } else if (v.model == "gpt2" && v.merges.empty()) {
    return InvalidArgument("tokenizer.ggml.merges is missing for a gpt2 (BPE) vocabulary");
  } else if (v.pre == "llama3" || v.pre == "llama-v3" || v.pre == "llama-bpe" ||
             v.pre == "falcon3") {
    v.add_bos = true;
  }
  RETURN_IF_ERROR(ReadId(g, "tokenizer.ggml.bos_token_id", &v.bos_id));
  RETURN_IF_ERROR(ReadId(g, "tokenizer.ggml.eos_token_id", &v.eos_id));
  RETURN_IF_ERROR(ReadId(g, "tokenizer.ggml.eot_token_id", &v.eot_id));
  RETURN_IF_ERROR(ReadId(g, "tokenizer.ggml.unknown_token_id", &v.unk_id));
  RETURN_IF_ERROR(ReadId(g, "tokenizer.ggml.padding_token_id", &v.pad_id));
  RETURN_IF_ERROR(ReadBool(g, "tokenizer.ggml.add_bos_token", &v.add_bos));
  RETURN_IF_ERROR(ReadBool(g, "tokenizer.ggml.add_eos_token", &v.add_eos));
  RETURN_IF_ERROR(ReadBool(g, "tokenizer.ggml.add_space_prefix", &v.add_space_prefix));
  const auto n = static_cast<int64_t>(v.tokens.size());
  for (int32_t* id : {&v.bos_id, &v.eos_id, &v.eot_id, &v.unk_id, &v.pad_id}) {
    if (*id >= n) *id = -1;  // as llama.cpp: an id past the vocabulary means "none"
  }
  return v;
}

Result<std::unique_ptr<Tokenizer>> Tokenizer::FromGguf(const GgufFile& gguf) {
  ASSIGN_OR_RETURN(VocabData vocab, VocabFromGguf(gguf));
  return Create(std::move(vocab));
}

}  // namespace kvrelay::engine
