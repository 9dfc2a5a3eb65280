// A fault-injecting RocksDB FileSystem for kv_store tests: wraps the real
// (POSIX) file system and, when armed, makes appends fail with ENOSPC once a
// byte budget is spent (a disk that fills up) and syncs fail with EIO (a
// failed fsync). GetFreeSpace reports the budget, so RocksDbTier's
// free-space check at Open sees the same "disk" the writes see.
//
// Usage:
//   std::shared_ptr<FaultFs> fs = FaultFs::Create();
//   std::unique_ptr<rocksdb::Env> env = fs->MakeEnv();
//   options.env = env.get();          // env must outlive the tier
//   fs->space_left.store(1 << 20);    // 1 MiB left, then ENOSPC
//   fs->fail_sync.store(true);        // every Sync/Fsync/RangeSync fails
//
// Thread-safety: the knobs are atomics; RocksDB calls in from its own threads.
#pragma once

#include <rocksdb/env.h>
#include <rocksdb/file_system.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

namespace kvrelay::kv_store::testing {

class FaultFs : public rocksdb::FileSystemWrapper {
 public:
  FaultFs() : rocksdb::FileSystemWrapper(rocksdb::FileSystem::Default()) {}

  static const char* kClassName() { return "KvrelayFaultFs"; }
  const char* Name() const override { return kClassName(); }

  // Bytes that may still be appended to any file; < 0 = unlimited.
  std::atomic<int64_t> space_left{-1};
  // When true, every Sync / Fsync / RangeSync fails with an I/O error.
  std::atomic<bool> fail_sync{false};
  // What was injected so far.
  std::atomic<int64_t> nospace_injected{0};
  std::atomic<int64_t> sync_failures_injected{0};

  std::unique_ptr<rocksdb::Env> MakeEnv() {
    return rocksdb::NewCompositeEnv(
        std::static_pointer_cast<rocksdb::FileSystem>(shared_from_this_()));
  }

  rocksdb::IOStatus NewWritableFile(const std::string& fname, const rocksdb::FileOptions& opts,
                                    std::unique_ptr<rocksdb::FSWritableFile>* result,
                                    rocksdb::IODebugContext* dbg) override {
    std::unique_ptr<rocksdb::FSWritableFile> base;
    rocksdb::IOStatus s = target()->NewWritableFile(fname, opts, &base, dbg);
    if (s.ok()) result->reset(new File(std::move(base), this));
    return s;
  }
  rocksdb::IOStatus ReopenWritableFile(const std::string& fname, const rocksdb::FileOptions& opts,
                                       std::unique_ptr<rocksdb::FSWritableFile>* result,
                                       rocksdb::IODebugContext* dbg) override {
    std::unique_ptr<rocksdb::FSWritableFile> base;
    rocksdb::IOStatus s = target()->ReopenWritableFile(fname, opts, &base, dbg);
    if (s.ok()) result->reset(new File(std::move(base), this));
    return s;
  }
  rocksdb::IOStatus GetFreeSpace(const std::string& path, const rocksdb::IOOptions& options,
                                 uint64_t* diskfree, rocksdb::IODebugContext* dbg) override {
    const int64_t left = space_left.load();
    if (left < 0) return target()->GetFreeSpace(path, options, diskfree, dbg);
    *diskfree = static_cast<uint64_t>(left);
    return rocksdb::IOStatus::OK();
  }

  // Takes `n` bytes of the budget; false (and nothing taken) when they do not fit.
  bool Consume(int64_t n) {
    int64_t left = space_left.load();
    while (left >= 0) {
      if (left < n) {
        nospace_injected.fetch_add(1);
        return false;
      }
      if (space_left.compare_exchange_weak(left, left - n)) return true;
    }
    return true;  // unlimited
  }
  rocksdb::IOStatus MaybeFailSync() {
    if (!fail_sync.load()) return rocksdb::IOStatus::OK();
    sync_failures_injected.fetch_add(1);
    return rocksdb::IOStatus::IOError("injected fsync failure");
  }

 private:
  class File : public rocksdb::FSWritableFileOwnerWrapper {
   public:
    File(std::unique_ptr<rocksdb::FSWritableFile> base, FaultFs* fs)
        : rocksdb::FSWritableFileOwnerWrapper(std::move(base)), fs_(fs) {}
    rocksdb::IOStatus Append(const rocksdb::Slice& data, const rocksdb::IOOptions& o,
                             rocksdb::IODebugContext* dbg) override {
      if (!fs_->Consume(static_cast<int64_t>(data.size()))) return NoSpace();
      return target()->Append(data, o, dbg);
    }
    rocksdb::IOStatus Append(const rocksdb::Slice& data, const rocksdb::IOOptions& o,
                             const rocksdb::DataVerificationInfo& v,
                             rocksdb::IODebugContext* dbg) override {
      if (!fs_->Consume(static_cast<int64_t>(data.size()))) return NoSpace();
      return target()->Append(data, o, v, dbg);
    }
    rocksdb::IOStatus PositionedAppend(const rocksdb::Slice& data, uint64_t offset,
                                       const rocksdb::IOOptions& o,
                                       rocksdb::IODebugContext* dbg) override {
      if (!fs_->Consume(static_cast<int64_t>(data.size()))) return NoSpace();
      return target()->PositionedAppend(data, offset, o, dbg);
    }
    rocksdb::IOStatus PositionedAppend(const rocksdb::Slice& data, uint64_t offset,
                                       const rocksdb::IOOptions& o,
                                       const rocksdb::DataVerificationInfo& v,
                                       rocksdb::IODebugContext* dbg) override {
      if (!fs_->Consume(static_cast<int64_t>(data.size()))) return NoSpace();
      return target()->PositionedAppend(data, offset, o, v, dbg);
    }
    rocksdb::IOStatus Sync(const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
      rocksdb::IOStatus s = fs_->MaybeFailSync();
      return s.ok() ? target()->Sync(o, dbg) : s;
    }
    rocksdb::IOStatus Fsync(const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
      rocksdb::IOStatus s = fs_->MaybeFailSync();
      return s.ok() ? target()->Fsync(o, dbg) : s;
    }
    rocksdb::IOStatus RangeSync(uint64_t offset, uint64_t nbytes, const rocksdb::IOOptions& o,
                                rocksdb::IODebugContext* dbg) override {
      rocksdb::IOStatus s = fs_->MaybeFailSync();
      return s.ok() ? target()->RangeSync(offset, nbytes, o, dbg) : s;
    }

   private:
    static rocksdb::IOStatus NoSpace() {
      rocksdb::IOStatus s = rocksdb::IOStatus::NoSpace("injected: no space left on device");
      s.SetRetryable(false);
      return s;
    }
    FaultFs* const fs_;
  };

  // FileSystem derives from std::enable_shared_from_this only in newer
  // RocksDB; keep our own weak self for MakeEnv.
  std::shared_ptr<FaultFs> shared_from_this_() { return self_.lock(); }

 public:
  // Call once after make_shared (MakeEnv needs it).
  static std::shared_ptr<FaultFs> Create() {
    auto fs = std::make_shared<FaultFs>();
    fs->self_ = fs;
    return fs;
  }

 private:
  std::weak_ptr<FaultFs> self_;
};

}  // namespace kvrelay::kv_store::testing
