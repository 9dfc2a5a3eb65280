// Crash test of RocksDbTier: a child process spills blocks continuously and
// acknowledges the durable ones; the parent SIGKILLs it at random moments
// (deterministic seed) and, after every kill, reopens the store and checks:
//   * every block acknowledged durable (since the last deliberate damage) is
//     present and verifies byte for byte;
//   * every key the store holds is one the child wrote, and any value it
//     serves that passes the codec is exactly the block written under that key.
// Every kDamageEvery-th cycle the parent also flips random bytes in the
// database files (sst / blob / WAL) before reopening: the store must still
// open, never crash, and never yield a wrong block (acknowledged blocks may
// then be lost, so the required set restarts after a damage cycle). Damage a
// cycle's reads did not touch can surface later as a read error (DataLoss) of
// an old block: that is a miss, allowed once any damage was done. A value
// that reads fine but fails verification outside a damage cycle, or any read
// error before the first damage, fails the test.
//
// Silent corruption: every kFlipEvery-th cycle the parent also flips one byte
// of a few stored values and writes them back through the tier (so RocksDB's
// own checksums cover the damaged bytes and cannot notice): from then on
// every read of such a key must fail the block codec's verification, i.e. be
// a miss, never KV.
//
// Cycles: KVRELAY_CRASH_CYCLES (default 120, under a minute; the `slow`
// variant runs 1000).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <unordered_map>

#include "tests/integration/kv_store/crash_common.h"

#ifndef KVRELAY_CRASH_CHILD
#error "KVRELAY_CRASH_CHILD must name the child executable"
#endif

namespace kvrelay::kv_store {
namespace {

namespace fs = std::filesystem;

constexpr int kDamageEvery = 5;
constexpr int kFlipEvery = 3;
constexpr uint64_t kIndicesPerCycle = 1'000'000;

struct ChildRun {
  std::vector<uint64_t> acked;
  int signal = 0;
  int exit_code = -1;
};

// Runs the child for `run_ms` then SIGKILLs it; collects its acknowledgements.
ChildRun RunAndKill(const std::string& dir, uint64_t first, int run_ms) {
  ChildRun out;
  int fds[2];
  EXPECT_EQ(::pipe(fds), 0);
  const std::string first_s = std::to_string(first);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::close(fds[0]);
    ::close(fds[1]);
    ::execl(KVRELAY_CRASH_CHILD, KVRELAY_CRASH_CHILD, dir.c_str(), first_s.c_str(),
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(fds[1]);
  std::string buf;
  const auto kill_at = std::chrono::steady_clock::now() + std::chrono::milliseconds(run_ms);
  bool killed = false;
  while (true) {
    const auto now = std::chrono::steady_clock::now();
    if (!killed && now >= kill_at) {
      ::kill(pid, SIGKILL);
      killed = true;
    }
    const int wait_ms =
        killed ? 1000
               : static_cast<int>(
                     std::chrono::duration_cast<std::chrono::milliseconds>(kill_at - now).count()) +
                     1;
    pollfd p{fds[0], POLLIN, 0};
    if (::poll(&p, 1, wait_ms) > 0) {
      char tmp[4096];
      const ssize_t n = ::read(fds[0], tmp, sizeof(tmp));
      if (n <= 0) break;  // EOF: the child is gone
      buf.append(tmp, static_cast<size_t>(n));
    } else if (killed) {
      break;
    }
  }
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (WIFSIGNALED(status)) out.signal = WTERMSIG(status);
  if (WIFEXITED(status)) out.exit_code = WEXITSTATUS(status);
  // Only complete lines count: a line cut by the kill was never acknowledged.
  size_t pos = 0;
  while (true) {
    const size_t nl = buf.find('\n', pos);
    if (nl == std::string::npos) break;
    const std::string line = buf.substr(pos, nl - pos);
    pos = nl + 1;
    if (line.size() > 2 && line[0] == 'A') out.acked.push_back(std::stoull(line.substr(2)));
  }
  return out;
}

// Flips `flips` random bits in random database files of the given kinds.
void Damage(const fs::path& dir, std::mt19937_64& rng, int flips) {
  std::vector<fs::path> files;
  for (auto& e : fs::directory_iterator(dir)) {
    const std::string ext = e.path().extension().string();
    if ((ext == ".sst" || ext == ".blob" || ext == ".log") && fs::file_size(e.path()) > 0) {
      files.push_back(e.path());
    }
  }
  if (files.empty()) return;
  for (int i = 0; i < flips; ++i) {
    const fs::path& f = files[rng() % files.size()];
    std::fstream s(f, std::ios::in | std::ios::out | std::ios::binary);
    const auto size = fs::file_size(f);
    const auto off = static_cast<std::streamoff>(rng() % size);
    char c = 0;
    s.seekg(off);
    s.read(&c, 1);
    c = static_cast<char>(c ^ (1 << (rng() % 8)));
    s.seekp(off);
    s.write(&c, 1);
  }
}

TEST(KvStoreCrashTest, AcknowledgedBlocksSurviveSigkillAndDamageNeverServesWrongKv) {
  int cycles = 120;
  if (const char* env = std::getenv("KVRELAY_CRASH_CYCLES")) cycles = std::atoi(env);
  const fs::path dir = fs::temp_directory_path() / ("kvstore_crash_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  std::mt19937_64 rng(20261129);

  std::unordered_map<BlockHash, uint64_t, BlockHashHasher> known;  // every hash the child may write
  std::set<uint64_t> required;  // acknowledged since the last damage
  std::set<uint64_t> flipped;   // values the parent corrupted (since the last damage)
  int64_t flips = 0, flips_detected = 0;
  int64_t total_acked = 0, served_checked = 0, damage_cycles = 0, repaired_or_moved = 0;
  int64_t latent_errors = 0;
  bool ever_damaged = false;
  for (int cycle = 0; cycle < cycles; ++cycle) {
    const uint64_t first = static_cast<uint64_t>(cycle + 1) * kIndicesPerCycle;
    const int run_ms = 10 + static_cast<int>(rng() % 140);
    ChildRun run = RunAndKill(dir.string(), first, run_ms);
    ASSERT_TRUE(run.signal == SIGKILL)
        << "cycle " << cycle << ": child exited with " << run.exit_code << " before the kill";
    uint64_t last = first;
    for (uint64_t a : run.acked) {
      required.insert(a);
      last = std::max(last, a);
    }
    total_acked += static_cast<int64_t>(run.acked.size());
    // The child writes dense indices and acknowledges at least every 8th, so
    // it wrote nothing past last + 8 (last = first when nothing was acked).
    for (uint64_t i = first; i <= last + 64; ++i) known[crash::Block(i).meta.hash] = i;

    const bool damage = cycle % kDamageEvery == kDamageEvery - 1;
    if (damage) {
      Damage(dir, rng, 1 + static_cast<int>(rng() % 8));
      ++damage_cycles;
      ever_damaged = true;
    }
    auto opened = RocksDbTier::Open(crash::TierOptions(dir.string()));
    ASSERT_TRUE(opened.ok()) << "cycle " << cycle << ": " << opened.status().ToString();
    RocksDbTier& tier = **opened;
    if (tier.open_report().outcome != RocksDbTier::OpenOutcome::kOpened) ++repaired_or_moved;

    // Nothing wrong is ever served.
    for (const BlockHash& h : tier.KeysLruOrder()) {
      auto it = known.find(h);
      ASSERT_NE(it, known.end()) << "cycle " << cycle << ": a key nobody wrote";
      auto v = tier.Get(h);
      if (!v.ok()) {
        ASSERT_TRUE(ever_damaged || v.status().code() == StatusCode::kNotFound)
            << "cycle " << cycle << ": read error without damage: " << v.status().ToString();
        if (!damage && v.status().code() != StatusCode::kNotFound) ++latent_errors;
        continue;
      }
      const auto want = crash::Block(it->second);
      DecodedBlock d = DecodeBlock(*v, want.meta);
      if (flipped.count(it->second)) {
        ASSERT_FALSE(d.ok()) << "cycle " << cycle << ": block " << it->second
                             << " was corrupted by a byte flip and still verifies";
        ++flips_detected;
        continue;
      }
      if (!d.ok()) {
        // A torn or damaged value is a miss, never KV; without damage it must not happen.
        ASSERT_TRUE(damage) << "cycle " << cycle << ": block " << it->second
                            << " fails verification without damage: " << MissReasonName(d.reason);
        continue;
      }
      ASSERT_EQ(std::vector<uint8_t>(d.payload.begin(), d.payload.end()), want.Payload());
      ++served_checked;
    }
    if (damage) {
      required.clear();  // damage may legitimately lose acknowledged blocks
      if (tier.open_report().outcome == RocksDbTier::OpenOutcome::kMovedAside) flipped.clear();
    } else {
      for (uint64_t i : required) {
        const auto want = crash::Block(i);
        auto v = tier.Get(want.meta.hash);
        ASSERT_TRUE(v.ok()) << "cycle " << cycle << ": acknowledged block " << i
                            << " lost: " << v.status().ToString();
        ASSERT_TRUE(DecodeBlock(*v, want.meta).ok()) << "cycle " << cycle << ": block " << i;
      }
    }
    if (!damage && cycle % kFlipEvery == kFlipEvery - 1) {
      // Flip one byte of up to two stored values and write them back.
      std::vector<BlockHash> keys = tier.KeysLruOrder();
      for (int k = 0; k < 2 && !keys.empty(); ++k) {
        const BlockHash h = keys[rng() % keys.size()];
        const uint64_t index = known.at(h);
        if (flipped.count(index)) continue;
        auto v = tier.Get(h);
        if (!v.ok()) continue;
        std::string bad = *v;
        bad[rng() % bad.size()] ^= static_cast<char>(1u << (rng() % 8));
        ASSERT_TRUE(tier.Put(h, bad).ok());
        flipped.insert(index);
        required.erase(index);
        ++flips;
      }
      ASSERT_TRUE(tier.WaitDurable(Deadline::AfterMs(10000)).ok());
    }
    opened->reset();
  }
  std::cout << "cycles " << cycles << ", acknowledged " << total_acked << ", served+verified "
            << served_checked << ", damage cycles " << damage_cycles << ", latent read errors "
            << latent_errors << ", repaired/moved " << repaired_or_moved << ", byte flips " << flips
            << " (reads of flipped values rejected by the codec: " << flips_detected << ")\n";
  EXPECT_GT(total_acked, 0);
  EXPECT_GT(flips, 0);
  EXPECT_GT(flips_detected, 0);
  std::error_code ec;
  for (auto& e : fs::directory_iterator(dir.parent_path(), ec)) {
    if (e.path().string().rfind(dir.string(), 0) == 0) fs::remove_all(e.path(), ec);
  }
}

}  // namespace
}  // namespace kvrelay::kv_store
