#include "replay.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace kvrelay::fuzz {
namespace {

namespace fs = std::filesystem;
using Fn = FuzzFn;

void RunOne(Fn fn, const std::string& s) {
  fn(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

// Runs `input` and its mutations; returns how many inputs ran.
long Mutate(Fn fn, const std::string& input, std::mt19937& rng, long random_edits,
            size_t max_flip_bytes) {
  long runs = 0;
  RunOne(fn, input);
  ++runs;
  const size_t step = input.size() > 2048 ? input.size() / 512 : 1;
  for (size_t n = 0; n < input.size(); n += step, ++runs) RunOne(fn, input.substr(0, n));
  const size_t flip_bytes = std::min(input.size(), max_flip_bytes);
  for (size_t i = 0; i < flip_bytes; ++i) {
    for (int b = 0; b < 8; ++b, ++runs) {
      std::string t = input;
      t[i] ^= static_cast<char>(1 << b);
      RunOne(fn, t);
    }
  }
  for (long k = 0; k < random_edits && !input.empty(); ++k, ++runs) {
    std::string t = input;
    const int edits = 1 + static_cast<int>(rng() % 8);
    for (int e = 0; e < edits; ++e) t[rng() % t.size()] = static_cast<char>(rng());
    RunOne(fn, t);
  }
  return runs;
}

}  // namespace

int RunReplay(int argc, char** argv, const std::vector<ReplayTarget>& targets) {
  bool write = false;
  long random_edits = -1;  // --random N; -1: each target's own (300 unless it says)
  std::string root, only;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--write") == 0) {
      write = true;
    } else if (std::strcmp(argv[i], "--random") == 0 && i + 1 < argc) {
      random_edits = std::atol(argv[++i]);
    } else if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc) {
      only = argv[++i];
    } else {
      root = argv[i];
    }
  }
  if (root.empty()) {
    std::fprintf(stderr, "usage: %s [--write] [--random N] [--only TARGET] CORPUS_ROOT\n", argv[0]);
    return 2;
  }
  std::mt19937 rng(14);
  for (const ReplayTarget& t : targets) {
    if (!only.empty() && only != t.name) continue;
    const fs::path dir = fs::path(root) / t.name;
    std::vector<std::string> inputs = t.seeds();
    if (write) {
      fs::create_directories(dir);
      for (size_t i = 0; i < inputs.size(); ++i) {
        std::ofstream(dir / ("seed-" + std::to_string(i)), std::ios::binary) << inputs[i];
      }
    }
    size_t files = 0;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      if (!e.is_regular_file()) continue;
      std::ifstream in(e.path(), std::ios::binary);
      inputs.emplace_back((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      ++files;
    }
    if (files == 0) {
      std::fprintf(stderr, "%s: no corpus files under %s\n", t.name, dir.c_str());
      return 1;
    }
    long runs = 0;
    const long edits =
        random_edits >= 0 ? random_edits : (t.random_edits >= 0 ? t.random_edits : 300);
    for (const std::string& s : inputs) runs += Mutate(t.fn, s, rng, edits, t.flip_bytes);
    std::printf("%s: %zu corpus files, %ld inputs run, no finding\n", t.name, files, runs);
  }
  return 0;
}

}  // namespace kvrelay::fuzz
