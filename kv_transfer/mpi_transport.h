// MPI backend: MPI_Isend/MPI_Irecv on a communicator given at construction
// (MPI_COMM_WORLD by default, or a decode group's sub-communicator).
//
// Threading choice: every MPI call of this transport is made by its one
// progress thread ("kv-mpi-progress"); API threads only queue work. MPI must
// be initialised with at least MPI_THREAD_SERIALIZED; MPI_THREAD_MULTIPLE
// (what InitMpiThreadMultiple requests) is needed when the application makes
// MPI calls of its own while the transport lives, which is the normal case.
// Create() checks the provided level and refuses below SERIALIZED.
//
// Wire: a 24-byte header message (request, tag, total) on header_tag, then
// the payload on data_tag as one message described by an hindexed datatype
// over the caller's regions (no staging copy on either side when the receive
// is posted first). MPI's per-(source, tag) ordering pairs payloads with
// headers. A payload whose receive is not posted yet is received into a
// staging buffer and copied when the receive is posted.
//
// Progress policy: while a message is actually moving (an MPI request of a
// send or of a matched payload is active) the progress thread keeps calling
// MPI_Test, yielding between calls, because MPI advances large transfers only
// inside those calls. After any progress it keeps polling the same way for
// spin_after_progress (the next header of a stream, or the reply to what was
// just sent, usually follows within microseconds). Otherwise it sleeps on a
// condition variable with exponential backoff between header polls, woken at
// once by new sends: up to posted_sleep_max while a receive is posted (a
// caller waits for data), up to idle_sleep_max when nothing is posted. An
// idle transport does not spin a core.
//
// Cancel: MPI cannot withdraw a message that is already matched, so Cancel of
// a send, or of a receive whose payload is already arriving, waits (up to
// cancel_drain_timeout) for MPI to release the buffers. A live peer always
// drains headers and payloads, so this is bounded by the transfer time.
//
// Dead peers: Open MPI 4.1 (even under mpirun --enable-recovery) never
// completes nor errors an MPI_Isend to a dead rank. Peer death is learnt from
// the control plane, which calls AbandonPeer: sends still queued fail at
// once; requests already handed to MPI end kAborted and their buffers are
// quarantined (the caller never reuses them; MPI may still read them), so
// nothing waits for the drain timeout. ConnectPeer re-admits a rank that came
// back (a stalled process that re-registered).
#pragma once

#include <mpi.h>

#include <chrono>
#include <deque>
#include <memory>
#include <thread>

#include "kv_transfer/transport_base.h"

namespace kvrelay::kv_transfer {

// MPI_Init_thread(MPI_THREAD_MULTIPLE) unless already initialised; error if
// the library provides less than MPI_THREAD_SERIALIZED.
Status InitMpiThreadMultiple(int* argc, char*** argv);

class MpiTransport final : public TransportBase {
 public:
  struct Options {
    MPI_Comm comm = MPI_COMM_WORLD;
    int max_inflight = 4096;
    int64_t max_unexpected_bytes = 1ll << 30;
    int header_tag = 0x4B56;
    int data_tag = 0x4B57;
    std::chrono::microseconds idle_sleep_min{20};
    std::chrono::microseconds idle_sleep_max{1000};
    std::chrono::microseconds posted_sleep_max{200};
    std::chrono::microseconds spin_after_progress{200};
    std::chrono::milliseconds cancel_drain_timeout{5000};
    // Shutdown waits this long beyond cancel_drain_timeout for the progress
    // thread; one stuck inside an MPI call past it ends the process with
    // stuck_exit_code (see Shutdown).
    std::chrono::milliseconds shutdown_grace{5000};
    int stuck_exit_code = 1;
  };
  static Result<std::unique_ptr<MpiTransport>> Create(Options options);
  ~MpiTransport() override;
  // Stops the progress thread. Call after the peers are done (e.g. after an
  // MPI_Barrier); transfers still in flight are failed. Idempotent.
  // A progress thread that does not end within cancel_drain_timeout +
  // shutdown_grace is inside an MPI call that does not return: seen with
  // Open MPI 4.1 after a peer died while this process sent to it (its
  // opal_progress never returns from the TCP BTL's event loop). Such a
  // thread can neither be joined nor outlived by this object, and MPI
  // cannot be finalized, so the process ends at once with stuck_exit_code
  // (std::_Exit), as MpiSession does when MPI_Finalize hangs.
  void Shutdown();

  std::string_view name() const override { return "mpi"; }
  bool SupportsDeviceMemory() const override { return false; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  Status ConnectPeer(int peer, std::string_view conn_info, Deadline deadline) override;

  static constexpr size_t kMaxMessageBytes = size_t{1} << 30;

 private:
  struct Active;
  explicit MpiTransport(Options options);
  Status StartSendLocked(const OpPtr& op, std::unique_lock<std::mutex>& lock) override;
  void RecvPostedLocked(const OpPtr& op, std::unique_lock<std::mutex>& lock) override;
  void CancelLocked(const OpPtr& op, std::unique_lock<std::mutex>& lock) override;
  void AbandonPeerLocked(int peer, const Status& why, std::unique_lock<std::mutex>& lock) override;
  void ProgressLoop();

  Options options_;
  int rank_ = 0;
  int world_size_ = 1;
  std::thread progress_;
  // Guarded by domain_->mu.
  bool stopping_ = false;
  bool progress_exited_ = false;
  std::deque<OpPtr> send_queue_;
};

}  // namespace kvrelay::kv_transfer
