// kvrelay-worker: prefill and decode in one engine (the colocated baseline):
// the prefill role, with every request run to completion here.
#include "prefill_worker/prefill_role.h"
#include "worker/worker.h"

int main(int argc, char** argv) {
  using namespace kvrelay;
  return worker::WorkerMain(
      worker::RoleKind::kColocated,
      [](const worker::WorkerOptions&) { return std::make_unique<prefill_worker::PrefillRole>(); },
      {}, argc, argv);
}
