#!/usr/bin/env python3
"""Checks that the docs name only things that exist.

For docs/ARCHITECTURE.md and README.md (or the files given):
- every path written in backticks (a word with a '/' or a known file
  extension) exists in the tree, relative to the repository root;
- every CamelCase name or kConstant in backticks (a type, a function, an
  enumerator) occurs as a word in the sources (C++, CUDA, .proto, CMake,
  Python, shell);
- every Markdown link target stays inside the repository and exists.
Exit 0 when everything is found, 1 with one line per miss.

Skipped on purpose: fenced code blocks (commands, not names), words with
placeholders (<area>, *, ...), flags (--x), build outputs and downloads
(build*/, models/, out/), and ALLOWED below.
"""
import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# Names in backticks that are concepts or third-party names, not kvrelay
# identifiers. Keep this list short: each entry says why.
ALLOWED = {
    "BlobDB",  # RocksDB's blob storage, a library feature
}
# Output and download folders: named in the docs, absent from a checkout.
GENERATED_PREFIXES = ("build", "models/", "out/", "kvstore/", "certs/")
EXTENSIONS = (".h", ".cc", ".cu", ".cuh", ".md", ".py", ".sh", ".json", ".proto",
              ".yaml", ".yml", ".txt", ".cmake", ".gguf", ".example")
SOURCE_PATTERNS = ["*.h", "*.cc", "*.cu", "*.cuh", "*.proto", "*.py", "*.sh",
                   "*.cmake", "CMakeLists.txt"]
CAMEL = re.compile(r"^(?:[A-Z][a-z0-9]+[A-Z][A-Za-z0-9]*|k[A-Z][A-Za-z0-9]+)$")


def tracked(patterns):
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--"]
                         + patterns, cwd=ROOT, capture_output=True, text=True, check=True)
    return [p for p in out.stdout.split("\n") if p]


def source_words():
    words = set()
    for path in tracked(SOURCE_PATTERNS):
        try:
            with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as f:
                words.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", f.read()))
        except OSError:
            pass  # deleted in the working tree
    return words


def strip_fences(text):
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def is_path(token):
    if token.startswith(("-", "http:", "https:")) or (token.startswith(".") and "/" not in token) or "/" not in token and not token.endswith(EXTENSIONS):
        return False
    if any(c in token for c in "<>*{}$=") or "..." in token or "…" in token:
        return False
    return re.search(r"[A-Za-z]", token) is not None


def path_exists(token, files):
    """True if `token` is a path from the root, or the tail of a tracked path
    (a file or folder named inside a sentence that already gave its folder)."""
    if os.path.exists(os.path.join(ROOT, token)):
        return True
    tail = "/" + token
    return any(f.endswith(tail) or (tail + "/") in f for f in files)


def check(doc, words, files):
    misses = []
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        text = strip_fences(f.read())
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        path = target.split("#", 1)[0]
        if not path:
            continue
        full = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), path))
        if "://" in target or not full.startswith(ROOT + os.sep):
            misses.append(f"{doc}: link leaves the repository: {target}")
        elif not os.path.exists(full):
            misses.append(f"{doc}: link to a missing file: {target}")
    for span in re.findall(r"`([^`\n]+)`", text):
        for token in re.split(r"[\s,;()\[\]\"'|]+", span):
            token = token.rstrip(".:")
            if not token:
                continue
            if is_path(token):
                if token.startswith("../"):
                    misses.append(f"{doc}: path outside the repository: {token}")
                    continue
                if token.startswith("/"):
                    continue  # an HTTP route (/metrics) or a root-anchored ignore rule
                token = token[2:] if token.startswith("./") else token
                if token.startswith(GENERATED_PREFIXES):
                    continue
                if not path_exists(token.rstrip("/"), files):
                    misses.append(f"{doc}: no such path: {token}")
                continue
            if token.startswith("-"):
                continue
            for name in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", token):
                if CAMEL.match(name) and name not in ALLOWED and name not in words:
                    misses.append(f"{doc}: `{name}` is not found in the sources")
    return misses


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("docs", nargs="*", default=["docs/ARCHITECTURE.md", "README.md"])
    args = parser.parse_args()
    words = source_words()
    files = tracked([])
    misses = []
    for doc in args.docs:
        misses += check(doc, words, files)
    for m in misses:
        print(m)
    print(f"{len(misses)} missing name(s) in {', '.join(args.docs)}")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
