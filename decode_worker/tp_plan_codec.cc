#include "decode_worker/tp_plan_codec.h"

namespace kvrelay::decode_worker {

proto::TpStepPlan ToProto(const engine::StepPlan& plan) {
  proto::TpStepPlan m;
  for (const auto& c : plan.copies) {
    auto* pc = m.add_copies();
    pc->set_src(c.src);
    pc->set_dst(c.dst);
  }
  for (const auto& q : plan.seqs) {
    auto* ps = m.add_seqs();
    ps->mutable_blocks()->Add(q.blocks.begin(), q.blocks.end());
    ps->set_cache_len(q.cache_len);
    ps->mutable_tokens()->Add(q.tokens.begin(), q.tokens.end());
    for (const auto& table : q.group_blocks) {
      ps->add_group_blocks()->mutable_blocks()->Add(table.begin(), table.end());
    }
  }
  return m;
}

engine::StepPlan FromProto(const proto::TpStepPlan& m) {
  engine::StepPlan plan;
  for (const auto& c : m.copies()) plan.copies.push_back({c.src(), c.dst()});
  for (const auto& q : m.seqs()) {
    engine::SeqStep s;
    s.blocks.assign(q.blocks().begin(), q.blocks().end());
    s.cache_len = q.cache_len();
    s.tokens.assign(q.tokens().begin(), q.tokens().end());
    s.logits = engine::LogitRows::kNone;
    for (const auto& table : q.group_blocks()) {
      s.group_blocks.emplace_back(table.blocks().begin(), table.blocks().end());
    }
    plan.seqs.push_back(std::move(s));
  }
  return plan;
}

}  // namespace kvrelay::decode_worker
