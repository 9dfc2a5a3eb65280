// Child process of kv_store_restart_test. One run = one process lifetime of a
// worker with the real engine on the real model:
//   spill   <model> <db dir>: generates from the test prompt, then evicts every
//           cached block of the pool (the pool's spill hook -> TieredCache ->
//           RocksDbTier), waits until durable and exits;
//   restore <model> <db dir>: restores the prompt's prefix from the DB into a
//           fresh pool, then generates;
//   fresh   <model>: generates without any cache.
// Prints "restored <tokens>", "cached <tokens>" and "tokens <id> <id> ...".
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/runtime/engine.h"
#include "engine/runtime/model.h"
#include "kv_store/rocksdb_tier.h"
#include "kv_store/tiered_cache.h"

namespace kvrelay {
namespace {

constexpr char kSalt[] = "restart-tenant";
constexpr int kPromptTokens = 70;  // 4 full blocks of 16 + 6
constexpr int kGenerate = 8;

std::vector<int32_t> Prompt(int vocab) {
  std::mt19937 rng(77);
  std::vector<int32_t> p(kPromptTokens);
  for (auto& t : p) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
  return p;
}

Status Generate(engine::Engine* e, const std::vector<int32_t>& prompt, std::vector<int32_t>* out,
                int64_t* cached) {
  engine::RequestSpec spec;
  spec.id = 1;
  spec.prompt = prompt;
  spec.sampling.max_tokens = kGenerate;
  spec.tenant_salt = kSalt;
  RETURN_IF_ERROR(e->Submit(std::move(spec)));
  while (e->HasWork()) {
    ASSIGN_OR_RETURN(auto events, e->Step());
    for (const auto& ev : events) {
      if (!ev.error.ok()) return ev.error;
      if (ev.token >= 0) out->push_back(ev.token);
      *cached = ev.cached_prompt_tokens;
    }
  }
  return Status::Ok();
}

Status Main(const std::string& mode, const std::string& model_path, const std::string& dir) {
  engine::EngineOptions eo;
  eo.model_path = model_path;
  eo.kv_capacity_bytes = 0;
  eo.max_running = 2;
  ASSIGN_OR_RETURN(auto e, engine::Engine::Create(eo));
  const auto& model = e->model();
  const std::vector<int32_t> prompt = Prompt(model.config().vocab);
  std::vector<int32_t> tokens;
  int64_t cached = 0;
  if (mode == "fresh") {
    RETURN_IF_ERROR(Generate(e.get(), prompt, &tokens, &cached));
  } else {
    kv_store::RocksDbTier::Options o;
    o.path = dir;
    ASSIGN_OR_RETURN(auto disk, kv_store::RocksDbTier::Open(o));
    kv_store::TieredCache cache({}, nullptr, disk.get());
    cache.Attach(e->pool());
    if (mode == "spill") {
      cache.NoteSequence(prompt, model.fingerprint(), kSalt);
      RETURN_IF_ERROR(Generate(e.get(), prompt, &tokens, &cached));
      // Take every block: the pool evicts its cached blocks through the spill hook.
      std::vector<engine::BlockId> all;
      while (true) {
        auto b = e->pool()->Allocate();
        if (!b.ok()) break;
        all.push_back(*b);
      }
      for (auto b : all) e->pool()->Release(b);
      RETURN_IF_ERROR(disk->WaitDurable(Deadline::AfterMs(60000)));
      std::printf("spilled %lld\n", static_cast<long long>(cache.stats().spills));
    } else if (mode == "restore") {
      std::vector<engine::BlockId> table;
      ASSIGN_OR_RETURN(int restored,
                       cache.RestorePrefix(e->pool(), prompt, model.fingerprint(), kSalt, &table));
      for (auto b : table) e->pool()->Release(b);
      std::printf("restored %d\n", restored);
      RETURN_IF_ERROR(Generate(e.get(), prompt, &tokens, &cached));
    } else {
      return InvalidArgument("unknown mode " + mode);
    }
    cache.Detach();
  }
  std::printf("cached %lld\ntokens", static_cast<long long>(cached));
  for (int32_t t : tokens) std::printf(" %d", t);
  std::printf("\n");
  return Status::Ok();
}

}  // namespace
}  // namespace kvrelay

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s spill|restore|fresh <model> [db dir]\n", argv[0]);
    return 2;
  }
  kvrelay::Status s = kvrelay::Main(argv[1], argv[2], argc > 3 ? argv[3] : "");
  if (!s.ok()) {
    std::fprintf(stderr, "restart child: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
