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
  }
}

Status MpiTpCollective::Wait(MPI_Request* req, const char* what) {
  const Deadline deadline = Deadline::After(timeout_);
  // Spin briefly (a collective between ranks that are all in the step is
  // microseconds), then yield the core in growing sleeps: on an
  // oversubscribed machine a spinning rank would steal the core its peer
  // needs to arrive.
  auto nap = std::chrono::microseconds(0);
  const auto spin_until = Clock::now() + std::chrono::microseconds(300);
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
      quarantined_bytes_ +=
          static_cast<int64_t>((send_.capacity() + gathered_.capacity()) * sizeof(float));
      quarantine_.push_back(std::make_unique<std::vector<float>>(std::move(send_)));
      quarantine_.push_back(std::make_unique<std::vector<float>>(std::move(gathered_)));
      send_ = {};
      gathered_ = {};
      return broken_;
    }
    if (Clock::now() >= spin_until) {
      nap = std::min<std::chrono::microseconds>(nap + std::chrono::microseconds(10),
                                                std::chrono::microseconds(200));
      std::this_thread::sleep_for(nap);
    }
  }
}

Status MpiTpCollective::Gather(const float* local, int64_t n_local, int64_t cap) {
  RETURN_IF_ERROR(broken_);
  if (n_local < 0 || n_local > cap || cap + 1 > INT_MAX / std::max(size_, 1)) {
    return InvalidArgument("TP collective: bad element count");
  }
  // One collective: every rank sends [its count | its data padded to `cap`]
  // (counts differ when heads do not split evenly, and a separate count
  // exchange would double the latency of the two collectives per layer).
  const int64_t slot = cap + 1;
  send_.assign(static_cast<size_t>(slot), 0.0f);
  send_[0] = static_cast<float>(n_local);  // exact: counts are < 2^24
  std::copy(local, local + n_local, send_.begin() + 1);
  gathered_.resize(static_cast<size_t>(slot * size_));
  MPI_Request req = MPI_REQUEST_NULL;
  MPI_Iallgather(send_.data(), static_cast<int>(slot), MPI_FLOAT, gathered_.data(),
                 static_cast<int>(slot), MPI_FLOAT, comm_, &req);
  RETURN_IF_ERROR(Wait(&req, "all-gather"));
  counts_.assign(static_cast<size_t>(size_), 0);
  for (int r = 0; r < size_; ++r) {
    const float c = gathered_[static_cast<size_t>(r * slot)];
    if (!(c >= 0 && c <= static_cast<float>(cap))) {
      return DataLoss("TP collective: rank " + std::to_string(r) + " sent a bad count");
    }
    counts_[r] = static_cast<int>(c);
  }
  return Status::Ok();
}

Status MpiTpCollective::AllGather(const float* local, int64_t n_local, float* out, int64_t n_out) {
  // No rank holds more than the whole.
  RETURN_IF_ERROR(Gather(local, n_local, n_out));
  int64_t total = 0;
  for (int c : counts_) total += c;
  if (total != n_out) {
    return DataLoss("TP all-gather: ranks sent " + std::to_string(total) +
                    " floats in all, expected " + std::to_string(n_out));
  }
  const int64_t slot = n_out + 1;
  float* dst = out;
  for (int r = 0; r < size_; ++r) {  // rank order
    const float* src = gathered_.data() + r * slot + 1;
    dst = std::copy(src, src + counts_[r], dst);
  }
  return Status::Ok();
}

Status MpiTpCollective::AllReduceSum(float* data, int64_t n) {
  RETURN_IF_ERROR(Gather(data, n, n));
  for (int r = 0; r < size_; ++r) {
    if (counts_[r] != n) {
      return DataLoss("TP all-reduce: rank " + std::to_string(r) + " sent " +
                      std::to_string(counts_[r]) + " floats, expected " + std::to_string(n));
    }
  }
  // Rank order, as the TCP link adds: ((x0 + x1) + x2) ...
  const float* x = gathered_.data() + 1;
  for (int64_t i = 0; i < n; ++i) data[i] = x[i];
  for (int r = 1; r < size_; ++r) {
    const float* p = x + static_cast<int64_t>(r) * (n + 1);
    for (int64_t i = 0; i < n; ++i) data[i] += p[i];
  }
  return Status::Ok();
}

}  // namespace kvrelay::decode_worker
