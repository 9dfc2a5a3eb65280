"""The Kubernetes manifests (deploy/k8s), checked offline and run on emulated hosts.

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
        log("SKIPPED schema validation: " + why)
        return
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
        for c in w["spec"]["template"]["spec"]["containers"]:
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
    try:
        import yaml  # noqa: F401
    except ImportError:
        log("SKIPPED: PyYAML missing (Debian python3-yaml)")
        return check
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
                for m in c.get("volumeMounts", []):
                    d = os.path.join(env.workdir, "volumes", "%s-%s" % (m["name"], p.name),
                                     m.get("subPath", ""))
                    os.makedirs(d, exist_ok=True)
                    mounts[m["mountPath"]] = d
                cmd = []
                for word in c["command"] + c.get("args", []):
                    for mp, d in mounts.items():
                        word = word.replace(mp, d)
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
