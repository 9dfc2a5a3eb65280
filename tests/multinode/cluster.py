"""A kvrelay cluster on emulated hosts (testbed.Testbed), launched two ways:

  mpirun  deploy/mpirun/launch.sh -H <hostfile of the hosts> from a `launcher`
          host, Open MPI's plm_rsh_agent entering each host's namespace;
  direct  each process started on its host by hand with the flags given (the
          Kubernetes-like mode: what a pod's command line says).

Either way the KV data plane is what the binaries choose (TCP today) and
every worker advertises its host's address. Clients run on the `launcher`
host (client.py); the coordinator is reached by its host name.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import testbed  # noqa: E402

HTTP_PORT = 8080
CONTROL_PORT = 9000
# The tests here measure capacity and faults with fixed workloads that
# saturate the cluster on purpose: every request must be served, so the
# coordinator's early shedding (a 2 s bound on the predicted wait by
# default) is off.
NO_SHEDDING = ["--max-queue-delay-ms", "0"]
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1"


class Env:
    """Where the binaries, model and scratch files are."""

    def __init__(self, bin_dir, cli, model, workdir):
        self.bin_dir = os.path.abspath(bin_dir)
        self.cli = os.path.abspath(cli)
        self.model = os.path.abspath(model)
        self.workdir = os.path.abspath(workdir)
        os.makedirs(self.workdir, exist_ok=True)

    def key_args(self):
        """--cluster-key-file FILE when the binaries take it (a key written for
        this run, mode 0600), else nothing: only flags the binaries accept."""
        if not hasattr(self, "_key_args"):
            probe = subprocess.run([os.path.join(self.bin_dir, "kvrelay-coordinator"),
                                    "--cluster-key-file", "/dev/null", "--help"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self._key_args = []
            if probe.returncode == 0:
                path = os.path.join(self.workdir, "cluster.key")
                if not os.path.exists(path):
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    os.write(fd, os.urandom(32).hex().encode())
                    os.close(fd)
                self._key_args = ["--cluster-key-file", path]
        return self._key_args

    def missing(self):
        for b in ("kvrelay-coordinator", "kvrelay-prefill", "kvrelay-decode"):
            if not os.access(os.path.join(self.bin_dir, b), os.X_OK):
                return "binary %s/%s not built" % (self.bin_dir, b)
        if not os.access(self.cli, os.X_OK):
            return "kvrelay CLI %s not built" % self.cli
        if not os.path.isfile(self.model):
            return "model %s not present (run scripts/fetch-model.sh)" % self.model
        if subprocess.run(["sh", "-c", "command -v mpirun"], stdout=subprocess.DEVNULL).returncode:
            return "mpirun not found"
        return None


def log(msg):
    print("[multinode %s] %s" % (time.strftime("%H:%M:%S"), msg), flush=True)


def client(bed, args, timeout):
    """Runs client.py on the launcher host; returns its CompletedProcess."""
    return bed.run("launcher", [sys.executable, os.path.join(HERE, "client.py")] + args,
                   timeout=timeout, check=False)


def client_state(bed, url):
    r = client(bed, ["state", url], timeout=30)
    try:
        return json.loads(r.stdout)
    except ValueError:
        return {"health": 0, "workers": [], "gauges": {}, "error": r.stderr}


def random_prompts(seed, count, length, vocab=(1000, 30000)):
    rng = random.Random(seed)
    return [[rng.randint(*vocab) for _ in range(length)] for _ in range(count)]


def complete(bed, env, url, prompts, max_tokens, concurrency, name, timeout_s=300):
    """Streams every prompt (greedy) through url; returns client.py's results."""
    inp = os.path.join(env.workdir, name + ".in.json")
    out = os.path.join(env.workdir, name + ".out.json")
    with open(inp, "w") as f:
        json.dump({"requests": [{"prompt": p, "max_tokens": max_tokens, "model": MODEL_NAME}
                                for p in prompts]}, f)
    if os.path.exists(out):
        os.unlink(out)
    r = client(bed, ["complete", url, inp, out, "--concurrency", str(concurrency),
                     "--timeout-s", str(timeout_s)], timeout=timeout_s + 60)
    if r.returncode != 0 or not os.path.exists(out):
        raise RuntimeError("client failed (%d): %s" % (r.returncode, r.stderr[-2000:]))
    with open(out) as f:
        return json.load(f)["results"]


def reference_texts(bed, env, prompts, max_tokens, name="reference", kv_dtype="f32"):
    """Greedy texts from the single-process engine: kvrelay-coordinator in local
    mode (one process, colocated engine) on the launcher host's loopback, one
    request at a time, same KV dtype as the cluster."""
    port = 18080
    logf = os.path.join(env.workdir, name + ".log")
    p = bed.spawn("launcher", [os.path.join(env.bin_dir, "kvrelay-coordinator"), "--model",
                               env.model, "--host", "127.0.0.1", "--port", str(port),
                               "--kv-dtype", kv_dtype], logf)
    try:
        url = "http://127.0.0.1:%d" % port
        if client(bed, ["wait", url, "60"], timeout=90).returncode != 0:
            raise RuntimeError("reference server did not start; see " + logf)
        res = complete(bed, env, url, prompts, max_tokens, 1, name)
        bad = [r for r in res if not r["ok"]]
        if bad:
            raise RuntimeError("reference request failed: %s" % bad[0]["error"])
        return [r["text"] for r in res]
    finally:
        stop_process(p, 10)


def stop_process(p, grace_s):
    """SIGTERM to the process group, SIGKILL after grace_s."""
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        p.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=10)


def make_hosts(n_prefill, n_decode, cpu, coord_cpu, extra_aliases=None):
    """[launcher (no quota), coord, p0.., d0..] for testbed.Testbed."""
    extra = extra_aliases or {}
    hosts = [("launcher", None, []), ("coord", coord_cpu, extra.get("coord", []))]
    hosts += [("p%d" % i, cpu, extra.get("p%d" % i, [])) for i in range(n_prefill)]
    hosts += [("d%d" % i, cpu, extra.get("d%d" % i, [])) for i in range(n_decode)]
    return hosts


class Cluster:
    """Coordinator on `coord`, prefill worker i on `p<i>`, decode group g (tp
    ranks) on `d<g>`."""

    def __init__(self, bed, env, mode, n_prefill, n_decode, tp=1, threads=1, heartbeat_ms=500,
                 tag="cluster", kv_transport=None, kv_timeout_ms=None):
        self.bed, self.env, self.mode = bed, env, mode
        self.n_prefill, self.n_decode, self.tp = n_prefill, n_decode, tp
        self.threads, self.heartbeat_ms, self.tag = threads, heartbeat_ms, tag
        self.kv_transport = kv_transport
        self.kv_timeout_ms = kv_timeout_ms
        self.url = "http://coord:%d" % HTTP_PORT
        self.procs = []
        self.logs = []

    def _log(self, name):
        path = os.path.join(self.env.workdir, "%s.%s.log" % (self.tag, name))
        self.logs.append(path)
        return path

    def start(self):
        if self.mode == "mpirun":
            self._start_mpirun()
        else:
            self._start_direct()

    def _start_mpirun(self):
        hostfile = os.path.join(self.env.workdir, self.tag + ".hostfile")
        with open(hostfile, "w") as f:
            f.write("coord slots=1\n")
            for i in range(self.n_prefill):
                f.write("p%d slots=1\n" % i)
            for g in range(self.n_decode):
                f.write("d%d slots=%d\n" % (g, self.tp))
        env = dict(os.environ)
        env["OMPI_MCA_plm_rsh_agent"] = self.bed.rsh_agent
        # Daemons and ranks talk over the hosts' network, not loopback.
        env["OMPI_MCA_oob_tcp_if_include"] = testbed.SUBNET + ".0/24"
        env["OMPI_MCA_btl_tcp_if_include"] = testbed.SUBNET + ".0/24"
        cmd = ["/bin/bash", os.path.join(SRC, "deploy/mpirun/launch.sh"), "-H", hostfile,
               "-c", "coord", "-P", str(self.n_prefill), "-D", str(self.n_decode),
               "-T", str(self.tp), "-b", self.env.bin_dir, "-m", self.env.model,
               "-p", str(HTTP_PORT), "-C", str(CONTROL_PORT), "-k", "f32",
               "-t", str(self.threads), "-B", str(self.heartbeat_ms)] + NO_SHEDDING
        if self.kv_transport:
            cmd += ["-X", self.kv_transport]
        if self.kv_timeout_ms:
            cmd += ["-W", str(self.kv_timeout_ms)]
        self.procs.append(("mpirun", self.bed.spawn("launcher", cmd, self._log("mpirun"),
                                                     env=env)))

    def _start_direct(self):
        world = 1 + self.n_prefill + self.n_decode * self.tp
        b = self.env.bin_dir
        common = ["--model", self.env.model, "--kv-dtype", "f32", "--threads", str(self.threads),
                  "--world-size", str(world), "--coordinator", "coord:%d" % CONTROL_PORT]
        common += self.env.key_args()
        if self.kv_transport:
            common += ["--kv-transport", self.kv_transport]
        if self.kv_timeout_ms:
            common += ["--kv-timeout-ms", str(self.kv_timeout_ms)]
        coord_ip = self.bed.host("coord").ip
        self.spawn("coord", "coordinator",
                   [os.path.join(b, "kvrelay-coordinator"), "--model", self.env.model,
                    "--host", coord_ip, "--port", str(HTTP_PORT), "--control-port",
                    str(CONTROL_PORT), "--kv-dtype", "f32", "--heartbeat-ms",
                    str(self.heartbeat_ms)] + NO_SHEDDING + self.env.key_args())
        rank = 1
        for i in range(self.n_prefill):
            h = "p%d" % i
            self.spawn(h, "prefill-%d" % i,
                       [os.path.join(b, "kvrelay-prefill"), "--id", "prefill-%d" % i,
                        "--rank", str(rank), "--kv-host", self.bed.host(h).ip,
                        "--advertise-host", h] + common)
            rank += 1
        for g in range(self.n_decode):
            h = "d%d" % g
            for r in range(self.tp):
                wid = "decode-%d" % g + ("-tp%d" % r if r else "")
                tp = ["--tp-size", str(self.tp), "--tp-rank", str(r), "--tp-leader",
                      "127.0.0.1:9200"] if self.tp > 1 else []
                self.spawn(h, wid, [os.path.join(b, "kvrelay-decode"), "--id", wid, "--rank",
                                    str(rank), "--kv-host", self.bed.host(h).ip,
                                    "--advertise-host", h] + tp + common)
                rank += 1

    def spawn(self, host, name, cmd, env=None):
        p = self.bed.spawn(host, cmd, self._log(name), env=env)
        self.procs.append((name, p))
        return p

    def wait_ready(self, timeout_s=180):
        """Until /health is 200 and lists every worker (a TP group registers once)."""
        want = self.n_prefill + self.n_decode
        deadline = time.time() + timeout_s
        st = {}
        while time.time() < deadline:
            for name, p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError("%s exited (%s) before the cluster was ready; logs: %s"
                                       % (name, p.returncode, " ".join(self.logs)))
            st = client_state(self.bed, self.url)
            if st["health"] == 200 and len(st["workers"]) >= want:
                return st
            time.sleep(0.5)
        raise RuntimeError("cluster not ready in %d s (state %s); logs: %s"
                           % (timeout_s, json.dumps(st)[:500], " ".join(self.logs)))

    def worker_pid(self, host, tp_rank=None):
        """The pid of the kvrelay worker on host (with --tp-rank tp_rank if given)."""
        for pid in self.bed.pids_on(host):
            try:
                with open("/proc/%d/cmdline" % pid, "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if not argv or not os.path.basename(argv[0]).startswith(b"kvrelay-"):
                continue
            if tp_rank is not None:
                rank = argv[argv.index(b"--tp-rank") + 1] if b"--tp-rank" in argv else b"0"
                if int(rank) != tp_rank:
                    continue
            return pid
        return None

    def alive(self):
        return [name for name, p in self.procs if p.poll() is None]

    def stop(self):
        for _, p in reversed(self.procs):
            stop_process(p, 20)

    def tail_logs(self, lines=15):
        out = []
        for path in self.logs:
            try:
                with open(path, errors="replace") as f:
                    tail = f.read().splitlines()[-lines:]
            except OSError:
                continue
            out.append("--- %s\n%s" % (path, "\n".join(tail)))
        return "\n".join(out)
