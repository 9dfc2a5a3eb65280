#include "engine/gguf/fingerprint.h"

#include <algorithm>
#include <string>
#include <vector>

#include "common/hash.h"

namespace kvrelay::engine {
namespace {

void HashString(Sha256* h, const std::string& s) {
  h->UpdatePod(static_cast<uint64_t>(s.size()));
  h->Update(s);
}

}  // namespace

std::array<uint8_t, 32> ComputeModelFingerprint(const GgufFile& file) {
  Sha256 h;
  HashString(&h, "kvrelay-model-fingerprint-v1");

  std::string arch;
  if (const GgufValue* v = file.Find("general.architecture");
      v != nullptr && v->type == GgufValueType::kString) {
    arch = std::get<std::string>(v->value);
  }
  HashString(&h, arch);
  const std::string prefix = arch + ".";
  std::vector<uint8_t> encoded;
  for (const auto& [key, value] : file.metadata()) {  // std::map: key order
    if (arch.empty() || key.compare(0, prefix.size(), prefix) != 0) continue;
    HashString(&h, key);
    h.UpdatePod(static_cast<uint32_t>(value.type));
    encoded.clear();
    EncodeGgufValue(value, &encoded);
    h.UpdatePod(static_cast<uint64_t>(encoded.size()));
    h.Update(encoded.data(), encoded.size());
  }

  std::vector<const GgufTensor*> sorted;
  sorted.reserve(file.tensors().size());
  for (const GgufTensor& t : file.tensors()) sorted.push_back(&t);
  std::sort(sorted.begin(), sorted.end(),
            [](const GgufTensor* a, const GgufTensor* b) { return a->name < b->name; });
  h.UpdatePod(static_cast<uint64_t>(sorted.size()));
  for (const GgufTensor* t : sorted) {
    HashString(&h, t->name);
    h.UpdatePod(static_cast<uint32_t>(t->type));
    h.UpdatePod(static_cast<uint32_t>(t->dims.size()));
    for (int64_t d : t->dims) h.UpdatePod(d);
  }
  for (const GgufTensor* t : sorted) {
    h.UpdatePod(t->nbytes);
    h.Update(t->data, t->nbytes);
  }
  return h.Finish();
}

}  // namespace kvrelay::engine
