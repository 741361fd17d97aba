#!/usr/bin/env python3
"""Compares two `flowmoe bench --json` files (a refactor's before and after, measured in one call):
per configuration and recipe, the forward + backward median of each, their ratio, and whether the
layers' memory, saved bytes per token and casts per pass are the same. Exit 1 when a row is missing from one side.

    python3 bench/compare_layer_bench.py before.json after.json [--tolerance 0.03]
"""

import argparse
import json
import sys


def rows(path):
    with open(path) as f:
        return {(r["config"], r["recipe"]): r for r in json.load(f)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--tolerance", type=float, default=0.03, help="relative time difference called the same")
    a = p.parse_args(argv)
    before, after = rows(a.before), rows(a.after)
    missing = sorted(set(before) ^ set(after))
    print(f"{'config':10} {'recipe':10} {'before ms':>10} {'after ms':>10} {'after/before':>13}  memory  saved B/token")
    worst = 0.0
    for key in sorted(set(before) & set(after)):
        b, c = before[key], after[key]
        tb, tc = b.get("total_ms"), c.get("total_ms")
        ratio = tc / tb if tb and tc else float("nan")
        worst = max(worst, abs(ratio - 1.0))
        same_mem = "same" if b.get("layer_gib") == c.get("layer_gib") else f"{b.get('layer_gib')} -> {c.get('layer_gib')} GiB"
        same_saved = ("same" if b.get("saved_bytes_per_token") == c.get("saved_bytes_per_token")
                      else f"{b.get('saved_bytes_per_token')} -> {c.get('saved_bytes_per_token')}")
        casts = "same casts" if (b.get("casts_fwd"), b.get("casts_bwd")) == (c.get("casts_fwd"), c.get("casts_bwd")) \
            else "casts differ"
        print(f"{key[0]:10} {key[1]:10} {tb:10.3f} {tc:10.3f} {ratio:13.3f}  {same_mem}  {same_saved}  {casts}")
    print(f"largest time difference: {100 * worst:.1f}% (tolerance {100 * a.tolerance:.0f}%)")
    for key in missing:
        print(f"missing on one side: {key}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
