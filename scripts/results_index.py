#!/usr/bin/env python3
"""Writes results/README.md: every file under results/ and the documents that cite it (by its path
from the repository root, a folder of it, or a dated file's unambiguous short name in backquotes),
so that a reader of a figure finds its log and a file nobody cites stands out. Run after adding or citing results:

    python3 scripts/results_index.py            # rewrites results/README.md
    python3 scripts/results_index.py --check    # exit 1 when it is out of date or a file is uncited
"""

import os
import re
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
DOCS = ["README.md"] + sorted(os.path.join("docs", n) for n in os.listdir(os.path.join(ROOT, "docs"))
                              if n.endswith(".md"))


DATED = re.compile(r"^\d{4}-\d{2}-\d{2}-")  # a session's file: 2026-11-29-s2-bench-convert.log


def short_forms(rel):
    """The short names a document may cite a dated file by, in backquotes: its name, its name
    without the extension, and without the date ("s2-bench-convert" for
    2026-11-29-s2-bench-convert.log, PERFORMANCE.md's log column). Undated files (runs/flow.json
    of a convergence folder) have none: a word like `flow` must not cite them."""
    name = rel.rsplit("/", 1)[-1]
    if not DATED.match(name):
        return []
    stem = os.path.splitext(name)[0]
    return [name, stem, stem[11:]]


def backquoted(form):
    """`form` as a whole backquoted token, optionally with an extension: `s2-bench-convert` or
    `s2-bench-convert.log`, never `s2-bench-convert-v2` or `flow-fp4` for `flow`."""
    return re.compile("`" + re.escape(form) + r"(?:\.[A-Za-z0-9]+)?`")


def citations():
    texts = {d: open(os.path.join(ROOT, d), encoding="utf-8").read() for d in DOCS}
    files = []
    for base, dirs, names in os.walk(os.path.join(ROOT, "results")):
        dirs.sort()
        for n in sorted(names):
            rel = os.path.relpath(os.path.join(base, n), ROOT).replace(os.sep, "/")
            if rel != "results/README.md":
                files.append(rel)
    # a short form two files share (the same session name in runs/ and another folder) cites neither
    counts = {}
    for rel in files:
        for form in set(short_forms(rel)):
            counts[form] = counts.get(form, 0) + 1
    rows = []
    for rel in files:
        # a citation names the file by its path from the repository root (results/runs/...), or a
        # folder of it (e.g. results/convergence/sympy-6l/), or an unambiguous short form in backquotes
        parts = rel.split("/")
        prefixes = [rel] + ["/".join(parts[:i]) + "/" for i in range(3, len(parts))]
        patterns = [backquoted(f) for f in short_forms(rel) if counts[f] == 1]
        # or a sibling's shorthand: "`...-v1.log`, `-v2.log`" after a full name of the same session
        n = parts[-1]
        base_stem, ext = os.path.splitext(n)
        words = base_stem.split("-")
        session = "-".join(words[:4]) if DATED.match(n) else None  # e.g. 2026-12-04-s16
        tails = [f"`-{'-'.join(words[-k:])}{ext}`" for k in range(1, len(words) - 3)]
        cited = [d for d, t in texts.items()
                 if any(p in t for p in prefixes) or any(p.search(t) for p in patterns)
                 or (session and session in t and any(tl in t for tl in tails))]
        rows.append((rel, cited))
    return rows


def render(rows):
    out = ["# results/: the measurements the documents cite",
           "",
           "Raw logs, JSON and figures of the device sessions (docs/ keeps documents only). Each file and the",
           "documents that cite it; written by `scripts/results_index.py` (run it after adding a result).",
           "",
           "| file | cited by |",
           "| --- | --- |"]
    for rel, cited in rows:
        out.append(f"| `{rel[len('results/'):]}` | {', '.join(cited) if cited else '(none)'} |")
    return "\n".join(out) + "\n"


def main(argv):
    rows = citations()
    text = render(rows)
    path = os.path.join(ROOT, "results", "README.md")
    if "--check" in argv:
        old = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
        uncited = [r for r, c in rows if not c]
        if old != text or uncited:
            print(f"results_index: {'out of date' if old != text else ''} {len(uncited)} uncited: "
                  + ", ".join(uncited[:10]), file=sys.stderr)
            return 1
        return 0
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"results_index: {len(rows)} files, {sum(1 for _, c in rows if not c)} uncited")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
