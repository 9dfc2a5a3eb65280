// The TP step plan a follower executes (issue #41): rank 0 publishes each
// step as a proto::TpStepPlan over the authenticated TP link
// (decode_worker/tp_plan_codec.h), and the follower repeats it on its own KV
// pool (engine::TpFollower::Execute). The link authenticates the leader, but
// a leader with a bug, or anyone holding the cluster key, must not make a
// follower write outside its pool, read outside its model or crash.
//
// The follower here runs a tiny synthetic llama (2 layers, d_model 64) as
// the whole model (a group of one rank, so its collectives return at once)
// over a pool of kBlocks blocks.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "decode_worker/tp_plan_codec.h"
#include "engine/runtime/model.h"
#include "engine/runtime/tensor_parallel.h"
#include "fuzz_targets.h"
#include "tests/testing/synthetic_model.h"

namespace kvrelay::fuzz {
namespace {

constexpr int64_t kBlocks = 8;
constexpr int kBlockTokens = 16;

struct Follower {
  std::unique_ptr<engine::InProcessTpGroup> group;
  std::unique_ptr<engine::TpFollower> follower;
  int vocab = 0;
};

// Destroyed at exit (the pool's threads joined): a ThreadSanitizer build
// reports a thread never joined.
Follower& Get() {
  static const std::unique_ptr<Follower> f = [] {
    auto out = std::make_unique<Follower>();
    testing::SyntheticModelOptions mo;
    auto path = testing::WriteTempSyntheticModel(mo);
    if (!path.ok()) {
      std::fprintf(stderr, "tp_plan fuzz: %s\n", path.status().ToString().c_str());
      std::abort();
    }
    auto model = engine::Model::Load(*path, engine::ModelLoadOptions{});
    std::remove(path->c_str());
    if (!model.ok()) {
      std::fprintf(stderr, "tp_plan fuzz: %s\n", model.status().ToString().c_str());
      std::abort();
    }
    out->vocab = (*model)->config().vocab;
    engine::EngineOptions o;
    o.threads = 1;
    o.block_tokens = kBlockTokens;
    out->group = std::make_unique<engine::InProcessTpGroup>(1, std::chrono::seconds(5));
    auto follower = engine::TpFollower::Create(
        o, std::shared_ptr<const engine::Model>(std::move(model).value()), kBlocks,
        out->group->rank(0));
    if (!follower.ok()) {
      std::fprintf(stderr, "tp_plan fuzz: %s\n", follower.status().ToString().c_str());
      std::abort();
    }
    out->follower = std::move(follower).value();
    return out;
  }();
  return *f;
}

// True when every block, position and token `plan` names is one the pool
// and the model have (what Execute must have checked before it said OK).
bool InBounds(const engine::StepPlan& plan, int vocab) {
  auto block_ok = [](engine::BlockId b) { return b >= 0 && b < kBlocks; };
  for (const auto& c : plan.copies) {
    if (!block_ok(c.src) || !block_ok(c.dst)) return false;
  }
  for (const engine::SeqStep& s : plan.seqs) {
    if (s.tokens.empty() || s.cache_len < 0) return false;
    const int64_t room = static_cast<int64_t>(s.blocks.size()) * kBlockTokens;
    if (s.cache_len > room || static_cast<int64_t>(s.tokens.size()) > room - s.cache_len) {
      return false;
    }
    const int64_t used = (s.end() + kBlockTokens - 1) / kBlockTokens;
    for (int64_t b = 0; b < used; ++b) {
      if (!block_ok(s.blocks[static_cast<size_t>(b)])) return false;
    }
    for (int32_t t : s.tokens) {
      if (t < 0 || t >= vocab) return false;
    }
  }
  return true;
}

std::string Serialize(const engine::StepPlan& plan) {
  return decode_worker::ToProto(plan).SerializeAsString();
}

}  // namespace

int FuzzTpPlan(const uint8_t* data, size_t size) {
  proto::TpStepPlan m;
  if (!m.ParseFromArray(data, static_cast<int>(size))) return 0;
  Follower& f = Get();
  const engine::StepPlan plan = decode_worker::FromProto(m);
  const Status s = f.follower->Execute(plan);
  if (s.ok() && !InBounds(plan, f.vocab)) {
    std::fprintf(stderr, "tp_plan fuzz: a plan outside the pool or the vocabulary was executed\n");
    std::abort();
  }
  return 0;
}

std::vector<std::string> TpPlanSeeds() {
  std::vector<std::string> seeds;
  engine::StepPlan prefill;  // a 5-token prompt into block 2
  prefill.seqs.push_back({1, {2}, 0, {10, 11, 12, 13, 14}, engine::LogitRows::kNone, {}});
  seeds.push_back(Serialize(prefill));
  engine::StepPlan decode;  // two sequences decoding, one past its first block
  decode.seqs.push_back({1, {2}, 5, {15}, engine::LogitRows::kNone, {}});
  decode.seqs.push_back({2, {3, 4}, 16, {20}, engine::LogitRows::kNone, {}});
  seeds.push_back(Serialize(decode));
  engine::StepPlan cow;  // a copy-on-write, then a step on the copy
  cow.copies.push_back({2, 5});
  cow.seqs.push_back({3, {5}, 4, {30, 31}, engine::LogitRows::kNone, {}});
  seeds.push_back(Serialize(cow));
  engine::StepPlan far;  // a cache length near the int64 limit (must be refused)
  far.seqs.push_back(
      {4, {1}, std::numeric_limits<int64_t>::max() - 1, {7}, engine::LogitRows::kNone, {}});
  seeds.push_back(Serialize(far));
  engine::StepPlan grouped;  // group tables on a one-group model (must be refused)
  grouped.seqs.push_back({5, {1}, 0, {7, 8}, engine::LogitRows::kNone, {{2}, {3}}});
  seeds.push_back(Serialize(grouped));
  return seeds;
}

}  // namespace kvrelay::fuzz

#ifdef KVRELAY_LIBFUZZER_ENTRY
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return kvrelay::fuzz::FuzzTpPlan(data, size);
}
#endif
