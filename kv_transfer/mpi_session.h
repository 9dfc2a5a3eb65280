// MpiSession: MPI's lifetime in a daemon launched by mpirun.
//
// With Open MPI, when one process of a job calls MPI_Init every process of
// the job must (the others' MPI_Init waits for it), so under mpirun EVERY
// kvrelay daemon — coordinator included, even though it only idles in MPI —
// holds an MpiSession for its whole life. Outside mpirun it does nothing.
//
// MPI_Finalize synchronises with the job's other processes; a peer that died
// (a fault, kill -9) can make it wait forever, so the destructor finalizes
// under a deadline and ends the process with `exit_code` if it is missed:
// an exiting daemon never hangs on MPI.
#pragma once

#include <mpi.h>

#include <chrono>

#include "common/status.h"

namespace kvrelay::kv_transfer {

// Under mpirun every process joins the TP split at startup (MPI_Comm_split is
// collective over MPI_COMM_WORLD): the ranks of one tensor-parallel decode
// group pass the same color (the group leader's world rank) and their TP rank
// as key; every other process passes kNoTpGroup.
inline constexpr int kNoTpGroup = -1;

class MpiSession {
 public:
  // MPI_Init_thread(MPI_THREAD_MULTIPLE) and the TP split when launched by
  // mpirun; nothing otherwise.
  static Result<MpiSession> Start(int* argc, char*** argv, int tp_color = kNoTpGroup,
                                  int tp_key = 0);
  // This process's TP sub-communicator (MPI_COMM_NULL when it is in no
  // group or MPI is not running). Valid while the session lives.
  static MPI_Comm tp_comm();
  MpiSession(MpiSession&& other) noexcept : active_(other.active_) { other.active_ = false; }
  MpiSession& operator=(MpiSession&&) = delete;
  ~MpiSession();

  bool active() const { return active_; }
  // The status the process ends with if MPI_Finalize misses its deadline.
  void set_exit_code(int code) { exit_code_ = code; }

 private:
  explicit MpiSession(bool active) : active_(active) {}
  bool active_ = false;
  int exit_code_ = 0;
  std::chrono::milliseconds finalize_timeout_{5000};
};

}  // namespace kvrelay::kv_transfer
