#include "decode_worker/mpi_tp_collective.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <thread>

#include "common/clock.h"
#include "common/logging.h"

namespace kvrelay::decode_worker {

Result<std::unique_ptr<MpiTpCollective>> MpiTpCollective::Create(
    MPI_Comm comm, std::chrono::milliseconds timeout) {
  if (comm == MPI_COMM_NULL) return FailedPrecondition("no MPI TP communicator");
  int rank = 0, size = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  return std::unique_ptr<MpiTpCollective>(new MpiTpCollective(comm, rank, size, timeout));
}

MpiTpCollective::~MpiTpCollective() {
  if (!quarantine_.empty()) {
    LOG_WARNING << "leaving " << quarantined_bytes_
                << " bytes of TP collective buffers to MPI (abandoned collectives)";
    // Deliberately leaked: an abandoned MPI collective may still write them.
    for (auto& b : quarantine_) (void)b.release();
    for (auto& b : quarantine_counts_) (void)b.release();
  }
}

Status MpiTpCollective::Wait(MPI_Request* req, const char* what) {
  const Deadline deadline = Deadline::After(timeout_);
  // Spin briefly (a collective between ranks that are all in the step is
  // microseconds), then yield the core in growing sleeps: on an
  // oversubscribed machine a spinning rank would steal the core its peer
  // needs to arrive.
  auto nap = std::chrono::microseconds(0);
  const auto spin_until = Clock::now() + std::chrono::microseconds(50);
  while (true) {
    int done = 0;
    if (MPI_Test(req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
      broken_ = Unavailable(std::string("TP ") + what + ": MPI_Test failed");
      return broken_;
    }
    if (done) return Status::Ok();
    if (deadline.Expired()) {
      broken_ = DeadlineExceeded(std::string("TP ") + what + " did not complete within " +
                                 std::to_string(timeout_.count()) +
                                 " ms (a member of the group is gone or stalled)");
      // The request cannot be cancelled: keep what MPI may still write.
      quarantined_bytes_ += static_cast<int64_t>((send_.capacity() + gathered_.capacity()) *
                                                 sizeof(float)) +
                            static_cast<int64_t>(n_all_.capacity() * sizeof(long long));
      quarantine_.push_back(std::make_unique<std::vector<float>>(std::move(send_)));
      quarantine_.push_back(std::make_unique<std::vector<float>>(std::move(gathered_)));
      quarantine_counts_.push_back(std::make_unique<std::vector<long long>>(std::move(n_all_)));
      send_ = {};
      gathered_ = {};
      n_all_ = {};
      return broken_;
    }
    if (Clock::now() >= spin_until) {
      nap = std::min<std::chrono::microseconds>(nap + std::chrono::microseconds(20),
                                                std::chrono::microseconds(500));
      std::this_thread::sleep_for(nap);
    }
  }
}

Status MpiTpCollective::Gather(const float* local, int64_t n_local) {
  RETURN_IF_ERROR(broken_);
  if (n_local < 0 || n_local > INT_MAX) return InvalidArgument("TP collective: bad element count");
  // 1. Every rank's count (they differ when heads do not split evenly).
  n_all_.assign(static_cast<size_t>(size_), 0);
  long long mine = n_local;
  MPI_Request req = MPI_REQUEST_NULL;
  MPI_Iallgather(&mine, 1, MPI_LONG_LONG, n_all_.data(), 1, MPI_LONG_LONG, comm_, &req);
  RETURN_IF_ERROR(Wait(&req, "count exchange"));
  counts_.assign(static_cast<size_t>(size_), 0);
  displs_.assign(static_cast<size_t>(size_), 0);
  long long total = 0;
  for (int r = 0; r < size_; ++r) {
    if (n_all_[r] < 0 || total + n_all_[r] > INT_MAX) {
      return InvalidArgument("TP collective: the group's element counts overflow");
    }
    counts_[r] = static_cast<int>(n_all_[r]);
    displs_[r] = static_cast<int>(total);
    total += n_all_[r];
  }
  // 2. The data, in rank order.
  send_.assign(local, local + n_local);
  gathered_.resize(static_cast<size_t>(total));
  req = MPI_REQUEST_NULL;
  MPI_Iallgatherv(send_.data(), static_cast<int>(n_local), MPI_FLOAT, gathered_.data(),
                  counts_.data(), displs_.data(), MPI_FLOAT, comm_, &req);
  return Wait(&req, "all-gather");
}

Status MpiTpCollective::AllGather(const float* local, int64_t n_local, float* out,
                                  int64_t n_out) {
  RETURN_IF_ERROR(Gather(local, n_local));
  if (static_cast<int64_t>(gathered_.size()) != n_out) {
    return DataLoss("TP all-gather: ranks sent " + std::to_string(gathered_.size()) +
                    " floats in all, expected " + std::to_string(n_out));
  }
  std::memcpy(out, gathered_.data(), static_cast<size_t>(n_out) * sizeof(float));
  return Status::Ok();
}

Status MpiTpCollective::AllReduceSum(float* data, int64_t n) {
  RETURN_IF_ERROR(Gather(data, n));
  for (int r = 0; r < size_; ++r) {
    if (counts_[r] != n) {
      return DataLoss("TP all-reduce: rank " + std::to_string(r) + " sent " +
                      std::to_string(counts_[r]) + " floats, expected " + std::to_string(n));
    }
  }
  // Rank order, as the TCP link adds: ((x0 + x1) + x2) ...
  const float* x = gathered_.data();
  for (int64_t i = 0; i < n; ++i) data[i] = x[i];
  for (int r = 1; r < size_; ++r) {
    const float* p = x + static_cast<int64_t>(r) * n;
    for (int64_t i = 0; i < n; ++i) data[i] += p[i];
  }
  return Status::Ok();
}

}  // namespace kvrelay::decode_worker
