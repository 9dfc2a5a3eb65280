#include "kv_transfer/mpi_session.h"

#include <mpi.h>
#include <unistd.h>

#include <condition_variable>
#include <mutex>
#include <thread>

#include "common/logging.h"
#include "kv_transfer/mpi_transport.h"
#include "kv_transfer/transport_factory.h"

namespace kvrelay::kv_transfer {

namespace {
MPI_Comm g_tp_comm = MPI_COMM_NULL;  // set once in Start, before any other thread exists
}  // namespace

MPI_Comm MpiSession::tp_comm() { return g_tp_comm; }

Result<MpiSession> MpiSession::Start(int* argc, char*** argv, int tp_color, int tp_key) {
  if (!LaunchedByMpirun()) return MpiSession(false);
  RETURN_IF_ERROR(InitMpiThreadMultiple(argc, argv));
  MpiSession session(true);
  const int rc =
      MPI_Comm_split(MPI_COMM_WORLD, tp_color < 0 ? MPI_UNDEFINED : tp_color, tp_key, &g_tp_comm);
  if (rc != MPI_SUCCESS) return Unavailable("MPI_Comm_split of the TP groups failed");
  return session;
}

MpiSession::~MpiSession() {
  if (!active_) return;
  if (g_tp_comm != MPI_COMM_NULL) {
    // Not MPI_Comm_free: it is collective and a member may be dead.
    g_tp_comm = MPI_COMM_NULL;
  }
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  const int code = exit_code_;
  const auto timeout = finalize_timeout_;
  std::thread watchdog([&] {
    std::unique_lock lock(mu);
    if (!cv.wait_for(lock, timeout, [&] { return done; })) {
      LOG_WARNING << "MPI_Finalize did not return within " << timeout.count()
                  << " ms (a peer of the job is gone); exiting without it";
      _exit(code);
    }
  });
  MPI_Finalize();  // on the thread that initialised MPI, as the standard asks
  {
    std::lock_guard lock(mu);
    done = true;
  }
  cv.notify_all();
  watchdog.join();
}

}  // namespace kvrelay::kv_transfer
