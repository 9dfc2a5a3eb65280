// Runs under `mpirun --enable-recovery -np 2`: rank 1 SIGKILLs itself, rank 0
// has a 64 MiB MPI send in flight to it. Open MPI 4.1 never completes nor
// errors such a send; the transport must give up on it as soon as it is told
// the peer is dead (AbandonPeer, what the control plane does on a missed
// heartbeat): the send ends kAborted within milliseconds, its buffer is
// counted as quarantined (and deliberately never freed here), a queued
// receive from the dead rank fails Unavailable, new posts to it are refused,
// and Shutdown does not wait for the abandoned requests.
//
// mpirun's own exit status reflects rank 1's signal, so the test's verdict is
// the line "mpi peer death: PASSED" (ctest PASS_REGULAR_EXPRESSION).
#include <mpi.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "common/clock.h"
#include "kv_transfer/mpi_session.h"
#include "kv_transfer/mpi_transport.h"

namespace kvrelay::kv_transfer {
namespace {

int failures = 0;

void Check(bool ok, const std::string& what) {
  std::printf("%s: %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++failures;
}

TransferDesc Desc(int peer, uint64_t request, std::vector<uint8_t>* buf) {
  TransferDesc d;
  d.peer = peer;
  d.request_id = request;
  d.layout = {1, static_cast<int64_t>(buf->size() / 2), MemoryKind::kHost};
  d.slices.push_back({0, 0, 1, 0, 1, buf->data(), 0});
  return d;
}

// True once `pid` is gone or a zombie (it cannot run MPI any more).
bool Dead(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return true;
  std::string line;
  std::getline(stat, line);
  const size_t paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'Z';
}

int RunSurvivor(MpiTransport* t, pid_t victim) {
  const Deadline gone = Deadline::AfterMs(20000);
  while (!Dead(victim) && !gone.Expired()) usleep(2000);  // polls a condition, with a deadline
  Check(Dead(victim), "rank 1 (pid " + std::to_string(victim) + ") is dead");

  // Never freed: once abandoned, MPI may read these buffers at any time.
  auto* big = new std::vector<uint8_t>(64u << 20, 0x5A);
  auto* big2 = new std::vector<uint8_t>(64u << 20, 0x5B);
  std::vector<uint8_t> small(4096);
  auto send = t->PostSend(Desc(1, 7, big));
  auto send2 = t->PostSend(Desc(1, 8, big2));
  auto recv = t->PostRecv(Desc(1, 9, &small));
  Check(send.ok() && send2.ok() && recv.ok(), "sends and a receive posted to the dead rank");
  if (!send.ok() || !send2.ok() || !recv.ok()) return 1;
  // Give MPI a real chance to move the message: it must not complete.
  const Status early = t->Wait(*send, Deadline::AfterMs(300));
  Check(early.code() == StatusCode::kDeadlineExceeded || early.code() == StatusCode::kAborted,
        "the 64 MiB send to the dead rank does not complete (" + early.ToString() + ")");
  // The Wait above cancelled `send`: MPI owns it, so the cancel waited the
  // drain timeout and left it bound; AbandonPeer must now take both sends.
  auto post_again = t->PostSend(Desc(1, 10, big));

  const auto start = Clock::now();
  t->AbandonPeer(1, Unavailable("rank 1 was killed"));
  const double abandon_s = SecondsSince(start);
  Check(abandon_s < 1.0, "AbandonPeer returned in " + std::to_string(abandon_s) + " s");
  const Status s2 = t->Cancel(*send2);
  Check(s2.code() == StatusCode::kAborted,
        "Cancel of the abandoned send reports its buffers quarantined: " + s2.ToString());
  const Status r = t->Wait(*recv, Deadline::AfterMs(1000));
  Check(r.code() == StatusCode::kUnavailable,
        "the receive from the dead rank failed Unavailable: " + r.ToString());
  Check(t->quarantined_bytes() >= static_cast<int64_t>(64u << 20),
        "quarantined bytes counted: " + std::to_string(t->quarantined_bytes()));
  auto refused = t->PostSend(Desc(1, 11, &small));
  Check(!refused.ok() && refused.status().code() == StatusCode::kUnavailable,
        "a new send to the dead rank is refused: " + refused.status().ToString());
  if (post_again.ok()) (void)t->Cancel(*post_again);
  Check(t->inflight() == 0, "nothing left in flight: " + std::to_string(t->inflight()));

  // Only quarantined requests are left in MPI, and they never complete: the
  // progress thread must not spin on them (it did, a core for the rest of
  // the process's life after any peer death). Process CPU time over a fixed
  // half-second window while this thread sleeps.
  timespec cpu0{}, cpu1{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu0);
  const auto window = Clock::now();
  usleep(500000);  // the measurement window itself, not a wait for anything
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &cpu1);
  const double wall_s = SecondsSince(window);
  const double cpu_s = (cpu1.tv_sec - cpu0.tv_sec) + (cpu1.tv_nsec - cpu0.tv_nsec) * 1e-9;
  Check(cpu_s < 0.2 * wall_s,
        "with only quarantined requests left the transport idles: " + std::to_string(cpu_s) +
            " s of CPU in " + std::to_string(wall_s) + " s");

  const auto stop = Clock::now();
  t->Shutdown();
  const double shutdown_s = SecondsSince(stop);
  Check(shutdown_s < 2.0,
        "Shutdown did not wait for abandoned requests (" + std::to_string(shutdown_s) + " s)");
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace kvrelay::kv_transfer

int main(int argc, char** argv) {
  using namespace kvrelay::kv_transfer;
  auto session = MpiSession::Start(&argc, &argv, -1, 0);
  if (!session.ok() || !session->active()) {
    std::printf("FAIL: not under mpirun (%s)\n",
                session.ok() ? "no MPI" : session.status().ToString().c_str());
    return 2;
  }
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size != 2) {
    std::printf("FAIL: run with -np 2\n");
    return 2;
  }
  MpiTransport::Options o;
  o.cancel_drain_timeout = std::chrono::milliseconds(200);
  auto t = MpiTransport::Create(o);
  if (!t.ok()) {
    std::printf("FAIL: %s\n", t.status().ToString().c_str());
    return 2;
  }
  int pid = static_cast<int>(getpid());
  if (rank == 1) {
    MPI_Send(&pid, 1, MPI_INT, 0, 1, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    raise(SIGKILL);
  }
  MPI_Recv(&pid, 1, MPI_INT, 1, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  MPI_Barrier(MPI_COMM_WORLD);
  const int rc = RunSurvivor(t->get(), static_cast<pid_t>(pid));
  std::printf("mpi peer death: %s\n", rc == 0 ? "PASSED" : "FAILED");
  std::fflush(stdout);
  session->set_exit_code(rc);
  return rc;  // the session's destructor finalises under a deadline (a peer is dead)
}
