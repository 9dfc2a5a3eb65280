// kvrelay-decode: receives prompt KV from prefill workers and decodes in a
// continuous batch; with --tp-size T, rank 0 leads the group and ranks 1..T-1
// follow it.
#include "decode_worker/decode_role.h"
#include "decode_worker/tp_follower.h"
#include "worker/worker.h"

int main(int argc, char** argv) {
  using namespace kvrelay;
  return worker::WorkerMain(
      worker::RoleKind::kDecode,
      [](const worker::WorkerOptions&) { return std::make_unique<decode_worker::DecodeRole>(); },
      decode_worker::RunTpFollower, argc, argv);
}
