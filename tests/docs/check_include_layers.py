#!/usr/bin/env python3
"""Checks the include rules between top-level folders.

The layering is read from docs/ARCHITECTURE.md, section "Layering", its
first paragraph: the folders in backticks joined by arrows, lowest first (`common` → `engine` →
...); folders in one step separated by commas share a layer. A C++/CUDA file
in folder A may include a header of folder B only if B is in a lower layer
(or B is A). `bench` and `tests` sit on top and may include any layer.
A folder that holds C++ but is not in the layering is an error, so a new
folder gets a place in ARCHITECTURE.md. Known exceptions go in ALLOWED with
the reason. Exit 0 when clean, 1 with one line per violation.
"""
import os
import re
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TOP = ("bench", "tests")
# Inside a folder, subfolders that must not include each other
# (docs/ARCHITECTURE.md, "Layering"): {folder: {subfolder: subfolders it may
# not include}}. Files at the folder's top (the seams, main.cc) may include any.
INNER = {
    "coordinator": {"openai": {"http", "cluster"}, "cluster": {"http", "openai"}, "http": {"cluster"}},
}
# (including file, included header) pairs that break the layering on purpose.
# Empty: the tree follows the layering. Add an entry only with its reason.
ALLOWED = {}


def layers():
    with open(os.path.join(ROOT, "docs", "ARCHITECTURE.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Layering", 1)[1].split("\n\n", 1)[0]
    chain = section.split("\n", 1)[1]
    rank = {}
    for i, step in enumerate(chain.split("→")):
        for name in re.findall(r"`([a-z_]+)`", step):
            rank.setdefault(name, i)
    top = max(rank.values()) + 1
    for name in TOP:
        rank[name] = top
    return rank


def main():
    rank = layers()
    files = subprocess.run(["git", "ls-files", "--", "*.h", "*.cc", "*.cu", "*.cuh"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    folders = {f.split("/")[0] for f in files if "/" in f}
    errors = [f"folder {d}/ holds C++ but has no layer in docs/ARCHITECTURE.md"
              for d in sorted(folders - set(rank))]
    for path in files:
        if "/" not in path:
            continue
        a = path.split("/")[0]
        try:
            with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as f:
                lines = f.readlines()
        except OSError:
            continue  # deleted in the working tree
        for n, line in enumerate(lines, 1):
            m = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
            if not m or "/" not in m.group(1):
                continue
            b = m.group(1).split("/")[0]
            if b == a and a in INNER and path.count("/") >= 2 and m.group(1).count("/") >= 2:
                sa, sb = path.split("/")[1], m.group(1).split("/")[1]
                if sb in INNER[a].get(sa, ()):
                    errors.append(f"{path}:{n}: {a}/{sa}/ includes {m.group(1)}; "
                                  f"{a}/{sa}/ may not include {a}/{sb}/ (docs/ARCHITECTURE.md)")
                continue
            if b == a or b not in folders or a not in rank or b not in rank:
                continue
            if rank[b] >= rank[a] and (path, m.group(1)) not in ALLOWED:
                errors.append(f"{path}:{n}: {a}/ includes {m.group(1)}, "
                              f"which is not below it in docs/ARCHITECTURE.md's layering")
    for e in errors:
        print(e)
    order = sorted(rank, key=lambda k: rank[k])
    print(f"{len(errors)} violation(s); layers: {', '.join(f'{k}={rank[k]}' for k in order)}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
