// kvrelay-worker: prefill and decode in one process (the colocated baseline).
#include "worker/worker.h"

int main(int argc, char** argv) {
  return kvrelay::worker::WorkerMain(kvrelay::worker::Role::kColocated, argc, argv);
}
