#!/usr/bin/env python3
"""PNG plots of a `kvrelay plan` report (the JSON it writes with --plots DIR).

  plot_plan.py PLAN_JSON OUT_DIR

disagg_vs_colocated.png  goodput (req/s within both SLOs) vs offered rate, per
                         node, for the best disaggregated and colocated setups
scaling.png              highest rate meeting the SLOs vs nodes, both families
ranking.png              goodput per node of every configuration searched
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    out = sys.argv[2]
    os.makedirs(out, exist_ok=True)
    slo = plan["slo"]
    w = plan["workload"]
    subtitle = (f'{plan["profile"]}: {w["input_len"]} in / {w["output_len"]} out\n'
                f'SLO TTFT p90 <= {slo["ttft_p90_ms"]:.0f} ms, TPOT p90 <= {slo["tpot_p90_ms"]:.1f} ms')

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in plan["ranked"]:
        if not c["curve"]:
            continue
        n = c["nodes"]
        xs = [p["rate"] / n for p in c["curve"]]
        ys = [p["goodput"] / n for p in c["curve"]]
        style = "--" if c["colocated"] else "-"
        ax.plot(xs, ys, style, marker="o", ms=3, label=f'{c["config"]} ({n} nodes)')
    ax.set_xlabel("offered rate per node (req/s)")
    ax.set_ylabel("goodput per node (req/s within SLOs)")
    ax.set_title("disaggregated (solid) vs colocated (dashed)\n" + subtitle, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "disagg_vs_colocated.png"), dpi=120)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    families = {}
    for s in plan["scaling"]:
        families.setdefault(s["family"], []).append(s)
    for fam, pts in families.items():
        pts.sort(key=lambda s: s["nodes"])
        style = "--" if pts[0]["colocated"] else "-"
        ax.plot([s["nodes"] for s in pts], [s["max_rate"] for s in pts], style, marker="o",
                label=f"{fam} shape, scaled")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("nodes")
    ax.set_ylabel("highest rate meeting both SLOs (req/s)")
    ax.set_title("scaling with nodes\n" + subtitle, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "scaling.png"), dpi=120)

    ranked = plan["ranked"][:20]
    fig, ax = plt.subplots(figsize=(7, 0.3 * len(ranked) + 1.5))
    names = [c["config"] for c in ranked][::-1]
    vals = [c["per_node"] for c in ranked][::-1]
    colors = ["tab:orange" if c["colocated"] else "tab:blue" for c in ranked][::-1]
    ax.barh(names, vals, color=colors)
    ax.set_xlabel("goodput per node (req/s)")
    ax.set_title("configurations searched (blue: disaggregated, orange: colocated)\n" + subtitle,
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "ranking.png"), dpi=120)
    for name in ("disagg_vs_colocated.png", "scaling.png", "ranking.png"):
        print(os.path.join(out, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
