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

Result<MpiSession> MpiSession::Start(int* argc, char*** argv) {
  if (!LaunchedByMpirun()) return MpiSession(false);
  RETURN_IF_ERROR(InitMpiThreadMultiple(argc, argv));
  return MpiSession(true);
}

MpiSession::~MpiSession() {
  if (!active_) return;
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
