// Runs the security fuzz targets (fuzz_targets.h) under the normal build:
// for each target, its seeds and every file of its checked-in corpus
// (tests/fuzz/corpus/<target>/, grown by the libFuzzer runs), every
// truncation and single-bit flip of each, and random mutations with a fixed
// seed. A target aborts on a broken invariant, which fails the ctest.
//
//   security_fuzz_replay CORPUS_ROOT              replay
//   security_fuzz_replay --write CORPUS_ROOT      (re)write the seed files first
//   security_fuzz_replay --random N [--only T] CORPUS_ROOT
//                                                 N random edits per input (an unguided
//                                                 fuzz loop, for targets libFuzzer cannot build)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "fuzz_targets.h"
#include "protocols/frame_codec.h"

// The frame decoder's target (tests/unit/protocols/fuzz/frame_fuzz.cc).
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

namespace fs = std::filesystem;
using Fn = int (*)(const uint8_t*, size_t);

std::vector<std::string> FrameSeeds() {
  using kvrelay::protocols::EncodeFrame;
  std::string stream;
  for (int i = 0; i < 4; ++i)
    stream += *EncodeFrame(static_cast<uint16_t>(i + 1), std::string(i * 37, 'a' + i));
  std::string over(kvrelay::protocols::kFrameHeaderBytes, '\0');
  kvrelay::protocols::EncodeFrameHeader(100, 16u << 20, reinterpret_cast<uint8_t*>(over.data()));
  return {stream, *EncodeFrame(16, std::string(100, 'h')), over + "partial"};
}

struct Target {
  const char* name;
  Fn fn;
  std::vector<std::string> (*seeds)();
  // Bit flips cover this many leading bytes of each input (truncations and
  // random edits cover all of it): less for a target whose inputs are slow.
  size_t flip_bytes = 600;
};

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

int main(int argc, char** argv) {
  bool write = false;
  long random_edits = 300;
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
    std::fprintf(stderr, "usage: security_fuzz_replay [--write] CORPUS_ROOT\n");
    return 2;
  }
  const Target targets[] = {
      {"frame", LLVMFuzzerTestOneInput, FrameSeeds},
      {"auth_handshake", kvrelay::fuzz::FuzzAuthHandshake, kvrelay::fuzz::AuthSeeds},
      {"block_codec", kvrelay::fuzz::FuzzBlockCodec, kvrelay::fuzz::BlockCodecSeeds},
      {"layer_manifest", kvrelay::fuzz::FuzzLayerManifest, kvrelay::fuzz::LayerManifestSeeds},
      // A JSON parse and a schema compile per input; the flips reach the
      // request line and the first headers, where the framing is.
      {"http_request", kvrelay::fuzz::FuzzHttpRequest, kvrelay::fuzz::HttpRequestSeeds, 96},
      {"tp_plan", kvrelay::fuzz::FuzzTpPlan, kvrelay::fuzz::TpPlanSeeds},
  };
  std::mt19937 rng(14);
  for (const Target& t : targets) {
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
    for (const std::string& s : inputs) runs += Mutate(t.fn, s, rng, random_edits, t.flip_bytes);
    std::printf("%s: %zu corpus files, %ld inputs run, no finding\n", t.name, files, runs);
  }
  return 0;
}
