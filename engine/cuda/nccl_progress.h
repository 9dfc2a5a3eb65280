// The two rules the NCCL communicator and the nccl KV transport follow, kept
// free of NCCL and CUDA headers so the host-side tests check them without a
// GPU (tests/unit/cuda/nccl_progress_test.cc).
//
// 1. Completion on a non-blocking communicator. With `config.blocking = 0`
//    (every wait here has a deadline) ncclGroupEnd, ncclSend, ncclRecv and the
//    collectives may return ncclInProgress: the operation is accepted but NOT
//    yet enqueued on the caller's stream. NCCL's contract: poll
//    ncclCommGetAsyncError until it returns ncclSuccess before calling NCCL
//    again or trusting the stream. Until then the stream may be empty, and
//    cudaStreamQuery answers "idle" for work that has not started. That is the
//    H200 run's `nccl1` failure (2026-12-04): the receive read its 24-byte
//    header from a staging buffer nothing had written yet ("got request 0 tag
//    0 (0 bytes): posts out of order"), and the op's stream and staging
//    buffer were then freed while NCCL was still enqueueing work on them
//    (the SIGSEGV of the first run). So: an idle stream means "done" only
//    while the communicator's state is ncclSuccess.
// 2. Library version. The transport is built against one nccl.h and runs
//    with whatever libnccl.so.2 the machine has (the GPU machine's comes from
//    a Python wheel). NCCL keeps its ABI within a major version and grows
//    ncclConfig_t by minor version, so a library of another major, or older
//    in minor than the headers, is refused with both versions named.
#pragma once

#include <string>

#include "common/status.h"

namespace kvrelay::engine::cuda {

enum class NcclCommState { kSuccess, kInProgress, kFailed };
enum class StreamState { kIdle, kBusy, kFailed };
enum class NcclOpProgress { kDone, kPending, kFailed };

constexpr NcclOpProgress ClassifyNcclProgress(NcclCommState comm, StreamState stream) {
  if (comm == NcclCommState::kFailed || stream == StreamState::kFailed) {
    return NcclOpProgress::kFailed;
  }
  // Rule 1: work accepted in progress may not be on the stream yet.
  if (comm == NcclCommState::kInProgress) return NcclOpProgress::kPending;
  return stream == StreamState::kIdle ? NcclOpProgress::kDone : NcclOpProgress::kPending;
}

// NCCL_VERSION_CODE encoding since 2.9: major * 10000 + minor * 100 + patch.
struct NcclVersion {
  int major = 0, minor = 0, patch = 0;
  static constexpr NcclVersion FromCode(int code) {
    return {code / 10000, (code % 10000) / 100, code % 100};
  }
  std::string ToString() const {
    return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
  }
};

// Rule 2: OK when the loaded library can serve code built against `header`;
// otherwise FailedPrecondition naming both versions. `allow_mismatch` (the
// KVRELAY_NCCL_ALLOW_VERSION_MISMATCH=1 escape hatch) turns a refusal into OK.
inline Status CheckNcclVersion(int header_code, int runtime_code, bool allow_mismatch) {
  const NcclVersion h = NcclVersion::FromCode(header_code);
  const NcclVersion r = NcclVersion::FromCode(runtime_code);
  const bool compatible = r.major == h.major && r.minor >= h.minor;
  if (compatible || allow_mismatch) return Status::Ok();
  return FailedPrecondition("NCCL library " + r.ToString() + " (libnccl.so.2 loaded at run time) " +
                            "cannot serve code built against nccl.h " + h.ToString() +
                            ": use a library of major " + std::to_string(h.major) +
                            " and minor >= " + std::to_string(h.minor) +
                            " (LD_LIBRARY_PATH), or rebuild against its " +
                            "headers; KVRELAY_NCCL_ALLOW_VERSION_MISMATCH=1 overrides");
}

}  // namespace kvrelay::engine::cuda
