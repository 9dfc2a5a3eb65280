// The corpus replay of the fuzz targets (fuzz_targets.h) under the normal
// build: for each target, its seeds and every file of its checked-in corpus
// (tests/fuzz/corpus/<target>/, grown by the libFuzzer runs), every
// truncation and single-bit flip of each, and random mutations with a fixed
// seed. A target aborts on a broken invariant, which fails the ctest.
//
//   REPLAY CORPUS_ROOT              replay
//   REPLAY --write CORPUS_ROOT      (re)write the seed files first
//   REPLAY --random N [--only T] CORPUS_ROOT
//                                   N random edits per input (an unguided
//                                   fuzz loop, for targets libFuzzer cannot build)
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kvrelay::fuzz {

using FuzzFn = int (*)(const uint8_t*, size_t);

struct ReplayTarget {
  const char* name;
  FuzzFn fn;
  std::vector<std::string> (*seeds)();
  // Bit flips cover this many leading bytes of each input (truncations and
  // random edits cover all of it): less for a target whose inputs are slow.
  size_t flip_bytes = 600;
  // Random edits per input unless --random says; -1: 300.
  long random_edits = -1;
};

// The replay's main: parses argv as above and runs `targets`; the exit code.
int RunReplay(int argc, char** argv, const std::vector<ReplayTarget>& targets);

}  // namespace kvrelay::fuzz
