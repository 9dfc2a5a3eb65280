// libFuzzer target for the frame decoder (built with KVRELAY_FUZZ=ON and
// clang), also linked into frame_replay_test so gcc builds run the same body
// over systematic truncations and bit flips.
//
// Invariants checked on every input: no crash, memory bounded (buffered
// bytes never exceed one header + max payload), a failed decoder stays failed,
// and every decoded frame respects the size limit.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "protocols/frame_codec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using kvrelay::protocols::FrameDecoder;
  constexpr uint32_t kMax = 4096;
  FrameDecoder decoder(FrameDecoder::Options{kMax});
  // Feed in pieces whose sizes come from the input itself.
  size_t pos = 0;
  bool failed = false;
  while (pos < size) {
    size_t piece = 1 + (data[pos] % 17);
    if (piece > size - pos) piece = size - pos;
    kvrelay::Status st = decoder.Feed(data + pos, piece);
    pos += piece;
    if (failed && st.ok()) std::abort();  // errors are sticky
    failed = !st.ok();
    if (decoder.buffered_bytes() > kMax + kvrelay::protocols::kFrameHeaderBytes) std::abort();
    while (auto frame = decoder.Next()) {
      if (frame->payload.size() > kMax) std::abort();
    }
  }
  (void)decoder.Finish();
  return 0;
}
