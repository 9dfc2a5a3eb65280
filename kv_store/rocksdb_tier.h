// RocksDbTier: a KvTier on local disk that survives process restarts and crashes.
//
// Storage: one RocksDB database with two column families:
//   "default": key = 32-byte chain hash (a grouped pool's group g > 0 block:
//              engine::GroupBlockHash), value = encoded block (block_codec.h).
//              Integrated BlobDB: values >= min_blob_size (every KV block) live in
//              blob files, so compactions move 32-byte keys and blob pointers,
//              not hundreds of KiB per block; garbage collection reclaims
//              evicted blobs. Blobs are stored uncompressed: KV payloads are
//              float mantissas that barely compress (a blob file of real
//              SmolLM2-135M f32 KV blocks: LZ4 -1 saves 0.0 %, ZSTD -3 7.3 %,
//              ZSTD -19 7.3 %), and decompression would sit on the restore
//              path that TTFT waits on. SSTs (keys and the small "meta"
//              family) use LZ4 when the library has it.
//   "meta":    key = chain hash, value = u64 value size | i64 write time (µs,
//              wall clock) | i64 last access time (µs). Written in the same
//              WriteBatch as the value, so the two never disagree after a crash.
// At Open the meta family is scanned to rebuild the in-memory LRU index
// (access-time order); the index drives capacity eviction, TTL and Contains.
//
// Writes are asynchronous: Put copies nothing (it takes the value), appends to
// a bounded queue and returns; one background writer thread ("kvstore-writer")
// groups queued puts, evictions, erasures and access-time updates into one
// WriteBatch per round. A full queue DROPS the new value (ResourceExhausted,
// counted in puts_dropped) instead of blocking the caller: a spilled block can
// always be recomputed. A value is visible to Get/Contains as soon as Put
// returns (pending values are served from the queue).
//
// "Acknowledged durable": a Put that returned OK is durable once a
// WaitDurable() call started after it has returned OK. WaitDurable asks the
// writer to write everything queued so far and then make it durable with one
// synced write (WriteOptions::sync = true, or DB::SyncWAL when nothing is left
// to write), i.e. the WAL records holding those values are fsync'ed. Such a
// value survives SIGKILL and power loss of the process (not the loss or damage
// of the disk itself). Values not yet acknowledged may or may not survive a
// crash; whatever survives is whole (RocksDB replays WAL records atomically).
//
// Damage: Open tries a normal open (paranoid checks on, WAL replayed to the
// last intact record). If RocksDB reports corruption, or the index cannot be
// rebuilt because a block fails its checksum, the directory is renamed to
// "<path>.corrupt-<unix seconds>" and the tier starts empty, keeping at most
// keep_damaged_copies such directories (oldest deleted). RepairDB is not
// used by default (try_repair): it does not recover BlobDB blob files, and
// the crash test found that the tables it rebuilds can trip assertions in the
// Debian librocksdb's iterator, i.e. abort the process. Losing a cache is
// fine; crashing is not. Damaged values that RocksDB does not catch itself
// are caught by the block codec's checksum when the caller decodes them, so
// bad KV is never served. A value RocksDB reports as corrupt on Get is
// dropped from the index (Get returns DataLoss once, then NotFound), and such
// a read, or any failed write (RocksDB turns read-only after a background
// error, e.g. a compaction meeting a damaged file), marks the database
// damaged: the destructor leaves a KVRELAY_DAMAGED file and the next Open
// moves the directory aside, so latent damage cannot keep the tier read-only.
//
// Disk full and other write failures (not damage): a write that fails with an
// I/O error (ENOSPC, EIO, a failed fsync) loses the values of that batch
// (counted in write_failures, logged at most once per log_interval_seconds),
// keeps every value already stored readable, and suspends writing for
// resume_interval_ms: meanwhile Put refuses at once (Unavailable, counted in
// write_failures), then the writer calls DB::Resume() and writes again. Such
// a failure never marks the database damaged (only corruption does), so the
// next Open keeps its contents.
//
// Open on a full disk: a writable open needs free space for RocksDB's own
// files (MANIFEST, OPTIONS, WAL replay). Open checks the free space first (the
// Env's FileSystem::GetFreeSpace); below open_reserve_bytes plus the bytes of
// WAL files to replay, or when a writable open fails with an I/O error, it
// opens the database read-only (DB::OpenForReadOnly): reads are served,
// Put refuses (Unavailable, counted), read_only() is true. Preallocation
// (fallocate of MANIFEST/WAL files) is off, so an open never reserves
// megabytes it does not write. RocksDB 7.8 (Debian) asserts
// `sync_without_flush_called_` and aborts when a file writer is reused after
// a failed append; the free-space check keeps a full disk from reaching it.
//
// Events: the tier records what it stored (when the writer's batch succeeded,
// so the block is on disk) and what it dropped (capacity, TTL, erase,
// corruption) as TierEvents (tier = kDisk); TakeEvents() hands them to one
// consumer (TieredCache, which forwards them on its owner thread).
//
// Privacy: the store directory (and the parents Open creates) is 0700 and
// every file in it 0600 whatever the process umask: Open chmods an existing
// tree (a store of an older kvrelay), and the Env's FileSystem chmods every
// file and directory RocksDB creates later. The blocks themselves are sealed
// by the caller (TieredCache::Options::sealer, block_seal.h).
//
// One writer process per directory: RocksDB locks the directory (LOCK file),
// so a second process opening the same path fails with Unavailable. kvrelay
// gives every worker its own directory (see tiered_cache.h for why).
//
// Thread-safety: all methods may be called concurrently.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/clock.h"
#include "kv_store/host_ram_tier.h"
#include "kv_store/kv_tier.h"

namespace rocksdb {
class DB;
class ColumnFamilyHandle;
class Env;
class Status;
}  // namespace rocksdb

namespace kvrelay::kv_store {

class RocksDbTier final : public KvTier {
 public:
  struct Options {
    std::string path;                        // database directory (created if missing)
    int64_t capacity_bytes = 16LL << 30;     // sum of value sizes kept; LRU beyond it
    int64_t ttl_seconds = 0;                 // 0 = none; else entries older than this
                                             // (since their last Put) are misses and removed
    int64_t block_cache_bytes = 32LL << 20;  // SST block cache (keys, meta, index blocks)
    int64_t min_blob_size = 4096;            // values at least this big go to blob files
    int64_t blob_file_size = 256LL << 20;
    int64_t write_buffer_bytes = 64LL << 20;  // memtable size of the value family
    int max_queue_blocks = 64;                // spill queue bound (count) ...
    int64_t max_queue_bytes = 256LL << 20;    // ... and bytes; a Put over either is dropped
    int max_batch_blocks = 16;                // puts grouped into one WriteBatch
    bool sync_every_batch = false;            // true: every batch is a synced write
    bool try_repair = false;      // run RepairDB before moving a damaged directory aside
    int keep_damaged_copies = 1;  // "<path>.corrupt-*" directories kept for forensics
    // Free bytes a writable open needs on the directory's file system, beyond
    // the WAL bytes it replays; with less, Open opens read-only.
    int64_t open_reserve_bytes = 16LL << 20;
    // After a failed write, Put refuses for this long, then the writer resumes.
    int64_t resume_interval_ms = 5000;
    // Write failures are logged at most once per this many seconds.
    int64_t log_interval_seconds = 60;
    // At open, asks the kernel to read up to this many bytes of the store's
    // files into the page cache in the background (posix_fadvise WILLNEED:
    // the tables first, then the newest blob files), so that the first
    // restores after a restart or a reboot read memory, not the disk. 0: off.
    int64_t prefetch_bytes = 0;
    // false: values are read without RocksDB's checksums (ReadOptions::
    // verify_checksums), for a caller that verifies every value it reads and
    // erases one that fails, as TieredCache does (each value is an encoded
    // block whose xxh3 covers every byte; a sealed one has a GCM tag too).
    // Debian's portable librocksdb checks blob records with a table-driven
    // CRC32C (~1.5 GB/s): half the CPU of a restore, for nothing the codec
    // does not catch. The tables (keys, blob references) are then verified
    // whole at open (DB::VerifyChecksum; a failure is damage, see above).
    bool verify_value_checksums = true;
    // Events kept for TakeEvents(); beyond it the oldest are dropped and
    // TakeEvents reports the overflow (the consumer re-announces KeysLruOrder()).
    int64_t max_pending_events = 1 << 16;
    // Not owned; null = rocksdb::Env::Default(). Tests pass an Env over a
    // fault-injecting FileSystem (disk full, failed fsync).
    rocksdb::Env* env = nullptr;
    // Wall clock in microseconds since the Unix epoch (TTL and LRU survive
    // restarts, so a steady clock will not do). Tests inject a fake.
    std::function<int64_t()> now_us;

    Status Validate() const;
  };

  // How Open found the directory.
  enum class OpenOutcome { kOpened, kRepaired, kMovedAside, kReadOnly };
  struct OpenReport {
    OpenOutcome outcome = OpenOutcome::kOpened;
    std::string detail;    // the RocksDB error that triggered repair / move / read-only
    std::string moved_to;  // for kMovedAside
    int64_t entries = 0;   // index entries after open
  };

  static Result<std::unique_ptr<RocksDbTier>> Open(const Options& options);
  // Writes what is queued, syncs the WAL (best effort) and closes the database.
  ~RocksDbTier() override;
  RocksDbTier(const RocksDbTier&) = delete;
  RocksDbTier& operator=(const RocksDbTier&) = delete;

  std::string_view name() const override { return "rocksdb"; }
  // Asynchronous (see the file comment). ResourceExhausted when the queue is
  // full or the value exceeds capacity_bytes; Unavailable after shutdown
  // began, when read-only, or while writing is suspended after a failure.
  Status Put(const BlockHash& hash, std::string value) override;
  Result<std::string> Get(const BlockHash& hash) override;
  // One RocksDB MultiGet for every hash not pending in the queue; results in
  // input order, with the same meaning as Get's.
  std::vector<Result<std::string>> GetBatch(std::span<const BlockHash> hashes) override;
  bool Contains(const BlockHash& hash) override;
  Status Erase(const BlockHash& hash) override;
  int64_t capacity_bytes() const override { return options_.capacity_bytes; }
  int64_t used_bytes() const override;
  TierStats stats() const override;

  // Waits until every Put/Erase accepted before this call is written to the
  // database (visible to a reopened DB after a clean close, not yet synced).
  Status Flush(Deadline deadline) override;
  // Waits until every Put accepted before this call is durable (see the file
  // comment). DeadlineExceeded when the deadline passes first; the error of a
  // failed write when a write in that range failed.
  Status WaitDurable(Deadline deadline) override;

  const OpenReport& open_report() const { return open_report_; }
  // True when opened read-only (full disk): reads only, every Put refused.
  bool read_only() const { return read_only_; }
  // True while writes are suspended after a failure (see the file comment).
  bool writes_suspended() const;
  // Hashes in the index, least recently used first (tests, tools).
  std::vector<BlockHash> KeysLruOrder() const;
  // Values in the spill queue now, and whether a value of `bytes` would fit.
  int64_t queued_blocks() const;
  bool HasQueueRoom(int64_t bytes) const override;
  // Stored/evicted events since the last call, oldest first. `*overflowed`
  // (may be null) is set when events were dropped since the last call.
  std::vector<TierEvent> TakeEvents(bool* overflowed) override;
  // Test hook: while paused the writer takes no work, so the queue fills.
  void SetWriterPausedForTesting(bool paused);

 private:
  explicit RocksDbTier(const Options& options);
  Status OpenDb();
  // Options::prefetch_bytes: WILLNEED on the store's files, within budget.
  static void PrefetchFiles(const std::string& path, int64_t budget);
  Status TryOpen(bool after_repair);
  Status OpenReadOnly(const std::string& why);
  // Why a writable open could not fit on the disk now; empty when it can.
  std::string ShortOfSpace() const;
  // Writer thread only: closes and reopens the database (after a failure
  // that Resume cannot clear). Takes db_mutex_ exclusively.
  Status ReopenForWriting();
  Status RebuildIndex(bool reconcile_values);
  void PruneDamagedCopies(const std::filesystem::path& newest);
  void CloseDb();
  void WriterLoop();
  int64_t Now() const;
  // Turns one value read from the DB into Get's result. Requires mutex_.
  Result<std::string> FinishReadLocked(const BlockHash& hash, const rocksdb::Status& s,
                                       std::string value);
  void EmitLocked(TierEvent::Kind kind, const BlockHash& hash);
  // Logs a write failure at most once per log_interval_seconds. Requires mutex_.
  void LogWriteFailureLocked(const Status& s, int64_t lost);

  struct PendingPut {
    uint64_t seq;
    BlockHash hash;
    std::shared_ptr<const std::string> value;
  };
  struct IndexEntry {
    BlockHash hash;
    int64_t size = 0;
    int64_t write_us = 0;
    int64_t access_us = 0;
  };
  using LruList = std::list<IndexEntry>;

  // Removes an index entry and schedules its deletion. Requires mutex_.
  void DropEntryLocked(LruList::iterator it);

  Options options_;
  OpenReport open_report_;
  // options_.env (or the default) over a FileSystem that makes every file
  // RocksDB creates private (0600; directories 0700). Owns the wrapper.
  std::unique_ptr<rocksdb::Env> private_env_;
  rocksdb::Env* env_ = nullptr;  // private_env_
  // db_ is replaced only by ReopenForWriting (writer thread) under db_mutex_
  // held exclusively; readers on other threads hold it shared.
  mutable std::shared_mutex db_mutex_;
  rocksdb::DB* db_ = nullptr;                       // owned; closed in the destructor
  rocksdb::ColumnFamilyHandle* data_cf_ = nullptr;  // owned by db_'s lifetime
  rocksdb::ColumnFamilyHandle* meta_cf_ = nullptr;
  bool read_only_ = false;  // set during Open, constant afterwards

  mutable std::mutex mutex_;
  std::condition_variable work_cv_;  // writer waits for work
  std::condition_variable done_cv_;  // Flush/WaitDurable wait for progress
  // All below guarded by mutex_.
  std::deque<PendingPut> queue_;
  int64_t queued_bytes_ = 0;
  std::unordered_map<BlockHash, std::shared_ptr<const std::string>, BlockHashHasher> pending_;
  std::unordered_set<BlockHash, BlockHashHasher> deletes_;  // to delete in the next batch
  std::unordered_set<BlockHash, BlockHashHasher> touched_;  // access times to persist
  LruList lru_;                                             // front = most recently used
  std::unordered_map<BlockHash, LruList::iterator, BlockHashHasher> index_;
  int64_t used_ = 0;
  uint64_t next_seq_ = 0;        // last sequence number handed to a Put/Erase
  uint64_t written_seq_ = 0;     // everything <= this is written (or failed)
  uint64_t durable_seq_ = 0;     // everything <= this that was written is synced
  uint64_t sync_request_ = 0;    // a WaitDurable wants durable_seq_ >= this
  uint64_t max_failed_seq_ = 0;  // highest sequence in a failed write
  Status last_write_error_;
  TimePoint suspended_until_{};   // Put refuses until then (after a failed write)
  bool needs_resume_ = false;     // call DB::Resume() before the next write
  TimePoint last_failure_log_{};  // rate limit of the write-failure log line
  int64_t failures_since_log_ = 0;
  std::vector<TierEvent> events_;
  bool events_overflowed_ = false;
  bool stop_ = false;
  bool paused_ = false;   // test hook
  bool damaged_ = false;  // corruption was met (read or write): discard at next open
  TierStats stats_;

  std::thread writer_;  // joined in the destructor
};

}  // namespace kvrelay::kv_store
