// The collectives of a tensor-parallel decode group over its MPI
// sub-communicator (kv_transfer/mpi_session.h makes it with MPI_Comm_split):
// MPI's non-blocking collectives, polled with a deadline.
//
// Results are bit-identical on every rank and to the TCP link's
// (tp_group.h): one MPI_Iallgather per call of [count | data padded to the
// bound], unpacked in rank order; the all-reduce gathers every rank's vector
// and adds them in rank order on each rank (MPI_Iallreduce's summation order
// is the library's).
//
// A collective with a dead member never completes and never errors (measured
// with Open MPI 4.1, see docs/BENCHMARKS.md). So a collective that misses its
// deadline breaks the group for good (status()), and the buffers MPI may
// still write are quarantined — kept, never reused or freed, counted — rather
// than freed under MPI's feet. The caller's buffers are never handed to MPI:
// data goes through staging owned here.
//
// Threading: one owner thread (the engine's Step thread).
#pragma once

#include <mpi.h>

#include <chrono>
#include <memory>
#include <vector>

#include "common/status.h"
#include "engine/runtime/tp_collective.h"

namespace kvrelay::decode_worker {

class MpiTpCollective final : public engine::TpCollective {
 public:
  // `comm` (not owned) must be this group's communicator: size = TP size,
  // rank = TP rank.
  static Result<std::unique_ptr<MpiTpCollective>> Create(MPI_Comm comm,
                                                         std::chrono::milliseconds timeout);
  ~MpiTpCollective() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Status AllReduceSum(float* data, int64_t n) override;
  Status AllGather(const float* local, int64_t n_local, float* out, int64_t n_out) override;

  // OK until a collective missed its deadline.
  Status status() const { return broken_; }
  // Staging buffers abandoned to MPI (bytes), for the metric.
  int64_t quarantined_bytes() const { return quarantined_bytes_; }

 private:
  MpiTpCollective(MPI_Comm comm, int rank, int size, std::chrono::milliseconds timeout)
      : comm_(comm), rank_(rank), size_(size), timeout_(timeout) {}
  // Waits for `req` until the deadline, yielding the core while it waits.
  Status Wait(MPI_Request* req, const char* what);
  // Gathers every rank's local[0, n_local) (n_local <= cap on every rank):
  // gathered_ holds, per rank in rank order, a slot of cap + 1 floats — the
  // count, then the data; counts_ has each rank's count.
  Status Gather(const float* local, int64_t n_local, int64_t cap);

  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
  std::chrono::milliseconds timeout_;
  Status broken_;
  std::vector<int> counts_;  // each rank's element count, this call
  std::vector<float> send_, gathered_;
  // Buffers of abandoned collectives: MPI may still write them.
  std::vector<std::unique_ptr<std::vector<float>>> quarantine_;
  int64_t quarantined_bytes_ = 0;
};

}  // namespace kvrelay::decode_worker
