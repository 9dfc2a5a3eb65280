#include "engine/kv_cache/kv_cache.h"

#include <cstring>
#include <limits>
#include <utility>

#include "common/hash.h"
#include "common/logging.h"
#include "engine/kv_cache/block_manager.h"
#include "engine/kv_cache/kv_codec.h"
#include "engine/kv_cache/kv_storage.h"

namespace kvrelay::engine {

std::string_view KvDtypeName(KvDtype d) {
  switch (d) {
    case KvDtype::kF32:
      return "f32";
    case KvDtype::kF16:
      return "f16";
    case KvDtype::kBF16:
      return "bf16";
    case KvDtype::kInt8:
      return "int8";
    case KvDtype::kKivi4:
      return "kivi4";
    case KvDtype::kKivi2:
      return "kivi2";
  }
  return "unknown";
}

Result<KvDtype> ParseKvDtype(std::string_view name) {
  for (KvDtype d : {KvDtype::kF32, KvDtype::kF16, KvDtype::kBF16, KvDtype::kInt8, KvDtype::kKivi4,
                    KvDtype::kKivi2}) {
    if (name == KvDtypeName(d)) return d;
  }
  return InvalidArgument("unknown KV dtype '" + std::string(name) +
                         "' (expected f32, f16, bf16, int8, kivi4 or kivi2)");
}

int64_t KvLayout::SlabBytes() const { return kvcodec::SlabBytes(dtype, block_tokens, head_dim); }

BlockHash HashBlock(const BlockHash& parent, std::span<const int32_t> tokens,
                    const ModelFingerprint& model, std::string_view tenant_salt) {
  Sha256 h;
  h.Update(parent.data(), parent.size());
  const uint32_t n = static_cast<uint32_t>(tokens.size());
  const uint8_t n_le[4] = {static_cast<uint8_t>(n), static_cast<uint8_t>(n >> 8),
                           static_cast<uint8_t>(n >> 16), static_cast<uint8_t>(n >> 24)};
  h.Update(n_le, 4);
  for (int32_t t : tokens) {
    const uint32_t u = static_cast<uint32_t>(t);
    const uint8_t b[4] = {static_cast<uint8_t>(u), static_cast<uint8_t>(u >> 8),
                          static_cast<uint8_t>(u >> 16), static_cast<uint8_t>(u >> 24)};
    h.Update(b, 4);
  }
  h.Update(model.data(), model.size());
  h.Update(tenant_salt);
  return h.Finish();
}

std::vector<BlockHash> HashPrefixBlocks(std::span<const int32_t> tokens, int block_tokens,
                                        const ModelFingerprint& model,
                                        std::string_view tenant_salt) {
  std::vector<BlockHash> out;
  if (block_tokens <= 0) return out;
  const size_t full = tokens.size() / static_cast<size_t>(block_tokens);
  out.reserve(full);
  BlockHash parent{};
  for (size_t i = 0; i < full; ++i) {
    parent = HashBlock(parent, tokens.subspan(i * block_tokens, block_tokens), model, tenant_salt);
    out.push_back(parent);
  }
  return out;
}

namespace {

// The pool: a BlockManager (which blocks are live, the prefix cache) over a
// KvStorage (their bytes). The storage forgets a block the manager frees or
// hands out again, and seals it before the manager commits it.
class KvBlockPoolImpl final : public KvBlockPool {
 public:
  KvBlockPoolImpl(int64_t blocks, std::unique_ptr<KvStorage> storage)
      : manager_(blocks), storage_(std::move(storage)) {}

  const KvLayout& layout() const override { return storage_->layout(); }
  int64_t total_blocks() const override { return manager_.total_blocks(); }
  int64_t free_blocks() const override { return manager_.free_blocks(); }
  int64_t available_blocks() const override { return manager_.available_blocks(); }
  int64_t staging_slots_free() const override { return storage_->staging_slots_free(); }

  Result<BlockId> Allocate() override {
    Result<BlockId> id = manager_.Allocate();
    if (id.ok()) storage_->Forget(*id);
    return id;
  }
  void Ref(BlockId id) override { manager_.Ref(id); }
  void Release(BlockId id) override {
    if (manager_.Release(id)) storage_->Forget(id);
  }
  int refcount(BlockId id) const override { return manager_.refcount(id); }

  void WriteToken(BlockId id, int layer, int offset, const float* k, const float* v) override {
    storage_->WriteToken(id, layer, offset, k, v);
  }
  void ReadHead(BlockId id, int layer, int head, int n, float* k, float* v) const override {
    storage_->ReadHead(id, layer, head, n, k, v);
  }
  const float* HeadSlabF32(BlockId id, int layer, bool value, int head) const override {
    return storage_->HeadSlabF32(id, layer, value, head);
  }
  std::span<uint8_t> LayerData(BlockId id, int layer) override {
    if (host_write_hook_) host_write_hook_(id);
    return storage_->LayerData(id, layer);
  }
  std::span<const uint8_t> LayerData(BlockId id, int layer) const override {
    return std::as_const(*storage_).LayerData(id, layer);
  }
  const uint8_t* LayerAddress(BlockId id, int layer) const override {
    return storage_->LayerAddress(id, layer);
  }
  void CopyBlock(BlockId src, BlockId dst) override {
    if (host_write_hook_) host_write_hook_(dst);
    storage_->CopyBlock(src, dst);
  }

  void Commit(BlockId id, const BlockHash& hash) override {
    if (manager_.WouldCommit(id, hash)) storage_->Seal(id);
    manager_.Commit(id, hash);
  }
  std::vector<BlockId> MatchPrefix(std::span<const BlockHash> hashes) override {
    return manager_.MatchPrefix(hashes);
  }
  bool IsCached(const BlockHash& hash) const override { return manager_.IsCached(hash); }
  void SetSpillHook(std::function<void(const BlockHash&, BlockId)> hook) override {
    manager_.SetSpillHook(std::move(hook));
  }
  void SetEventListener(std::function<void(const KvEvent&)> listener) override {
    manager_.SetEventListener(std::move(listener));
  }
  void SetHostWriteHook(std::function<void(BlockId)> hook) override {
    host_write_hook_ = std::move(hook);
  }

 private:
  BlockManager manager_;
  std::unique_ptr<KvStorage> storage_;
  std::function<void(BlockId)> host_write_hook_;
};

}  // namespace

Result<std::unique_ptr<KvBlockPool>> KvBlockPool::Create(const Options& options) {
  const KvLayout& l = options.layout;
  if (l.layers <= 0 || l.kv_heads <= 0 || l.head_dim <= 0) {
    return InvalidArgument("KV layout needs layers, kv_heads and head_dim > 0 (got " +
                           std::to_string(l.layers) + ", " + std::to_string(l.kv_heads) + ", " +
                           std::to_string(l.head_dim) + ")");
  }
  if (l.block_tokens <= 0 || l.block_tokens > 4096) {
    return InvalidArgument("KV layout block_tokens must be in [1, 4096], got " +
                           std::to_string(l.block_tokens));
  }
  const int bits = kvcodec::KiviBits(l.dtype);
  if (bits != 0 && (static_cast<int64_t>(l.head_dim) * bits) % 8 != 0) {
    return InvalidArgument("KV dtype " + std::string(KvDtypeName(l.dtype)) +
                           " needs head_dim * bits to be a multiple of 8, head_dim is " +
                           std::to_string(l.head_dim));
  }
  if (static_cast<uint8_t>(l.dtype) > static_cast<uint8_t>(KvDtype::kKivi2)) {
    return InvalidArgument("unknown KV dtype " + std::to_string(static_cast<int>(l.dtype)));
  }
  if (options.capacity_bytes <= 0) return InvalidArgument("KV capacity_bytes must be > 0");
  int64_t staging_slots = 0;
  int64_t budget = options.capacity_bytes;
  if (bits != 0) {
    const int64_t slot_bytes = 2LL * l.kv_heads * l.block_tokens * l.head_dim * 4;
    const int64_t staging_bytes =
        options.staging_bytes >= 0 ? options.staging_bytes : options.capacity_bytes / 8;
    staging_slots =
        std::min<int64_t>(staging_bytes / slot_bytes, std::numeric_limits<int32_t>::max());
    budget -= staging_slots * slot_bytes;
  }
  const int64_t block_bytes = l.BlockBytes();
  const int64_t blocks = budget > 0 ? budget / block_bytes : 0;
  if (blocks <= 0) {
    return ResourceExhausted("KV capacity of " + std::to_string(options.capacity_bytes) +
                             " bytes holds no block of " + std::to_string(block_bytes) + " bytes");
  }
  if (blocks > std::numeric_limits<BlockId>::max()) {
    return InvalidArgument("KV capacity holds more than 2^31 blocks; raise block_tokens");
  }
  return std::unique_ptr<KvBlockPool>(
      new KvBlockPoolImpl(blocks, KvStorage::CreateHost(l, blocks, staging_slots)));
}

}  // namespace kvrelay::engine
