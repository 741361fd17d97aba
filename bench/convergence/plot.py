#!/usr/bin/env python3
"""Merge the convergence runs and draw the figures and the table of docs/CONVERGENCE.md.

    python3 bench/convergence/plot.py [--out results/convergence]

Reads every <out>/runs/*.json written by `python -m flowmoe.train --json` (bench/convergence/run.sh)
and writes:
    <out>/results.json   all runs (configuration, curves, figures), keyed by run name
    <out>/curves.png     train loss (moving average) and validation loss of every run
    <out>/delta.png      each run's difference to bf16 (seed 0) in %, with bf16's second seed as
                         the seed-to-seed spread
    <out>/table.md       final validation loss, delta vs bf16 in %, tokens/s, peak memory, saved
                         activation bytes per token (per MoE layer), nonfinite / underflow counts,
                         skipped steps, and the guards (issue 30): the fewest weight refreshes of a
                         MoE layer, the least any layer's w1 / w2 / wr moved from its initial
                         weights (relative Frobenius norm), the fresh-layer check
The figures need matplotlib; without it the JSON and the table are still written.
"""

import argparse
import glob
import json
import os
import sys

ORDER = ["torch-bf16", "bf16", "blockwise", "fp8-naive", "flow", "flow-fp4", "flow-colamax", "frozen"]
BASE = "bf16"


def sort_key(name):
    recipe = name.split("-seed")[0]
    return ("-seed" in name, ORDER.index(recipe) if recipe in ORDER else len(ORDER), name)


def colors(runs):
    """One colour per run, the same in both figures."""
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:gray",
               "tab:brown", "tab:pink", "tab:olive", "tab:cyan"]
    return {name: palette[i % len(palette)] for i, name in enumerate(runs)}


def load_runs(out):
    runs = {}
    for path in sorted(glob.glob(os.path.join(out, "runs", "*.json"))):
        with open(path) as f:
            r = json.load(f)
        runs[r.get("name") or os.path.splitext(os.path.basename(path))[0]] = r
    if not runs and os.path.isfile(os.path.join(out, "results.json")):
        with open(os.path.join(out, "results.json")) as f:
            runs = json.load(f)["runs"]
    return dict(sorted(runs.items(), key=lambda kv: sort_key(kv[0])))


def moving_average(xs, n):
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= n:
            acc -= xs[i - n]
        out.append(acc / min(i + 1, n))
    return out


def delta_pct(a, b):
    return None if a is None or b is None else 100.0 * (a - b) / b


def saved_per_layer(r, key="per_layer"):
    """Mean over the MoE layers of the saved activation bytes per token (key "per_layer": as
    allocated, padding rows included; "unpadded_per_layer": routed rows only)."""
    s = r.get("saved_bytes_per_token")
    if not s:
        return None
    vals = [v for v in s.get(key) or [] if v is not None]
    return sum(vals) / len(vals) if vals else None


def comparable(r, ref):
    """Why run r is not the same experiment as ref (model, schedule, batch, data), or None."""
    def key(x):
        d = x.get("data", {})
        # the exponent rule of flow's column copies is part of the recipe, not of the experiment
        # (runs written before the option existed have no such field)
        model = {k: v for k, v in (x.get("model") or {}).items() if k != "transpose_exponent"}
        return (model, x.get("hyper"), x.get("tokens_per_step"), x.get("precision"),
                d.get("train_bytes"), d.get("val_bytes"))
    if key(r) != key(ref):
        return "different configuration"
    if not r.get("complete", True):
        return f"incomplete: {len(r.get('train_loss', []))} steps"
    return None


def guard_cell(r):
    """The guards of a run in a few words ("—" for runs written before the guards existed)."""
    g = r.get("moe_guard")
    if not g:
        return "— (no guard fields)"
    if not g["ok"]:
        return f"FAILED ({len(g['failures'])})"
    layers = g["layers"]
    moved = "/".join(f"{100 * min(e['moved'][n] for e in layers):.1f}" for n in ("w1", "w2", "wr"))
    wu = [e["weight_updates"] for e in layers if e["weight_updates"] is not None]
    fresh = all(e["fresh_check"] == "identical" for e in layers)
    parts = [f"{min(wu)} refreshes" if wu else "reads masters", f"moved {moved}%"]
    if g.get("frozen_experts"):
        parts[1] = "frozen"
    return ", ".join(parts) + (", fresh ok" if fresh else "")


def table(runs):
    base = runs.get(BASE, {}).get("final_val_loss")
    ref = runs.get(BASE) or next(iter(runs.values()))
    rows = ["| run | final val loss | Δ vs bf16 | tokens/s | peak memory GiB (device used) | saved B/token per MoE layer (unpadded) "
            "| nonfinite | underflow | skipped steps | guards (refreshes, moved w1/w2/wr) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in runs.items():
        v = r.get("final_val_loss")
        d = delta_pct(v, base)
        mem, used = r.get("peak_memory_bytes"), r.get("device_memory_used_bytes")
        sv, su = saved_per_layer(r), saved_per_layer(r, "unpadded_per_layer")
        why = comparable(r, ref)
        rows.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
            name if why is None else f"{name} ({why})",
            f"{v:.4f}" if v is not None else "—",
            "—" if d is None or name == BASE else f"{d:+.2f}%",
            f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "—",
            ("—" if not mem else f"{mem / 2**30:.2f}") + ("" if not used else f" ({used / 2**30:.2f})"),
            "—" if sv is None else f"{sv:,.0f}" + ("" if su is None else f" ({su:,.0f})"),
            r.get("nonfinite", "—"), r.get("underflow", "—"), r.get("skipped_steps", "—"), guard_cell(r)))
    first = next(iter(runs.values()))
    m = first["model"]
    note = (f"\nModel: {m['layers']} layers, H {m['hidden']}, {m['heads']} heads, {m['experts']} experts of "
            f"F {m['ffn']}, top-{m['topk']} {m['router']}, aux {m['aux_loss_coef']}; "
            f"{first['params_total'] / 1e6:.1f}M parameters ({first['params_active'] / 1e6:.1f}M active per token); "
            f"{first['hyper']['steps']} steps of {first['tokens_per_step']} tokens; data {first['data']['description']}; "
            f"{first.get('device', '?')}, torch {first.get('torch', '?')}. Validation loss in nats per byte "
            f"(mean over {first['hyper']['val_batches']} fixed batches of the held-out works).\n")
    return "\n".join(rows) + "\n" + note


# Two-sided 95% quantiles of Student's t for 1..10 degrees of freedom (more: 1.96 is close enough
# for a table that states n).
T95 = [None, 12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228]


def mean_ci(xs):
    """(mean, half-width of the 95% interval of the mean; None for one value)."""
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, None
    sd = (sum((x - m) ** 2 for x in xs) / (n - 1)) ** 0.5
    return m, (T95[n - 1] if n - 1 < len(T95) else 1.96) * sd / n ** 0.5


def arms(runs):
    """{arm: {seed: run}} of the complete runs comparable with bf16 (seed 0 has no suffix)."""
    ref = runs.get(BASE) or next(iter(runs.values()))
    out = {}
    for name, r in runs.items():
        if comparable(r, ref) is not None or r.get("final_val_loss") is None:
            continue
        arm, _, seed = name.partition("-seed")
        out.setdefault(arm, {})[int(seed) if seed else 0] = r
    return dict(sorted(out.items(), key=lambda kv: sort_key(kv[0])))


def seed_table(runs):
    """Per arm over its seeds: mean final validation loss ± 95% interval; its difference to bf16
    paired by seed (same initial weights and data order) in % of bf16's mean, ± 95% interval;
    whether the arm's mean lies inside bf16's band (the range of bf16's seeds); counters and
    guards over the seeds. Empty when bf16 has fewer than two seeds."""
    groups = arms(runs)
    base = groups.get(BASE, {})
    if len(base) < 2:
        return ""
    bvals = [r["final_val_loss"] for r in base.values()]
    bmean = sum(bvals) / len(bvals)
    lo, hi = min(bvals), max(bvals)
    rows = [f"| arm | seeds | final val loss, mean ± 95% | Δ vs bf16 (paired by seed), mean ± 95% "
            f"| inside bf16 band [{lo:.4f}, {hi:.4f}] | per seed | nonfinite | underflow (mean) | guards |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for arm, by_seed in groups.items():
        seeds = sorted(by_seed)
        vals = [by_seed[s]["final_val_loss"] for s in seeds]
        m, ci = mean_ci(vals)
        paired = [100 * (by_seed[s]["final_val_loss"] - base[s]["final_val_loss"]) / bmean
                  for s in seeds if s in base]
        if arm == BASE:
            delta = "—"
        elif paired:
            dm, dci = mean_ci(paired)
            delta = f"{dm:+.2f}%" + ("" if dci is None else f" ± {dci:.2f}%") + \
                (f" ({len(paired)} pairs)" if len(paired) != len(seeds) else "")
        else:
            delta = "no common seed"
        under = [r.get("underflow") for r in by_seed.values() if isinstance(r.get("underflow"), (int, float))]
        guards = {guard_cell(r).split(",")[0] for r in by_seed.values()}
        failed = [s for s in seeds if (by_seed[s].get("moe_guard") or {}).get("ok") is False]
        rows.append("| {} | {} | {:.4f}{} | {} | {} | {} | {} | {} | {} |".format(
            arm, " ".join(map(str, seeds)), m, "" if ci is None else f" ± {ci:.4f}", delta,
            "—" if arm == BASE else ("yes" if lo <= m <= hi else "no"),
            " / ".join(f"{v:.4f}" for v in vals),
            sum(r.get("nonfinite") or 0 for r in by_seed.values()),
            f"{sum(under) / len(under):.3g}" if under else "—",
            ("FAILED seeds " + " ".join(map(str, failed))) if failed else "ok (" + "; ".join(sorted(guards)) + ")"))
    return "\n".join(rows) + "\n"


def plot(runs, out, smooth):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot.py: matplotlib is not installed; figures not drawn (pip install matplotlib, or the package's extra: pip install '.[torch]')", file=sys.stderr)
        return []
    col = colors(runs)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, r in runs.items():
        tl = r["train_loss"]
        style = "--" if "-seed" in name else "-"
        a1.plot(range(1, len(tl) + 1), moving_average(tl, smooth), style, color=col[name], label=name, lw=1.2)
        vs, vl = zip(*r["val"]) if r["val"] else ((), ())
        a2.plot(vs, vl, style, marker=".", color=col[name], label=name, lw=1.2)
    a1.set(title=f"train loss (moving average of {smooth} steps)", xlabel="step", ylabel="loss (nats/byte)")
    a2.set(title="validation loss (held-out works)", xlabel="step", ylabel="loss (nats/byte)")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend()
        lows = [min(r["train_loss"]) for r in runs.values()]
        a.set_ylim(min(lows) * 0.95, min(lows) * 2.0)
    fig.tight_layout()
    curves = os.path.join(out, "curves.png")
    fig.savefig(curves, dpi=120)
    plt.close(fig)

    files = [curves]
    groups = arms(runs)
    if len(groups.get(BASE, {})) >= 2:
        files.append(plot_seed_delta(groups, out, smooth, col))
    elif BASE in runs:
        files.append(plot_run_delta(runs, out, smooth, col, plt))
    return files


def plot_run_delta(runs, out, smooth, col, plt):
    """delta.png for one seed per arm: each run's difference to bf16 (seed 0) in %."""
    b = runs[BASE]
    bt = moving_average(b["train_loss"], smooth)
    bv = dict((s, v) for s, v in b["val"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, r in runs.items():
        if name == BASE:
            continue
        style = "--" if "-seed" in name else "-"
        t = moving_average(r["train_loss"], smooth)
        n = min(len(t), len(bt))
        start = min(200, n // 10)  # the first steps' differences dwarf the rest
        a1.plot(range(start + 1, n + 1), [100 * (t[i] - bt[i]) / bt[i] for i in range(start, n)], style,
                color=col[name], label=name, lw=1.2)
        pts = [(s, 100 * (v - bv[s]) / bv[s]) for s, v in r["val"] if s in bv]
        if pts:
            a2.plot(*zip(*pts), style, marker=".", color=col[name], label=name, lw=1.2)
    a1.set(title=f"train loss vs bf16 (moving average of {smooth}), %", xlabel="step", ylabel="Δ loss %")
    a2.set(title="validation loss vs bf16, %", xlabel="step", ylabel="Δ loss %")
    for a in (a1, a2):
        a.axhline(0, color="k", lw=0.8)
        for y, c, what in ((0.3, "k", "flow target +0.3%"), (0.6, "0.5", "flow-fp4 target +0.6%")):
            a.axhline(y, color=c, lw=0.8, ls=":", label=what)
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    delta = os.path.join(out, "delta.png")
    fig.savefig(delta, dpi=120)
    plt.close(fig)
    return delta


def plot_seed_delta(groups, out, smooth, col):
    """delta.png over seeds: each arm's mean (over its seeds) minus bf16's mean, in % of bf16's
    mean, at every step (train, moving average) and validation; bf16's seed band (its seeds'
    range around its mean) shaded."""
    import matplotlib.pyplot as plt

    def mean_curve(by_seed, key):
        curves = []
        for r in by_seed.values():
            if key == "train":
                curves.append(moving_average(r["train_loss"], smooth))
            else:
                curves.append(dict((s, v) for s, v in r["val"]))
        return curves

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    base = groups[BASE]
    bt = mean_curve(base, "train")
    n = min(len(c) for c in bt)
    start = min(200, n // 10)  # the first steps' differences dwarf the rest
    bmean = [sum(c[i] for c in bt) / len(bt) for i in range(n)]
    steps = range(start + 1, n + 1)
    a1.fill_between(steps, [100 * (min(c[i] for c in bt) - bmean[i]) / bmean[i] for i in range(start, n)],
                    [100 * (max(c[i] for c in bt) - bmean[i]) / bmean[i] for i in range(start, n)],
                    color="tab:blue", alpha=0.15, label=f"bf16 band ({len(bt)} seeds)")
    bv = mean_curve(base, "val")
    vsteps = sorted(set.intersection(*[set(c) for c in bv]))
    vmean = {s: sum(c[s] for c in bv) / len(bv) for s in vsteps}
    a2.fill_between(vsteps, [100 * (min(c[s] for c in bv) - vmean[s]) / vmean[s] for s in vsteps],
                    [100 * (max(c[s] for c in bv) - vmean[s]) / vmean[s] for s in vsteps],
                    color="tab:blue", alpha=0.15, label=f"bf16 band ({len(bv)} seeds)")
    for arm, by_seed in groups.items():
        if arm == BASE:
            continue
        c = col.get(arm, None)
        tc = mean_curve(by_seed, "train")
        m = min(n, min(len(x) for x in tc))
        a1.plot(range(start + 1, m + 1), [100 * (sum(x[i] for x in tc) / len(tc) - bmean[i]) / bmean[i]
                                          for i in range(start, m)], color=c, lw=1.2,
                label=f"{arm} ({len(tc)} seeds)")
        vc = mean_curve(by_seed, "val")
        pts = [(s, 100 * (sum(x[s] for x in vc) / len(vc) - vmean[s]) / vmean[s]) for s in vsteps
               if all(s in x for x in vc)]
        if pts:
            a2.plot(*zip(*pts), marker=".", color=c, lw=1.2, label=f"{arm} ({len(vc)} seeds)")
    a1.set(title=f"train loss vs bf16 mean (moving average of {smooth}), %", xlabel="step", ylabel="Δ loss %")
    a2.set(title="validation loss vs bf16 mean, %", xlabel="step", ylabel="Δ loss %")
    for a in (a1, a2):
        a.axhline(0, color="k", lw=0.8)
        for y, cc, what in ((0.25, "k", "pass bar +0.25%"), (-0.25, "k", None)):
            a.axhline(y, color=cc, lw=0.8, ls=":", label=what)
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    delta = os.path.join(out, "delta.png")
    fig.savefig(delta, dpi=120)
    plt.close(fig)
    return delta


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/convergence")
    ap.add_argument("--smooth", type=int, default=50, help="moving-average window of the train curves")
    args = ap.parse_args(argv)
    runs = load_runs(args.out)
    if not runs:
        print(f"plot.py: no runs under {args.out}/runs and no {args.out}/results.json", file=sys.stderr)
        return 1
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"runs": runs}, f)
    md = table(runs)
    seeds = seed_table(runs)
    if seeds:
        md = "Per arm over seeds:\n\n" + seeds + "\nEvery run:\n\n" + md
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(md)
    print(md)
    for p in plot(runs, args.out, args.smooth):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
