#include "deploy/process_group.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace kvrelay::deploy {
namespace {

TEST(ProcessGroupTest, ABadExecutableIsReportedBySpawn) {
  ProcessGroup g;
  Status s = g.Spawn({"ghost", {"/nonexistent/kvrelay-ghost"}, {}});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("ghost"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find("No such file"), std::string::npos) << s.ToString();
  EXPECT_EQ(g.size(), 0u);
}

TEST(ProcessGroupTest, StopEndsAndReapsChildren) {
  ProcessGroup g;
  ASSERT_TRUE(g.Spawn({"sleeper", {"/bin/sleep", "60"}, {}}).ok());
  const pid_t pid = g.Pid("sleeper");
  ASSERT_GT(pid, 0);
  g.Stop(std::chrono::milliseconds(5000));
  EXPECT_EQ(kill(pid, 0), -1);  // reaped: the pid is gone
}

// A child killed with SIGKILL is reported by WaitAnyExit (name and signal),
// can be started again from its spec (a new pid), and Respawn refuses a child
// that is still running or was never spawned.
TEST(ProcessGroupTest, AKilledChildIsReportedAndRespawned) {
  ProcessGroup g;
  ASSERT_TRUE(g.Spawn({"sleeper", {"/bin/sleep", "60"}, {}}).ok());
  ASSERT_TRUE(g.Spawn({"other", {"/bin/sleep", "60"}, {}}).ok());
  const pid_t first = g.Pid("sleeper");
  EXPECT_EQ(g.Respawn("sleeper").code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(g.Respawn("nobody").code(), StatusCode::kNotFound);
  ASSERT_EQ(kill(first, SIGKILL), 0);
  auto exited = g.WaitAnyExit(Deadline::After(std::chrono::seconds(10)));
  ASSERT_TRUE(exited.ok()) << exited.status().ToString();
  EXPECT_EQ(exited->name, "sleeper");
  EXPECT_NE(exited->description.find("killed by signal"), std::string::npos) << exited->description;
  ASSERT_TRUE(g.Respawn("sleeper").ok());
  const pid_t second = g.Pid("sleeper");
  EXPECT_GT(second, 0);
  EXPECT_NE(second, first);
  EXPECT_EQ(kill(second, 0), 0);
  EXPECT_EQ(g.LivePids().size(), 2u);
  // StopChild ends and reaps one child only.
  g.StopChild("sleeper", std::chrono::milliseconds(5000));
  EXPECT_EQ(kill(second, 0), -1);
  EXPECT_EQ(g.LivePids().size(), 1u);
  EXPECT_EQ(g.WaitAnyExit(Deadline::After(std::chrono::milliseconds(50))).status().code(),
            StatusCode::kDeadlineExceeded);
  g.Stop(std::chrono::milliseconds(5000));
}

// Stop and StopChild keep how each child exited: a clean exit, an exit
// status a sanitizer would give, and a child that ignores SIGTERM and is
// killed after the grace. Each shell child writes a file once its trap is set,
// so SIGTERM never arrives before it.
TEST(ProcessGroupTest, StopRecordsHowEachChildExited) {
  char tmpl[] = "/tmp/kvrelay-pg-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  auto shell = [&](const std::string& name, const std::string& trap) {
    return ChildSpec{
        name,
        {"/bin/sh", "-c",
         "trap '" + trap + "' TERM; : > " + dir + "/" + name + "; while :; do sleep 0.02; done"},
        {}};
  };
  ProcessGroup g;
  // Stop handles the newest first: `clean` gets its moment before the grace
  // runs out on `stubborn`.
  ASSERT_TRUE(g.Spawn(shell("stubborn", "")).ok());
  ASSERT_TRUE(g.Spawn(shell("failing", "exit 66")).ok());
  ASSERT_TRUE(g.Spawn(shell("clean", "exit 0")).ok());
  for (const char* name : {"stubborn", "failing", "clean"}) {
    const std::string marker = dir + "/" + name;
    bool ready = false;
    for (int i = 0; i < 1000 && !ready; ++i) {
      ready = access(marker.c_str(), F_OK) == 0;
      if (!ready) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_TRUE(ready) << name << " never set its trap";
    unlink(marker.c_str());
  }
  g.StopChild("failing", std::chrono::seconds(5));
  g.Stop(std::chrono::milliseconds(1500));
  rmdir(dir.c_str());
  const std::vector<ProcessGroup::Exit> stopped = g.stopped();
  ASSERT_EQ(stopped.size(), 3u);
  EXPECT_EQ(stopped[0].name, "failing");
  EXPECT_EQ(stopped[0].description, "exited with status 66");
  EXPECT_EQ(stopped[1].name, "clean");
  EXPECT_EQ(stopped[1].description, "exited with status 0");
  EXPECT_EQ(stopped[2].name, "stubborn");
  EXPECT_EQ(stopped[2].description, std::string("killed by signal ") + strsignal(SIGKILL));
}

// A launcher killed with SIGKILL (no Stop, no destructor) still takes its
// children with it: PR_SET_PDEATHSIG. This test process is the launcher's
// parent and a child subreaper, so the orphaned grandchild is reparented to it
// and can be waited for with a deadline.
TEST(ProcessGroupTest, ChildrenDieWithTheirLauncher) {
  ASSERT_EQ(prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t launcher = fork();
  ASSERT_GE(launcher, 0);
  if (launcher == 0) {
    close(fds[0]);
    ProcessGroup g;
    if (!g.Spawn({"sleeper", {"/bin/sleep", "120"}, {}}).ok()) _exit(1);
    const pid_t child = g.Pid("sleeper");
    if (write(fds[1], &child, sizeof child) != sizeof child) _exit(1);
    for (;;) pause();  // until SIGKILL
  }
  close(fds[1]);
  pid_t grandchild = -1;
  const ssize_t n = read(fds[0], &grandchild, sizeof grandchild);
  close(fds[0]);
  kill(launcher, SIGKILL);
  int status = 0;
  waitpid(launcher, &status, 0);
  ASSERT_EQ(n, static_cast<ssize_t>(sizeof grandchild));
  ASSERT_GT(grandchild, 0);
  // The grandchild should get SIGTERM at once; allow 10 s.
  bool gone = false;
  for (int i = 0; i < 1000 && !gone; ++i) {
    if (waitpid(grandchild, &status, WNOHANG) == grandchild) {
      gone = true;
      EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM) << status;
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  if (!gone) {  // do not leave it behind
    kill(grandchild, SIGKILL);
    waitpid(grandchild, &status, 0);
  }
  EXPECT_TRUE(gone) << "the child outlived its launcher";
  prctl(PR_SET_CHILD_SUBREAPER, 0);
}

}  // namespace
}  // namespace kvrelay::deploy
