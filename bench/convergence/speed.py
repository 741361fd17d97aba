#!/usr/bin/env python3
"""Whole-model training speed (issue 17 item 6): the same MoE language model with flowmoe's layer
and with the plain PyTorch BF16 MoE layer (flowmoe.reference_moe: torch._grouped_mm, autograd),
training tokens/s measured in one process on one GPU.

Model: flowmoe.lm.MoELM at DeepSeek-V2-Lite's MoE dimensions, where the MoE layers dominate:
4 layers, H 2048, 16 heads of 128, 64 experts of F 1408, top-6 softmax (no renormalisation),
aux loss 0.01; sequences of 2048 tokens, 4 per step (T = 8192 tokens per MoE call), byte vocabulary.
A step is what flowmoe.train does: forward + loss under BF16 autocast, backward, gradient
clipping, fused AdamW; timed with a device synchronisation at the end of every step, median over
--reps steps after --warmup steps. The tokens are random bytes (speed does not depend on the text).

    python3 bench/convergence/speed.py                         # torch BF16 vs flowmoe flow
    python3 bench/convergence/speed.py --recipes bf16 blockwise flow flow-fp4 --json results/convergence/speed.json
    python3 bench/convergence/speed.py --tiny --device cpu --moe torch   # smoke test

Printed: per model, step ms, tokens/s, model TFLOP/s (6 x active parameters + attention),
peak memory, and the speed-up over the PyTorch BF16 model (target: flow >= 1.4x).

The trainer's guards (flowmoe/train_guards.py, issue 30) run here too, so a fast step that does
not train the experts cannot pass for a result: every model's JSON entry holds "moe_guard" (per
MoE layer: weight refreshes, how far w1/w2/wr moved, the fresh-layer check after the last step),
and the script exits with status 3 when a guard failed (the table is still printed and written).
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time

try:
    import flowmoe.train  # noqa: F401  (installed package)
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import torch

from flowmoe.lm import LMConfig, MoELM
from flowmoe.train import device_used_bytes, train_step
from flowmoe.train_guards import MoEGuard, summary_line

V2_LITE = dict(layers=4, hidden=2048, heads=16, ffn=1408, experts=64, topk=6, seq_len=2048)
TINY = dict(layers=2, hidden=128, heads=2, ffn=128, experts=4, topk=2, seq_len=64)


class _Opt:  # the hyper-parameters make_optimizer reads
    def __init__(self, lr):
        self.lr, self.weight_decay = lr, 0.1


def measure(name, impl, recipe, cfg, batch, warmup, reps, device, seed, fresh_check=True):
    from flowmoe.train import make_optimizer
    tokens_per_step = batch * cfg.seq_len
    torch.manual_seed(seed)
    model = MoELM(cfg, moe=impl, recipe=recipe, max_tokens=tokens_per_step, device=device, seed=seed)
    guard = MoEGuard(model)  # the initial MoE weights, on the host
    opt = make_optimizer(model, _Opt(1e-4), device)
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, cfg.vocab, (batch, cfg.seq_len + 1), generator=g).to(device)
    x, y = data[:, :-1], data[:, 1:]
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        loss, _, ok = train_step(model, opt, x, y, clip=1.0, autocast_dtype=torch.bfloat16 if cuda else None)
        losses.append(float(loss.detach()))
        if cuda:
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        guard.after_step(ok)
    step = statistics.median(times)
    r = {
        "name": name, "moe": impl, "recipe": recipe,
        "step_ms": 1e3 * step,
        "step_ms_min": 1e3 * min(times),
        "tokens_per_s": tokens_per_step / step,
        "model_tflops": cfg.train_flops_per_token() * tokens_per_step / step / 1e12,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,  # PyTorch's allocator
        "device_memory_used_bytes": device_used_bytes(device),  # + native workspaces, context
        "first_loss": losses[0], "last_loss": losses[-1],
    }
    if fresh_check:  # after the figures: its layers count in none of them
        guard.fresh_check(warmup + reps)
    r["moe_guard"] = guard.report()
    for m in model.moe_layers():  # free flowmoe's native workspaces before the next model
        if hasattr(m, "release"):
            m.release()
    del model, opt, data, x, y
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipes", nargs="+", default=["flow"], help="flowmoe recipes to time")
    ap.add_argument("--moe", choices=("both", "torch", "flowmoe"), default="both")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-fresh-check", action="store_true",
                    help="skip the guard's fresh-layer check after the timed steps (it builds a new layer per "
                         "block; the figures do not depend on it; the weights-moved guard still runs)")
    ap.add_argument("--layers", type=int, default=None,
                    help="transformer blocks (default 4; e.g. 2 and 6 give the per-layer memory growth)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dims = dict(TINY if args.tiny else V2_LITE)
    if args.layers is not None:
        dims["layers"] = args.layers
    cfg = LMConfig(**dims, router="softmax", aux_loss_coef=0.01)
    total, active = cfg.params()
    print(f"# whole-model training speed: {cfg.layers} layers, H {cfg.hidden}, {cfg.heads} heads, "
          f"{cfg.experts} experts of F {cfg.ffn}, top-{cfg.topk}; {total / 1e9:.2f}B parameters, "
          f"{active / 1e6:.0f}M active; {args.batch} x {cfg.seq_len} = {args.batch * cfg.seq_len} tokens per step; "
          f"{args.warmup} warm-up + {args.reps} timed steps (median); torch {torch.__version__}, "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}", flush=True)
    plan = []
    if args.moe in ("both", "torch"):
        plan.append(("torch-bf16", "torch", "bf16"))
    if args.moe in ("both", "flowmoe"):
        plan += [(f"flowmoe-{r}", "flowmoe", r) for r in args.recipes]
    results = []
    for name, impl, recipe in plan:
        r = measure(name, impl, recipe, cfg, args.batch, args.warmup, args.reps, device, args.seed,
                    fresh_check=not args.no_fresh_check)
        results.append(r)
        print(f"# {name}: {r['step_ms']:.2f} ms/step, {r['tokens_per_s']:,.0f} tokens/s; "
              + (summary_line(r["moe_guard"]) if r["moe_guard"]["ok"] else
                 "GUARD FAILED: " + "; ".join(r["moe_guard"]["failures"])), flush=True)
    base = next((r for r in results if r["name"] == "torch-bf16"), None)
    print("| model | step ms | tokens/s | model TFLOP/s | peak GiB (PyTorch) | device used GiB | vs PyTorch BF16 MoE |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        r["speedup_vs_torch"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        mem = r["peak_memory_bytes"]
        used = r["device_memory_used_bytes"]
        print(f"| {r['name']} | {r['step_ms']:.2f} | {r['tokens_per_s']:,.0f} | {r['model_tflops']:.0f} | "
              f"{mem / 2**30 if mem else 0:.2f} | {used / 2**30 if used else 0:.2f} | "
              f"{r['speedup_vs_torch'] or 0:.2f}× |")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"model": cfg.__dict__, "batch": args.batch, "warmup": args.warmup, "reps": args.reps,
                       "torch": torch.__version__, "results": results}, f, indent=1)
    failed = [r["name"] for r in results if not r["moe_guard"]["ok"]]
    if failed:
        print(f"speed.py: the MoE guards failed for {', '.join(failed)} (the experts were not trained or "
              "a layer computed with stale weights): these speeds are not of a working training step",
              file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
