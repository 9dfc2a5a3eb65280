#include "kv_store/rocksdb_tier.h"

#include <fcntl.h>
#include <pthread.h>
#include <rocksdb/cache.h>
#include <rocksdb/convenience.h>
#include <rocksdb/db.h>
#include <rocksdb/env.h>
#include <rocksdb/file_system.h>
#include <rocksdb/options.h>
#include <rocksdb/table.h>
#include <rocksdb/write_batch.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <tuple>
#include <vector>

#include "common/logging.h"

namespace kvrelay::kv_store {
namespace {

constexpr char kMetaFamily[] = "meta";
constexpr char kDamagedMarker[] = "KVRELAY_DAMAGED";
constexpr size_t kMetaBytes = 24;

rocksdb::Slice KeyOf(const BlockHash& h) {
  return rocksdb::Slice(reinterpret_cast<const char*>(h.data()), h.size());
}

std::string EncodeMeta(int64_t size, int64_t write_us, int64_t access_us) {
  std::string out(kMetaBytes, '\0');
  std::memcpy(out.data(), &size, 8);
  std::memcpy(out.data() + 8, &write_us, 8);
  std::memcpy(out.data() + 16, &access_us, 8);
  return out;
}

Status FromRocks(const rocksdb::Status& s, std::string_view what) {
  if (s.ok()) return Status::Ok();
  std::string msg = std::string(what) + ": " + s.ToString();
  if (s.IsNotFound()) return NotFound(msg);
  if (s.IsCorruption()) return DataLoss(msg);
  if (s.IsIOError()) return Unavailable(msg);
  if (s.IsInvalidArgument()) return InvalidArgument(msg);
  if (s.IsTimedOut()) return DeadlineExceeded(msg);
  return Internal(msg);
}

int64_t WallMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// RocksDB's info log, routed to kvrelay's log at WARN and above: no LOG /
// LOG.old.* files pile up in the store directory, and an open on a full disk
// does not need to create one.
class RocksLogger final : public rocksdb::Logger {
 public:
  RocksLogger() : rocksdb::Logger(rocksdb::InfoLogLevel::WARN_LEVEL) {}
  using rocksdb::Logger::Logv;
  void Logv(const char* format, va_list ap) override {
    char buf[1024];
    std::vsnprintf(buf, sizeof(buf), format, ap);
    LOG_WARNING << "rocksdb: " << buf;
  }
};

bool MentionsLock(const std::string& msg) {
  std::string lower(msg);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return lower.find("lock") != std::string::npos;
}

// Modes of everything the store creates, whatever the process umask: the
// blocks are tenants' prompts (sealed, see block_seal.h, but private anyway).
constexpr mode_t kPrivateDirMode = 0700;
constexpr mode_t kPrivateFileMode = 0600;

// A FileSystem that makes every file and directory RocksDB creates private
// (files 0600, directories 0700) right after creating it. The store
// directory is 0700 already, so no other user can open a file in the moment
// between its creation (umask mode) and the chmod.
class PrivateFileSystem final : public rocksdb::FileSystemWrapper {
 public:
  explicit PrivateFileSystem(const std::shared_ptr<rocksdb::FileSystem>& target)
      : rocksdb::FileSystemWrapper(target) {}
  static const char* kClassName() { return "KvrelayPrivateFileSystem"; }
  const char* Name() const override { return kClassName(); }

  rocksdb::IOStatus NewWritableFile(const std::string& f, const rocksdb::FileOptions& o,
                                    std::unique_ptr<rocksdb::FSWritableFile>* r,
                                    rocksdb::IODebugContext* dbg) override {
    return Private(target()->NewWritableFile(f, o, r, dbg), f, kPrivateFileMode);
  }
  rocksdb::IOStatus ReopenWritableFile(const std::string& f, const rocksdb::FileOptions& o,
                                       std::unique_ptr<rocksdb::FSWritableFile>* r,
                                       rocksdb::IODebugContext* dbg) override {
    return Private(target()->ReopenWritableFile(f, o, r, dbg), f, kPrivateFileMode);
  }
  rocksdb::IOStatus ReuseWritableFile(const std::string& f, const std::string& old_f,
                                      const rocksdb::FileOptions& o,
                                      std::unique_ptr<rocksdb::FSWritableFile>* r,
                                      rocksdb::IODebugContext* dbg) override {
    return Private(target()->ReuseWritableFile(f, old_f, o, r, dbg), f, kPrivateFileMode);
  }
  rocksdb::IOStatus NewRandomRWFile(const std::string& f, const rocksdb::FileOptions& o,
                                    std::unique_ptr<rocksdb::FSRandomRWFile>* r,
                                    rocksdb::IODebugContext* dbg) override {
    return Private(target()->NewRandomRWFile(f, o, r, dbg), f, kPrivateFileMode);
  }
  rocksdb::IOStatus NewLogger(const std::string& f, const rocksdb::IOOptions& o,
                              std::shared_ptr<rocksdb::Logger>* r,
                              rocksdb::IODebugContext* dbg) override {
    return Private(target()->NewLogger(f, o, r, dbg), f, kPrivateFileMode);
  }
  rocksdb::IOStatus LockFile(const std::string& f, const rocksdb::IOOptions& o,
                             rocksdb::FileLock** l, rocksdb::IODebugContext* dbg) override {
    return Private(target()->LockFile(f, o, l, dbg), f, kPrivateFileMode);
  }
  rocksdb::IOStatus CreateDir(const std::string& d, const rocksdb::IOOptions& o,
                              rocksdb::IODebugContext* dbg) override {
    return Private(target()->CreateDir(d, o, dbg), d, kPrivateDirMode);
  }
  rocksdb::IOStatus CreateDirIfMissing(const std::string& d, const rocksdb::IOOptions& o,
                                       rocksdb::IODebugContext* dbg) override {
    return Private(target()->CreateDirIfMissing(d, o, dbg), d, kPrivateDirMode);
  }

 private:
  static rocksdb::IOStatus Private(rocksdb::IOStatus s, const std::string& path, mode_t mode) {
    if (s.ok() && ::chmod(path.c_str(), mode) != 0) {
      LOG_WARNING << "kv_store: chmod " << path << ": " << std::strerror(errno);
    }
    return s;
  }
};

// Creates `dir` and its missing parents, each one 0700.
Status CreatePrivateDirectories(const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> missing;
  std::error_code ec;
  for (std::filesystem::path p = dir; !p.empty() && !std::filesystem::exists(p, ec);
       p = p.parent_path()) {
    missing.push_back(p);
    if (p == p.parent_path()) break;
  }
  std::filesystem::create_directories(dir, ec);
  if (ec) return Unavailable("creating " + dir.string() + ": " + ec.message());
  for (const std::filesystem::path& p : missing) ::chmod(p.c_str(), kPrivateDirMode);
  return Status::Ok();
}

// Makes `root` 0700 and what is under it private (directories 0700, files
// 0600), e.g. a store written by an older kvrelay with the umask's modes.
// Symbolic links are neither followed nor changed. An error only when `root`
// itself cannot be made private (another owner): its blocks would be readable.
Status MakeTreePrivate(const std::filesystem::path& root) {
  if (::chmod(root.c_str(), kPrivateDirMode) != 0) {
    return FailedPrecondition("kv_store: cannot make " + root.string() +
                              " private (chmod 0700): " + std::strerror(errno));
  }
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(root, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    struct stat st;
    if (::lstat(it->path().c_str(), &st) != 0) continue;
    const mode_t want = S_ISDIR(st.st_mode)   ? kPrivateDirMode
                        : S_ISREG(st.st_mode) ? kPrivateFileMode
                                              : 0;
    if (want == 0 || (st.st_mode & 07777) == want) continue;
    if (::chmod(it->path().c_str(), want) != 0) {
      LOG_WARNING << "kv_store: chmod " << it->path().string() << ": " << std::strerror(errno);
    }
  }
  return Status::Ok();
}

rocksdb::CompressionType SstCompression() {
  for (rocksdb::CompressionType t : rocksdb::GetSupportedCompressions()) {
    if (t == rocksdb::kLZ4Compression) return t;
  }
  return rocksdb::kNoCompression;
}

}  // namespace

Status RocksDbTier::Options::Validate() const {
  if (path.empty()) return InvalidArgument("RocksDbTier: path is empty");
  if (capacity_bytes <= 0) return InvalidArgument("RocksDbTier: capacity_bytes must be > 0");
  if (ttl_seconds < 0) return InvalidArgument("RocksDbTier: ttl_seconds must be >= 0");
  if (block_cache_bytes < 0) return InvalidArgument("RocksDbTier: block_cache_bytes must be >= 0");
  if (min_blob_size < 0) return InvalidArgument("RocksDbTier: min_blob_size must be >= 0");
  if (blob_file_size <= 0) return InvalidArgument("RocksDbTier: blob_file_size must be > 0");
  if (write_buffer_bytes <= 0)
    return InvalidArgument("RocksDbTier: write_buffer_bytes must be > 0");
  if (max_queue_blocks <= 0) return InvalidArgument("RocksDbTier: max_queue_blocks must be > 0");
  if (max_queue_bytes <= 0) return InvalidArgument("RocksDbTier: max_queue_bytes must be > 0");
  if (max_batch_blocks <= 0) return InvalidArgument("RocksDbTier: max_batch_blocks must be > 0");
  if (keep_damaged_copies < 0) {
    return InvalidArgument("RocksDbTier: keep_damaged_copies must be >= 0");
  }
  if (open_reserve_bytes < 0) {
    return InvalidArgument("RocksDbTier: open_reserve_bytes must be >= 0");
  }
  if (resume_interval_ms < 0) {
    return InvalidArgument("RocksDbTier: resume_interval_ms must be >= 0");
  }
  if (log_interval_seconds < 0) {
    return InvalidArgument("RocksDbTier: log_interval_seconds must be >= 0");
  }
  if (max_pending_events <= 0) {
    return InvalidArgument("RocksDbTier: max_pending_events must be > 0");
  }
  return Status::Ok();
}

RocksDbTier::RocksDbTier(const Options& options) : options_(options) {
  if (!options_.now_us) options_.now_us = WallMicros;
  rocksdb::Env* base = options_.env != nullptr ? options_.env : rocksdb::Env::Default();
  private_env_ =
      rocksdb::NewCompositeEnv(std::make_shared<PrivateFileSystem>(base->GetFileSystem()));
  env_ = private_env_.get();
}

int64_t RocksDbTier::Now() const { return options_.now_us(); }

Result<std::unique_ptr<RocksDbTier>> RocksDbTier::Open(const Options& options) {
  RETURN_IF_ERROR(options.Validate());
  std::unique_ptr<RocksDbTier> tier(new RocksDbTier(options));
  RETURN_IF_ERROR(tier->OpenDb());
  {
    std::lock_guard<std::mutex> lock(tier->mutex_);
    tier->open_report_.entries = static_cast<int64_t>(tier->index_.size());
  }
  tier->writer_ = std::thread([t = tier.get()] { t->WriterLoop(); });
  pthread_setname_np(tier->writer_.native_handle(), "kvstore-writer");
  if (options.prefetch_bytes > 0) PrefetchFiles(options.path, options.prefetch_bytes);
  return tier;
}

void RocksDbTier::PrefetchFiles(const std::string& path, int64_t budget) {
  // Tables (keys and the blob index) first, then blob files newest first:
  // a blob file holds the values in the order they were written, and the
  // newest are the likeliest to be asked for again.
  struct File {
    std::filesystem::path path;
    int64_t bytes;
    std::filesystem::file_time_type written;
    bool blob;
  };
  std::vector<File> files;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(path, ec)) {
    const std::string ext = e.path().extension().string();
    if (ext != ".sst" && ext != ".blob") continue;
    std::error_code fe;
    const auto bytes = e.file_size(fe);
    const auto written = e.last_write_time(fe);
    if (fe) continue;  // gone meanwhile (compaction)
    files.push_back({e.path(), static_cast<int64_t>(bytes), written, ext == ".blob"});
  }
  std::sort(files.begin(), files.end(), [](const File& a, const File& b) {
    if (a.blob != b.blob) return !a.blob;
    return a.written > b.written;
  });
  int64_t asked = 0;
  int n = 0;
  for (const File& f : files) {
    if (asked >= budget) break;
    const int fd = ::open(f.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    const int64_t len = std::min(f.bytes, budget - asked);
    // The kernel reads ahead at most a few MiB per call (8 MiB measured
    // here), so the file is asked for in 4 MiB pieces.
    constexpr int64_t kPiece = 4 << 20;
    int64_t done = 0;
    while (done < len && ::posix_fadvise(fd, static_cast<off_t>(done),
                                         static_cast<off_t>(std::min(kPiece, len - done)),
                                         POSIX_FADV_WILLNEED) == 0) {
      done += std::min(kPiece, len - done);
    }
    if (done > 0) ++n;
    asked += done;
    ::close(fd);
  }
  if (asked > 0) {
    LOG_INFO << "kv_store: reading " << (asked >> 20) << " MiB of " << n
             << " store files into the page cache in the background";
  }
}

namespace {

struct DbConfig {
  rocksdb::DBOptions db;
  std::vector<rocksdb::ColumnFamilyDescriptor> families;
};

DbConfig MakeConfig(const RocksDbTier::Options& o, rocksdb::Env* env) {
  DbConfig c;
  rocksdb::DBOptions& db_options = c.db;
  db_options.create_if_missing = true;
  db_options.create_missing_column_families = true;
  db_options.paranoid_checks = true;
  db_options.max_total_wal_size = 4 * static_cast<uint64_t>(o.write_buffer_bytes);
  db_options.max_background_jobs = 2;
  db_options.env = env;
  db_options.info_log = std::make_shared<RocksLogger>();
  // No fallocate: a preallocated MANIFEST (4 MiB by default) or WAL reserves
  // space that is never written, and on a nearly full disk that reservation
  // alone fails the open.
  db_options.allow_fallocate = false;
  db_options.manifest_preallocation_size = 0;

  auto cache = rocksdb::NewLRUCache(static_cast<size_t>(o.block_cache_bytes));
  rocksdb::BlockBasedTableOptions table;
  table.block_cache = cache;
  table.cache_index_and_filter_blocks = true;

  rocksdb::ColumnFamilyOptions data;
  data.table_factory.reset(rocksdb::NewBlockBasedTableFactory(table));
  data.compression = SstCompression();
  data.write_buffer_size = static_cast<size_t>(o.write_buffer_bytes);
  data.enable_blob_files = true;
  data.min_blob_size = static_cast<uint64_t>(o.min_blob_size);
  data.blob_file_size = static_cast<uint64_t>(o.blob_file_size);
  data.blob_compression_type = rocksdb::kNoCompression;
  data.enable_blob_garbage_collection = true;
  data.blob_garbage_collection_age_cutoff = 0.5;

  rocksdb::ColumnFamilyOptions meta;
  meta.table_factory.reset(rocksdb::NewBlockBasedTableFactory(table));
  meta.compression = SstCompression();
  meta.write_buffer_size = 4 << 20;

  c.families = {{rocksdb::kDefaultColumnFamilyName, data}, {kMetaFamily, meta}};
  return c;
}

}  // namespace

Status RocksDbTier::TryOpen(bool after_repair) {
  DbConfig config = MakeConfig(options_, env_);
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* db = nullptr;
  if (after_repair) {
    rocksdb::Status rs = rocksdb::RepairDB(options_.path, config.db, config.families);
    if (!rs.ok()) return FromRocks(rs, "RepairDB " + options_.path);
  }
  rocksdb::Status s = rocksdb::DB::Open(config.db, options_.path, config.families, &handles, &db);
  if (!s.ok()) return FromRocks(s, "opening " + options_.path);
  db_ = db;
  data_cf_ = handles[0];
  meta_cf_ = handles[1];
  if (!options_.verify_value_checksums) {
    // Reads will not check the tables' blocks: check them all now.
    rocksdb::Status verified = db_->VerifyChecksum();
    if (!verified.ok()) {
      CloseDb();
      return FromRocks(verified, "verifying the tables of " + options_.path);
    }
  }
  Status rebuilt = RebuildIndex(after_repair);
  if (!rebuilt.ok()) {
    CloseDb();
    return rebuilt;
  }
  return Status::Ok();
}

Status RocksDbTier::OpenReadOnly(const std::string& why) {
  read_only_ = true;
  open_report_.outcome = OpenOutcome::kReadOnly;
  open_report_.detail = why;
  std::error_code ec;
  if (!std::filesystem::exists(std::filesystem::path(options_.path) / "CURRENT", ec)) {
    // Nothing to read: an empty store that refuses writes (never a failed start).
    LOG_ERROR << "kv_store: " << why << "; " << options_.path
              << " holds no database, the disk tier is off until a restart with free space";
    return Status::Ok();
  }
  DbConfig config = MakeConfig(options_, env_);
  config.db.create_if_missing = false;
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* db = nullptr;
  rocksdb::Status s =
      rocksdb::DB::OpenForReadOnly(config.db, options_.path, config.families, &handles, &db,
                                   /*error_if_wal_file_exists=*/false);
  if (!s.ok()) {
    LOG_ERROR << "kv_store: " << why << "; read-only open of " << options_.path << " failed too ("
              << s.ToString() << "), the disk tier is off until a restart";
    return Status::Ok();
  }
  db_ = db;
  data_cf_ = handles[0];
  meta_cf_ = handles[1];
  Status rebuilt = Status::Ok();
  if (!options_.verify_value_checksums) {  // as in TryOpen
    rebuilt = FromRocks(db_->VerifyChecksum(), "verifying the tables");
  }
  if (rebuilt.ok()) rebuilt = RebuildIndex(/*reconcile_values=*/false);
  if (!rebuilt.ok()) {
    LOG_ERROR << "kv_store: read-only " << options_.path << ": " << rebuilt.ToString()
              << "; the disk tier is off until a restart";
    CloseDb();
    std::lock_guard<std::mutex> lock(mutex_);
    lru_.clear();
    index_.clear();
    deletes_.clear();
    used_ = 0;
    return Status::Ok();
  }
  LOG_ERROR << "kv_store: " << why << "; opened " << options_.path
            << " read-only: stored prefixes are served, nothing new is written";
  return Status::Ok();
}

namespace {

// Bytes of WAL files a writable open replays (and may flush to new SSTs).
int64_t WalBytes(const std::string& dir) {
  int64_t total = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (e.path().extension() == ".log") {
      const auto size = e.file_size(ec);
      if (!ec) total += static_cast<int64_t>(size);
    }
  }
  return total;
}

}  // namespace

std::string RocksDbTier::ShortOfSpace() const {
  uint64_t free_bytes = 0;
  rocksdb::IOStatus fs = env_->GetFileSystem()->GetFreeSpace(options_.path, rocksdb::IOOptions(),
                                                             &free_bytes, nullptr);
  if (!fs.ok()) return "";  // unknown: try the writable open
  const int64_t need = options_.open_reserve_bytes + WalBytes(options_.path);
  if (static_cast<int64_t>(free_bytes) >= need) return "";
  return "only " + std::to_string(free_bytes) + " bytes free on the disk of " + options_.path +
         ", a writable open needs " + std::to_string(need);
}

Status RocksDbTier::ReopenForWriting() {
  if (std::string why = ShortOfSpace(); !why.empty()) return Unavailable(why);
  std::unique_lock<std::shared_mutex> db_lock(db_mutex_);
  CloseDb();
  DbConfig config = MakeConfig(options_, env_);
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* db = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(config.db, options_.path, config.families, &handles, &db);
  if (!s.ok()) return FromRocks(s, "reopening " + options_.path);
  db_ = db;
  data_cf_ = handles[0];
  meta_cf_ = handles[1];
  return Status::Ok();
}

Status RocksDbTier::OpenDb() {
  std::error_code ec;
  RETURN_IF_ERROR(CreatePrivateDirectories(options_.path));
  RETURN_IF_ERROR(MakeTreePrivate(options_.path));

  auto short_of_space = [this] { return ShortOfSpace(); };

  const bool marked =
      std::filesystem::exists(std::filesystem::path(options_.path) / kDamagedMarker, ec);
  Status s;
  if (marked) {
    s = DataLoss("marked damaged by an earlier process");
  } else if (std::string why = short_of_space(); !why.empty()) {
    return OpenReadOnly(why);
  } else {
    s = TryOpen(/*after_repair=*/false);
  }
  if (s.ok()) {
    open_report_.outcome = OpenOutcome::kOpened;
  } else {
    // An I/O error is not damage: a full disk, a failed fsync, a device
    // error. Keep the data and serve it read-only. A lock held by another
    // process is a configuration error (two workers on one directory).
    if (s.code() == StatusCode::kUnavailable) {
      if (MentionsLock(s.message())) return s;
      return OpenReadOnly(s.ToString());
    }
    // Anything else is treated as damage: repair, then start over.
    open_report_.detail = s.ToString();
    Status repaired = s;
    if (options_.try_repair) {
      LOG_WARNING << "kv_store: " << s.ToString() << "; running RepairDB";
      repaired = TryOpen(/*after_repair=*/true);
    }
    if (repaired.ok()) {
      open_report_.outcome = OpenOutcome::kRepaired;
    } else {
      const int64_t secs = WallMicros() / 1000000;
      std::string aside = options_.path + ".corrupt-" + std::to_string(secs);
      for (int i = 1; std::filesystem::exists(aside, ec); ++i) {
        aside = options_.path + ".corrupt-" + std::to_string(secs) + "-" + std::to_string(i);
      }
      LOG_ERROR << "kv_store: damaged database (" << repaired.ToString() << "); moving "
                << options_.path << " to " << aside << " and starting empty";
      std::filesystem::rename(options_.path, aside, ec);
      if (ec) return Unavailable("moving damaged " + options_.path + " aside: " + ec.message());
      RETURN_IF_ERROR(CreatePrivateDirectories(options_.path));
      PruneDamagedCopies(aside);
      if (std::string why = short_of_space(); !why.empty() && std::filesystem::exists(aside)) {
        // A forensic copy is not worth a store that cannot open.
        LOG_WARNING << "kv_store: " << why << "; deleting the damaged copy " << aside;
        std::filesystem::remove_all(aside, ec);
      }
      if (std::string why = short_of_space(); !why.empty()) return OpenReadOnly(why);
      s = TryOpen(/*after_repair=*/false);
      if (!s.ok()) {
        if (s.code() == StatusCode::kUnavailable && !MentionsLock(s.message())) {
          return OpenReadOnly(s.ToString());
        }
        return s;
      }
      open_report_.outcome = OpenOutcome::kMovedAside;
      open_report_.moved_to = aside;
    }
  }
  return Status::Ok();
}

void RocksDbTier::PruneDamagedCopies(const std::filesystem::path& newest) {
  // Copies are named "<path>.corrupt-<unix seconds>[-<n>]"; order by (seconds, n).
  // `newest` is the copy just moved aside: it is kept whatever its name sorts
  // as (a freed name of the same second can sort before an older "-n" copy).
  const std::filesystem::path base(options_.path);
  const std::string prefix = base.filename().string() + ".corrupt-";
  std::vector<std::tuple<long long, long long, std::filesystem::path>> copies;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(base.parent_path(), ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    if (e.path().filename() == newest.filename()) continue;
    const char* p = name.c_str() + prefix.size();
    char* end = nullptr;
    const long long secs = std::strtoll(p, &end, 10);
    const long long n = (end != nullptr && *end == '-') ? std::strtoll(end + 1, nullptr, 10) : 0;
    copies.emplace_back(secs, n, e.path());
  }
  std::sort(copies.begin(), copies.end());  // oldest first
  if (options_.keep_damaged_copies <= 0) copies.emplace_back(0, 0, newest);
  // `newest` counts as one of the copies kept.
  const size_t keep = static_cast<size_t>(std::max(0, options_.keep_damaged_copies - 1));
  for (size_t i = 0; i + keep < copies.size(); ++i) {
    LOG_WARNING << "kv_store: deleting old damaged copy " << std::get<2>(copies[i]);
    std::filesystem::remove_all(std::get<2>(copies[i]), ec);
  }
}

Status RocksDbTier::RebuildIndex(bool reconcile_values) {
  std::vector<IndexEntry> entries;
  rocksdb::ReadOptions ro;
  ro.verify_checksums = true;
  ro.fill_cache = false;
  std::unordered_set<BlockHash, BlockHashHasher> seen;
  {
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(ro, meta_cf_));
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      if (it->key().size() != 32 || it->value().size() != kMetaBytes) continue;  // foreign: ignore
      IndexEntry e;
      std::memcpy(e.hash.data(), it->key().data(), 32);
      std::memcpy(&e.size, it->value().data(), 8);
      std::memcpy(&e.write_us, it->value().data() + 8, 8);
      std::memcpy(&e.access_us, it->value().data() + 16, 8);
      if (e.size < 0) continue;
      seen.insert(e.hash);
      entries.push_back(e);
    }
    if (!it->status().ok()) return FromRocks(it->status(), "scanning the meta family");
  }
  if (reconcile_values) {
    // After a repair the families may disagree: index values without meta
    // (reading them is the price of a rare event) and forget meta without values.
    std::unordered_set<BlockHash, BlockHashHasher> have_value;
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(ro, data_cf_));
    const int64_t now = Now();
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      if (it->key().size() != 32) continue;
      BlockHash h;
      std::memcpy(h.data(), it->key().data(), 32);
      have_value.insert(h);
      if (!seen.count(h)) {
        entries.push_back(IndexEntry{h, static_cast<int64_t>(it->value().size()), now, now});
        seen.insert(h);
      }
    }
    if (!it->status().ok()) return FromRocks(it->status(), "scanning the value family");
    std::erase_if(entries, [&](const IndexEntry& e) { return !have_value.count(e.hash); });
  }
  std::sort(entries.begin(), entries.end(),
            [](const IndexEntry& a, const IndexEntry& b) { return a.access_us > b.access_us; });
  std::lock_guard<std::mutex> lock(mutex_);
  lru_.clear();
  index_.clear();
  used_ = 0;
  for (const IndexEntry& e : entries) {
    lru_.push_back(e);
    index_[e.hash] = std::prev(lru_.end());
    used_ += e.size;
  }
  // Honour a capacity or TTL that shrank since the last run.
  const int64_t now = Now();
  const int64_t ttl_us = options_.ttl_seconds * 1000000;
  for (auto it = lru_.begin(); it != lru_.end();) {
    auto next = std::next(it);
    if (ttl_us > 0 && now - it->write_us > ttl_us) {
      ++stats_.expired;
      DropEntryLocked(it);
    }
    it = next;
  }
  while (used_ > options_.capacity_bytes && !lru_.empty()) {
    ++stats_.evictions;
    stats_.evicted_bytes += lru_.back().size;
    DropEntryLocked(std::prev(lru_.end()));
  }
  return Status::Ok();
}

void RocksDbTier::DropEntryLocked(LruList::iterator it) {
  const BlockHash h = it->hash;
  used_ -= it->size;
  index_.erase(h);
  lru_.erase(it);
  pending_.erase(h);
  touched_.erase(h);
  if (!read_only_) deletes_.insert(h);
  EmitLocked(TierEvent::Kind::kEvicted, h);
}

void RocksDbTier::EmitLocked(TierEvent::Kind kind, const BlockHash& hash) {
  if (static_cast<int64_t>(events_.size()) >= options_.max_pending_events) {
    events_.erase(events_.begin(),
                  events_.begin() + static_cast<std::ptrdiff_t>(events_.size() / 2));
    events_overflowed_ = true;
  }
  TierEvent e;
  e.kind = kind;
  e.tier = BlockTier::kDisk;
  e.hash = hash;
  e.held_anywhere = kind == TierEvent::Kind::kStored;
  events_.push_back(e);
}

std::vector<TierEvent> RocksDbTier::TakeEvents(bool* overflowed) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<TierEvent> out;
  out.swap(events_);
  if (overflowed != nullptr) *overflowed = events_overflowed_;
  events_overflowed_ = false;
  return out;
}

void RocksDbTier::LogWriteFailureLocked(const Status& s, int64_t lost) {
  failures_since_log_ += lost;
  const TimePoint now = Clock::now();
  if (last_failure_log_ != TimePoint{} &&
      now - last_failure_log_ < std::chrono::seconds(options_.log_interval_seconds)) {
    return;
  }
  LOG_WARNING << "kv_store: " << options_.path << ": write failed (" << s.ToString() << "); "
              << failures_since_log_ << " block(s) not stored since the last report, "
              << stats_.write_failures << " in all; stored blocks are still served, writes "
              << "resume in " << options_.resume_interval_ms << " ms";
  last_failure_log_ = now;
  failures_since_log_ = 0;
}

bool RocksDbTier::writes_suspended() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return read_only_ || needs_resume_;
}

bool RocksDbTier::HasQueueRoom(int64_t bytes) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(queue_.size()) < options_.max_queue_blocks &&
         queued_bytes_ + bytes <= options_.max_queue_bytes;
}

void RocksDbTier::CloseDb() {
  if (db_ == nullptr) return;
  if (data_cf_) db_->DestroyColumnFamilyHandle(data_cf_);
  if (meta_cf_) db_->DestroyColumnFamilyHandle(meta_cf_);
  data_cf_ = meta_cf_ = nullptr;
  rocksdb::Status s = db_->Close();
  if (!s.ok()) {
    LOG_WARNING << "kv_store: closing " << options_.path << ": " << s.ToString();
  }
  delete db_;
  db_ = nullptr;
}

RocksDbTier::~RocksDbTier() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    sync_request_ = next_seq_;  // best effort: leave nothing acknowledged-but-unsynced
  }
  work_cv_.notify_all();
  if (writer_.joinable()) writer_.join();
  bool damaged;
  bool failing;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    damaged = damaged_;
    failing = needs_resume_;
  }
  // A read-only database has nothing to flush; after a failed write (disk
  // full) a flush would fail too, and the WAL replays at the next open.
  if (db_ != nullptr && !damaged && !read_only_ && !failing) {
    // Flush memtables so the next Open need not replay the WAL (faster restart).
    rocksdb::FlushOptions fo;
    rocksdb::Status s = db_->Flush(fo, {data_cf_, meta_cf_});
    if (!s.ok()) {
      LOG_WARNING << "kv_store: flushing " << options_.path << " at close: " << s.ToString();
    }
  }
  CloseDb();
  if (damaged && !read_only_) {
    // The next Open moves the directory aside and starts empty.
    const std::filesystem::path marker_path = std::filesystem::path(options_.path) / kDamagedMarker;
    {
      std::ofstream marker(marker_path);
      marker << "damage seen by this process; the next open discards this database\n";
    }
    ::chmod(marker_path.c_str(), kPrivateFileMode);
    LOG_WARNING << "kv_store: " << options_.path << " marked damaged";
  }
}

Status RocksDbTier::Put(const BlockHash& hash, std::string value) {
  const int64_t size = static_cast<int64_t>(value.size());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stop_) return Unavailable("RocksDbTier: shutting down");
    if (read_only_) {
      ++stats_.write_failures;
      return Unavailable("RocksDbTier: opened read-only (" + open_report_.detail + ")");
    }
    if (needs_resume_ && Clock::now() < suspended_until_) {
      ++stats_.write_failures;
      return Unavailable("RocksDbTier: writes suspended after a failed write: " +
                         last_write_error_.ToString());
    }
    if (size > options_.capacity_bytes) {
      ++stats_.puts_dropped;
      return ResourceExhausted("RocksDbTier: value of " + std::to_string(size) +
                               " bytes exceeds capacity " +
                               std::to_string(options_.capacity_bytes));
    }
    if (static_cast<int64_t>(queue_.size()) >= options_.max_queue_blocks ||
        queued_bytes_ + size > options_.max_queue_bytes) {
      ++stats_.puts_dropped;
      return ResourceExhausted("RocksDbTier: spill queue full, block dropped");
    }
    auto shared = std::make_shared<const std::string>(std::move(value));
    const int64_t now = Now();
    auto it = index_.find(hash);
    if (it != index_.end()) {
      used_ -= it->second->size;
      lru_.erase(it->second);
      index_.erase(it);
    }
    deletes_.erase(hash);
    lru_.push_front(IndexEntry{hash, size, now, now});
    index_[hash] = lru_.begin();
    used_ += size;
    while (used_ > options_.capacity_bytes && lru_.size() > 1) {
      ++stats_.evictions;
      stats_.evicted_bytes += lru_.back().size;
      DropEntryLocked(std::prev(lru_.end()));
    }
    pending_[hash] = shared;
    touched_.erase(hash);
    queue_.push_back(PendingPut{++next_seq_, hash, std::move(shared)});
    queued_bytes_ += size;
    ++stats_.puts;
    stats_.put_bytes += size;
  }
  work_cv_.notify_one();
  return Status::Ok();
}

Result<std::string> RocksDbTier::Get(const BlockHash& hash) {
  std::vector<Result<std::string>> out = GetBatch(std::span<const BlockHash>(&hash, 1));
  return std::move(out[0]);
}

Result<std::string> RocksDbTier::FinishReadLocked(const BlockHash& hash, const rocksdb::Status& s,
                                                  std::string value) {
  if (s.ok()) {
    ++stats_.hits;
    return value;
  }
  auto it = index_.find(hash);
  if (s.IsNotFound()) {
    // Evicted or erased meanwhile, or meta without value after damage.
    ++stats_.misses;
    if (it != index_.end() && !pending_.count(hash)) DropEntryLocked(it->second);
    return NotFound("block not in rocksdb tier");
  }
  ++stats_.errors;
  if (s.IsCorruption()) {
    if (!read_only_) damaged_ = true;
    if (it != index_.end() && !pending_.count(hash)) {
      DropEntryLocked(it->second);  // never read it again
    }
  }
  return FromRocks(s, "reading a block");
}

namespace {

// A value read into a PinnableSlice, as a string: moved out when the slice
// holds it in its own buffer, copied when it pins RocksDB's memory.
std::string TakeValue(rocksdb::PinnableSlice& v) {
  std::string* self = v.GetSelf();
  if (!v.IsPinned() && v.data() == self->data() && v.size() == self->size()) {
    return std::move(*self);
  }
  return v.ToString();
}

}  // namespace

std::vector<Result<std::string>> RocksDbTier::GetBatch(std::span<const BlockHash> hashes) {
  std::vector<Result<std::string>> out;
  out.reserve(hashes.size());
  // Indices of `hashes` to read from the database.
  std::vector<size_t> reads;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.get_batches;
    const int64_t now = Now();
    const int64_t ttl_us = options_.ttl_seconds * 1000000;
    bool dropped = false;
    for (size_t i = 0; i < hashes.size(); ++i) {
      const BlockHash& hash = hashes[i];
      auto it = index_.find(hash);
      if (it == index_.end()) {  // (a tier without a database has an empty index)
        ++stats_.misses;
        out.emplace_back(NotFound("block not in rocksdb tier"));
        continue;
      }
      if (ttl_us > 0 && now - it->second->write_us > ttl_us) {
        ++stats_.expired;
        ++stats_.misses;
        DropEntryLocked(it->second);
        dropped = true;
        out.emplace_back(NotFound("block expired in rocksdb tier"));
        continue;
      }
      it->second->access_us = now;
      lru_.splice(lru_.begin(), lru_, it->second);
      auto p = pending_.find(hash);
      if (p != pending_.end()) {
        ++stats_.hits;
        out.emplace_back(std::string(*p->second));
        continue;
      }
      if (!read_only_) touched_.insert(hash);
      out.emplace_back(NotFound(""));  // placeholder, filled below
      reads.push_back(i);
    }
    if (dropped) work_cv_.notify_one();
  }
  if (reads.empty()) return out;
  std::vector<rocksdb::Slice> keys;
  keys.reserve(reads.size());
  for (size_t i : reads) keys.push_back(KeyOf(hashes[i]));
  std::vector<rocksdb::PinnableSlice> values(reads.size());
  std::vector<rocksdb::Status> statuses(reads.size());
  rocksdb::ReadOptions ro;
  ro.verify_checksums = options_.verify_value_checksums;
  {
    std::shared_lock<std::shared_mutex> db_lock(db_mutex_);
    if (db_ != nullptr) {
      db_->MultiGet(ro, data_cf_, keys.size(), keys.data(), values.data(), statuses.data(),
                    /*sorted_input=*/false);
    } else {
      for (auto& st : statuses) st = rocksdb::Status::NotFound("database closed");
    }
  }
  // The values leave RocksDB's buffers before the tier's lock is taken: a
  // restore reads in parts at once (TieredCache::ReadLoad), and its copies
  // (720 KiB a block for the default model) must not queue on one lock.
  std::vector<std::string> got(reads.size());
  for (size_t k = 0; k < reads.size(); ++k) {
    if (statuses[k].ok()) got[k] = TakeValue(values[k]);
    values[k].Reset();
  }
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t k = 0; k < reads.size(); ++k) {
    out[reads[k]] = FinishReadLocked(hashes[reads[k]], statuses[k], std::move(got[k]));
  }
  return out;
}

bool RocksDbTier::Contains(const BlockHash& hash) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = index_.find(hash);
  if (it == index_.end()) return false;
  const int64_t ttl_us = options_.ttl_seconds * 1000000;
  return !(ttl_us > 0 && Now() - it->second->write_us > ttl_us);
}

Status RocksDbTier::Erase(const BlockHash& hash) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = index_.find(hash);
    if (it != index_.end()) {
      DropEntryLocked(it->second);
    } else {
      deletes_.insert(hash);  // may exist on disk without an index entry
    }
    ++next_seq_;
  }
  work_cv_.notify_one();
  return Status::Ok();
}

int64_t RocksDbTier::used_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return used_;
}

int64_t RocksDbTier::queued_blocks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(queue_.size());
}

TierStats RocksDbTier::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  TierStats s = stats_;
  s.entries = static_cast<int64_t>(index_.size());
  s.used_bytes = used_;
  return s;
}

std::vector<BlockHash> RocksDbTier::KeysLruOrder() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<BlockHash> out;
  out.reserve(lru_.size());
  for (auto it = lru_.rbegin(); it != lru_.rend(); ++it) out.push_back(it->hash);
  return out;
}

void RocksDbTier::SetWriterPausedForTesting(bool paused) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    paused_ = paused;
  }
  work_cv_.notify_all();
}

Status RocksDbTier::Flush(Deadline deadline) {
  std::unique_lock<std::mutex> lock(mutex_);
  const uint64_t target = next_seq_;
  work_cv_.notify_one();
  if (!done_cv_.wait_until(lock, deadline.at, [&] { return written_seq_ >= target; })) {
    return DeadlineExceeded("RocksDbTier::Flush: writer still behind at the deadline");
  }
  if (max_failed_seq_ > 0 && max_failed_seq_ <= target && !last_write_error_.ok()) {
    return last_write_error_;
  }
  return Status::Ok();
}

Status RocksDbTier::WaitDurable(Deadline deadline) {
  std::unique_lock<std::mutex> lock(mutex_);
  const uint64_t target = next_seq_;
  const uint64_t durable_before = durable_seq_;
  if (durable_seq_ >= target) return Status::Ok();
  sync_request_ = std::max(sync_request_, target);
  work_cv_.notify_one();
  if (!done_cv_.wait_until(lock, deadline.at, [&] { return durable_seq_ >= target; })) {
    return DeadlineExceeded("RocksDbTier::WaitDurable: not durable by the deadline");
  }
  // Conservative: any failed write after the last durable point may have held
  // one of our values.
  if (max_failed_seq_ > durable_before) {
    return last_write_error_.ok() ? Internal("RocksDbTier: a write failed") : last_write_error_;
  }
  return Status::Ok();
}

void RocksDbTier::WriterLoop() {
  std::vector<PendingPut> puts;
  std::vector<BlockHash> deletes;
  std::vector<std::pair<BlockHash, std::string>> metas;
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    work_cv_.wait(lock, [&] {
      if (paused_ && !stop_) return false;
      return stop_ || !queue_.empty() || !deletes_.empty() || sync_request_ > durable_seq_ ||
             written_seq_ < next_seq_;
    });
    // A read-only (or absent) database writes nothing: settle every request.
    if (read_only_) {
      for (const PendingPut& p : queue_) pending_.erase(p.hash);
      queue_.clear();
      queued_bytes_ = 0;
      deletes_.clear();
      touched_.clear();
      written_seq_ = durable_seq_ = next_seq_;
      done_cv_.notify_all();
      if (stop_) break;
      continue;
    }
    // After a failed write: wait out the suspension, then ask RocksDB to
    // clear its background error before writing again.
    if (needs_resume_) {
      const TimePoint until = suspended_until_;
      if (!stop_ && Clock::now() < until) {
        // Queued values would fail again: they are lost, not retried.
        const int64_t lost = static_cast<int64_t>(queue_.size());
        for (const PendingPut& p : queue_) {
          auto cur = pending_.find(p.hash);
          if (cur != pending_.end() && cur->second == p.value) {
            pending_.erase(cur);
            auto idx = index_.find(p.hash);
            if (idx != index_.end()) {
              used_ -= idx->second->size;
              lru_.erase(idx->second);
              index_.erase(idx);
            }
          }
        }
        queue_.clear();
        queued_bytes_ = 0;
        deletes_.clear();
        touched_.clear();
        stats_.write_failures += lost;
        max_failed_seq_ = std::max(max_failed_seq_, next_seq_);
        written_seq_ = next_seq_;
        if (sync_request_ > durable_seq_) durable_seq_ = sync_request_;  // failed, settled
        done_cv_.notify_all();
        work_cv_.wait_until(lock, until, [&] { return stop_; });
        continue;
      }
      lock.unlock();
      Status r = db_ != nullptr ? FromRocks(db_->Resume(), "resuming writes")
                                : Unavailable("the database is closed");
      if (!r.ok()) {
        // A failed WAL append or fsync leaves RocksDB's WAL writer unusable
        // ("Seen error"): Resume cannot clear that, a reopen can (it replays
        // the WAL). Only with room on the disk: an open on a full disk is
        // what must never happen.
        Status reopened = ReopenForWriting();
        if (reopened.ok()) r = Status::Ok();
      }
      lock.lock();
      if (!r.ok()) {
        suspended_until_ = Clock::now() + std::chrono::milliseconds(options_.resume_interval_ms);
        LogWriteFailureLocked(r, 0);
        if (stop_) break;
        continue;
      }
      needs_resume_ = false;
      LOG_INFO << "kv_store: " << options_.path << ": writes resumed";
    }
    // Take one round of work.
    puts.clear();
    deletes.clear();
    metas.clear();
    while (!queue_.empty() && static_cast<int>(puts.size()) < options_.max_batch_blocks) {
      PendingPut p = std::move(queue_.front());
      queue_.pop_front();
      queued_bytes_ -= static_cast<int64_t>(p.value->size());
      auto cur = pending_.find(p.hash);
      if (cur == pending_.end() || cur->second != p.value) continue;  // superseded or dropped
      auto idx = index_.find(p.hash);
      if (idx == index_.end()) continue;
      metas.emplace_back(
          p.hash, EncodeMeta(idx->second->size, idx->second->write_us, idx->second->access_us));
      puts.push_back(std::move(p));
    }
    deletes.assign(deletes_.begin(), deletes_.end());
    deletes_.clear();
    for (const BlockHash& h : touched_) {
      auto idx = index_.find(h);
      if (idx == index_.end() || pending_.count(h)) continue;
      metas.emplace_back(
          h, EncodeMeta(idx->second->size, idx->second->write_us, idx->second->access_us));
    }
    touched_.clear();
    const uint64_t round_seq = queue_.empty() ? next_seq_ : queue_.front().seq - 1;
    const bool want_sync =
        options_.sync_every_batch || (sync_request_ > durable_seq_ && sync_request_ <= round_seq);
    const bool stopping = stop_ && queue_.empty();
    const bool has_writes = !puts.empty() || !deletes.empty() || !metas.empty();
    lock.unlock();

    rocksdb::Status s;
    if (has_writes) {
      rocksdb::WriteBatch batch;
      for (const PendingPut& p : puts) {
        batch.Put(data_cf_, KeyOf(p.hash), rocksdb::Slice(*p.value));
      }
      for (const auto& [h, m] : metas) batch.Put(meta_cf_, KeyOf(h), m);
      for (const BlockHash& h : deletes) {
        batch.Delete(data_cf_, KeyOf(h));
        batch.Delete(meta_cf_, KeyOf(h));
      }
      rocksdb::WriteOptions wo;
      wo.sync = want_sync;
      s = db_->Write(wo, &batch);
    } else if (want_sync) {
      s = db_->SyncWAL();
    }

    lock.lock();
    std::vector<bool> current(puts.size());
    for (size_t i = 0; i < puts.size(); ++i) {
      const PendingPut& p = puts[i];
      auto cur = pending_.find(p.hash);
      current[i] = cur != pending_.end() && cur->second == p.value;
      if (current[i]) pending_.erase(cur);
      if (s.ok()) {
        ++stats_.written;
        stats_.written_bytes += static_cast<int64_t>(p.value->size());
        if (current[i] && index_.count(p.hash)) EmitLocked(TierEvent::Kind::kStored, p.hash);
      }
    }
    if (!s.ok()) {
      ++stats_.errors;
      last_write_error_ = FromRocks(s, "writing a batch");
      max_failed_seq_ = std::max<uint64_t>(max_failed_seq_, round_seq);
      if (s.IsCorruption()) {
        // A background error from a compaction that met a damaged file: the
        // DB stays read-only until reopened, and the next open discards it.
        damaged_ = true;
        LOG_WARNING << "kv_store: " << last_write_error_.ToString();
      } else {
        // Disk full, failed fsync, device error: not damage. Writes pause,
        // stored values stay readable, and the writer resumes later.
        needs_resume_ = true;
        suspended_until_ = Clock::now() + std::chrono::milliseconds(options_.resume_interval_ms);
      }
      stats_.write_failures += static_cast<int64_t>(puts.size());
      if (!s.IsCorruption()) {
        LogWriteFailureLocked(last_write_error_, static_cast<int64_t>(puts.size()));
      }
      for (size_t i = 0; i < puts.size(); ++i) {  // not stored: forget them
        if (!current[i]) continue;                // a newer Put of the same hash owns the entry
        const PendingPut& p = puts[i];
        auto idx = index_.find(p.hash);
        if (idx != index_.end()) {
          used_ -= idx->second->size;
          lru_.erase(idx->second);
          index_.erase(idx);
        }
      }
    }
    written_seq_ = std::max(written_seq_, round_seq);
    if (want_sync) durable_seq_ = std::max(durable_seq_, round_seq);
    done_cv_.notify_all();
    if (stopping) break;
  }
}

}  // namespace kvrelay::kv_store
