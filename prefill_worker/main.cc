// kvrelay-prefill: runs prompts and streams their KV, layer by layer, to decode workers.
#include "worker/worker.h"

int main(int argc, char** argv) {
  return kvrelay::worker::WorkerMain(kvrelay::worker::Role::kPrefill, argc, argv);
}
