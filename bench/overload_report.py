#!/usr/bin/env python3
"""Goodput figures of bench/overload.sh's runs (kvrelay bench serve --json files).

  overload_report.py window FILE SLO_MS          -> goodput of one run over its load window
  overload_report.py table OUT MULT SLO R Q PEAK SAT CONFIGS BEST_C  -> the markdown table

Goodput over the load window: the requests that met the TTFT deadline and
got their first token while the load was on (between the first and the last
arrival), per second of that span: the rate at which the cluster delivered
in-deadline service under the offered load. It cannot exceed what the cluster
sustains (a request counted had its first token inside the window), unlike
counting every arrival of the window that eventually met the deadline, which
a short burst inflates past capacity by queueing within the deadline (the
first version of this script reported 148-174% of the peak that way).
Dividing by the whole run's duration instead would dilute an open loop's
figure by its drain tail (the last arrivals finishing after the load
stopped), a share that depends only on the run's length; it is printed too.
"""
import json
import statistics
import sys


def window_goodput(j, slo_ms):
    reqs = j["requests"]
    if len(reqs) < 2:
        return 0.0
    starts = [r["start_s"] for r in reqs]
    t0, t1 = min(starts), max(starts)
    span = t1 - t0
    good = sum(1 for r in reqs if r["ok"] and r["ttft_ms"] <= slo_ms
               and r["start_s"] + r["ttft_ms"] / 1000.0 <= t1)
    return good / span if span > 0 else 0.0


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def table(out, mult, slo, r, q, peak, sat, configs, best_c):
    print(f"TTFT deadline {slo:.0f} ms; sweep peak goodput {peak:.2f} req/s (closed loop of "
          f"{best_c} clients), saturation {sat:.2f} req/s; shed = --max-running {r} "
          f"--max-queue-delay-ms {q}; defaults = the coordinator's (--max-running 64, "
          f"--max-queue-delay-ms 2000)")
    refs = {}
    for name in configs:
        got = [window_goodput(j, slo) for j in
               (load(f"{out}/{name}.peak-{w}.json") for w in ("before", "after")) if j]
        refs[name] = max(got) if got else peak
        print(f"{name}: reference peak {refs[name]:.2f} req/s (closed loop of {best_c} before / after: "
              + " / ".join(f"{g:.2f}" for g in got) + ")")
    print("| config | load | offered req/s | requests | shed (429/503 + Retry-After) | "
          "median time to refusal | failed | met deadline | goodput (load window) | of peak | "
          "goodput (whole run) | TTFT p50 / p90 of completed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = []
    for name in configs:
        for m in mult:
            path = f"{out}/{name}.x{m}.json"
            j = load(path)
            if j is None:
                print(f"| {name} | {m}x | (run failed: see {path}.txt) |")
                continue
            reqs = j["requests"]
            refused = [x["e2e_ms"] for x in reqs if not x["ok"] and x.get("retry_after")
                       and x.get("http_status") in (429, 503)]
            failed = j["failed"] - len(refused)
            med = f"{statistics.median(refused):.0f} ms" if refused else "-"
            g = window_goodput(j, slo)
            frac = g / refs[name] if refs[name] > 0 else 0.0
            print(f"| {name} | {m}x | {j['rate']:.2f} | {len(reqs)} | {len(refused)} | {med} | "
                  f"{failed} | {j['good_requests']} | {g:.2f} req/s | **{100 * frac:.0f}%** | "
                  f"{j['goodput_rps']:.2f} req/s | {j['ttft_ms']['p50']:.0f} / "
                  f"{j['ttft_ms']['p90']:.0f} ms |")
            lines.append(f"goodput_vs_peak {name} {m}x {frac:.2f}")
    print("\n".join(lines))


def main(argv):
    if len(argv) >= 4 and argv[1] == "window":
        with open(argv[2]) as f:
            print(f"{window_goodput(json.load(f), float(argv[3])):.4f}")
        return 0
    if len(argv) == 11 and argv[1] == "table":
        _, _, out, mult, slo, r, q, peak, sat, configs, conc = argv
        table(out, mult.split(), float(slo), r, q, float(peak), float(sat), configs.split(), conc)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
