// TieredCache: connects a live KvBlockPool to the tiers below it (host RAM,
// disk). It is the storage half of the engine's KV connector: the worker calls
// it at admission (how many tokens of a request can be loaded from the tiers),
// to load them into pool blocks, once per step (write-through and events) and
// at a clean shutdown (drain).
//
// How the worker uses it (all calls on the pool's owner thread unless noted):
//
//   TieredCache cache(options, ram_tier, disk_tier);
//   cache.Attach(pool, [&](const TierEvent& e) { /* to the coordinator */ });
//   // (Attach installs the pool's spill hook AND its event listener: pool
//   //  kStored/kEvicted reach the listener as TierEvents with tier kPool,
//   //  disk writes/evictions with tier kDisk. If the shell owns the pool's
//   //  listener, Attach(pool, listener, /*own_pool_listener=*/false) and call
//   //  cache.OnPoolEvent(ev) from it.)
//   cache.AnnounceAll();  // after (re)registering: kStored for all on disk/RAM
//
//   // Admission (connector: "how many tokens can be loaded from outside"):
//   PrefixMatch m = cache.Match(tokens, model, salt);   // no I/O, no refs
//   // m.pool_blocks leading blocks are in the pool already (the engine's own
//   // MatchPrefix will find them); m.external_blocks more are in RAM/disk:
//   // m.loadable_tokens() tokens. Allocate that many pool blocks (dst) and:
//   auto load = cache.StartLoad(m, tokens, model, salt, dst);  // reads on "kvstore-loader"
//   // ... keep stepping other requests; load->Ready() says when to finish ...
//   Result<int> n = cache.FinishLoad(*load, Deadline::After(...));
//   // n leading dst blocks now hold verified KV and are committed under their
//   // hashes (the engine's MatchPrefix finds them); the caller still owns one
//   // reference on every dst block and releases it only AFTER the engine has
//   // admitted the request (its own MatchPrefix took a reference) or the
//   // request ended. Releasing earlier lets the pool evict them before the
//   // engine looks (see RestorePrefix).
//
//   // Every engine step (after Step returns) and when idle:
//   cache.Pump();   // write-through of newly committed blocks + disk events
//
//   // Clean shutdown, after the last Step, before the pool is destroyed:
//   cache.Drain(Deadline::After(30s));   // everything served is on disk, synced
//
// Write-through: with write_through (the default) every full block the pool
// commits (kStored) whose tokens are known (noted by Match / RestorePrefix /
// NoteSequence) is queued for the disk tier: the hash goes to a backlog
// (bounded, max_write_backlog_blocks; beyond it new blocks are dropped and
// counted), and Pump() encodes as many as the disk tier's queue has room for
// (an encode is one copy of the block plus a checksum, ~0.1 ms per 737 KB
// SmolLM2 block) and hands them to the tier's writer thread, which does the
// I/O. The request path never waits for the disk. A block the disk already
// holds is not written again, so when the pool later evicts it only the RAM
// copy goes (the spill hook still copies it to the host-RAM tier). A block
// evicted before Pump reached it is written by the spill hook instead.
// Without write_through, the disk receives a block only when the RAM tier
// evicts it (less disk traffic, lost on a crash).
//
// Load (restore): Match checks the pool (IsCached) and the tiers (Contains,
// an index lookup) without reading values. StartLoad reads the external
// blocks on a background thread with one GetBatch per tier (RAM first, then
// one RocksDB MultiGet for the rest) and verifies each value against the
// expected model, layout, tenant, chain hash and tokens (block_codec.h): a
// value that fails is a miss (counted by reason, erased from its tier), never
// KV. The loader writes each block straight into the caller's pool block (a
// sealed block is decrypted there, then verified in place: the restore makes
// no copy beyond the tier's read), and FinishLoad commits the leading
// verified run.
//
// One store per worker, not one per host: RocksDB allows one writer process
// per database (the LOCK file); sharing one store between the workers of a
// host would need a store server process (one more hop on the restore path
// and a single point of failure) or RocksDB secondary instances (read-only
// followers that must replay the primary's MANIFEST to see new blocks). The
// prefix-aware router makes sharing unnecessary for hits: the disk tier's
// stored/evicted events tell it which worker holds a prefix, and it routes
// the request there. A per-worker directory also fails alone (a full or
// damaged disk tier affects one worker).
//
// Threading: methods that take or use the pool run on the pool's owner thread
// (the pool is thread-compatible; its spill hook and event listener run there
// too, and so does the TierEvent listener). stats() and LoadHandle::Ready()
// may be called from any thread.
#pragma once

#include <array>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/clock.h"
#include "engine/kv_cache/block_table.h"
#include "engine/kv_cache/kv_cache.h"
#include "engine/kv_cache/kv_groups.h"
#include "kv_store/block_codec.h"
#include "kv_store/block_seal.h"
#include "kv_store/host_ram_tier.h"
#include "kv_store/kv_tier.h"

namespace kvrelay::kv_store {

// What Match found for a prompt: its full-block hashes, how many leading
// blocks are in the pool, and how many blocks after those the tiers hold.
struct PrefixMatch {
  std::vector<BlockHash> hashes;  // every full block of the prompt
  int block_tokens = 0;
  int pool_blocks = 0;      // leading blocks cached in the pool now
  int external_blocks = 0;  // blocks [pool_blocks, pool_blocks + external_blocks) in RAM/disk
  // Tokens the connector can load from outside the pool.
  int64_t loadable_tokens() const { return int64_t{external_blocks} * block_tokens; }
  // Tokens that need no compute (pool + loadable).
  int64_t matched_tokens() const { return int64_t{pool_blocks + external_blocks} * block_tokens; }
};

// A batched read in flight (StartLoad) or done. Owned by the caller through
// a shared_ptr; the loader thread keeps its own reference while it reads.
class LoadHandle {
 public:
  // True when the reads are done and FinishLoad will not block.
  bool Ready() const;

 private:
  friend class TieredCache;
  // The loader writes into block k's layers only between BeginWrite (false:
  // abandoned, write nothing) and EndWrite.
  bool BeginWrite();
  void EndWrite();
  std::span<const std::span<uint8_t>> DstLayers(size_t k) const;

  mutable std::mutex mutex_;
  std::condition_variable done_cv_;  // done_, and writing_ back to 0
  bool done_ = false;                // guarded by mutex_
  bool abandoned_ = false;           // guarded by mutex_: FinishLoad gave up
  int writing_ = 0;                  // guarded by mutex_: writes in progress
  // Inputs (set on the owner thread before the handle is queued, then read-only).
  std::vector<BlockHash> hashes;  // the external blocks, in prompt order
  std::vector<BlockMeta> expected;
  std::vector<engine::BlockId> dst;            // the caller's pool block for each
  std::vector<std::span<uint8_t>> dst_layers;  // [k * layers + l]: dst[k]'s layer l
  size_t layers = 0;
  TimePoint queued_at;  // set by QueueLoad
  // Outputs (written by the loader before done_; read by FinishLoad after).
  std::vector<int> from_tier;  // the leading verified run: 0 = RAM, 1 = disk
  double queued_ms = 0;        // waiting for the loader thread
  double read_ms = 0;          // reading, unsealing and verifying into the blocks
  int read_threads = 1;
  // Written by FinishLoad (the caller's thread).
  double commit_ms = 0;  // committing the blocks under their hashes
};

class TieredCache {
 public:
  struct Options {
    bool write_through = true;                   // committed blocks go to disk at once (see above)
    int64_t max_tracked_blocks = 1 << 17;        // bound of the (hash -> tokens, tenant) table
    int64_t max_write_backlog_blocks = 1 << 14;  // committed blocks waiting for the disk queue
    int max_encodes_per_pump = 256;              // bound on one Pump's work
    // Seals every block the disk tier stores and opens every block read from
    // it (block_seal.h): the worker sets one made from its cluster key. Null:
    // the disk holds plaintext blocks (tests, tools). A block that does not
    // open (another key or tenant, tampered, or plaintext in a sealed store)
    // is a miss counted by reason (kAuth, kUnsealed) and erased from the
    // disk. The host-RAM tier is process memory and holds plaintext.
    std::shared_ptr<const BlockSealer> sealer = nullptr;
  };

  struct Stats {
    int64_t restored_blocks_ram = 0;
    int64_t restored_blocks_disk = 0;
    int64_t restored_bytes = 0;
    int64_t restores = 0;         // loads that restored at least one block
    int64_t load_batches = 0;     // StartLoad calls that read something
    int64_t pool_hit_blocks = 0;  // blocks RestorePrefix found already in the pool
    std::array<int64_t, static_cast<size_t>(MissReason::kCount)> misses{};  // by reason
    int64_t spills = 0;  // blocks encoded and handed to a tier
    int64_t spill_bytes = 0;
    int64_t spills_dropped = 0;    // refused by a full disk queue (or over capacity)
    int64_t spills_untracked = 0;  // evicted blocks with no noted tokens
    int64_t demotions = 0;         // RAM evictions forwarded to disk
    int64_t persisted_blocks = 0;  // written by PersistPrefix
    // Write-through:
    int64_t write_through_blocks = 0;  // committed blocks handed to the disk tier
    int64_t write_through_bytes = 0;
    int64_t write_through_dropped = 0;  // backlog full, or the disk refused the value
    int64_t write_through_skipped = 0;  // already on disk, or gone from the pool first
    int64_t write_backlog = 0;          // waiting now
  };

  using EventListener = std::function<void(const TierEvent&)>;

  // `ram` and `disk` may each be null; they are not owned and must outlive
  // this cache. When both are given and write_through is false, this installs
  // the RAM tier's eviction callback.
  TieredCache(const Options& options, HostRamTier* ram, KvTier* disk);
  // Stops the loader thread (waiting for a read in progress) and detaches.
  ~TieredCache();
  TieredCache(const TieredCache&) = delete;
  TieredCache& operator=(const TieredCache&) = delete;

  // Installs the spill hook and (with own_pool_listener) the event listener
  // on `pool`, replacing any other. `listener` (may be null) receives every
  // TierEvent on the owner thread: pool events as they happen, disk events
  // from Pump(). When something else must own the pool's listener (the
  // worker shell), pass own_pool_listener = false and call OnPoolEvent from
  // that listener for every pool event: write-through needs the kStored ones.
  // The pool must stay alive until Detach() or this cache's destruction.
  void Attach(engine::KvBlockPool* pool, EventListener listener = nullptr,
              bool own_pool_listener = true);
  void Detach();
  // One pool event (owner thread); see Attach. Forwards it to the listener as
  // a TierEvent (tier kPool) and queues committed blocks for write-through.
  void OnPoolEvent(const engine::KvEvent& ev);

  // The KV cache groups the attached pool's blocks serve (engine::Engine::
  // kv_groups()); call after Attach, before any other call. One group (the
  // default) keeps every behaviour and byte as before. With several, every
  // group's block is its own tier entry under its pool key
  // (engine::GroupBlockHash(chain hash, group): the chain hash itself for the
  // full-attention group 0, so a one-group pool of the same model and this
  // one meet under group 0's keys and tell each other's entries apart by the
  // codec's format version, a kLayout miss), encoded with only that group's
  // layers (block_codec.h, format version 2). Noting, spilling,
  // write-through and PersistPrefix then work per group block; a sliding
  // group's block the pool no longer holds is simply not stored. Loads go
  // through LoadMissing (RestorePrefix fills one table of every layer and
  // refuses). Routing: the router hashes prompts to chain
  // hashes, so a block counts as cached on this worker when group 0's block
  // is (the other groups' keys reach the listener too and never match).
  void SetKvGroups(const engine::KvCacheGroups& groups);

  // Queues kStored events for every block the disk and RAM tiers hold
  // (delivered by the next Pump), e.g. after registering with a coordinator.
  void AnnounceAll();

  // Records tokens/tenant/model of every full block of `tokens` so their
  // commit can be written through and their eviction spilled.
  void NoteSequence(std::span<const int32_t> tokens, const engine::ModelFingerprint& model,
                    std::string_view tenant_salt);

  // --- admission side ---
  // What the pool and the tiers hold of `tokens`' full blocks. No value is
  // read and no reference taken; also notes the sequence.
  PrefixMatch Match(std::span<const int32_t> tokens, const engine::ModelFingerprint& model,
                    std::string_view tenant_salt);

  // --- load side ---
  // Starts reading the external blocks of `match` into dst[0..] (fresh
  // blocks the caller allocated and holds: the first dst.size() external
  // blocks, or all of them when fewer) on the loader thread. Never blocks on
  // I/O. Until FinishLoad returns, the loader may write into every dst block.
  std::shared_ptr<LoadHandle> StartLoad(const PrefixMatch& match, std::span<const int32_t> tokens,
                                        const engine::ModelFingerprint& model,
                                        std::string_view tenant_salt,
                                        std::span<const engine::BlockId> dst);
  // Waits (until `deadline`) for `load`, then commits its leading verified
  // blocks dst[0..n) under their hashes and returns n; the caller still
  // holds every dst block, and those after n hold no KV to use.
  // DeadlineExceeded when the reads are not done by then: the load is
  // abandoned (the loader writes no more into dst once this returns, having
  // finished the block it was writing; nothing is committed).
  Result<int> FinishLoad(LoadHandle& load, Deadline deadline);

  // Convenience for a synchronous caller: fills `table` (cleared first) with
  // the longest available prefix of `tokens`' full blocks: pool hits
  // (MatchPrefix), then blocks loaded from the tiers (Match + StartLoad +
  // FinishLoad into newly allocated blocks). Every returned block holds one
  // reference for the caller, who must keep it until the engine has admitted
  // the request (or the request ended), not merely until the next step: an
  // unreferenced restored block is evictable. Returns the number of tokens
  // restored from the tiers (not counting pool hits). Stops early, without
  // error, when the pool has no free block.
  Result<int> RestorePrefix(engine::KvBlockPool* pool, std::span<const int32_t> tokens,
                            const engine::ModelFingerprint& model, std::string_view tenant_salt,
                            std::vector<engine::BlockId>* table);

  // The connector's admission side (engine::KvConnector::LoadPrefix), for
  // the KV cache groups of SetKvGroups (one group of the pool's layers
  // unless it split them). The engine holds the pool's hit of
  // `prefix.first` blocks: group 0's blocks [0, first) and each sliding
  // group's blocks from the window of min(first * B, n - 1) on
  // (n = prefix.tokens.size()). This finds the longest k > first such that
  // group 0 has blocks [first, k) and every sliding group the blocks
  // [max(first, w_g(k)), k), w_g(k) = the first block the window of position
  // min(k * B, n - 1) reads (KvCacheGroups::DroppableBlocks), each in the
  // pool or in RAM / on disk; then a shorter k, down to nothing. It takes
  // the pool's blocks (a reference each) and loads the others into new
  // blocks (verified, committed under their group keys); when a read fails
  // or the pool runs out, the hit shrinks to the longest k that what it got
  // still covers. The engine's chain hashes are used as they are — nothing
  // is hashed again — and every block from `prefix.first` on is noted, so
  // the ones computed next are written through with their tokens. On return
  // (*tables)[g] holds group g's entries for [first, first + result):
  // kNoBlock before w_g, one reference each after (the caller's). Returns the
  // blocks the hit grew by (0: nothing loaded, tables empty per group).
  Result<int64_t> LoadMissing(const engine::PrefixLookup& prefix,
                              const engine::ModelFingerprint& model, std::string_view tenant_salt,
                              std::vector<std::vector<engine::BlockId>>* tables);
  // engine::KvConnector::LoadPrefix of a worker over this cache (the prefill
  // role's, and any test that wants that path): LoadMissing, each group's
  // blocks adopted by tables[g]. Nothing when no block is missing or the
  // tables are not one per group; a failed load is logged (what loaded is kept).
  void LoadPrefix(const engine::PrefixLookup& prefix, const engine::ModelFingerprint& model,
                  std::string_view tenant_salt, std::span<engine::BlockTable> tables);

  // --- write side ---
  // Write-through of blocks committed since the last call (as many as the
  // disk queue takes; the rest wait), then disk events to the listener.
  // Cheap when there is nothing to do. Call after every engine step.
  void Pump();
  // Clean shutdown: writes every block still waiting (waiting for room in the
  // disk queue), then waits until the disk tier has written and synced all it
  // accepted. DeadlineExceeded when that does not finish in time.
  Status Drain(Deadline deadline);

  // Encodes the blocks of `tokens`' prefix that are in the pool now and puts
  // them in the tiers (as a spill would), without evicting them. Returns the
  // number of blocks handed to the tiers.
  Result<int> PersistPrefix(engine::KvBlockPool* pool, std::span<const int32_t> tokens,
                            const engine::ModelFingerprint& model, std::string_view tenant_salt);

  Stats stats() const;
  // The disk tier's (all zero without one). A worker carries both on its
  // heartbeat; the coordinator exports them (kvrelay_worker_kvstore_*).
  TierStats disk_stats() const;

 private:
  // Allocates up to m.external_blocks blocks of `pool`, loads the run after
  // m.pool_blocks into them and appends the filled ones to `out` (one
  // reference each); the rest go back. Returns the number filled.
  Result<int> LoadIntoNewBlocks(engine::KvBlockPool* pool, const PrefixMatch& m,
                                std::span<const int32_t> tokens,
                                const engine::ModelFingerprint& model, std::string_view tenant_salt,
                                std::vector<engine::BlockId>* out);

  // LoadMissing's reads: the blocks to_read[r] ((group, block) of `prefix`)
  // into dst[r], committed; returns how many of the leading ones were filled
  // (logs the restore).
  Result<int> ReadIntoBlocks(const engine::PrefixLookup& prefix,
                             const engine::ModelFingerprint& model,
                             const engine::KvCacheGroups& groups, const Sha256Digest& salt_hash,
                             std::span<const std::pair<int, int64_t>> to_read,
                             std::span<const engine::BlockId> dst);

  struct Note {
    engine::ModelFingerprint model;
    Sha256Digest salt_hash;
    std::vector<int32_t> tokens;
    int group = 0;  // the KV cache group whose block the noted key is
  };
  // Notes every group's key of blocks [first, hashes.size()) of `tokens`.
  void NoteBlocks(std::span<const BlockHash> hashes, size_t first, std::span<const int32_t> tokens,
                  const engine::ModelFingerprint& model, const Sha256Digest& salt_hash);
  // Queues `load` (hashes and expected filled) for the loader thread, to be
  // read into `dst` (one block each; the first hashes.size() of them).
  std::shared_ptr<LoadHandle> QueueLoad(std::shared_ptr<LoadHandle> load,
                                        std::span<const engine::BlockId> dst);
  void OnSpill(const BlockHash& hash, engine::BlockId block);
  void Emit(const TierEvent& ev);
  void NoteLocked(const BlockHash& hash, Note note);
  // Encodes and stores one block; returns true if some tier accepted it.
  bool Store(const BlockHash& hash, const Note& note, engine::KvBlockPool* pool,
             engine::BlockId block);
  // Writes one backlog entry; false when the disk queue has no room (retry later).
  bool WriteThroughOne(const BlockHash& hash);
  void CountMiss(MissReason r);
  // The bytes the disk tier stores for the encoded block `encoded` of tenant
  // `salt_hash` under `hash`: sealed when a sealer is set, else a copy.
  Result<std::string> ForDisk(const BlockHash& hash, const Sha256Digest& salt_hash,
                              std::string_view encoded) const;
  // Puts the block `stored` (a value the disk tier returned for `hash`) into
  // `dst` (its layers): opened in place when a sealer is set, then verified
  // against `expected`. kNone, or the miss reason (dst then holds no KV).
  MissReason FromDisk(const BlockHash& hash, const BlockMeta& expected, std::string_view stored,
                      std::span<const std::span<uint8_t>> dst) const;
  void LoaderLoop();
  void ReadLoad(LoadHandle& load);
  // Reads blocks [begin, end) of `load` into their dst blocks, up to and
  // including the first miss: per block the tier it came from (0 RAM, 1 disk)
  // or -1 (a miss, or the load was abandoned), -1 last.
  std::vector<int> ReadRange(LoadHandle& load, size_t begin, size_t end);
  // ReadRange's steps: one GetBatch per tier for blocks [begin, end), each
  // block put into its dst block, per block appended to `out`; false after a
  // miss. A chunk's values (RocksDB's buffers, two copies of each block) are
  // freed before the next chunk is read, so a restore reuses a few chunks of
  // memory instead of faulting in two fresh copies of the whole prefix.
  bool ReadChunk(LoadHandle& load, size_t begin, size_t end, std::vector<int>* out);
  static constexpr size_t kBlocksPerRead = 8;
  // ReadLoad's split: a thread per this many blocks, at most
  // min(kMaxReadThreads, twice the CPUs).
  static constexpr size_t kMinBlocksPerReadThread = 8;
  static constexpr size_t kMaxReadThreads = 4;

  const Options options_;
  HostRamTier* const ram_;
  KvTier* const disk_;
  engine::KvBlockPool* pool_ = nullptr;  // attached pool, owner thread only
  engine::KvCacheGroups groups_;         // SetKvGroups; empty = one group
  bool own_pool_listener_ = true;        // Attach installed the pool's listener
  EventListener listener_;               // owner thread only
  // Write-through backlog (owner thread only): committed, not yet written.
  std::deque<BlockHash> backlog_;
  std::unordered_set<BlockHash, BlockHashHasher> backlog_set_;
  std::vector<TierEvent> announce_;  // owner thread only: queued by AnnounceAll

  mutable std::mutex mutex_;
  // LRU of notes, front = newest. Guarded by mutex_.
  std::list<std::pair<BlockHash, Note>> notes_;
  std::unordered_map<BlockHash, std::list<std::pair<BlockHash, Note>>::iterator, BlockHashHasher>
      note_index_;  // guarded by mutex_
  Stats stats_;     // guarded by mutex_

  // Loader thread: reads queued loads (GetBatch per tier) and verifies them.
  std::mutex load_mutex_;
  std::condition_variable load_cv_;
  std::deque<std::shared_ptr<LoadHandle>> load_queue_;  // guarded by load_mutex_
  bool load_stop_ = false;                              // guarded by load_mutex_
  std::thread loader_;                                  // joined in the destructor
};

}  // namespace kvrelay::kv_store
