// engine::StepPlan <-> proto::TpStepPlan: the one place the step plan meets
// the protocol (rank 0 publishes each step to its TP followers).
#pragma once

#include "common/status.h"
#include "engine/runtime/step_plan.h"
#include "protocols/control.pb.h"

namespace kvrelay::decode_worker {

proto::TpStepPlan ToProto(const engine::StepPlan& plan);
// Logit rows are not carried: followers never sample.
engine::StepPlan FromProto(const proto::TpStepPlan& m);

}  // namespace kvrelay::decode_worker
