"""Emulated hosts on one machine: network namespaces on a bridge.

Each "host" is a network namespace with one veth link to a bridge that lives
in its own "switch" namespace, so nothing is added to the machine's own
network: the only addresses used are 10.77.0.0/24 inside these namespaces
and loopback. Every link is shaped with tc tbf (both directions), every host
has its own /etc/hosts (ip netns exec bind-mounts /etc/netns/<ns>/hosts), its
own hostname (a UTS namespace per launch, and a mount namespace that
bind-mounts /etc/netns/<ns>/hosts on /etc/hosts) and a cgroup v1 cpu quota, so a
host has a fixed CPU budget the way a node does.

Commands run on a host through the `hostexec` script the bed writes:
    hostexec HOST CMD...        (also mpirun's plm_rsh_agent: HOST 'CMD STRING')
It moves itself into the host's cgroup, enters the namespace and execs.

Teardown (Testbed.close, also from atexit and SIGTERM/SIGINT) kills every
process in the hosts' cgroups, deletes the namespaces, the cgroups and the
/etc/netns entries. Names carry the creating pid, so `cleanup_stale()` can
remove what a killed earlier run left behind.

Needs root, iproute2 (ip, tc), util-linux (unshare) and cgroup v1 `cpu` or
cgroup v2 `cpu.max`.
"""

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

PREFIX = "kvrmn"
SUBNET = "10.77.0"
CGROUP_V1 = "/sys/fs/cgroup/cpu"
CGROUP_V2 = "/sys/fs/cgroup"


def _run(args, check=True, **kw):
    r = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    if check and r.returncode != 0:
        raise RuntimeError("%s failed (%d): %s" % (" ".join(args), r.returncode, r.stderr.strip()))
    return r


def _cgroup_root():
    if os.path.isfile(os.path.join(CGROUP_V1, "cpu.cfs_quota_us")):
        return CGROUP_V1, 1
    if os.path.isfile(os.path.join(CGROUP_V2, "cgroup.controllers")):
        return CGROUP_V2, 2
    return None, 0


def missing_requirements():
    """Why the bed cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc, cgroups)"
    for tool in ("ip", "tc", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return "needs '%s' (iproute2 / util-linux)" % tool
    if _cgroup_root()[0] is None:
        return "no cgroup cpu controller (v1 %s or v2 cpu.max)" % CGROUP_V1
    probe = "%s-probe%d" % (PREFIX, os.getpid())
    r = _run(["ip", "netns", "add", probe], check=False)
    if r.returncode != 0:
        return "cannot create a network namespace: " + r.stderr.strip()
    _run(["ip", "netns", "del", probe], check=False)
    return None


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _kill_cgroup(path):
    procs = os.path.join(path, "cgroup.procs")
    for _ in range(50):
        try:
            with open(procs) as f:
                pids = [int(x) for x in f.read().split()]
        except FileNotFoundError:
            return
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def cleanup_stale():
    """Removes namespaces/cgroups/etc entries of earlier runs whose pid is gone."""
    r = _run(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in r.stdout.splitlines() if line.startswith(PREFIX)]
    root, _ = _cgroup_root()
    if root and os.path.isdir(root):
        names += [n for n in os.listdir(root) if n.startswith(PREFIX)]
    if os.path.isdir("/etc/netns"):
        names += [n for n in os.listdir("/etc/netns") if n.startswith(PREFIX)]
    for name in sorted(set(names)):
        try:
            owner = int(name[len(PREFIX):].split("-")[0])
        except ValueError:
            continue
        if _pid_alive(owner):
            continue
        if root:
            _kill_cgroup(os.path.join(root, name))
        _run(["ip", "netns", "del", name], check=False)
        if root and os.path.isdir(os.path.join(root, name)):
            try:
                os.rmdir(os.path.join(root, name))
            except OSError:
                pass
        shutil.rmtree(os.path.join("/etc/netns", name), ignore_errors=True)


def leftovers(pid=None):
    """Namespaces, cgroups and /etc/netns entries of run `pid` (default: this
    process) that still exist."""
    tag = "%s%d-" % (PREFIX, pid or os.getpid())
    r = _run(["ip", "netns", "list"], check=False)
    found = [line.split()[0] for line in r.stdout.splitlines() if line.startswith(tag)]
    root, _ = _cgroup_root()
    for d in (root, "/etc/netns"):
        if d and os.path.isdir(d):
            found += [os.path.join(d, n) for n in os.listdir(d) if n.startswith(tag)]
    return found


class Host:
    def __init__(self, bed, index, name, cpu, aliases):
        self.bed = bed
        self.index = index
        self.name = name
        self.cpu = cpu  # cores, or None for no quota
        self.aliases = list(aliases)
        self.ns = "%s-%s" % (bed.tag, name)
        self.ip = "%s.%d" % (SUBNET, 10 + index)
        self.dev = "eth0"
        self.peer_dev = "v%s%d" % (bed.tag[-6:], index)  # switch side, <= 15 chars
        self.cgroup = None

    def argv(self, cmd):
        """argv that runs `cmd` (a list) on this host."""
        return [self.bed.hostexec, self.name] + list(cmd)

    def cpu_seconds(self):
        """CPU time used by this host's cgroup so far (seconds)."""
        if self.bed.cgroup_version == 1:
            with open(os.path.join(self.cgroup, "cpuacct.usage")) as f:
                return int(f.read()) / 1e9
        with open(os.path.join(self.cgroup, "cpu.stat")) as f:
            for line in f:
                k, v = line.split()
                if k == "usage_usec":
                    return int(v) / 1e6
        return 0.0


class Testbed:
    """N hosts on one bridge. Use as a context manager; close() on every path."""

    def __init__(self, hosts, rate="1gbit", workdir=None):
        """hosts: list of (name, cpu_cores_or_None, [aliases]); rate: tc tbf rate per link."""
        self.tag = "%s%d" % (PREFIX, os.getpid())
        self.switch = "%s-sw" % self.tag
        self.rate = rate
        self.cgroup_root, self.cgroup_version = _cgroup_root()
        self.hosts = [Host(self, i, n, c, a) for i, (n, c, a) in enumerate(hosts)]
        self.by_name = {h.name: h for h in self.hosts}
        self._own_workdir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="kvrelay-multinode-bed-")
        self.hostexec = os.path.join(self.workdir, "hostexec")
        self._closed = False
        self._created_ns = []
        self._created_cg = []
        self._created_etc = []
        self._old_handlers = {}
        atexit.register(self.close)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _on_signal(self, signum, _frame):
        self.close()
        sys.exit(128 + signum)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def host(self, name):
        return self.by_name[name]

    # ------------------------------------------------------------ creation

    def _ns(self, ns, *args):
        return _run(["ip", "-n", ns] + list(args))

    def _create(self):
        _run(["ip", "netns", "add", self.switch])
        self._created_ns.append(self.switch)
        self._ns(self.switch, "link", "set", "lo", "up")
        self._ns(self.switch, "link", "add", "br0", "type", "bridge")
        self._ns(self.switch, "link", "set", "br0", "up")
        for h in self.hosts:
            _run(["ip", "netns", "add", h.ns])
            self._created_ns.append(h.ns)
            self._ns(h.ns, "link", "set", "lo", "up")
            # Create the pair inside the host namespace, then move one end.
            self._ns(h.ns, "link", "add", h.dev, "type", "veth", "peer", "name", h.peer_dev)
            self._ns(h.ns, "link", "set", h.peer_dev, "netns", self.switch)
            self._ns(h.ns, "addr", "add", h.ip + "/24", "dev", h.dev)
            self._ns(h.ns, "link", "set", h.dev, "up")
            self._ns(self.switch, "link", "set", h.peer_dev, "master", "br0")
            self._ns(self.switch, "link", "set", h.peer_dev, "up")
            if self.rate:
                for ns, dev in ((h.ns, h.dev), (self.switch, h.peer_dev)):
                    _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                          "tbf", "rate", self.rate, "burst", "256kb", "latency", "50ms"])
            etc = os.path.join("/etc/netns", h.ns)
            os.makedirs(etc, exist_ok=True)
            self._created_etc.append(etc)
            cg = os.path.join(self.cgroup_root, h.ns)
            os.makedirs(cg, exist_ok=True)
            self._created_cg.append(cg)
            h.cgroup = cg
            if self.cgroup_version == 1:
                period = 100000
                with open(os.path.join(cg, "cpu.cfs_period_us"), "w") as f:
                    f.write(str(period))
                with open(os.path.join(cg, "cpu.cfs_quota_us"), "w") as f:
                    f.write(str(int(h.cpu * period)) if h.cpu else "-1")
            else:
                with open(os.path.join(cg, "cpu.max"), "w") as f:
                    f.write("%d 100000" % int(h.cpu * 100000) if h.cpu else "max 100000")
        self.write_hosts_files()
        self._write_hostexec()

    def write_hosts_files(self):
        """(Re)writes every host's /etc/hosts from the hosts' names and aliases.
        Rewritten in place, so hosts already running see the change (their
        /etc/hosts is a bind mount of this file)."""
        lines = ["127.0.0.1 localhost"]
        for h in self.hosts:
            lines.append(" ".join([h.ip, h.name] + h.aliases))
        text = "\n".join(lines) + "\n"
        for h in self.hosts:
            with open(os.path.join("/etc/netns", h.ns, "hosts"), "w") as f:
                f.write(text)

    def add_alias(self, host, alias):
        self.host(host).aliases.append(alias)
        self.write_hosts_files()

    def _write_hostexec(self):
        cases = []
        for h in self.hosts:
            names = "|".join([h.name, h.ip] + h.aliases)
            cases.append("  %s) ns=%s cg=%s ;;" % (names, h.ns, h.cgroup))
        script = """#!/bin/bash
# hostexec HOST CMD...  : run CMD on emulated host HOST (its cgroup, network
# namespace, /etc/hosts and hostname). Also Open MPI's plm_rsh_agent: then the
# command arrives as one shell string, which `sh -c` runs.
set -e
host=$1; shift
case "$host" in
%s
  *) echo "hostexec: unknown host '$host'" >&2; exit 255 ;;
esac
echo $$ > "$cg/cgroup.procs"
if [ $# -eq 1 ]; then set -- /bin/sh -c "$1"; fi
# nsenter, not `ip netns exec`: that remounts /sys, which would hide the
# cgroup tree from commands (mpirun's agent) run on a host.
exec nsenter --net="/run/netns/$ns" unshare --mount --uts /bin/sh -c \
  'mount --bind "/etc/netns/$1/hosts" /etc/hosts && hostname "$0" && shift && exec "$@"' \
  "$host" "$ns" "$@"
""" % "\n".join(cases)
        with open(self.hostexec, "w") as f:
            f.write(script)
        os.chmod(self.hostexec, 0o755)
        # Open MPI's plm_rsh_agent is called as `AGENT HOST WORD...` where the
        # words form one remote shell command line (ssh joins them the same way).
        self.rsh_agent = os.path.join(self.workdir, "rsh-agent")
        with open(self.rsh_agent, "w") as f:
            f.write('#!/bin/bash\nhost=$1; shift\nexec %s "$host" "$*"\n' % self.hostexec)
        os.chmod(self.rsh_agent, 0o755)

    # ------------------------------------------------------------ operations

    def spawn(self, host, cmd, log_path, env=None):
        """Starts cmd on host (stdout+stderr to log_path). Returns the Popen."""
        log = open(log_path, "wb")
        try:
            return subprocess.Popen(self.host(host).argv(cmd), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        finally:
            log.close()

    def run(self, host, cmd, timeout, check=True):
        return _run(self.host(host).argv(cmd), check=check, timeout=timeout)

    def set_link(self, host, up):
        """Cuts (up=False) or restores a host's link (its switch-side veth)."""
        h = self.host(host)
        self._ns(self.switch, "link", "set", h.peer_dev, "up" if up else "down")

    def pids_on(self, host):
        with open(os.path.join(self.host(host).cgroup, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]

    def close(self):
        if self._closed:
            return
        self._closed = True
        for cg in self._created_cg:
            _kill_cgroup(cg)
        for ns in reversed(self._created_ns):
            _run(["ip", "netns", "del", ns], check=False)
        for cg in self._created_cg:
            for _ in range(20):
                try:
                    os.rmdir(cg)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    _kill_cgroup(cg)
                    time.sleep(0.1)
        for etc in self._created_etc:
            shutil.rmtree(etc, ignore_errors=True)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        for sig, old in self._old_handlers.items():
            try:
                signal.signal(sig, old)
            except (ValueError, TypeError):
                pass
