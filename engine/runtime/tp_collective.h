// The communication a tensor-parallel group needs inside one forward pass
// (see tensor_parallel.h for the design). Implementations: InProcessTpGroup
// (threads), worker/tp_group (TCP between processes) and an MPI one over a
// sub-communicator. Results must be bit-identical on every rank, and every call
// has a deadline inside: a dead peer is an error, never a hang.
#pragma once

#include <cstdint>

#include "common/status.h"

namespace kvrelay::engine {

class TpCollective {
 public:
  virtual ~TpCollective() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // data[0, n) = sum over ranks of every rank's data[0, n), added in rank order.
  virtual Status AllReduceSum(float* data, int64_t n) = 0;
  // out = concatenation, in rank order, of every rank's local[0, n_local);
  // n_out must equal the sum of the ranks' n_local.
  virtual Status AllGather(const float* local, int64_t n_local, float* out, int64_t n_out) = 0;
};

}  // namespace kvrelay::engine
