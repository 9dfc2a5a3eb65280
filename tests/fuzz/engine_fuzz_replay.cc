// The fuzz targets that run the engine (fuzz_targets.h: tp_plan) over their
// corpora, in the normal build only: the sanitizer builds of
// scripts/sanitize.sh do not compile the engine (replay.h says how they run).
//   engine_fuzz_replay [--write] [--random N] [--only TARGET] CORPUS_ROOT
#include <vector>

#include "fuzz_targets.h"
#include "replay.h"

int main(int argc, char** argv) {
  const std::vector<kvrelay::fuzz::ReplayTarget> targets = {
      {"tp_plan", kvrelay::fuzz::FuzzTpPlan, kvrelay::fuzz::TpPlanSeeds},
  };
  return kvrelay::fuzz::RunReplay(argc, argv, targets);
}
