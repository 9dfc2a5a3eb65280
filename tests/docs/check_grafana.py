#!/usr/bin/env python3
"""Checks that every series deploy/grafana/kvrelay.json queries exists.

Offline (the ctest entry): each kvrelay_* series in the dashboard's queries,
less a histogram's _bucket/_sum/_count suffix, must be a metric name the
coordinator registers: a "kvrelay_..." string literal in the C++ sources, or a
literal prefix ending in "_" (kvrelay_worker_kvstore_) joined to a string
literal of the same file (restored_blocks_total).

Live (by hand, needs a running cluster that has served a request):
  tests/docs/check_grafana.py --metrics-url http://127.0.0.1:8080/metrics
checks the same series against the names the cluster's /metrics exposes.
Series that appear only with a prefix store (kvrelay_worker_kvstore_*) are
reported, not failed, when the cluster runs without one.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DASHBOARD = os.path.join(ROOT, "deploy", "grafana", "kvrelay.json")
OPTIONAL_LIVE = ("kvrelay_worker_kvstore_",)


def dashboard_series():
    with open(DASHBOARD, encoding="utf-8") as f:
        dash = json.load(f)
    exprs = []
    for panel in dash["panels"]:
        exprs += [t["expr"] for t in panel.get("targets", [])]
    for var in dash.get("templating", {}).get("list", []):
        if isinstance(var.get("query"), dict):
            exprs.append(var["query"]["query"])
    series = set()
    for e in exprs:
        for name in re.findall(r"\bkvrelay_[a-z0-9_]+", e):
            series.add(re.sub(r"_(bucket|sum|count)$", "", name))
    return series


def source_names():
    files = subprocess.run(["git", "ls-files", "--", "*.cc", "*.h"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    names = set()
    for path in files:
        try:
            with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        literals = re.findall(r'"([a-z0-9_]+)"', text)
        for lit in literals:
            if lit.startswith("kvrelay_"):
                names.add(lit)
                if lit.endswith("_"):
                    names.update(lit + s for s in literals if not s.startswith("kvrelay_"))
    return names


def live_names(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    names = set()
    for line in text.splitlines():
        m = re.match(r"# TYPE (\S+)", line) or re.match(r"([a-z_:][a-z0-9_:]*)", line)
        if m:
            names.add(re.sub(r"_(bucket|sum|count)$", "", m.group(1)))
    return names


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--metrics-url", help="check against a live cluster's /metrics instead")
    args = parser.parse_args()
    series = dashboard_series()
    known = live_names(args.metrics_url) if args.metrics_url else source_names()
    missing = sorted(series - known)
    failed = [s for s in missing if not (args.metrics_url and s.startswith(OPTIONAL_LIVE))]
    for s in missing:
        print(f"{'missing' if s in failed else 'absent (no prefix store?)'}: {s}")
    where = args.metrics_url or "the sources"
    print(f"{len(series)} series queried, {len(failed)} not found in {where}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
