// KvTier: one storage level below the live KV block pool. A tier maps a
// block's chain hash (engine::BlockHash) to the block's encoded bytes (see
// block_codec.h); it never interprets the bytes. Verifying that a value is the
// right KV for a request is the codec's job, so a tier may return stale or
// damaged bytes without harm: the caller decodes and treats a failure as a miss.
//
// Implementations: HostRamTier (host_ram_tier.h, LRU in process memory) and
// RocksDbTier (rocksdb_tier.h, on local disk, survives restarts).
//
// Thread-safety: every method of every implementation is safe to call from
// several threads at once.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "engine/kv_cache/kv_cache.h"

namespace kvrelay::kv_store {

using engine::BlockHash;

// Counters of one tier since it was created (or opened).
struct TierStats {
  int64_t puts = 0;          // values accepted
  int64_t put_bytes = 0;     // bytes of accepted values
  int64_t puts_dropped = 0;  // values refused without blocking (queue full, over capacity)
  int64_t hits = 0;          // Get calls that returned a value
  int64_t misses = 0;        // Get calls that returned NotFound
  int64_t errors = 0;        // Get/Put calls that failed for another reason (I/O, corruption)
  int64_t evictions = 0;     // entries removed to stay under capacity
  int64_t evicted_bytes = 0;
  int64_t expired = 0;     // entries removed because their TTL passed
  int64_t entries = 0;     // entries held now
  int64_t used_bytes = 0;  // bytes held now (values only)
  // Asynchronous tiers (RocksDbTier) only:
  int64_t written = 0;         // values the background writer stored
  int64_t written_bytes = 0;   // ... and their bytes
  int64_t write_failures = 0;  // values lost to a failed write, or refused because the
                               // store is read-only / suspended after a failure (disk full)
  int64_t get_batches = 0;     // GetBatch calls (each one RocksDB MultiGet)
};

// Where a block lives, for stored/evicted events (the router's prefix index
// learns which worker holds a prefix and in which tier).
enum class BlockTier : uint8_t { kPool = 0, kHostRam = 1, kDisk = 2 };
std::string_view BlockTierName(BlockTier t);  // "pool", "ram", "disk"

// One change of what a tier holds.
struct TierEvent {
  enum class Kind : uint8_t { kStored, kEvicted };
  Kind kind = Kind::kStored;
  BlockTier tier = BlockTier::kPool;
  BlockHash hash{};
  // After this event, does any tier of this worker (pool, RAM, disk) still
  // hold the block? A router that keeps one set per worker removes the block
  // on kEvicted only when this is false.
  bool held_anywhere = true;
};

class KvTier {
 public:
  virtual ~KvTier() = default;

  // Short name for logs and stats ("ram", "rocksdb").
  virtual std::string_view name() const = 0;

  // Stores `value` under `hash`, replacing an older value. The tier owns the
  // moved-in bytes. A value larger than the tier's capacity is refused with
  // ResourceExhausted. An asynchronous tier (RocksDbTier) may return OK before
  // the value is written and documents when it becomes visible and durable;
  // it refuses with ResourceExhausted rather than block when it is behind.
  virtual Status Put(const BlockHash& hash, std::string value) = 0;

  // The value stored under `hash`; NotFound when absent (or expired). Other
  // codes (DataLoss, Unavailable) mean the storage failed; treat as a miss.
  // A hit marks the entry most recently used.
  virtual Result<std::string> Get(const BlockHash& hash) = 0;

  // True if Get would find a value (it does not read the value, and does not
  // change the LRU order).
  virtual bool Contains(const BlockHash& hash) = 0;

  // Removes the entry; OK when it was absent.
  virtual Status Erase(const BlockHash& hash) = 0;

  // Batch variants: one result per input, in order. The default
  // implementations loop; a tier may group the work.
  virtual std::vector<Status> PutBatch(std::vector<std::pair<BlockHash, std::string>> items);
  virtual std::vector<Result<std::string>> GetBatch(std::span<const BlockHash> hashes);

  // Asynchronous tiers: whether a Put of `bytes` would be queued now (not
  // dropped for a full queue); waiting until what was accepted is written
  // (Flush) or durable (WaitDurable); and the stored/evicted events since the
  // last call (`*overflowed`, may be null, is set when some were dropped).
  // The defaults suit a synchronous tier that keeps no events.
  virtual bool HasQueueRoom(int64_t bytes) const { return true; }
  virtual Status Flush(Deadline deadline) { return Status::Ok(); }
  virtual Status WaitDurable(Deadline deadline) { return Status::Ok(); }
  virtual std::vector<TierEvent> TakeEvents(bool* overflowed) {
    if (overflowed != nullptr) *overflowed = false;
    return {};
  }

  // Byte budget for values, and bytes of values held now.
  virtual int64_t capacity_bytes() const = 0;
  virtual int64_t used_bytes() const = 0;

  virtual TierStats stats() const = 0;
};

}  // namespace kvrelay::kv_store
