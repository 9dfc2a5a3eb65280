// kvrelay-decode: receives prompt KV from prefill workers and decodes in a continuous batch.
#include "worker/worker.h"

int main(int argc, char** argv) {
  return kvrelay::worker::WorkerMain(kvrelay::worker::Role::kDecode, argc, argv);
}
