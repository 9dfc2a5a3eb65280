#!/usr/bin/env python3
"""docs/BENCHMARKS.md's generated tables, from the results the bench scripts leave.

  bench/report.py record prefix_restart OUT [--commit C] [--conditions quiet|shared] [--note N]
      one run of bench/prefix_restart.sh (its OUT directory: results.jsonl and serve2.log)
  bench/report.py record overload OUT --slo-ms MS [--config defaults] [--label L] [...]
      one run of bench/overload.sh (its -O directory of `kvrelay bench serve --json` files)
  bench/report.py record engine OUT [...]
      one run of bench/compare_llamacpp.sh --out OUT (its compare.txt)
  bench/report.py record faults OUT [...]
      the runs of bench/fault_matrix.sh -O OUT (its fm.log and meta.json)
  bench/report.py record scaling OUT [...]
      one run of tests/multinode/multinode.py scaling --json OUT (the JSON file)
  bench/report.py record transfer OUT [...]
      one run of bench/kv_transfer.sh -O OUT (its rounds' outputs and meta.json)
  bench/report.py render [--doc docs/BENCHMARKS.md]
      rewrites every generated block of the page from bench/results/
  bench/report.py check [--doc docs/BENCHMARKS.md]
      exit 1 when a generated block differs from what bench/results/ gives (a ctest)

`record` appends the run to bench/results/NAME.json with the commit measured (default:
this checkout's HEAD), the date (the run's files' time, UTC), the host (CPU model, its
widest vector extension, vCPUs) and the conditions; then `render` puts it on the page.
A generated block is the text between "<!-- report:NAME -->" and "<!-- /report:NAME -->":
the runs of bench/results/NAME.json as one table and its summary line. The prose around
a block (what is measured, why, what the figures mean) is written by hand.
"""
import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
DOC = os.path.join(ROOT, "docs", "BENCHMARKS.md")
sys.path.insert(0, os.path.join(ROOT, "bench"))


# --- where and when a run was measured ---------------------------------------------

def host_description():
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    vector = "AVX-512" if "avx512f" in flags else ("AVX2 only" if "avx2" in flags else "no AVX2")
    return f"{model}, {vector}, {os.cpu_count()} vCPUs"


def head_commit():
    out = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True, check=False)
    return out.stdout.strip() or "unknown"


def file_time(path):
    t = datetime.datetime.fromtimestamp(os.path.getmtime(path), datetime.timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M UTC")


def results_path(name):
    return os.path.join(RESULTS, f"{name}.json")


def load_results(name):
    with open(results_path(name)) as f:
        return json.load(f)


def save_results(name, data):
    with open(results_path(name), "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


# --- one run from a bench script's output --------------------------------------------

def record_prefix_restart(out):
    """Median TTFT per phase of results.jsonl, and the restore's own log line."""
    path = os.path.join(out, "results.jsonl")
    phases = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            phases.setdefault(r["phase"], []).append(r)
    for p in ("cold", "ram", "restart"):
        if p not in phases:
            raise SystemExit(f"{path}: no '{p}' phase (the run did not finish)")
    restore_ms = None
    try:
        with open(os.path.join(out, "serve2.log")) as f:
            m = re.search(r"kv_store: restored \d+ blocks .*? in ([\d.]+) ms", f.read())
            restore_ms = float(m.group(1)) if m else None
    except OSError:
        pass
    med = {p: statistics.median(r["ttft_s"] for r in rs) for p, rs in phases.items()}
    return {
        "date": file_time(path),
        "cold_s": round(med["cold"], 3),
        "ram_s": round(med["ram"], 3),
        "restart_s": round(med["restart"], 3),
        "restore_ms": round(restore_ms) if restore_ms is not None else None,
        "prompt_tokens": min(r["prompt_tokens"] for r in phases["restart"]),
        "cached_tokens": min(r["cached_tokens"] for r in phases["restart"]),
    }


def record_engine(out):
    """kvrelay beside llama.cpp: the medians of compare_llamacpp.sh's alternated runs."""
    path = os.path.join(out, "compare.txt")
    with open(path) as f:
        text = f.read()
    head = re.search(r"^model (\S+), threads (\d+), (\d+) alternating runs each \(pp(\d+), tg(\d+)\), "
                     r"llama.cpp build (\w+)", text, re.M)
    who = re.search(r"^kvrelay kernels (\S*), llama.cpp (.*)$", text, re.M)
    runs = [tuple(map(float, m.groups()[1:])) for m in re.finditer(
        r"^run (\d+): kvrelay pp ([\d.]+) tg ([\d.]+) \| llama.cpp pp ([\d.]+) tg ([\d.]+)$", text, re.M)]
    if not head or not who or not runs:
        raise SystemExit(f"{path}: not the output of a finished bench/compare_llamacpp.sh run")
    # The script's median: the lower middle value of an even count.
    med = [statistics.median_low(r[k] for r in runs) for k in range(4)]
    return {
        "date": file_time(path),
        "model": os.path.basename(head.group(1)),
        "threads": int(head.group(2)),
        "reps": len(runs),
        "pp": int(head.group(4)),
        "tg": int(head.group(5)),
        "llama_build": head.group(6),
        "kernels": who.group(1) or "?",
        "llama_version": who.group(2).strip(),
        "kvrelay_pp": med[0], "kvrelay_tg": med[1], "llama_pp": med[2], "llama_tg": med[3],
    }


def record_overload(out, slo_ms, config):
    """Goodput of each open loop against the best closed loop run beside it."""
    from overload_report import load, window_goodput
    refs = [window_goodput(j, slo_ms) for j in
            (load(os.path.join(out, f"{config}.peak-{w}.json")) for w in ("before", "after")) if j]
    if not refs:
        raise SystemExit(f"{out}: no {config}.peak-before/after.json (the run did not finish)")
    peak = max(refs)
    of_peak, shed = {}, {}
    for mult in ("1", "2", "4"):
        j = load(os.path.join(out, f"{config}.x{mult}.json"))
        if j is None:
            continue
        of_peak[mult] = round(window_goodput(j, slo_ms) / peak, 3) if peak > 0 else 0.0
        shed[mult] = sum(1 for r in j["requests"] if not r["ok"] and r.get("retry_after")
                         and r.get("http_status") in (429, 503))
    return {
        "date": file_time(os.path.join(out, f"{config}.peak-before.json")),
        "config": config,
        "slo_ms": slo_ms,
        "peak_rps": round(peak, 2),
        "of_peak": of_peak,
        "shed": shed,
    }


FAULT_LINE = re.compile(
    r"FAULT (\S+)(?: round \d+)?: capacity [\d.]+ req/s, load ([\d.]+) req/s, (\d+) requests, "
    r"(\d+) affected \([\d.]+%\), worst time to final status after the fault ([\d.]+) s "
    r"\(any request ([\d.]+) s.*?first right answer sent after the fault ([-\d.]+) s after it")
FAULT_ORDER = ["kill_prefill", "stop_prefill", "kill_decode", "stop_decode", "kill_tp_follower",
               "stop_tp_follower", "kill_coordinator", "stop_coordinator", "long_stop_coordinator",
               "cut_kv_link", "blackhole_kv_link", "corrupt_kv_chunk"]


def record_faults(out):
    """Per fault case, over the runs: requests, affected, each run's worst time to a final
    status (any request in flight at the fault or sent after it) and first right answer."""
    path = os.path.join(out, "fm.log")
    with open(os.path.join(out, "meta.json")) as f:
        meta = json.load(f)
    cases = {}
    with open(path) as f:
        for line in f:
            m = FAULT_LINE.search(line)
            if not m:
                continue
            c = cases.setdefault(m.group(1), {"requests": 0, "affected": 0, "final_s": [],
                                              "serving_s": []})
            c["requests"] += int(m.group(3))
            c["affected"] += int(m.group(4))
            c["final_s"].append(float(m.group(6)))
            c["serving_s"].append(float(m.group(7)))
    runs = {len(c["final_s"]) for c in cases.values()}
    if not cases or len(runs) != 1:
        raise SystemExit(f"{path}: no FAULT lines, or cases with different run counts {sorted(runs)}")
    return {"date": file_time(path), "migration_limit": meta.get("migration_limit"),
            "runs": runs.pop(), "cases": cases}


def record_scaling(out):
    """Each size's throughput and latency medians, from multinode.py scaling --json."""
    with open(out) as f:
        j = json.load(f)
    args = j["args"]
    rows = []
    for row in j["rows"]:
        rep = row["report"]
        if rep.get("failed"):
            raise SystemExit(f"{out}: {row['size']}P+{row['size']}D had {rep['failed']} failed requests")
        rows.append({"size": row["size"], "req_s": round(rep["request_throughput"], 3),
                     "out_tok_s": round(rep["output_token_throughput"], 1),
                     "ttft_p50_ms": round(rep["ttft_ms"]["p50"]), "tpot_p50_ms": round(rep["tpot_ms"]["p50"], 1)})
    if not rows or rows[0]["size"] != 1:
        raise SystemExit(f"{out}: no 1P+1D row to scale against")
    form = "quick" if args.get("quick") else "full"
    return {"date": file_time(out), "form": form, "cpu_per_host": args["cpu"], "link": args["link"],
            "launch": args["launch"], "kv_transport": args.get("kv_transport") or "default",
            "workload": f"{args['num_prompts']} prompts at {args['rate']:g} req/s, "
                        f"{args['input_len']} in / {args['output_len']} out",
            "rows": rows, "efficiency": {str(k): round(v, 3) for k, v in j["efficiency"].items()}}


def parse_transfer_tables(text):
    """{backend: {bytes: (memcpy GB/s, GB/s, raw GB/s or None)}} of one `bench transfer` output."""
    tables, backend = {}, None
    for line in text.splitlines():
        m = re.match(r"== backend (\w+) ==", line)
        if m:
            backend = m.group(1)
            tables.setdefault(backend, {})
            continue
        m = re.match(r"\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+\d+%(?:\s+([\d.]+)\s+\d+%\s+\d+%)?\s*$", line)
        if m and backend:
            raw = float(m.group(4)) if m.group(4) else None
            tables[backend][int(m.group(1))] = (float(m.group(2)), float(m.group(3)), raw)
    return tables


OVERLAP = re.compile(
    r"== backend (\w+) ==.*?layer-wise overlap, real engine \((\d+)-token prefill, (\d+) layers x ([\d.]+) KiB, "
    r"(\w+) KV, medians of (\d+)\):\s+transfer alone ([\d.]+) ms \| prefill alone ([\d.]+) ms \| prefill with "
    r"layer-wise send ([\d.]+) ms \(prefill part ([\d.]+) ms, tail after it ([\d.]+) ms\)\s+hidden (-?\d+)% .*?"
    r"hidden by tail (-?\d+)%", re.S)


def record_transfer(out):
    """Per size and backend, the median over the rounds; the overlap run's figures."""
    with open(os.path.join(out, "meta.json")) as f:
        meta = json.load(f)
    cells = {}
    for r in range(1, meta["rounds"] + 1):
        for backend in ("mpi", "tcp"):
            path = os.path.join(out, f"{backend}-{r}.txt")
            with open(path) as f:
                table = parse_transfer_tables(f.read()).get(backend)
            if not table:
                raise SystemExit(f"{path}: no '== backend {backend} ==' table (the run failed)")
            for n, v in table.items():
                cells.setdefault(n, {}).setdefault(backend, []).append(v)
    sizes = []
    for n in sorted(cells):
        row = {"bytes": n}
        for backend, vs in cells[n].items():
            if len(vs) != meta["rounds"]:
                raise SystemExit(f"{out}: size {n} has {len(vs)} {backend} rounds of {meta['rounds']}")
            row[backend] = {"gbps": statistics.median(v[1] for v in vs),
                            "memcpy_gbps": statistics.median(v[0] for v in vs),
                            "raw_gbps": statistics.median(v[2] for v in vs) if vs[0][2] else None}
        sizes.append(row)
    overlap = {}
    path = os.path.join(out, "overlap.txt")
    with open(path) as f:
        text = f.read()
    for part in re.split(r"(?=== backend )", text):
        m = OVERLAP.search(part)
        if m:
            g = m.groups()
            overlap[g[0]] = {"tokens": int(g[1]), "layers": int(g[2]), "layer_kib": float(g[3]),
                             "kv_dtype": g[4], "repeats": int(g[5]), "transfer_ms": float(g[6]),
                             "prefill_ms": float(g[7]), "layerwise_ms": float(g[8]),
                             "tail_ms": float(g[10]), "hidden_by_tail_pct": int(g[12])}
    if set(overlap) != {"mpi", "tcp"}:
        raise SystemExit(f"{path}: overlap figures for {sorted(overlap)}, not mpi and tcp")
    return {"date": file_time(path), "rounds": meta["rounds"], "mpi_version": meta["mpi_version"],
            "commands": meta["commands"], "sizes": sizes, "overlap": overlap}


# --- the tables ------------------------------------------------------------------------

def fmt_s(v):
    return f"{v:.3f} s" if v < 1 else f"{v:.2f} s"


def render_prefix_restart(data):
    runs = data["runs"]
    lines = ["| run | recorded | cold | same prefix, new question (RAM pool hit) | "
             "same prefix, after a full restart (RocksDB) | restart / RAM hit | restore (log line) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    ratios, speedups = [], []
    for i, r in enumerate(runs, 1):
        ratio = r["restart_s"] / r["ram_s"]
        ratios.append(ratio)
        speedups.append(r["cold_s"] / r["restart_s"])
        restore = f"{r['restore_ms']} ms" if r.get("restore_ms") is not None else "—"
        lines.append(f"| {i} | {r['date']}, `{r['commit']}`, {r['conditions']} | {fmt_s(r['cold_s'])} | "
                     f"{fmt_s(r['ram_s'])} | {fmt_s(r['restart_s'])} | {ratio:.2f}× | {restore} |")
    goal = data["goal_ratio"]
    met = sum(1 for x in ratios if x <= goal)
    hosts = sorted({r["host"] for r in runs})
    latest = runs[-1]["commit"]
    last = [x for r, x in zip(runs, ratios) if r["commit"] == latest]
    lines.append("")
    lines.append(f"Median of the {len(runs)} runs: restart {statistics.median(ratios):.2f}× the RAM hit "
                 f"(goal ≤ {goal}×, met in {met} of {len(runs)}); of the {len(last)} on `{latest}`: "
                 f"{statistics.median(last):.2f}× (met in {sum(1 for x in last if x <= goal)}). "
                 f"Restart {statistics.median(speedups):.1f}× faster than cold (goal ≥ {data['goal_speedup']}×), "
                 f"at least {min(r['cached_tokens'] / r['prompt_tokens'] for r in runs):.1%} of the "
                 f"prompt cached after the restart. Host: {'; '.join(hosts)}.")
    return lines


def render_overload(data):
    runs = data["runs"]
    lines = ["| run | recorded | TTFT deadline | peak (closed loop) | 1× saturation | 2× | 4× | "
             "shed at 4× |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    goal, slo_goal = data["goal_of_peak"], data["goal_slo_ms"]
    met = judged = 0
    for r in runs:
        cells = [f"{100 * r['of_peak'][m]:.0f} %" if m in r["of_peak"] else "—" for m in ("1", "2", "4")]
        lines.append(f"| {r['label']} | {r['date']}, `{r['commit']}`, {r['conditions']} | "
                     f"{r['slo_ms'] / 1000:g} s | {r['peak_rps']:.2f} req/s | {' | '.join(cells)} | "
                     f"{r['shed'].get('4', '—')} |")
        if r["slo_ms"] == slo_goal and r["config"] == "defaults":
            judged += 1
            met += all(r["of_peak"].get(m, 0) >= goal for m in ("2", "4"))
    hosts = sorted({r["host"] for r in runs})
    lines.append("")
    lines.append(f"Goal: goodput at 2× and 4× saturation ≥ {100 * goal:.0f} % of the peak with the "
                 f"defaults and a {slo_goal / 1000:g} s TTFT deadline: met in {met} of {judged} such "
                 f"runs. Host: {'; '.join(hosts)}.")
    return lines


def render_engine(data):
    runs = data["runs"]
    lines = ["| run | recorded | model | kvrelay kernels / llama.cpp build | pp: kvrelay / llama.cpp | ratio | "
             "tg: kvrelay / llama.cpp | ratio |",
             "|---|---|---|---|---:|---:|---:|---:|"]
    for i, r in enumerate(runs, 1):
        lines.append(f"| {i} | {r['date']}, `{r['commit']}`, {r['conditions']}, {r['host']} | {r['model']}, "
                     f"{r['threads']} threads, {r['reps']} runs | {r['kernels']} / {r['llama_build']} | "
                     f"pp{r['pp']} {r['kvrelay_pp']:,.1f} / {r['llama_pp']:,.1f} tok/s | "
                     f"{r['kvrelay_pp'] / r['llama_pp']:.2f} | tg{r['tg']} {r['kvrelay_tg']:,.1f} / "
                     f"{r['llama_tg']:,.1f} | {r['kvrelay_tg'] / r['llama_tg']:.2f} |")
    goal = data["goal_ratio"]
    latest = {}
    for r in runs:  # the newest run of each (host, model)
        latest[(r["host"], r["model"])] = r
    parts = []
    for (host, model), r in sorted(latest.items()):
        pp, tg = r["kvrelay_pp"] / r["llama_pp"], r["kvrelay_tg"] / r["llama_tg"]
        met = "met" if min(pp, tg) >= goal else "**missed**"
        parts.append(f"{model} on {host}: pp {pp:.2f}×, tg {tg:.2f}× ({met})")
    lines.append("")
    lines.append(f"Newest run of each model and host, kvrelay ÷ llama.cpp (goal ≥ {goal}× on both): "
                 + "; ".join(parts) + ".")
    return lines


def render_faults(data):
    runs = data["runs"]
    on = [r for r in runs if r.get("migration_limit") is None]
    off = [r for r in runs if r.get("migration_limit") == 0]
    if not on:
        raise SystemExit("bench/results/faults.json: no run with migration on")
    a, b = on[-1], (off[-1] if off else None)
    n = a["runs"]
    lines = [f"| fault | affected, migration on ({n} run{'s' if n > 1 else ''}) | every request ends "
             "within, median / max (s) | serving again after, median (s) | affected, migration off |",
             "|---|---:|---:|---:|---:|"]
    for name in [k for k in FAULT_ORDER if k in a["cases"]] + sorted(set(a["cases"]) - set(FAULT_ORDER)):
        c = a["cases"][name]
        serving = [x for x in c["serving_s"] if x >= 0]
        cell_off = "—"
        if b and name in b["cases"]:
            o = b["cases"][name]
            cell_off = f"{100 * o['affected'] / o['requests']:.1f} %" if o["requests"] else "—"
        cell_serving = f"{statistics.median(serving):.2f}" if serving else "—"
        lines.append(f"| {name} | {c['affected']} of {c['requests']} | "
                     f"{statistics.median(c['final_s']):.2f} / {max(c['final_s']):.2f} | "
                     f"{cell_serving} | {cell_off} |")
    lines.append("")
    desc = f"Migration on: {n} runs recorded {a['date']}, `{a['commit']}`, {a['conditions']}"
    if b:
        desc += f"; migration off: {b['runs']} run recorded {b['date']}, `{b['commit']}`, {b['conditions']}"
    lines.append(desc + f". Host: {a['host']}.")
    return lines


def render_scaling(data):
    runs = data["runs"]
    lines = ["| run | recorded | form, workload | hosts | req/s | out tok/s | TTFT p50 | TPOT p50 | efficiency |",
             "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(runs, 1):
        for row in r["rows"]:
            eff = r["efficiency"].get(str(row["size"]))
            lines.append(f"| {i} | {r['date']}, `{r['commit']}`, {r['conditions']} | {r['form']}: {r['workload']} | "
                         f"{row['size']}P+{row['size']}D | {row['req_s']:.3f} | {row['out_tok_s']:.1f} | "
                         f"{row['ttft_p50_ms'] / 1000:.1f} s | {row['tpot_p50_ms']:.1f} ms | "
                         f"{'%.2f' % eff if eff is not None else '—'} |")
    goal, floor = data["goal_efficiency"], data["floor_efficiency"]
    parts = []
    for form in ("quick", "full"):
        effs = [r["efficiency"]["4"] for r in runs if r["form"] == form and "4" in r["efficiency"]]
        if effs:
            parts.append(f"{form} form, {len(effs)} run{'s' if len(effs) > 1 else ''}: median "
                         f"{statistics.median(effs):.2f} (goal ≥ {goal} met in {sum(e >= goal for e in effs)}; "
                         f"the test's floor {floor})")
    hosts = sorted({r["host"] for r in runs})
    first = runs[0] if runs else {}
    lines.append("")
    lines.append("Efficiency at 4P+4D = its req/s ÷ (4 × 1P+1D's): " + "; ".join(parts) +
                 f". Every host {first.get('cpu_per_host', '?')} core, links {first.get('link', '?')}, "
                 f"{first.get('launch', '?')} launch, KV transport {first.get('kv_transport', '?')}. "
                 f"Host: {'; '.join(hosts)}.")
    return lines


def render_transfer(data):
    if not data["runs"]:
        raise SystemExit("bench/results/transfer.json: no run recorded (bench/kv_transfer.sh -O OUT, "
                         "then bench/report.py record transfer OUT)")
    r = data["runs"][-1]
    goal_size, goals = data["goal_bytes"], data["goal_of_memcpy"]
    lines = ["| size | TCP GB/s | TCP / memcpy | raw TCP GB/s | MPI GB/s | MPI / memcpy | raw MPI GB/s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    met = {}
    for row in r["sizes"]:
        cells = []
        for b in ("tcp", "mpi"):
            c = row[b]
            of = c["gbps"] / c["memcpy_gbps"]
            if row["bytes"] == goal_size:
                met[b] = of
            raw = f"{c['raw_gbps']:.2f}" if c["raw_gbps"] else "—"
            cells += [f"{c['gbps']:.2f}", f"{100 * of:.0f} %", raw]
        lines.append(f"| {row['bytes'] >> 20} MiB | " + " | ".join(cells) + " |")
    lines.append("")
    goal_text = "; ".join(
        f"{b.upper()} {100 * met[b]:.0f} % (goal ≥ {100 * goals[b]:.0f} %, {'met' if met[b] >= goals[b] else 'not met'})"
        for b in ("tcp", "mpi") if b in met)
    lines.append(f"At {goal_size >> 20} MiB, of memcpy: {goal_text}. Each cell is the median of {r['rounds']} "
                 f"alternated rounds; memcpy is glibc's between two warm buffers of the same size, measured "
                 f"beside each transfer; raw is a plain `MPI_Send`/`send()` loop of the same sizes.")
    o = r["overlap"]["mpi"]
    lines.append("")
    lines.append(f"Layer-wise overlap with a real {o['tokens']:,}-token prefill ({o['layers']} layers × "
                 f"{o['layer_kib']:.0f} KiB, {o['kv_dtype']} KV, medians of {o['repeats']}): when the prefill "
                 f"returns, the receiver has the last layer after " +
                 ", ".join(f"{r['overlap'][b]['tail_ms']:.2f} ms over {b.upper()} ({r['overlap'][b]['hidden_by_tail_pct']} % "
                           f"of the {r['overlap'][b]['transfer_ms']:.1f} ms transfer hidden)" for b in ("mpi", "tcp")) +
                 f"; the prefill alone took {o['prefill_ms']:.0f} ms.")
    lines.append("")
    lines.append(f"Recorded {r['date']}, `{r['commit']}`, {r['conditions']}; {r['host']}; {r['mpi_version']}. "
                 f"Commands (`bench/kv_transfer.sh` runs them): `" + "`, `".join(
                     re.sub(r"\S*/(cli/kvrelay|models/)", r"\1", c) for c in r["commands"]) + "`.")
    return lines


RENDERERS = {"prefix_restart": render_prefix_restart, "overload": render_overload,
             "engine": render_engine, "faults": render_faults,
             "scaling": render_scaling, "transfer": render_transfer}


def render_doc(text):
    """The page with every generated block rewritten; errors for a block without results."""
    def block(m):
        name = m.group(1)
        if name not in RENDERERS:
            raise SystemExit(f"{DOC}: unknown generated block '{name}' (known: {', '.join(RENDERERS)})")
        body = RENDERERS[name](load_results(name))
        return f"<!-- report:{name} -->\n" + "\n".join(body) + f"\n<!-- /report:{name} -->"
    return re.sub(r"<!-- report:(\w+) -->\n.*?<!-- /report:\1 -->", block, text, flags=re.S)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("name", choices=sorted(RENDERERS))
    rec.add_argument("out", help="the bench script's output directory")
    rec.add_argument("--commit", default=None, help="the commit measured (default: HEAD)")
    rec.add_argument("--conditions", default="quiet", help="quiet | shared (others ran beside it)")
    rec.add_argument("--note", default="")
    rec.add_argument("--slo-ms", type=float, default=2000, help="overload: the TTFT deadline")
    rec.add_argument("--config", default="defaults", help="overload: the config measured")
    rec.add_argument("--label", default=None, help="overload: the row's name")
    for name in ("render", "check"):
        sub.add_parser(name).add_argument("--doc", default=DOC)
    a = p.parse_args(argv[1:])

    if a.cmd == "record":
        if a.name == "prefix_restart":
            run = record_prefix_restart(a.out)
        elif a.name == "engine":
            run = record_engine(a.out)
        elif a.name == "faults":
            run = record_faults(a.out)
        elif a.name == "scaling":
            run = record_scaling(a.out)
        elif a.name == "transfer":
            run = record_transfer(a.out)
        else:
            run = record_overload(a.out, a.slo_ms, a.config)
            run["label"] = a.label or f"{a.config}, {os.path.basename(os.path.normpath(a.out))}"
        run.update(commit=a.commit or head_commit(), host=host_description(),
                   conditions=a.conditions, source=os.path.abspath(a.out))
        if a.note:
            run["note"] = a.note
        data = load_results(a.name)
        data["runs"].append(run)
        save_results(a.name, data)
        print(f"recorded run {len(data['runs'])} of {a.name}: {json.dumps(run)}")
        return 0

    with open(a.doc) as f:
        text = f.read()
    new = render_doc(text)
    if a.cmd == "render":
        if new != text:
            with open(a.doc, "w") as f:
                f.write(new)
        print(f"{a.doc}: {'rewritten' if new != text else 'up to date'}")
        return 0
    if new != text:
        print(f"{a.doc}: a generated block differs from bench/results/ (run bench/report.py render)",
              file=sys.stderr)
        return 1
    for name in sorted(f[:-5] for f in os.listdir(RESULTS) if f.endswith(".json")):
        if f"<!-- report:{name} -->" not in text:
            print(f"{a.doc}: bench/results/{name}.json has no block '<!-- report:{name} -->'",
                  file=sys.stderr)
            return 1
    print(f"{a.doc}: every generated block matches bench/results/")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
