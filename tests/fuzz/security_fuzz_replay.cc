// The security fuzz targets (fuzz_targets.h) over their corpora, under the
// normal build and the sanitizers (replay.h says how they are run):
//   security_fuzz_replay [--write] [--random N] [--only TARGET] CORPUS_ROOT
#include <string>
#include <vector>

#include "fuzz_targets.h"
#include "protocols/frame_codec.h"
#include "replay.h"

// The frame decoder's target (tests/unit/protocols/fuzz/frame_fuzz.cc).
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

std::vector<std::string> FrameSeeds() {
  using kvrelay::protocols::EncodeFrame;
  std::string stream;
  for (int i = 0; i < 4; ++i)
    stream += *EncodeFrame(static_cast<uint16_t>(i + 1), std::string(i * 37, 'a' + i));
  std::string over(kvrelay::protocols::kFrameHeaderBytes, '\0');
  kvrelay::protocols::EncodeFrameHeader(100, 16u << 20, reinterpret_cast<uint8_t*>(over.data()));
  return {stream, *EncodeFrame(16, std::string(100, 'h')), over + "partial"};
}

}  // namespace

int main(int argc, char** argv) {
  using kvrelay::fuzz::ReplayTarget;
  const std::vector<ReplayTarget> targets = {
      {"frame", LLVMFuzzerTestOneInput, FrameSeeds},
      {"auth_handshake", kvrelay::fuzz::FuzzAuthHandshake, kvrelay::fuzz::AuthSeeds},
      {"block_codec", kvrelay::fuzz::FuzzBlockCodec, kvrelay::fuzz::BlockCodecSeeds},
      {"layer_manifest", kvrelay::fuzz::FuzzLayerManifest, kvrelay::fuzz::LayerManifestSeeds},
      // A JSON parse and a schema compile per input; the flips reach the
      // request line and the first headers, where the framing is.
      {"http_request", kvrelay::fuzz::FuzzHttpRequest, kvrelay::fuzz::HttpRequestSeeds, 96},
      // Each input is a few TCP round trips to a live coordinator (~ms):
      // the flips reach the first records' headers and payload starts.
      {"control_frame", kvrelay::fuzz::FuzzControlFrames, kvrelay::fuzz::ControlFrameSeeds, 16, 20},
  };
  return kvrelay::fuzz::RunReplay(argc, argv, targets);
}
