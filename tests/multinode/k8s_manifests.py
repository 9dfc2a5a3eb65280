"""The Kubernetes manifests (deploy/k8s*), checked offline and run on emulated hosts.

Offline (no root, no cluster; `k8s_manifests.py offline`, ctest deploy_k8s_offline):
every kustomization rendered from the tracked files alone (`kubectl kustomize`),
the Helm chart rendered, each object validated against the Kubernetes schemas,
and the deployment rules checked (non-root, read-only root, capabilities
dropped, probes, budgets, unique data-plane ranks at any replica count, the
model fetched by an init container). `k8s_manifests.py dockerignore` (ctest
deploy_dockerignore) checks .dockerignore keeps secrets and local state out of
the image's build context. A missing tool (PyYAML, kubernetes-validate, kubectl)
fails the test when CI=true and is reported as a skip (exit 77) elsewhere.

1. Offline validation: every manifest listed in kustomization.yaml against the
   Kubernetes OpenAPI schemas with the PyPI package kubernetes-validate (in a
   venv this test creates; skipped with a message when PyPI is unreachable),
   plus the cross-references a schema cannot see: each StatefulSet's
   serviceName is a headless Service, each Service selects pods, the control
   Service publishes not-ready addresses, liveness is not the readiness probe,
   every binary a container runs is one the Dockerfile copies into the image.
2. Emulation: one emulated host per pod (its name and the StatefulSet's pod DNS
   name `pod.service` resolve to it). A Service name resolves to its pod only
   while Kubernetes would route to it: at once with publishNotReadyAddresses,
   else once the pod's readiness probe passes (probes run as the kubelet would,
   from outside the pod). Each container's command line is taken from the
   manifest as written, with the environment the kubelet gives it (POD_NAME,
   POD_IP, CPU_LIMIT from the downward API) and the image's paths mapped to
   this checkout the way the Dockerfile's COPY lines place them; volumes are
   directories in the work dir. One request goes through the kvrelay-api
   Service and must equal the single-process engine's greedy output.
"""

import glob
import json
import math
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import cluster  # noqa: E402
import testbed  # noqa: E402
from cluster import log  # noqa: E402

K8S_DIR = os.path.join(cluster.SRC, "deploy/k8s")
DOCKERFILE = os.path.join(cluster.SRC, "deploy/Dockerfile")


def load_manifests():
    import yaml
    with open(os.path.join(K8S_DIR, "kustomization.yaml")) as f:
        kust = yaml.safe_load(f)
    files = [os.path.join(K8S_DIR, r) for r in kust.get("resources", [])]
    docs = []
    for path in files:
        with open(path) as f:
            docs += [(path, d) for d in yaml.safe_load_all(f) if d]
    return kust, files, docs


# ------------------------------------------------------------------ validation

def validator(venv):
    """Path of kubernetes-validate in venv (created on first use), or None + why."""
    exe = os.path.join(venv, "bin", "kubernetes-validate")
    if os.access(exe, os.X_OK):
        return exe, None
    r = subprocess.run([sys.executable, "-m", "venv", venv], capture_output=True, text=True)
    if r.returncode != 0:
        return None, "cannot create a venv: " + r.stderr.strip()[-300:]
    r = subprocess.run([os.path.join(venv, "bin", "pip"), "install", "-q", "--disable-pip-version-check",
                        "--timeout", "30", "kubernetes-validate"], capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0:
        return None, "PyPI unreachable or kubernetes-validate not installable: " + r.stderr.strip()[-300:]
    return exe, None


def validate_offline(check, venv, files, workdir):
    exe, why = validator(venv)
    if exe is None:
        raise MissingTool("kubernetes-validate: " + why)
    for path in files:
        r = subprocess.run([exe, "--strict", path], capture_output=True, text=True, timeout=300)
        check.expect(r.returncode == 0, "kubernetes-validate --strict %s%s"
                     % (os.path.relpath(path, cluster.SRC),
                        "" if r.returncode == 0 else ": " + (r.stdout + r.stderr)[-500:]))
    # The validator itself catches a bad field (so a pass above means something).
    bad = os.path.join(workdir, "bad-manifest.yaml")
    with open(bad, "w") as f:
        f.write("apiVersion: v1\nkind: Service\nmetadata: {name: x}\n"
                "spec: {selector: {a: b}, ports: [{port: 1}], publishNotReadyAdresses: true}\n")
    r = subprocess.run([exe, "--strict", bad], capture_output=True, text=True, timeout=300)
    check.expect(r.returncode != 0, "kubernetes-validate rejects a misspelt field")


def dockerfile_paths():
    """{image path: checkout path} from the final stage's COPY --from=build lines,
    and the ENTRYPOINT's binary."""
    with open(DOCKERFILE) as f:
        text = f.read()
    workdir = "/src"
    m = re.search(r"^WORKDIR\s+(\S+)", text, re.M)
    if m:
        workdir = m.group(1)
    copies = {}
    for src, dst in re.findall(r"^COPY\s+--from=\S+\s+(\S+)\s+(\S+)\s*$", text, re.M):
        if not src.startswith(workdir + "/"):
            continue
        copies[dst.rstrip("/")] = src[len(workdir) + 1:].rstrip("/")
    m = re.search(r'^ENTRYPOINT\s+\[\s*"([^"]+)"', text, re.M)
    return copies, (m.group(1) if m else None)


def map_image_path(copies, path, build_dir, model_dir):
    """Where an image path lives in this checkout's build, or None."""
    best = None
    for dst, src in copies.items():
        if path == dst or path.startswith(dst + "/"):
            if best is None or len(dst) > len(best[0]):
                best = (dst, src)
    if best is None:
        return None
    dst, src = best
    rest = path[len(dst):]
    if src.startswith("build/"):
        local = os.path.join(build_dir, src[len("build/"):])
    elif src == "models" or src.startswith("models/"):
        local = os.path.join(model_dir, src[len("models"):].lstrip("/"))
    else:
        local = os.path.join(cluster.SRC, src)
    return local.rstrip("/") + rest


def pod_specs(docs):
    workloads = [d for _, d in docs if d.get("kind") in ("Deployment", "StatefulSet")]
    services = [d for _, d in docs if d.get("kind") == "Service"]
    return workloads, services


def cross_checks(check, docs, env):
    workloads, services = pod_specs(docs)
    svc = {s["metadata"]["name"]: s for s in services}
    for w in workloads:
        name = w["metadata"]["name"]
        labels = w["spec"]["template"]["metadata"]["labels"]
        check.expect(all(w["spec"]["selector"]["matchLabels"].get(k) == v
                         for k, v in labels.items() if k in w["spec"]["selector"]["matchLabels"]),
                     "%s: selector matches its pod labels" % name)
        if w["kind"] == "StatefulSet":
            s = svc.get(w["spec"].get("serviceName"))
            check.expect(s is not None and s["spec"].get("clusterIP") == "None",
                         "%s: serviceName %s is a headless Service in the manifests"
                         % (name, w["spec"].get("serviceName")))
    for s in services:
        sel = s["spec"].get("selector", {})
        hit = [w["metadata"]["name"] for w in workloads
               if all(w["spec"]["template"]["metadata"]["labels"].get(k) == v
                      for k, v in sel.items())]
        check.expect(bool(hit), "Service %s selects pods (%s)" % (s["metadata"]["name"], hit))
    control = svc.get("kvrelay-control")
    check.expect(control is not None and control["spec"].get("publishNotReadyAddresses") is True,
                 "kvrelay-control routes to the coordinator before it is ready "
                 "(publishNotReadyAddresses), so workers can register")
    copies, entry = dockerfile_paths()
    build_dir = os.path.dirname(env.bin_dir)
    model_dir = os.path.dirname(env.model)
    ep = map_image_path(copies, entry, build_dir, model_dir) if entry else None
    check.expect(ep is not None and os.access(ep, os.X_OK),
                 "Dockerfile ENTRYPOINT %s is a binary the image copies (%s)" % (entry, ep))
    for w in workloads:
        spec = w["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            live, ready = c.get("livenessProbe"), c.get("readinessProbe")
            if ready is not None:
                check.expect(live is not None and live != ready,
                             "%s/%s: liveness differs from readiness" % (w["metadata"]["name"],
                                                                         c["name"]))
            for path in re.findall(r"/opt/kvrelay/\S+", " ".join(c["command"] + c.get("args", []))):
                path = path.strip("\"'")
                local = map_image_path(copies, path, build_dir, model_dir)
                check.expect(local is not None and os.path.exists(local),
                             "%s/%s: %s is in the image (%s)" % (w["metadata"]["name"], c["name"],
                                                                 path, local))


# ------------------------------------------------------------------ emulation

def project_secret(d, secret, workdir):
    """Writes the Secret a volume names, as the kubelet would: the cluster key
    the kustomization generates from cluster.key (one random key per test run)."""
    if secret.get("secretName") != "kvrelay-cluster-key":
        raise RuntimeError("secret %s not emulated" % secret.get("secretName"))
    src = os.path.join(workdir, "cluster.key")
    if not os.path.exists(src):
        with open(src, "w") as f:
            f.write(os.urandom(32).hex())
    path = os.path.join(d, "cluster.key")
    if not os.path.exists(path):
        with open(src) as f, open(path, "w") as out:
            out.write(f.read())
    os.chmod(path, secret.get("defaultMode", 0o644))


def cpu_cores(q):
    q = str(q)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


class Pod:
    def __init__(self, workload, ordinal):
        self.workload = workload
        self.kind = workload["kind"]
        wname = workload["metadata"]["name"]
        self.name = "%s-%d" % (wname, ordinal) if self.kind == "StatefulSet" else wname + "-0"
        self.spec = workload["spec"]["template"]["spec"]
        self.labels = workload["spec"]["template"]["metadata"]["labels"]
        self.ready = False


def container_limit(c, limit_ranges):
    lim = (c.get("resources") or {}).get("limits", {}).get("cpu")
    if lim is None:
        for lr in limit_ranges:
            for item in lr["spec"]["limits"]:
                if item.get("type") == "Container" and "cpu" in item.get("default", {}):
                    lim = item["default"]["cpu"]
    return lim


def probe_ok(bed, pod_host, probe, named_ports):
    port = probe.get("tcpSocket", probe.get("httpGet", {})).get("port")
    port = named_ports.get(port, port)
    ip = bed.host(pod_host).ip
    if "httpGet" in probe:
        code = ("import urllib.request,sys\ntry:\n r=urllib.request.urlopen('http://%s:%s%s',timeout=2)"
                "\n sys.exit(0 if 200<=r.status<400 else 1)\nexcept Exception: sys.exit(1)"
                % (ip, port, probe["httpGet"].get("path", "/")))
    else:
        code = ("import socket,sys\ntry: socket.create_connection(('%s',%s),2).close()\n"
                "except OSError: sys.exit(1)" % (ip, port))
    r = bed.run("launcher", [sys.executable, "-c", code], timeout=20, check=False)
    return r.returncode == 0


def run(a, env, check):
    require_yaml()
    kust, files, docs = load_manifests()
    listed = set(os.path.basename(f) for f in files)
    present = set(os.path.basename(f) for f in glob.glob(os.path.join(K8S_DIR, "*.yaml"))) - {
        "kustomization.yaml"}
    check.expect(listed == present, "kustomization.yaml lists every manifest (%s)" % sorted(listed))
    validate_offline(check, a.venv or os.path.join(env.workdir, "k8s-venv"), files, env.workdir)
    cross_checks(check, docs, env)

    workloads, services = pod_specs(docs)
    limit_ranges = [d for _, d in docs if d.get("kind") == "LimitRange"]
    pods = []
    for w in workloads:
        for i in range(w["spec"].get("replicas", 1)):
            pods.append(Pod(w, i))
    hosts = [("launcher", None, [])]
    for p in pods:
        cores = sum(cpu_cores(container_limit(c, limit_ranges) or 1) for c in p.spec["containers"])
        aliases = []
        if p.kind == "StatefulSet":
            aliases.append("%s.%s" % (p.name, p.workload["spec"]["serviceName"]))
        hosts.append((p.name, cores, aliases))

    def selected(s):
        sel = s["spec"].get("selector", {})
        return [p for p in pods if all(p.labels.get(k) == v for k, v in sel.items())]

    copies, _ = dockerfile_paths()
    build_dir, model_dir = os.path.dirname(env.bin_dir), os.path.dirname(env.model)
    coord = [p for p in pods if p.workload["metadata"]["name"] == "kvrelay-coordinator"]
    if not check.expect(len(coord) == 1, "one coordinator pod"):
        return check
    coord = coord[0]
    coord_cmd = coord.spec["containers"][0]["command"]
    kv_dtype = coord_cmd[coord_cmd.index("--kv-dtype") + 1] if "--kv-dtype" in coord_cmd else "f16"
    prompts = cluster.random_prompts(a.seed + 11, 2, 40)

    with testbed.Testbed(hosts, rate=a.link) as bed:
        procs = []
        published = set()

        def publish():
            """Service names resolve to the pods Kubernetes would route to now."""
            for s in services:
                name = s["metadata"]["name"]
                targets = [p for p in selected(s)
                           if p.ready or s["spec"].get("publishNotReadyAddresses")]
                if name in published or not targets:
                    continue
                published.add(name)
                bed.add_alias(targets[0].name, name)

        def start_pod(p):
            for c in p.spec["containers"]:
                env_vars = dict(os.environ)
                for e in c.get("env", []):
                    vf = e.get("valueFrom", {})
                    if "value" in e:
                        env_vars[e["name"]] = e["value"]
                    elif vf.get("fieldRef", {}).get("fieldPath") == "metadata.name":
                        env_vars[e["name"]] = p.name
                    elif vf.get("fieldRef", {}).get("fieldPath") == "status.podIP":
                        env_vars[e["name"]] = bed.host(p.name).ip
                    elif vf.get("resourceFieldRef", {}).get("resource") == "limits.cpu":
                        lim = container_limit(c, limit_ranges)
                        env_vars[e["name"]] = str(int(math.ceil(cpu_cores(lim)))) if lim else "1"
                    else:
                        raise RuntimeError("%s: env %s not emulated" % (p.name, e["name"]))
                mounts = {}
                secrets = {v["name"]: v["secret"] for v in p.spec.get("volumes", [])
                           if "secret" in v}
                for m in c.get("volumeMounts", []):
                    d = os.path.join(env.workdir, "volumes", "%s-%s" % (m["name"], p.name),
                                     m.get("subPath", ""))
                    os.makedirs(d, exist_ok=True)
                    if m["name"] in init_volumes(p.spec):
                        # An init container fills this volume (the model): its
                        # download is not repeated here; the volume gets the
                        # model scripts/fetch-model.sh put in the checkout.
                        for fname in os.listdir(model_dir):
                            dst = os.path.join(d, fname)
                            if not os.path.exists(dst):
                                os.symlink(os.path.join(model_dir, fname), dst)
                    if m["name"] in secrets:
                        # As the kubelet projects a Secret: one file per key,
                        # with the volume's defaultMode (the cluster key).
                        project_secret(d, secrets[m["name"]], env.workdir)
                    mounts[m["mountPath"]] = d
                cmd = []
                # Each mount path where a path starts (a word, a --flag= value,
                # a path inside an `sh -c` script) maps to its volume, in one pass: a volume's own path (under
                # /tmp when the build is) must not be mapped again by a later
                # mount such as /tmp.
                mount_re = None
                if mounts:
                    alts = "|".join(re.escape(mp.rstrip("/"))
                                    for mp in sorted(mounts, key=len, reverse=True))
                    mount_re = re.compile(r"(^|[=\s\"':])(%s)(?=[/\s\"']|$)" % alts)
                by_path = {mp.rstrip("/"): d for mp, d in mounts.items()}
                for word in c["command"] + c.get("args", []):
                    if mount_re is not None:
                        word = mount_re.sub(lambda m: m.group(1) + by_path[m.group(2)], word)
                    for path in set(re.findall(r"/opt/kvrelay/[^\s\"']+", word)):
                        word = word.replace(path, map_image_path(copies, path, build_dir,
                                                                 model_dir))
                    cmd.append(word)
                logf = os.path.join(env.workdir, "k8s.%s.%s.log" % (p.name, c["name"]))
                log("  %s/%s: %s" % (p.name, c["name"], " ".join(c["command"])[:160]))
                procs.append(("%s/%s" % (p.name, c["name"]),
                              bed.spawn(p.name, cmd, logf, env=env_vars), logf))

        try:
            ref = cluster.reference_texts(bed, env, prompts, 12, name="k8s-ref", kv_dtype=kv_dtype)
            publish()
            # The coordinator alone: alive (liveness) but not ready (no workers).
            start_pod(coord)
            cc = coord.spec["containers"][0]
            ports = {pp["name"]: pp["containerPort"] for pp in cc.get("ports", []) if "name" in pp}
            alive = wait_for(lambda: probe_ok(bed, coord.name, cc["livenessProbe"], ports), 60)
            check.expect(alive, "coordinator passes its liveness probe with no workers yet")
            check.expect(not probe_ok(bed, coord.name, cc["readinessProbe"], ports),
                         "coordinator is not ready with no workers registered")
            for p in pods:
                if p is not coord:
                    start_pod(p)
            want = len([p for p in pods if p is not coord])

            def ready():
                for name, pr, logf in procs:
                    if pr.poll() is not None:
                        raise RuntimeError("%s exited (%s): %s" % (name, pr.returncode,
                                                                   tail(logf)))
                if not probe_ok(bed, coord.name, cc["readinessProbe"], ports):
                    return False
                st = cluster.client_state(bed, "http://%s:%d" % (bed.host(coord.name).ip,
                                                                 cluster.HTTP_PORT))
                return len(st["workers"]) >= want
            try:
                ok = wait_for(ready, 120)
            except RuntimeError as e:
                check.expect(False, str(e))
                return check
            check.expect(ok, "every worker pod registered through kvrelay-control and the "
                         "coordinator became ready")
            coord.ready = bool(ok)
            for p in pods:
                p.ready = p.ready or bool(ok)
            publish()
            if ok:
                res = cluster.complete(bed, env, "http://kvrelay-api:8080", prompts, 12, 2,
                                       "k8s-serve")
                check.expect(all(r["ok"] for r in res) and [r["text"] for r in res] == ref,
                             "a request through the kvrelay-api Service equals the engine's "
                             "greedy output (%s)" % [(r["ok"], r["error"]) for r in res])
            stores = glob.glob(os.path.join(env.workdir, "volumes", "kvstore-*", "**", "CURRENT"),
                               recursive=True)
            with_store = [p for p in pods if any(
                "--kv-store" in " ".join(c["command"]) for c in p.spec["containers"])]
            claims = [p for p in with_store if p.workload["spec"].get("volumeClaimTemplates")]
            check.expect(bool(with_store) and claims == with_store and len(stores) >= len(with_store),
                         "each pod with --kv-store keeps it on its own claimed volume "
                         "(%d pods, %d RocksDB stores)" % (len(with_store), len(stores)))
        finally:
            for name, pr, logf in reversed(procs):
                cluster.stop_process(pr, 20)
    return check


def tail(path, n=8):
    try:
        with open(path, errors="replace") as f:
            return " | ".join(f.read().splitlines()[-n:])
    except OSError:
        return ""


def wait_for(cond, timeout_s, step=0.3):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(step)
    return False


# ------------------------------------------------------------------ offline mode

class StandaloneCheck:
    """multinode.py's Check for the offline modes: pass/fail lines, counted."""

    def __init__(self):
        self.failures, self.count = [], 0

    def expect(self, cond, what):
        self.count += 1
        log(("ok   " if cond else "FAIL ") + what)
        if not cond:
            self.failures.append(what)
        return cond


class MissingTool(Exception):
    """A tool the check needs is not installed: a failure on CI, a skip elsewhere."""


def require_yaml():
    try:
        import yaml  # noqa: F401
    except ImportError:
        raise MissingTool("PyYAML (Debian python3-yaml; scripts/install-deps.sh installs it)")


def init_volumes(pod_spec):
    """Names of the volumes an init container writes."""
    return {m["name"] for c in pod_spec.get("initContainers", [])
            for m in c.get("volumeMounts", []) if not m.get("readOnly")}


DEPLOY = os.path.join(cluster.SRC, "deploy")
KUSTOMIZATIONS = ["k8s", "k8s-tls", "k8s-cuda", "k8s-prometheus"]
WORLD_SIZE = 65536


def tracked_copy(workdir):
    """deploy/ as a clean checkout has it (tracked files only), plus the
    git-ignored certificates k8s-tls's secretGenerator reads (dummies)."""
    dst = os.path.join(workdir, "clean")
    if os.path.isdir(dst):
        subprocess.run(["rm", "-rf", dst], check=True)
    r = subprocess.run(["git", "-C", cluster.SRC, "ls-files", "-co", "--exclude-standard", "deploy"],
                       capture_output=True, text=True)
    files = r.stdout.split() if r.returncode == 0 else []
    if not files:  # not a git checkout: every file under deploy/
        files = [os.path.relpath(os.path.join(dp, f), cluster.SRC)
                 for dp, _, fs in os.walk(DEPLOY) for f in fs]
    for f in files:
        os.makedirs(os.path.dirname(os.path.join(dst, f)), exist_ok=True)
        with open(os.path.join(cluster.SRC, f), "rb") as i, open(os.path.join(dst, f), "wb") as o:
            o.write(i.read())
    certs = os.path.join(dst, "deploy/k8s-tls/certs")
    os.makedirs(certs, exist_ok=True)
    for n in ("ca.crt", "coordinator.crt", "coordinator.key", "worker.crt", "worker.key"):
        with open(os.path.join(certs, n), "w") as f:
            f.write("dummy\n")
    return os.path.join(dst, "deploy")


def render_kustomizations(check, deploy):
    import yaml
    kubectl = subprocess.run(["sh", "-c", "command -v kubectl"], capture_output=True, text=True)
    if kubectl.returncode != 0:
        raise MissingTool("kubectl (its `kubectl kustomize` renders the overlays)")
    out = {}
    for k in KUSTOMIZATIONS:
        r = subprocess.run(["kubectl", "kustomize", os.path.join(deploy, k)], capture_output=True,
                           text=True, timeout=120)
        ok = check.expect(r.returncode == 0, "kubectl kustomize deploy/%s renders from a clean "
                          "checkout%s" % (k, "" if r.returncode == 0 else ": " + r.stderr[-400:]))
        if ok:
            out[k] = [d for d in yaml.safe_load_all(r.stdout) if d]
    return out


def render_helm(check, deploy, workdir):
    """The chart's objects: `helm template` when helm is installed, else the
    chart's own subset rendered here (it uses only {{ .Values.x.y }} and
    {{ .Release.Namespace }}; any other action fails the check)."""
    import yaml
    chart = os.path.join(deploy, "helm/kvrelay")
    with open(os.path.join(chart, "values.yaml")) as f:
        values = yaml.safe_load(f)
    helm = subprocess.run(["sh", "-c", "command -v helm"], capture_output=True, text=True)
    if helm.returncode == 0:
        r = subprocess.run(["helm", "template", "kvrelay", chart, "--namespace", "kvrelay"],
                           capture_output=True, text=True, timeout=120)
        check.expect(r.returncode == 0, "helm template renders the chart: " + r.stderr[-300:])
        return [d for d in yaml.safe_load_all(r.stdout) if d]
    docs = []
    for name in sorted(os.listdir(os.path.join(chart, "templates"))):
        if not name.endswith(".yaml"):
            continue
        with open(os.path.join(chart, "templates", name)) as f:
            text = f.read()

        def subst(m):
            expr = m.group(1).strip()
            if expr == ".Release.Namespace":
                return "kvrelay"
            if not expr.startswith(".Values."):
                check.expect(False, "helm/kvrelay/templates/%s: {{ %s }} is beyond the chart's "
                             "simple subset" % (name, expr))
                return ""
            v = values
            for key in expr[len(".Values."):].split("."):
                v = v[key]
            return str(v)
        text = re.sub(r"\{\{-?\s*(.*?)\s*-?\}\}", subst, text)
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def schema_validate(check, exe, label, docs, workdir):
    """Every object against the Kubernetes schemas; a CRD object's pod
    templates as PodTemplates (the validator has no CRD schemas)."""
    import yaml
    core = []
    for d in docs:
        if d["kind"] == "LeaderWorkerSet":
            lwt = d["spec"]["leaderWorkerTemplate"]
            for t in ("leaderTemplate", "workerTemplate"):
                if t in lwt:
                    core.append({"apiVersion": "v1", "kind": "PodTemplate",
                                 "metadata": {"name": "%s-%s" % (d["metadata"]["name"], t.lower())},
                                 "template": lwt[t]})
        elif d["kind"] == "ServiceMonitor":
            continue  # checked in deploy_rules
        else:
            core.append(d)
    path = os.path.join(workdir, "rendered-%s.yaml" % label.replace("/", "-"))
    with open(path, "w") as f:
        yaml.safe_dump_all(core, f)
    r = subprocess.run([exe, "--strict", path], capture_output=True, text=True, timeout=300)
    check.expect(r.returncode == 0, "kubernetes-validate --strict %s (%d objects)%s"
                 % (label, len(core), "" if r.returncode == 0 else ": " + (r.stdout + r.stderr)[-600:]))


def pod_templates(docs):
    """(object name, pod spec, labels, replicas, kind) of every workload."""
    out = []
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            t = d["spec"]["template"]
            out.append((d["metadata"]["name"], t["spec"], t["metadata"].get("labels", {}),
                        d["spec"].get("replicas", 1), d["kind"]))
        elif d["kind"] == "LeaderWorkerSet":
            t = d["spec"]["leaderWorkerTemplate"]["workerTemplate"]
            out.append((d["metadata"]["name"], t["spec"], t["metadata"].get("labels", {}),
                        d["spec"].get("replicas", 1), d["kind"]))
    return out


def shell_value(expr, env):
    """The value of a --rank / --world-size word as sh would expand it (the
    forms the manifests use: $((...)), ${POD_NAME##*-}, $VAR, literals)."""
    expr = expr.strip("\"'")
    expr = re.sub(r"\$\{POD_NAME##\*-\}", lambda m: env["POD_NAME"].rsplit("-", 1)[1], expr)
    expr = re.sub(r"\$\{?([A-Z_]+)\}?", lambda m: str(env[m.group(1)]), expr)
    m = re.fullmatch(r"\$\(\((.*)\)\)", expr)
    if m:
        expr = m.group(1)
    expr = re.sub(r"\b([A-Z_]+)\b", lambda m: str(env[m.group(1)]), expr)
    if not re.fullmatch(r"[0-9+*\- ()]+", expr):
        raise ValueError("cannot evaluate " + expr)
    return int(eval(expr))  # digits and + - * ( ) only


def data_plane_ranks(check, label, docs, scale):
    """Every data-plane rank with each workload scaled to `scale` replicas:
    unique, inside one world size the same for all."""
    seen, worlds = {}, set()
    for name, spec, _, _, kind in pod_templates(docs):
        for c in spec["containers"]:
            cmd = " ".join(c.get("command", []) + c.get("args", []))
            rank = re.search(r"--rank\s+(\$\(\(.*?\)\)|\S+)", cmd)
            world = re.search(r"--world-size\s+(\S+)", cmd)
            if rank is None:
                continue
            size = 2
            if kind == "LeaderWorkerSet":
                pods = [("%s-%d" % (name, g), {"GROUP_INDEX": g, "TP_RANK": w, "LWS_GROUP_SIZE": size})
                        for g in range(scale) for w in range(size)]
            else:
                pods = [("%s-%d" % (name, i), {}) for i in range(scale)]
            for pod, extra in pods:
                env = dict(extra, POD_NAME=pod)
                r, w = shell_value(rank.group(1), env), shell_value(world.group(1), env)
                worlds.add(w)
                key = "%s/%s" % (pod, c["name"])
                if not check.expect(0 <= r < w and r not in seen,
                                    "%s: %s rank %d at %d replicas is unique and < %d (%s)"
                                    % (label, key, r, scale, w, seen.get(r))):
                    return
                seen[r] = key
    check.expect(len(worlds) == 1, "%s: one world size for every pod (%s)" % (label, worlds))


def deploy_rules(check, label, docs):
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for d in docs:
        if d["kind"] != "Namespace":
            check.expect(d["metadata"].get("namespace") == "kvrelay",
                         "%s: %s %s is in namespace kvrelay" % (label, d["kind"], d["metadata"]["name"]))
    check.expect(any(k == "LimitRange" for k, _ in kinds), "%s: a namespaced LimitRange" % label)
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    for name, spec, labels, _, kind in pod_templates(docs):
        where = "%s: %s" % (label, name)
        psc = spec.get("securityContext", {})
        check.expect(psc.get("runAsNonRoot") is True and psc.get("runAsUser", 0) != 0,
                     where + ": runs as non-root")
        for c in spec.get("initContainers", []) + spec["containers"]:
            sc = c.get("securityContext", {})
            check.expect(sc.get("readOnlyRootFilesystem") is True
                         and sc.get("allowPrivilegeEscalation") is False
                         and sc.get("capabilities", {}).get("drop") == ["ALL"],
                         "%s/%s: read-only root, no privilege escalation, drops ALL capabilities"
                         % (where, c["name"]))
        for v in spec.get("volumes", []):
            if "secret" in v:
                mode = v["secret"].get("defaultMode", 0o644)
                check.expect(mode & 0o007 == 0, "%s: Secret %s unreadable to others (mode %o; the "
                             "cluster key loader refuses it otherwise)" % (where, v["name"], mode))
        filled = init_volumes(spec)
        for c in spec["containers"]:
            cmd = " ".join(c.get("command", []) + c.get("args", []))
            check.expect("--world-size 30" not in cmd, where + ": no fixed world size of 30")
            model = re.search(r"--model\s+(\S+)", cmd)
            if model:
                mounts = [m for m in c.get("volumeMounts", [])
                          if model.group(1).startswith(m["mountPath"].rstrip("/") + "/")]
                check.expect(bool(mounts) and mounts[0]["name"] in filled,
                             "%s/%s: the model %s is on a volume an init container fills"
                             % (where, c["name"], model.group(1)))
            if kind != "Deployment":
                check.expect("startupProbe" in c and "readinessProbe" in c and "livenessProbe" in c,
                             "%s/%s: startup, readiness and liveness probes" % (where, c["name"]))
        if kind != "Deployment":
            check.expect(any(all(labels.get(k) == v for k, v in
                                 p["spec"]["selector"]["matchLabels"].items()) for p in pdbs),
                         where + ": a PodDisruptionBudget selects its pods")
    data_plane_ranks(check, label, docs, 40)


def cuda_rules(check, docs):
    lws = [d for d in docs if d["kind"] == "LeaderWorkerSet"]
    check.expect(len(lws) == 1 and not any(d["kind"] == "StatefulSet" and d["metadata"]["name"] ==
                                           "kvrelay-decode" for d in docs),
                 "k8s-cuda: decode groups are a LeaderWorkerSet, the CPU StatefulSet is gone")
    for d in lws:
        lwt = d["spec"]["leaderWorkerTemplate"]
        spec = lwt["workerTemplate"]["spec"]
        check.expect(bool(spec.get("nodeSelector")), "k8s-cuda: GPU pods have a nodeSelector")
        for c in spec["containers"]:
            cmd = " ".join(c["command"])
            gpu = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
            check.expect(str(gpu) == "1", "k8s-cuda: %s requests one nvidia.com/gpu" % c["name"])
            check.expect("--device cuda:0" in cmd, "k8s-cuda: ranks start with --device cuda:0")
            check.expect("LWS_GROUP_SIZE" in cmd and lwt.get("size", 1) >= 2,
                         "k8s-cuda: TP size is the group size (%s)" % lwt.get("size"))


def monitor_rules(check, docs):
    svcs = [d for d in docs if d["kind"] == "Service"]
    mons = [d for d in docs if d["kind"] == "ServiceMonitor"]
    check.expect(len(mons) == 1, "k8s-prometheus: one ServiceMonitor")
    for m in mons:
        sel = m["spec"]["selector"]["matchLabels"]
        hit = [s for s in svcs if all(s["metadata"].get("labels", {}).get(k) == v
                                      for k, v in sel.items())]
        ports = {p.get("name") for s in hit for p in s["spec"]["ports"]}
        check.expect(bool(hit) and all(e["port"] in ports for e in m["spec"]["endpoints"]),
                     "k8s-prometheus: the ServiceMonitor selects a Service with its port (%s)"
                     % [s["metadata"]["name"] for s in hit])


def offline(a):
    check = StandaloneCheck()
    workdir = a.workdir or os.path.join("/tmp", "kvrelay-k8s-offline")
    os.makedirs(workdir, exist_ok=True)
    require_yaml()
    deploy = tracked_copy(workdir)
    rendered = render_kustomizations(check, deploy)
    exe, why = validator(a.venv or os.path.join(workdir, "venv"))
    if exe is None:
        raise MissingTool("kubernetes-validate: " + why)
    validate_offline(check, a.venv or os.path.join(workdir, "venv"), [], workdir)
    for k, docs in rendered.items():
        schema_validate(check, exe, "deploy/" + k, docs, workdir)
        deploy_rules(check, "deploy/" + k, docs)
    if "k8s-cuda" in rendered:
        cuda_rules(check, rendered["k8s-cuda"])
    if "k8s-prometheus" in rendered:
        monitor_rules(check, rendered["k8s-prometheus"])
    chart = render_helm(check, deploy, workdir)
    schema_validate(check, exe, "deploy/helm/kvrelay", chart, workdir)
    deploy_rules(check, "deploy/helm/kvrelay", chart + [d for d in rendered.get("k8s", [])
                                                        if d["kind"] == "Namespace"])
    base = {(d["kind"], d["metadata"]["name"]) for d in rendered.get("k8s", [])} - {
        ("Namespace", "kvrelay")}
    got = {(d["kind"], d["metadata"]["name"]) for d in chart}
    check.expect(got == base, "the Helm chart renders deploy/k8s's objects (missing %s, extra %s)"
                 % (sorted(base - got), sorted(got - base)))
    return check


# ------------------------------------------------------------------ .dockerignore

def dockerignore_patterns():
    with open(os.path.join(cluster.SRC, ".dockerignore")) as f:
        lines = [ln.strip() for ln in f]
    out = []
    for ln in lines:
        if not ln or ln.startswith("#"):
            continue
        neg = ln.startswith("!")
        p = os.path.normpath(ln[1:] if neg else ln).lstrip("/")
        rx, i = "", 0
        while i < len(p):  # Docker's matcher: ** any dirs, * and ? within one name
            if p.startswith("**/", i):
                rx, i = rx + "(.*/)?", i + 3
            elif p.startswith("**", i):
                rx, i = rx + ".*", i + 2
            elif p[i] == "*":
                rx, i = rx + "[^/]*", i + 1
            elif p[i] == "?":
                rx, i = rx + "[^/]", i + 1
            else:
                rx, i = rx + re.escape(p[i]), i + 1
        out.append((re.compile(rx + r"\Z"), neg))
    return out


def docker_excluded(patterns, path):
    """Whether Docker leaves `path` (relative, '/'-separated) out of the context:
    the last pattern matching it or one of its parent directories decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for rx, neg in patterns:
        if any(rx.match(p) for p in prefixes):
            excluded = not neg
    return excluded


def dockerignore(a):
    check = StandaloneCheck()
    pats = dockerignore_patterns()
    must_leave_out = [
        "deploy/k8s/cluster.key", "cluster.key", "deploy/k8s-tls/certs/ca.key",
        "deploy/k8s-tls/certs/worker.key", "deploy/k8s-tls/certs/ca.crt", "certs/ca.key",
        "tls/server.pem", "keys/api-keys.txt", "api_keys.txt", ".env", "deploy/.env.local",
        "kvstore/prefill-0/CURRENT", "deploy/kvstore/x", "build/CMakeCache.txt",
        "build-serve/build.log", "build-asan/bin/kvrelay", "cmake-build-debug/x",
        "models/SmolLM2-135M-Instruct.Q4_1.gguf", "bench/x.gguf", ".git/config",
        ".venv/bin/python", "build/multinode-venv/bin/pip", "openai-venv/bin/python",
        "tools/__pycache__/x.pyc", ".ccache/x", "compile_commands.json"]
    for p in must_leave_out:
        check.expect(docker_excluded(pats, p), ".dockerignore leaves out %s" % p)
    # What the image build needs stays in: every tracked file (the sources).
    r = subprocess.run(["git", "-C", cluster.SRC, "ls-files"], capture_output=True, text=True)
    tracked = r.stdout.split() if r.returncode == 0 else []
    kept_out = [p for p in tracked if docker_excluded(pats, p)]
    check.expect(bool(tracked) and not kept_out,
                 "every tracked file is in the build context (%d files; left out: %s)"
                 % (len(tracked), kept_out[:10]))
    for p in ("CMakeLists.txt", "scripts/build.sh", "scripts/install-deps.sh",
              "scripts/fetch-model.sh", "deploy/Dockerfile"):
        check.expect(not docker_excluded(pats, p), "the build context keeps %s" % p)
    # This checkout's own local state: every untracked secret-like file is left out.
    r = subprocess.run(["git", "-C", cluster.SRC, "ls-files", "-o", "--directory"],
                       capture_output=True, text=True)
    for p in r.stdout.split():
        p = p.rstrip("/")
        if re.search(r"(^|/)(cluster\.key|certs|kvstore)($|/)|\.(key|pem)$", p):
            check.expect(docker_excluded(pats, p), "this checkout's %s is left out" % p)
    return check


def main():
    import argparse
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("what", choices=["offline", "dockerignore"])
    ap.add_argument("--venv", default=None, help="where kubernetes-validate is installed")
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args()
    try:
        check = offline(a) if a.what == "offline" else dockerignore(a)
    except MissingTool as e:
        if os.environ.get("CI") == "true":
            log("FAILED: a tool is missing on CI: %s" % e)
            return 1
        log("SKIPPED: missing %s" % e)
        return 77
    for f in check.failures:
        log("  failed: " + f)
    log("%s: %s (%d checks)" % (a.what, "FAILED" if check.failures else "passed", check.count))
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main())
