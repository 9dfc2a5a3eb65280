// The tokenizer of a KVRELAY_MINIMAL_GPU build on a machine without ICU
// (the bare GPU check machine): models load with load_tokenizer = false, and
// asking for a tokenizer fails clearly instead of the build failing.
#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/pre_tokenizer.h"
#include "engine/tokenizer/tokenizer.h"

namespace kvrelay::engine {

namespace {
constexpr const char* kWhy =
    "this is a KVRELAY_MINIMAL_GPU build without ICU: it has no tokenizer (load models with "
    "ModelLoadOptions.load_tokenizer = false)";
}  // namespace

// Never constructed in this build; the destructors exist for Model's
// unique_ptr<Tokenizer> (always null here).
struct PreTokenizer::Patterns {};
PreTokenizer::~PreTokenizer() = default;
Tokenizer::~Tokenizer() = default;

Result<std::unique_ptr<Tokenizer>> Tokenizer::FromGguf(const GgufFile&) {
  return Unimplemented(kWhy);
}

Result<ChatTemplate> ChatTemplate::FromGguf(const GgufFile&) { return Unimplemented(kWhy); }

}  // namespace kvrelay::engine
