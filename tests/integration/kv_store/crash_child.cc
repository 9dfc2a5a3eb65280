// Child process of kv_store_crash_test: spills synthetic blocks into a
// RocksDbTier as fast as it can and, after each WaitDurable that returned OK,
// acknowledges the durable block indices on stdout ("A <index>\n", one
// write(2) per line). The parent SIGKILLs it at random moments.
//
// Usage: kv_store_crash_child <db dir> <first block index>
#include <sys/prctl.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kv_store/rocksdb_tier.h"
#include "tests/integration/kv_store/crash_common.h"

int main(int argc, char** argv) {
  using namespace kvrelay;
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s <db dir> <first block index>\n", argv[0]);
    return 2;
  }
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the test
  const uint64_t first = std::strtoull(argv[2], nullptr, 10);
  auto tier = kv_store::RocksDbTier::Open(kv_store::crash::TierOptions(argv[1]));
  if (!tier.ok()) {
    std::fprintf(stderr, "child: open failed: %s\n", tier.status().ToString().c_str());
    return 3;
  }
  // Indices are dense: a dropped Put (full queue) is retried after the queue
  // drained, so every index the child ever wrote is at most 8 past the last
  // acknowledged one (the parent relies on it to know every key).
  std::vector<uint64_t> accepted;
  const Deadline stop = Deadline::AfterMs(20000);
  uint64_t i = first;
  while (!stop.Expired()) {
    auto b = kv_store::crash::Block(i);
    const bool ok = (*tier)->Put(b.meta.hash, b.Encoded()).ok();
    if (ok) {
      accepted.push_back(i);
      ++i;
    }
    if (!ok || accepted.size() >= 8) {
      if (!(*tier)->WaitDurable(Deadline::AfterMs(5000)).ok()) {
        accepted.clear();  // not acknowledged; the parent will not require them
        continue;
      }
      for (uint64_t a : accepted) {
        const std::string line = "A " + std::to_string(a) + "\n";
        if (::write(1, line.data(), line.size()) != static_cast<ssize_t>(line.size())) return 4;
      }
      accepted.clear();
    }
  }
  return 0;
}
