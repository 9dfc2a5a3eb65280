// kvrelay-prefill: runs prompts and streams their KV, layer by layer, to decode groups.
#include "prefill_worker/prefill_role.h"
#include "worker/worker.h"

int main(int argc, char** argv) {
  using namespace kvrelay;
  return worker::WorkerMain(
      worker::RoleKind::kPrefill,
      [](const worker::WorkerOptions&) { return std::make_unique<prefill_worker::PrefillRole>(); },
      {}, argc, argv);
}
