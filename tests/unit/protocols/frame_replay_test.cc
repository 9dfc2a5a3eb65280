// Replays the fuzz target body (fuzz/frame_fuzz.cc) over every truncation
// and every single-bit flip of a valid multi-frame stream, plus random
// streams, in a normal gcc build. The target aborts on any broken invariant.
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "protocols/frame_codec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace kvrelay::protocols {
namespace {

std::string ValidStream() {
  std::string s;
  for (int i = 0; i < 4; ++i)
    s += *EncodeFrame(static_cast<uint16_t>(i + 1), std::string(i * 37, 'a' + i));
  return s;
}

TEST(FrameReplay, EveryTruncation) {
  std::string s = ValidStream();
  for (size_t n = 0; n <= s.size(); ++n) {
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.data()), n);
  }
}

TEST(FrameReplay, EveryBitFlip) {
  std::string s = ValidStream();
  int errors = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    for (int b = 0; b < 8; ++b) {
      std::string t = s;
      t[i] ^= static_cast<char>(1 << b);
      LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(t.data()), t.size());
      FrameDecoder d(FrameDecoder::Options{4096});
      Status st = d.Feed(t.data(), t.size());
      if (!st.ok() || !d.Finish().ok()) ++errors;
    }
  }
  // Flips in the 4 headers' magic/version bytes are always detected.
  EXPECT_GE(errors, 4 * 6 * 8);
}

TEST(FrameReplay, RandomStreams) {
  std::mt19937 rng(7);
  for (int i = 0; i < 2000; ++i) {
    std::string t(rng() % 300, '\0');
    for (auto& c : t) c = static_cast<char>(rng());
    if (!t.empty() && rng() % 2) {  // start some with a valid header prefix
      std::string h = *EncodeFrame(1, std::string(rng() % 64, 'z'));
      t = h.substr(0, std::min(h.size(), t.size())) + t;
    }
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(t.data()), t.size());
  }
}

}  // namespace
}  // namespace kvrelay::protocols
