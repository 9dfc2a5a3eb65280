// The fault matrix (issue #14): a `kvrelay launch` cluster serving an
// open-loop client at ~70% of the capacity measured just before, and one fault
// injected mid-load:
//   kill -9 of the prefill worker, of the decode worker, of a TP follower, of
//   the coordinator (the launcher restarts each; a follower's whole group);
//   SIGSTOP of the prefill or decode worker past the heartbeat deadline (the
//   coordinator drops it; resumed, it reconnects); SIGSTOP of a TP follower
//   (rank 0 misses the step deadline, drains and leaves; the launcher
//   restarts the group); SIGSTOP of the coordinator past its heartbeat
//   deadline (workers stay, or re-register, and serving resumes), and past
//   the workers' coordinator deadline (every worker drops its link, retries
//   with backoff and re-registers after the SIGCONT).
// Each case asserts the hard invariants:
//   - no request fails for the fault of a worker (prefill, decode, TP
//     follower): it migrates or waits for the worker to come back;
//   - every request ends with a final status within a bound (none hangs):
//     40 s for any request, and, for those in flight at the fault or sent
//     after it, 2 heartbeat intervals from the fault (or from their sending;
//     for a stopped coordinator, from its SIGCONT) for an error, plus the
//     load's own latency for an answer, every silent-fault deadline being
//     set from the heartbeat interval (kFinalStatusWithinS);
//   - every answer that completes equals the single-process engine's greedy
//     tokens (no wrong token);
//   - the cluster serves again afterwards (the victim back in /health and
//     kvrelay_worker_healthy 1, consecutive answers right);
//   - every worker's KV blocks are back at their idle baseline;
// and prints its figures (requests affected, time to their final status, time
// until serving again) as one "FAULT ..." line for docs/BENCHMARKS.md.
//
// Short form (label integration, in ./scripts/test.sh): 1 prefill + 1 decode,
// a few seconds of load around the fault. KVRELAY_FAULTS_LONG=1 (the `slow`
// CTest entry): 2 prefill + 2 decode, longer load, every case three times.
// Timings beyond those bounds are reported, not asserted: the CI machine is
// a loaded 2-core host.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "common/http_client.h"
#include "deploy/local_launcher.h"
#include "deploy/process_group.h"
#include "protocols/cluster_auth.h"
#include "tests/faults/fault_harness.h"
#include "tests/faults/tcp_relay.h"
#include "tests/testing/skip.h"

namespace kvrelay::faults {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

bool LongForm() {
  const char* v = std::getenv("KVRELAY_FAULTS_LONG");
  return v != nullptr && std::string(v) == "1";
}

// The coordinator's --migration-limit for a measurement of the behaviour
// without it (KVRELAY_FAULTS_MIGRATION_LIMIT=0: a fault's requests fail, so
// the "none affected" checks are off); empty: the default (3), checked.
std::string MigrationLimit() {
  const char* v = std::getenv("KVRELAY_FAULTS_MIGRATION_LIMIT");
  return v != nullptr ? std::string(v) : std::string();
}

constexpr int kMaxTokens = 8;
constexpr int kRequestTimeoutMs = 60'000;  // the client's own bound; a request this slow hung
constexpr double kFinalStatusBoundS = 40;  // every request ends well inside it

enum class Fault { kKill, kStop, kLongStop };

struct Case {
  const char* name;
  const char* victim;  // process name in the launcher's log
  Fault fault;
  int tp = 1;  // ranks per decode group (kvrelay launch --tp)
};

// H, the cluster's heartbeat interval (LaunchedCluster::Options::heartbeat_ms).
// The issue's bound is "every request gets a final status within 2 heartbeat
// intervals" of the fault, so every silent-fault deadline is set from H to
// end inside it, and 2 H must also hold a request's ordinary latency under
// ~70% load on a loaded 2-core host (up to ~0.8 s measured): hence 1 s, not
// the 200 ms the matrix used when it allowed 3 s of slack.
constexpr double kHeartbeatS = 1.0;
// The coordinator drops a worker silent for 1.5 H (--heartbeat-timeout-ms;
// checked every tenth of it): a heartbeat may come 0.5 H late before a live
// worker is taken for dead, and a silent one is dropped, its requests ended,
// by 1.65 H after its last heartbeat, which was before the fault.
constexpr double kHeartbeatTimeoutS = 1.5 * kHeartbeatS;
// The TP ranks' --tp-step-timeout-ms: rank 0 notices a silent follower within
// it mid-step, or within 1.25 x it between steps (it pings each quarter), so
// 1.2 H puts detection at <= 1.5 H.
constexpr double kTpStepTimeoutS = 1.2 * kHeartbeatS;
// The workers' --kv-progress-timeout-ms (the KV path cases): a stream that
// moves nothing for 1.5 H fails, counted from its last byte, before the cut.
constexpr double kKvProgressTimeoutS = 1.5 * kHeartbeatS;
// The workers' coordinator-liveness deadline (--coordinator-timeout-ms): 3 H,
// as their default would be at this interval (worker/worker_options.h).
constexpr double kCoordinatorTimeoutS = 3 * kHeartbeatS;
// How long the coordinator stays SIGSTOPped. Short: past its own 1.5 H
// worker deadline (it must not drop its workers for its own stall) and under
// the workers' coordinator deadline (they may keep their links). Long: 1.5 H
// past the workers' deadline, so every worker drops its link and retries with
// backoff until the coordinator answers again, then re-registers.
constexpr auto kCoordinatorStop = milliseconds(static_cast<int>(1600 * kHeartbeatS));
constexpr auto kCoordinatorLongStop =
    milliseconds(static_cast<int>(1000 * (kCoordinatorTimeoutS + 1.5 * kHeartbeatS)));
// Every request in flight at the fault or sent after it gets its final status
// within 2 H of the fault, or of its own sending when later (a stopped
// coordinator can say nothing while stopped: for it the clock starts at its
// SIGCONT). An error, the fault's doing, must come within 2 H, no slack. An
// answer also carries the request's ordinary latency under this load, which
// is no fault's doing and on a loaded shared host reaches 2 H by itself
// (measured here at load average 18: up to 1.4 s; 0.2-0.4 s quiet): an answer
// is allowed 2 H plus the worst latency of the answers completed before the
// fault in the same run (OrdinaryLatencyS; printed), i.e. the fault may hold
// an answered request back by at most 2 H. Requests sent to a stopped
// coordinator wait in its listen backlog and are answered together after its
// SIGCONT: those answers may take that backlog / the measured capacity more;
// so may, in the short form, the answers to the requests that waited for a
// role's only worker to come back (RunOnce).
constexpr double kFinalStatusWithinS = 2 * kHeartbeatS;
// How long the coordinator holds a request that finds no healthy worker of a
// role, new or migrating after a loss, waiting for one to register
// (--worker-wait-ms; its default is one heartbeat). The short form has one
// worker per role, so a request whose worker died or stalled waits for that
// worker's restart or resumption: 2 H covers it here (0.3-0.6 s after the
// drop measured, on a loaded host more), and the matrix asserts that no
// request fails for the fault of a worker (issue #39).
constexpr double kWorkerWaitS = 2 * kHeartbeatS;

// Requests sent before `t` and answered (or failed) after it.
int InFlightAt(const std::vector<Outcome>& outcomes, Clock::time_point t) {
  int n = 0;
  for (const Outcome& o : outcomes) n += o.sent < t && o.ended > t;
  return n;
}

// The worst latency of the requests answered before the fault (the load's
// own latency, with no fault in it); 0 when none.
double OrdinaryLatencyS(const std::vector<Outcome>& outcomes, Clock::time_point fault_at) {
  double worst = 0;
  for (const Outcome& o : outcomes) {
    if (o.http_status == 200 && o.ended <= fault_at) worst = std::max(worst, o.seconds());
  }
  return worst;
}
// A right answer, sent after the fault, ends within this of the fault
// detection (of the SIGCONT, for a stopped coordinator).
constexpr double kServingAgainBoundS = 5.0;

// How long the fault takes to be detectable by design (see the cases); the
// coordinator's stop is measured from its SIGCONT instead.
double DetectS(const Case& c) {
  const std::string v = c.victim;
  if (c.fault == Fault::kKill) return 0;  // a closed connection, at once
  if (v == "coordinator") return 0;
  if (v.find("-tp") != std::string::npos) return kTpStepTimeoutS * 1.25;
  return kHeartbeatTimeoutS * 1.1;  // a silent worker, checked every tenth of the deadline
}

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

class FaultMatrixTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    ref_ = GreedyReference::Get();
    if (ref_ == nullptr)
      KVRELAY_SKIP_OR_FAIL() << "model file not present (run scripts/fetch-model.sh)";
    const char* texts[] = {"The capital of France is", "Rivers flow to the sea because",
                           "def add(a, b):\n    return", "The three primary colours are"};
    for (const char* t : texts) {
      prompts_.push_back(ref_->Encode(t));
      expected_.push_back(ref_->Text(prompts_.back(), kMaxTokens));
    }
    LaunchedCluster::Options o;
    o.prefill = LongForm() ? 2 : 1;
    o.decode = LongForm() ? 2 : 1;
    o.heartbeat_ms = static_cast<int>(kHeartbeatS * 1000);
    o.heartbeat_timeout_ms = static_cast<int>(kHeartbeatTimeoutS * 1000);
    o.tp_step_timeout_ms = static_cast<int>(kTpStepTimeoutS * 1000);
    o.coordinator_timeout_ms = static_cast<int>(kCoordinatorTimeoutS * 1000);
    // A stall queues the open-loop load behind it; what is tested is that no
    // request fails for the fault, so early shedding (the coordinator's 2 s
    // bound on a predicted wait, tested in coordinator_test) is off.
    o.extra = {"--coordinator-arg=--worker-wait-ms=" +
                   std::to_string(static_cast<int>(kWorkerWaitS * 1000)),
               "--max-queue-delay-ms", "0"};
    if (!MigrationLimit().empty()) {
      o.extra.push_back("--coordinator-arg=--migration-limit=" + MigrationLimit());
    }
    if (GetParam().tp > 1) {
      o.extra.push_back("--tp");
      o.extra.push_back(std::to_string(GetParam().tp));
    }
    auto c = LaunchedCluster::Start(o);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    cluster_ = std::move(*c);
    for (int i = 0; i < o.prefill; ++i) workers_.push_back("prefill-" + std::to_string(i));
    for (int i = 0; i < o.decode; ++i) workers_.push_back("decode-" + std::to_string(i));
  }
  void TearDown() override {
    if (cluster_ != nullptr && HasFailure()) {
      std::fprintf(stderr, "--- launcher log tail ---\n%s\n", cluster_->LogTail(60000).c_str());
    }
    cluster_.reset();
  }

  uint16_t port() const { return cluster_->http_port(); }

  bool AllIdle() {
    auto running = WorkerGauge(port(), "kvrelay_worker_running");
    if (running.size() != workers_.size()) return false;
    for (const auto& [w, v] : running) {
      if (v != 0) return false;
    }
    return true;
  }

  // Requests per second the cluster completes with 2 clients back to back.
  double MeasureCapacity() {
    constexpr int kPerClient = 3;
    const auto start = Clock::now();
    std::vector<std::thread> clients;
    std::atomic<int> ok{0};
    for (int c = 0; c < 2; ++c) {
      clients.emplace_back([&, c] {
        for (int i = 0; i < kPerClient; ++i) {
          const int p = (c * kPerClient + i) % static_cast<int>(prompts_.size());
          Outcome o = Complete(port(), prompts_[p], kMaxTokens, kRequestTimeoutMs);
          EXPECT_EQ(o.http_status, 200) << o.error;
          EXPECT_EQ(o.text, expected_[p]);
          if (o.http_status == 200) ok.fetch_add(1);
        }
      });
    }
    for (auto& t : clients) t.join();
    return ok.load() / std::max(1e-3, Seconds(Clock::now() - start));
  }

  void RunOnce(const Case& c, int round);

  GreedyReference* ref_ = nullptr;
  std::unique_ptr<LaunchedCluster> cluster_;
  std::vector<std::string> workers_;
  std::vector<std::vector<int32_t>> prompts_;
  std::vector<std::string> expected_;
};

void FaultMatrixTest::RunOnce(const Case& c, int round) {
  const std::string victim = c.victim;
  const bool coordinator = victim == "coordinator";
  // A TP follower has no coordinator link: its fault shows on its group,
  // which rank 0 registers ("decode-0-tp1" -> "decode-0"), and the launcher
  // restarts the group as a whole.
  const bool follower = victim.find("-tp") != std::string::npos;
  const std::string watched = follower ? victim.substr(0, victim.find("-tp")) : victim;
  const bool restarted = c.fault == Fault::kKill || follower;
  const bool stopped_coordinator = coordinator && c.fault != Fault::kKill;
  std::map<std::string, pid_t> worker_pids;
  for (const auto& w : workers_) worker_pids[w] = cluster_->Pid(w);
  // Idle baseline of every worker's KV use (unreferenced prefix-cache blocks
  // count as free), and the load rate: 70% of what was just measured.
  const double capacity = MeasureCapacity();
  ASSERT_TRUE(WaitFor([&] { return AllIdle(); }, seconds(30))) << "the cluster never went idle";
  const auto baseline = WorkerGauge(port(), "kvrelay_worker_kv_utilization");
  const double rate = std::max(0.5, 0.7 * capacity);
  const pid_t pid = cluster_->Pid(victim);
  ASSERT_GT(pid, 0) << victim << " not in the launcher's log";
  const int restarts_before = cluster_->Restarts();

  LoadClient load(port(), prompts_, kMaxTokens, kRequestTimeoutMs);
  load.Start(rate);
  // Load for a moment before the fault (so requests are in flight at it).
  std::this_thread::sleep_for(milliseconds(LongForm() ? 8000 : 2500));  // load duration, no race
  // The fault must hit a request: at ~70% load the cluster is idle ~30% of the
  // time, so wait for one in flight rather than hope.
  ASSERT_TRUE(WaitFor([&] { return load.InFlight() > 0; }, seconds(20)))
      << "no request in flight within 20 s of load";
  const auto fault_at = Clock::now();
  // Where the final-status clock starts: the fault, or a stopped
  // coordinator's SIGCONT (it cannot answer before).
  auto clock_at = fault_at;
  const int registrations_before = cluster_->CountInLog("] registered as ");
  if (c.fault == Fault::kKill) {
    ASSERT_EQ(kill(pid, SIGKILL), 0);
  } else if (coordinator) {
    // A stopped coordinator answers nothing (HTTP or control) and cannot
    // report itself; past its heartbeat deadline (the long stop: past the
    // workers' coordinator deadline too) it is resumed. Workers must not
    // exit meanwhile; afterwards they stay or re-register and it serves again.
    ASSERT_EQ(kill(pid, SIGSTOP), 0);
    std::this_thread::sleep_for(c.fault == Fault::kLongStop ? kCoordinatorLongStop
                                                            : kCoordinatorStop);  // no race
    kill(pid, SIGCONT);
    clock_at = Clock::now();
  } else {
    ASSERT_EQ(kill(pid, SIGSTOP), 0);
    // Past the heartbeat deadline (a TP follower: past the group's step
    // deadline): the coordinator stops counting it healthy.
    const bool dropped = WaitFor(
        [&] {
          auto h = WorkerGauge(port(), "kvrelay_worker_healthy");
          return h.count(watched) == 0 || h[watched] == 0;
        },
        seconds(10));
    kill(pid, SIGCONT);
    ASSERT_TRUE(dropped) << watched << " still healthy 10 s after SIGSTOP of " << victim;
  }
  // Serving again: the victim (restarted, or resumed and re-registered) is in
  // /health and reported healthy.
  const bool back = WaitFor(
      [&] {
        if (restarted && cluster_->Pid(victim) == pid) return false;
        if (!HealthyWith(port(), workers_)) return false;
        auto h = WorkerGauge(port(), "kvrelay_worker_healthy");
        for (const auto& w : workers_) {
          if (h[w] != 1) return false;
        }
        return true;
      },
      seconds(60));
  const auto back_at = Clock::now();
  // Keep the load on a little after recovery, then stop it.
  std::this_thread::sleep_for(milliseconds(LongForm() ? 8000 : 2000));  // load duration, no race
  std::vector<Outcome> outcomes = load.Stop();
  EXPECT_GE(InFlightAt(outcomes, fault_at), 1) << "the fault hit no request in flight";
  ASSERT_TRUE(back) << victim << " did not come back within 60 s";

  int affected = 0, ok = 0, wrong = 0;
  // Requests sent while the coordinator was stopped (issue #46 finding 5:
  // they all failed when it resumed), and those of them that failed.
  int sent_in_stall = 0, failed_in_stall = 0;
  std::string first_error;
  double worst_final = 0, worst_latency = 0, first_ok_after = -1, worst_after_fault = 0;
  const double final_bound = kFinalStatusWithinS;
  const double ordinary = OrdinaryLatencyS(outcomes, fault_at);
  // A stopped coordinator leaves the requests sent while it was stopped in
  // its listen backlog; once it runs again and its workers are back it serves
  // them all at once, and no cluster answers a backlog faster than its
  // capacity. An answer from that backlog may also take backlog / capacity.
  // Likewise in the short form a stalled or dead worker is its role's only
  // one: the requests waiting for it when it is back (those on it when it
  // went, and those sent while it was away) are served together, and
  // continuous batching ends the first of them about when the last: an answer
  // may take the number waiting at the return / capacity more (the CI run of
  // stop 54: decode-0's group back 2.4 s after the fault with ~15 waiting,
  // their answers 4.3-4.8 s after it).
  int backlog = 0;
  if (stopped_coordinator) {
    for (const Outcome& o : outcomes) {
      if (o.sent >= fault_at && o.sent < clock_at) ++backlog;
    }
  } else if (!LongForm()) {
    backlog = InFlightAt(outcomes, back_at);
  }
  const double backlog_s = backlog / std::max(capacity, 1e-3);
  for (size_t i = 0; i < outcomes.size(); ++i) {
    const Outcome& o = outcomes[i];
    const bool in_stall = stopped_coordinator && o.sent >= fault_at && o.sent < clock_at;
    sent_in_stall += in_stall;
    failed_in_stall += in_stall && o.http_status != 200;
    worst_latency = std::max(worst_latency, o.seconds());
    EXPECT_LT(o.seconds(), kFinalStatusBoundS)
        << "request " << i << " took " << o.seconds() << " s: " << o.error;
    if (o.ended > fault_at) {
      // In flight at the fault or sent after it: an error within 2 heartbeat
      // intervals, an answer within them plus its ordinary latency.
      const double t = Seconds(o.ended - std::max(o.sent, clock_at));
      worst_after_fault = std::max(worst_after_fault, t);
      // The long form (2 prefill + 2 decode) keeps serving on the other
      // workers while the victim restarts, and that restart's model load
      // competes with them for the 2 cores: answers then run slower than
      // before the fault (2.6 s seen at load average 18) with nothing held
      // back, so there only errors are held to 2 H (answers to the 40 s
      // bound above). In the short form a request that finds its role's only
      // worker away waits for it up to the coordinator's --worker-wait-ms
      // (default one heartbeat, issue #46) and is then refused, or answered
      // once the worker is back: its answer meets 2 H + that wait + ordinary
      // latency.
      const bool answered = o.http_status == 200;
      if (!answered || !LongForm()) {
        const double bound =
            answered ? final_bound + kWorkerWaitS + ordinary + backlog_s : final_bound;
        EXPECT_LT(t, bound) << "request " << i << " (HTTP " << o.http_status << ") ended " << t
                            << " s after the fault (or its sending), bound " << bound
                            << " s: " << o.error;
      }
    }
    if (o.http_status == 200) {
      ++ok;
      if (o.text != expected_[o.prompt]) ++wrong;
      EXPECT_EQ(o.text, expected_[o.prompt]) << "request " << i << ": a wrong token";
      if (o.sent >= fault_at) {
        const double t = Seconds(o.ended - clock_at);
        if (first_ok_after < 0 || t < first_ok_after) first_ok_after = t;
      }
      continue;
    }
    ++affected;
    if (first_error.empty())
      first_error = std::to_string(o.http_status) + " " + o.error.substr(0, 160);
    if (o.ended > fault_at) {
      worst_final = std::max(worst_final, Seconds(o.ended - std::max(o.sent, clock_at)));
    }
    if (!coordinator) {
      // The coordinator lives: every refusal is an HTTP error with a body.
      EXPECT_TRUE(o.http_status == 429 || o.http_status == 500 || o.http_status == 503 ||
                  o.http_status == 504)
          << "request " << i << ": HTTP " << o.http_status << " " << o.error;
    }
  }
  EXPECT_GT(ok, 0);
  EXPECT_EQ(wrong, 0);
  if (stopped_coordinator) {
    // A stalled coordinator's listen backlog holds them; resumed, it finds
    // its workers (or waits --worker-wait-ms for them to register again)
    // and answers every one.
    EXPECT_GT(sent_in_stall, 0) << "the load sent nothing while the coordinator was stopped";
    EXPECT_EQ(failed_in_stall, 0) << failed_in_stall << " of " << sent_in_stall
                                  << " requests sent to the stopped coordinator failed; first "
                                     "error: "
                                  << first_error;
  }
  if (!coordinator && MigrationLimit().empty()) {
    // A worker killed or stalled fails no request: those on it move on to
    // the workers left, or wait for it to come back (--migration-limit,
    // --worker-wait-ms), and the client's stream continues.
    EXPECT_EQ(affected, 0) << "requests failed for the fault of " << victim
                           << "; first error: " << first_error;
  }
  EXPECT_GE(first_ok_after, 0) << "no request sent after the fault completed during the load";
  EXPECT_LT(first_ok_after, DetectS(c) + kServingAgainBoundS)
      << "serving again only " << first_ok_after << " s after the fault"
      << (stopped_coordinator ? " (its SIGCONT)" : "");
  // After the fault the cluster answers again, right, several times in a row.
  for (int i = 0; i < 3; ++i) {
    const int p = i % static_cast<int>(prompts_.size());
    Outcome o = Complete(port(), prompts_[p], kMaxTokens, kRequestTimeoutMs);
    EXPECT_EQ(o.http_status, 200) << "after the fault: " << o.error;
    EXPECT_EQ(o.text, expected_[p]);
  }
  // Every KV block is back: nothing running, each worker at most at its
  // baseline (a restarted worker starts empty).
  std::map<std::string, double> last;
  const bool returned = WaitFor(
      [&] {
        if (!AllIdle()) return false;
        last = WorkerGauge(port(), "kvrelay_worker_kv_utilization");
        if (last.size() != workers_.size()) return false;
        for (const auto& [w, v] : last) {
          if (v > baseline.at(w) + 1e-9) return false;
        }
        return true;
      },
      seconds(20));
  std::string report;
  for (const auto& [w, v] : last) {
    report += w + "=" + std::to_string(v) + " (baseline " +
              std::to_string(baseline.count(w) ? baseline.at(w) : -1) + ") ";
  }
  EXPECT_TRUE(returned) << "KV blocks not returned: " << report;
  if (restarted) {
    EXPECT_GT(cluster_->Restarts(), restarts_before) << "the launcher did not restart " << victim;
  } else {
    EXPECT_EQ(cluster_->Pid(victim), pid) << "a stalled worker is resumed, not restarted";
  }
  const int reregistered = cluster_->CountInLog("] registered as ") - registrations_before;
  if (!LongForm() && MigrationLimit().empty()) {
    // One fault moves a request once. A second move is a fault of the
    // recovery itself: a re-run handed a stale cancel of its own id (the
    // engine's event lookup), or the prefill side's late close of a resumed
    // decode worker's old data connections cutting its new streams.
    EXPECT_EQ(cluster_->CountInLog("(move 2 of "), 0)
        << "a request had to move again after moving for the fault of " << victim;
  }
  if (stopped_coordinator) {
    // No worker exited over the stopped coordinator: the same processes serve.
    EXPECT_EQ(cluster_->Restarts(), restarts_before);
    for (const auto& [w, p] : worker_pids) {
      EXPECT_EQ(cluster_->Pid(w), p) << w << " was restarted over a stopped coordinator";
    }
  }
  if (c.fault == Fault::kLongStop) {
    // Past their coordinator deadline every worker dropped its link and
    // registered again once the coordinator answered.
    EXPECT_GE(reregistered, static_cast<int>(workers_.size()))
        << "the workers did not re-register after a stop past their coordinator deadline";
  }
  std::printf(
      "FAULT %s round %d: capacity %.2f req/s, load %.2f req/s, %zu requests, %d affected "
      "(%.1f%%), worst time to final status after the fault %.2f s (any request %.2f s, "
      "bound %.2f s, answers + %.2f s ordinary latency + %.2f s for %d requests waiting at the "
      "return), worst latency %.2f s, first right answer sent after the fault %.2f s "
      "after it, victim healthy again after %.2f s, %d re-registrations; first error: %s\n",
      c.name, round, capacity, rate, outcomes.size(), affected,
      outcomes.empty() ? 0.0 : 100.0 * affected / static_cast<double>(outcomes.size()), worst_final,
      worst_after_fault, final_bound, ordinary, backlog_s, backlog, worst_latency, first_ok_after,
      Seconds(back_at - clock_at), reregistered, first_error.c_str());
  std::fflush(stdout);
}

TEST_P(FaultMatrixTest, EveryRequestEndsRightAndServingResumes) {
  const int rounds = LongForm() ? 3 : 1;
  for (int r = 0; r < rounds && !HasFatalFailure(); ++r) RunOnce(GetParam(), r);
}

INSTANTIATE_TEST_SUITE_P(
    Faults, FaultMatrixTest,
    ::testing::Values(Case{"kill_prefill", "prefill-0", Fault::kKill},
                      Case{"stop_prefill", "prefill-0", Fault::kStop},
                      Case{"kill_decode", "decode-0", Fault::kKill},
                      Case{"stop_decode", "decode-0", Fault::kStop},
                      Case{"kill_tp_follower", "decode-0-tp1", Fault::kKill, 2},
                      Case{"stop_tp_follower", "decode-0-tp1", Fault::kStop, 2},
                      Case{"kill_coordinator", "coordinator", Fault::kKill},
                      Case{"stop_coordinator", "coordinator", Fault::kStop},
                      Case{"long_stop_coordinator", "coordinator", Fault::kLongStop}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// deploy/mpirun/launch.sh -X tcp -R: a worker killed with SIGKILL is started
// again by its rank's supervisor (outside MPI), registers, and the cluster
// answers right again; the coordinator too.
TEST(MpirunSupervisionTest, KilledProcessesAreRestartedAndServeAgain) {
  if (std::system("command -v mpirun >/dev/null 2>&1 && command -v setpriv >/dev/null 2>&1") != 0) {
    KVRELAY_SKIP_OR_FAIL() << "mpirun or setpriv not found";
  }
  GreedyReference* ref = GreedyReference::Get();
  if (ref == nullptr)
    KVRELAY_SKIP_OR_FAIL() << "model file not present (run scripts/fetch-model.sh)";
  const std::vector<int32_t> prompt = ref->Encode("The capital of France is");
  const std::string want = ref->Text(prompt, kMaxTokens);
  LaunchedCluster::Options o;
  o.mpirun = true;
  // launch.sh passes the silent-fault deadlines through (checked below on
  // every process, restarted ones included, from its command line).
  o.heartbeat_timeout_ms = 3 * o.heartbeat_ms;
  o.tp_step_timeout_ms = 1'700;
  o.kv_progress_timeout_ms = 1'900;
  o.coordinator_timeout_ms = 6 * o.heartbeat_ms;
  auto started = LaunchedCluster::Start(o);
  ASSERT_TRUE(started.ok()) << started.status().ToString();
  std::unique_ptr<LaunchedCluster> cluster = std::move(*started);
  const uint16_t port = cluster->http_port();
  auto answers_right = [&] {
    Outcome out = Complete(port, prompt, kMaxTokens, 10'000);
    return out.http_status == 200 && out.text == want;
  };
  ASSERT_TRUE(answers_right()) << cluster->LogTail();
  auto has_deadlines = [&](const char* name) {
    const pid_t pid = cluster->Pid(name);
    std::ifstream in("/proc/" + std::to_string(pid) + "/cmdline", std::ios::binary);
    std::string cmdline((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
    cmdline += ' ';
    const bool coordinator = std::string(name) == "coordinator";
    for (const auto& [flag, ms] :
         {std::pair{"--heartbeat-timeout-ms", coordinator ? o.heartbeat_timeout_ms : 0},
          std::pair{"--tp-step-timeout-ms", coordinator ? 0 : o.tp_step_timeout_ms},
          std::pair{"--kv-progress-timeout-ms", coordinator ? 0 : o.kv_progress_timeout_ms},
          std::pair{"--coordinator-timeout-ms", coordinator ? 0 : o.coordinator_timeout_ms}}) {
      if (ms == 0) continue;
      const std::string want = std::string(" ") + flag + " " + std::to_string(ms) + " ";
      EXPECT_NE(cmdline.find(want), std::string::npos)
          << name << " lacks" << want << ": " << cmdline;
    }
  };
  for (const char* name : {"prefill-0", "decode-0", "coordinator"}) has_deadlines(name);
  for (const char* victim : {"prefill-0", "decode-0", "coordinator"}) {
    const pid_t pid = cluster->Pid(victim);
    ASSERT_GT(pid, 0) << victim << "\n" << cluster->LogTail();
    const int restarts = cluster->Restarts();
    const auto killed_at = Clock::now();
    ASSERT_EQ(kill(pid, SIGKILL), 0);
    const bool back = WaitFor(
        [&] {
          const pid_t now = cluster->Pid(victim);
          return now > 0 && now != pid && HealthyWith(port, {"prefill-0", "decode-0"}) &&
                 answers_right();
        },
        seconds(60));
    ASSERT_TRUE(back) << victim << " not back within 60 s\n" << cluster->LogTail();
    EXPECT_GT(cluster->Restarts(), restarts);
    has_deadlines(victim);  // the supervisor restarted it with the same flags
    std::printf("MPIRUN %s killed: serving right again after %.2f s\n", victim,
                Seconds(Clock::now() - killed_at));
  }
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(answers_right());
}

// The KV data path itself fails: the decode worker advertises its KV port on
// 127.0.0.2, where a relay the test controls forwards to its real listener on
// 127.0.0.1. Under ~70% load the relay either drops every KV connection (RST)
// and refuses new ones for 1 s, or flips one byte inside a KV chunk, or stops
// forwarding every open connection for good without closing it (a cut with
// no reset: only the no-progress deadlines, --kv-progress-timeout-ms, end
// what those connections carried, and the prefill side reconnects). The same
// invariants hold: final statuses within the bound, only the engine's tokens
// (a corrupted block is caught by its checksum, never decoded), serving after,
// KV blocks back.
enum class KvFault { kCut, kCorrupt, kBlackhole };
// How long cut_kv_link keeps the relayed KV link down.
constexpr milliseconds kCutDown{1000};

const char* KvFaultName(KvFault f) {
  switch (f) {
    case KvFault::kCut:
      return "cut_kv_link";
    case KvFault::kCorrupt:
      return "corrupt_kv_chunk";
    case KvFault::kBlackhole:
      return "blackhole_kv_link";
  }
  return "?";
}

// The workers' --kv-progress-timeout-ms in the KV path cases (from H, above).
constexpr int kKvProgressTimeoutMs = static_cast<int>(kKvProgressTimeoutS * 1000);

class KvPathFaultTest : public ::testing::TestWithParam<KvFault> {
 protected:
  void SetUp() override {
    ref_ = GreedyReference::Get();
    if (ref_ == nullptr)
      KVRELAY_SKIP_OR_FAIL() << "model file not present (run scripts/fetch-model.sh)";
    for (const char* t : {"The capital of France is", "Rivers flow to the sea because"}) {
      prompts_.push_back(ref_->Encode(t));
      expected_.push_back(ref_->Text(prompts_.back(), kMaxTokens));
    }
    char tmpl[] = "/tmp/kvrelay-kvpath-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    const std::string key = dir_ + "/cluster.key";
    ASSERT_TRUE(protocols::ClusterKey::GenerateFile(key).ok());
    auto http = deploy::PickFreePort();
    auto control = deploy::PickFreePort();
    auto kv = deploy::PickFreePort();
    ASSERT_TRUE(http.ok() && control.ok() && kv.ok());
    port_ = *http;
    auto relay = TcpRelay::Start("127.0.0.2", *kv, "127.0.0.1", *kv);
    ASSERT_TRUE(relay.ok()) << relay.status().ToString();
    relay_ = std::move(*relay);
    const std::string bin = KVRELAY_FAULTS_BIN_DIR;
    const std::string coord = "127.0.0.1:" + std::to_string(*control);
    auto worker = [&](const std::string& binary, const std::string& id, int rank) {
      return std::vector<std::string>{bin + "/" + binary,
                                      "--id",
                                      id,
                                      "--coordinator",
                                      coord,
                                      "--model",
                                      ModelPath(),
                                      "--kv-dtype",
                                      "f32",
                                      "--kv-capacity-mb",
                                      "128",
                                      "--threads",
                                      "1",
                                      "--rank",
                                      std::to_string(rank),
                                      "--world-size",
                                      "2",
                                      "--kv-timeout-ms",
                                      "10000",
                                      "--kv-progress-timeout-ms",
                                      std::to_string(kKvProgressTimeoutMs),
                                      "--cluster-key-file",
                                      key};
    };
    ASSERT_TRUE(
        group_
            .Spawn(
                {"coordinator",
                 {bin + "/kvrelay-coordinator", "--model", ModelPath(), "--port",
                  std::to_string(port_), "--control-port", std::to_string(*control),
                  "--cluster-key-file", key, "--kv-dtype", "f32", "--heartbeat-ms",
                  std::to_string(static_cast<int>(kHeartbeatS * 1000)), "--heartbeat-timeout-ms",
                  std::to_string(static_cast<int>(kHeartbeatTimeoutS * 1000)), "--migration-limit",
                  MigrationLimit().empty() ? std::string("3") : MigrationLimit()},
                 {}})
            .ok());
    ASSERT_TRUE(group_.Spawn({"prefill-0", worker("kvrelay-prefill", "prefill-0", 0), {}}).ok());
    auto decode = worker("kvrelay-decode", "decode-0", 1);
    for (const char* a : {"--kv-host", "127.0.0.1", "--advertise-host", "127.0.0.2"}) {
      decode.push_back(a);
    }
    decode.push_back("--kv-port");
    decode.push_back(std::to_string(*kv));
    ASSERT_TRUE(group_.Spawn({"decode-0", decode, {}}).ok());
    ASSERT_TRUE(WaitFor(
        [&] {
          return HealthyWith(port_, {"prefill-0", "decode-0"});
        },
        seconds(120)))
        << "the hand-started cluster did not become healthy";
  }
  void TearDown() override {
    group_.Stop(std::chrono::seconds(15));
    if (relay_) relay_->Stop();
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  bool AllIdle() {
    auto running = WorkerGauge(port_, "kvrelay_worker_running");
    if (running.size() != 2) return false;
    for (const auto& [w, v] : running) {
      if (v != 0) return false;
    }
    return true;
  }

  GreedyReference* ref_ = nullptr;
  std::string dir_;
  uint16_t port_ = 0;
  std::unique_ptr<TcpRelay> relay_;
  deploy::ProcessGroup group_;
  std::vector<std::vector<int32_t>> prompts_;
  std::vector<std::string> expected_;
};

TEST_P(KvPathFaultTest, EveryRequestEndsRightAndServingResumes) {
  const KvFault fault = GetParam();
  // Capacity: 2 clients back to back.
  const auto start = Clock::now();
  std::vector<std::thread> clients;
  for (int c = 0; c < 2; ++c) {
    clients.emplace_back([&, c] {
      for (int i = 0; i < 3; ++i) {
        Outcome o = Complete(port_, prompts_[(c + i) % 2], kMaxTokens, kRequestTimeoutMs);
        EXPECT_EQ(o.http_status, 200) << o.error;
        EXPECT_EQ(o.text, expected_[(c + i) % 2]);
      }
    });
  }
  for (auto& t : clients) t.join();
  const double capacity = 6 / std::max(1e-3, Seconds(Clock::now() - start));
  ASSERT_TRUE(WaitFor([&] { return AllIdle(); }, seconds(30)));
  const auto baseline = WorkerGauge(port_, "kvrelay_worker_kv_utilization");
  // KV streams refused by a checksum/manifest check so far, summed over the
  // workers; -1 when no worker exports the series (so a missing series fails).
  auto integrity_failures = [&] {
    const auto g = WorkerGauge(port_, "kvrelay_worker_kv_integrity_failures_total");
    double n = g.empty() ? -1 : 0;
    for (const auto& [w, v] : g) n += v;
    return n;
  };
  const double integrity_before = integrity_failures();
  ASSERT_GE(integrity_before, 0) << "no worker exports kvrelay_worker_kv_integrity_failures_total";
  const double rate = std::max(0.5, 0.7 * capacity);
  LoadClient load(port_, prompts_, kMaxTokens, kRequestTimeoutMs);
  load.Start(rate);
  std::this_thread::sleep_for(milliseconds(2500));  // load duration, no race
  ASSERT_TRUE(WaitFor([&] { return load.InFlight() > 0; }, seconds(20)))
      << "no request in flight within 20 s of load";
  const auto fault_at = Clock::now();
  if (fault == KvFault::kCut) {
    relay_->Cut();
    std::this_thread::sleep_for(kCutDown);  // the link stays down this long
    relay_->Restore();
  } else if (fault == KvFault::kBlackhole) {
    // No reset, no error: the open KV connections just go quiet for good.
    // Only the no-progress deadlines can end what they carry.
    relay_->Blackhole();
  } else {
    relay_->CorruptNext();
    EXPECT_TRUE(WaitFor([&] { return relay_->corrupted(); }, seconds(20)))
        << "no KV chunk went through the relay to corrupt";
  }
  std::this_thread::sleep_for(milliseconds(fault == KvFault::kBlackhole ? 5000 : 3000));  // load
  std::vector<Outcome> outcomes = load.Stop();
  EXPECT_GE(InFlightAt(outcomes, fault_at), 1) << "the fault hit no request in flight";
  if (fault == KvFault::kCorrupt) {
    // The flipped byte was caught by a block checksum, and counted (a
    // heartbeat or two later), not decoded: the checks are what this proves.
    double now = -1;
    EXPECT_TRUE(
        WaitFor([&] { return (now = integrity_failures()) >= integrity_before + 1; }, seconds(10)))
        << "the corrupted KV chunk was not counted as an integrity failure on /metrics ("
        << integrity_before << " before, " << now << " after)";
  }
  const double ordinary = OrdinaryLatencyS(outcomes, fault_at);
  int affected = 0;
  std::string first_error;
  double worst_final = 0, first_ok_after = -1, worst_after_fault = 0;
  for (size_t i = 0; i < outcomes.size(); ++i) {
    const Outcome& o = outcomes[i];
    EXPECT_LT(o.seconds(), kFinalStatusBoundS) << "request " << i << ": " << o.error;
    if (o.ended > fault_at) {
      worst_after_fault =
          std::max(worst_after_fault, Seconds(o.ended - std::max(o.sent, fault_at)));
    }
    if (o.ended > fault_at) {
      // Within 2 heartbeat intervals of the fault (or of its sending) plus
      // this run's ordinary latency: a cut without a reset ends its requests
      // by the no-progress deadline (1.5 H, from the stream's last byte), not
      // by the 10 s kv_timeout; but a worker checks that deadline between
      // engine steps, and under load one step can take as long as a whole
      // short request (blackhole_kv_link: 2.7-3.5 s against a fixed 2 s at
      // load 5.5, issue #42). So the bound follows the run's own latency.
      // A request whose hand-over failed after its first token moves on to
      // a new prefill (--migration-limit): an answer may cost one more run,
      // and a moved request whose KV path is cut cannot be answered before
      // the link is back (moves to the refusing address fail at once).
      const double down = fault == KvFault::kCut ? Seconds(kCutDown) : 0.0;
      const double bound =
          kFinalStatusWithinS + ordinary + (o.http_status == 200 ? down + ordinary : 0.0);
      EXPECT_LT(Seconds(o.ended - std::max(o.sent, fault_at)), bound)
          << "request " << i << " (HTTP " << o.http_status << "), bound " << bound
          << " s: " << o.error;
    }
    if (o.http_status == 200) {
      EXPECT_EQ(o.text, expected_[o.prompt]) << "request " << i << ": a wrong token";
      if (o.sent >= fault_at) {
        const double t = Seconds(o.ended - fault_at);
        if (first_ok_after < 0 || t < first_ok_after) first_ok_after = t;
      }
      continue;
    }
    ++affected;
    if (first_error.empty())
      first_error = std::to_string(o.http_status) + " " + o.error.substr(0, 160);
    worst_final = std::max(worst_final, Seconds(o.ended - std::max(o.sent, fault_at)));
    EXPECT_TRUE(o.http_status == 429 || o.http_status == 500 || o.http_status == 503 ||
                o.http_status == 504)
        << "request " << i << ": HTTP " << o.http_status << " " << o.error;
  }
  // A fault of the KV path fails no request either: a corrupt or lost
  // stream is run again (--migration-limit), and a prefill whose decode
  // group refuses connections for a moment (the cut) tries again until it
  // is back instead of failing the task.
  if (MigrationLimit().empty()) {
    EXPECT_EQ(affected, 0) << "requests failed for " << KvFaultName(fault)
                           << "; first error: " << first_error;
  }
  // Serving after, through the relay.
  const bool serving = WaitFor(
      [&] {
        Outcome o = Complete(port_, prompts_[0], kMaxTokens, kRequestTimeoutMs);
        return o.http_status == 200 && o.text == expected_[0];
      },
      seconds(60));
  EXPECT_TRUE(serving) << "the cluster did not answer right within 60 s of the fault";
  if (fault == KvFault::kBlackhole) {
    EXPECT_GE(first_ok_after, 0) << "no request sent after the fault completed during the load";
    EXPECT_LT(first_ok_after, kServingAgainBoundS)
        << "serving again only after " << first_ok_after << " s";
  }
  for (int i = 0; i < 3; ++i) {
    Outcome o = Complete(port_, prompts_[i % 2], kMaxTokens, kRequestTimeoutMs);
    EXPECT_EQ(o.http_status, 200) << o.error;
    EXPECT_EQ(o.text, expected_[i % 2]);
  }
  std::map<std::string, double> last;
  const bool returned = WaitFor(
      [&] {
        if (!AllIdle()) return false;
        last = WorkerGauge(port_, "kvrelay_worker_kv_utilization");
        for (const auto& [w, v] : last) {
          if (v > baseline.at(w) + 1e-9) return false;
        }
        return last.size() == 2;
      },
      seconds(20));
  EXPECT_TRUE(returned) << "KV blocks not returned after the fault";
  std::printf(
      "FAULT %s: capacity %.2f req/s, load %.2f req/s, %zu requests, %d affected (%.1f%%), "
      "worst time to final status after the fault %.2f s (any request %.2f s, ordinary latency "
      "%.2f s), first right answer sent after the fault %.2f s after it; first error: %s\n",
      KvFaultName(fault), capacity, rate, outcomes.size(), affected,
      outcomes.empty() ? 0.0 : 100.0 * affected / static_cast<double>(outcomes.size()), worst_final,
      worst_after_fault, ordinary, first_ok_after, first_error.c_str());
  std::fflush(stdout);
}

// Issue #46: /health says when the data plane is down while every worker is
// registered (the control plane fine). A cut that lasts makes the prefill's
// connects to the decode rank fail for longer than --kv-progress-timeout-ms:
// /health answers 503 and names it; once the link is back and a request
// gets through, 200 again.
using KvPathHealthTest = KvPathFaultTest;
TEST_P(KvPathHealthTest, HealthSaysWhenNoPrefillWorkerReachesADecodeWorker) {
  ASSERT_EQ(Complete(port_, prompts_[0], kMaxTokens, kRequestTimeoutMs).text, expected_[0]);
  auto health = [&](std::string* body) {
    HttpCallSpec spec;
    spec.port = port_;
    spec.target = "/health";
    spec.timeout_ms = 2000;
    auto r = HttpCall(spec);
    if (!r.ok()) return 0;
    *body = r->body;
    return r->status;
  };
  std::string body;
  ASSERT_EQ(health(&body), 200) << body;
  // Requests keep the prefill trying while the link is down.
  LoadClient load(port_, prompts_, kMaxTokens, kRequestTimeoutMs);
  relay_->Cut();
  load.Start(2.0);
  const bool down = WaitFor([&] { return health(&body) == 503; }, seconds(30));
  EXPECT_TRUE(down) << "/health still says ok with the KV link cut: " << body;
  EXPECT_NE(body.find("no prefill worker reaches a decode worker"), std::string::npos) << body;
  EXPECT_NE(body.find("data_plane_error"), std::string::npos) << body;
  EXPECT_NE(body.find("cannot reach decode rank 1"), std::string::npos) << body;
  relay_->Restore();
  const bool up = WaitFor([&] { return health(&body) == 200; }, seconds(30));
  EXPECT_TRUE(up) << "/health not ok again after the link came back: " << body;
  (void)load.Stop();
  EXPECT_EQ(Complete(port_, prompts_[1], kMaxTokens, kRequestTimeoutMs).text, expected_[1]);
}

INSTANTIATE_TEST_SUITE_P(Health, KvPathHealthTest, ::testing::Values(KvFault::kCut),
                         [](const ::testing::TestParamInfo<KvFault>& info) {
                           return std::string(KvFaultName(info.param));
                         });

INSTANTIATE_TEST_SUITE_P(Faults, KvPathFaultTest,
                         ::testing::Values(KvFault::kCut, KvFault::kCorrupt, KvFault::kBlackhole),
                         [](const ::testing::TestParamInfo<KvFault>& info) {
                           return std::string(KvFaultName(info.param));
                         });

}  // namespace
}  // namespace kvrelay::faults
