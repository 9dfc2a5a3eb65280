"""HTTP client for the multinode tests; runs on an emulated host (hostexec).

  client.py wait URL TIMEOUT_S           exit 0 once GET /health is 200, 1 at the deadline
  client.py complete URL IN.json OUT.json [--concurrency C] [--timeout-s T]
  client.py state URL                    print {"health", "workers", "gauges"} as JSON

IN.json: {"requests": [{"prompt": [ids...], "max_tokens": N}, ...]}. Each
request is a streamed greedy /v1/completions call (ignore_eos); OUT.json gets,
per request: ok, http status, text, finish_reason, error, and wall-clock
times (time.time(), comparable across hosts: one kernel) of start, first
token and end. Standard library only.
"""

import http.client
import json
import sys
import threading
import time
import urllib.parse


def _conn(url, timeout):
    u = urllib.parse.urlsplit(url)
    return http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)


def health(url, timeout=2.0):
    try:
        c = _conn(url, timeout)
        c.request("GET", "/health")
        r = c.getresponse()
        r.read()
        c.close()
        return r.status
    except OSError:
        return 0


def wait(url, timeout_s):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if health(url) == 200:
            return 0
        time.sleep(0.2)
    return 1


def complete_one(url, req, timeout_s):
    out = {"ok": False, "status": 0, "text": "", "finish_reason": None, "error": None,
           "start": time.time(), "first": None, "end": None, "tokens": 0}
    body = {"model": req.get("model", "default"), "prompt": req["prompt"],
            "max_tokens": req["max_tokens"], "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    try:
        c = _conn(url, timeout_s)
        c.request("POST", "/v1/completions", body=json.dumps(body),
                  headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        r = c.getresponse()
        out["status"] = r.status
        if r.status != 200:
            out["error"] = "HTTP %d: %s" % (r.status, r.read()[:300].decode("utf-8", "replace"))
            return out
        done = False
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            ev = json.loads(data)
            if "error" in ev:
                out["error"] = ev["error"].get("message", "error event")
                continue
            if ev.get("usage"):
                out["tokens"] = ev["usage"].get("completion_tokens", 0)
            for ch in ev.get("choices") or []:
                if ch.get("text"):
                    if out["first"] is None:
                        out["first"] = time.time()
                    out["text"] += ch["text"]
                if ch.get("finish_reason"):
                    out["finish_reason"] = ch["finish_reason"]
        c.close()
        if out["error"] is None and not done:
            out["error"] = "stream ended without [DONE]"
        out["ok"] = out["error"] is None and out["finish_reason"] in ("length", "stop")
    except (OSError, ValueError, http.client.HTTPException) as e:
        out["error"] = "%s: %s" % (type(e).__name__, e)
    finally:
        out["end"] = time.time()
    return out


def complete(url, in_path, out_path, concurrency, timeout_s):
    with open(in_path) as f:
        reqs = json.load(f)["requests"]
    results = [None] * len(reqs)
    lock = threading.Lock()
    nxt = [0]

    def worker():
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(reqs):
                return
            results[i] = complete_one(url, reqs[i], timeout_s)

    threads = [threading.Thread(target=worker) for _ in range(max(1, min(concurrency, len(reqs))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with open(out_path, "w") as f:
        json.dump({"results": results}, f)
    return 0


def state(url):
    """/health's worker list and the per-worker gauges of /metrics."""
    out = {"health": 0, "workers": [], "gauges": {}}
    try:
        c = _conn(url, 5)
        c.request("GET", "/health")
        r = c.getresponse()
        out["health"] = r.status
        out["workers"] = json.loads(r.read()).get("workers", [])
        c.request("GET", "/metrics")
        r = c.getresponse()
        for line in r.read().decode().splitlines():
            if not line.startswith("kvrelay_worker_") or "{" not in line:
                continue
            name, rest = line.split("{", 1)
            labels, value = rest.rsplit("}", 1)
            worker = labels.split('worker="', 1)[1].split('"', 1)[0]
            out["gauges"].setdefault(worker, {})[name[len("kvrelay_worker_"):]] = float(value)
        c.close()
    except (OSError, ValueError, http.client.HTTPException, IndexError) as e:
        out["error"] = str(e)
    print(json.dumps(out))
    return 0


def main(argv):
    if len(argv) >= 2 and argv[0] == "state":
        return state(argv[1])
    if len(argv) >= 3 and argv[0] == "wait":
        return wait(argv[1], float(argv[2]))
    if len(argv) >= 4 and argv[0] == "complete":
        conc, timeout = 1, 300.0
        rest = argv[4:]
        while rest:
            if rest[0] == "--concurrency":
                conc = int(rest[1])
            elif rest[0] == "--timeout-s":
                timeout = float(rest[1])
            else:
                print("client.py: unknown flag " + rest[0], file=sys.stderr)
                return 2
            rest = rest[2:]
        return complete(argv[1], argv[2], argv[3], conc, timeout)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
