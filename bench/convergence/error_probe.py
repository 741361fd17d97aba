#!/usr/bin/env python3
"""Per-recipe error of the MoE layer on a model's own activations and gradients (issue 35).

Runs one training batch through a `flowmoe.train` model (a checkpoint, or freshly initialised),
captures each MoE layer's input x and output gradient dy, and then, per layer, runs every recipe
of flowmoe's layer (and flow with the column-amax exponent) on exactly those x, dy and weights. Each
is compared with an FP32 computation of the same function (flowmoe.reference_moe in FP32: the
reference the recipes round away from), for y, dx, dW1, dW2 and dWr:

    relative error = ||recipe - FP32|| / ||FP32||

together with the layer's counters (underflow: values the exact conversions rounded) and, for the
FP8 recipes, the column checks (elements of each wgrad column copy whose decoded value differs from
the row-wise tensor's). The question it answers: which tensor of which recipe loses what, on real
data rather than on random normal tensors. Trained activations are heavy-tailed (outlier tokens
and features), which is where the exponent rule of the column copies matters.

    python3 bench/convergence/error_probe.py --tiny                          # CPU smoke test
    python3 bench/convergence/error_probe.py --ckpt runs/flow/last.pt --json probe.json   # GPU

The checkpoint is one `python -m flowmoe.train --ckpt-dir` wrote, of the `small` configuration
(or --tiny's) with the same size options as the run (--layers, --hidden, --experts, ...); the
batch comes from the same corpus the trainer reads (--data as there).
"""

import argparse
import json
import os
import sys

try:
    import flowmoe.train  # noqa: F401  (installed package)
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import torch

from flowmoe import data as data_mod
from flowmoe.lm import LMConfig, MoELM
from flowmoe.reference_moe import ReferenceMoE
from flowmoe.torch import MoE
from flowmoe.train import SMALL, TINY

RECIPES = ("bf16", "blockwise", "fp8-naive", "flow", "flow-fp4", "flow-colamax")
TENSORS = ("y", "dx", "dw1", "dw2", "dwr")


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def capture(model, tokens, targets, amp):
    """x and dy of every MoE layer for one forward + backward of the model's loss."""
    got = [dict() for _ in model.moe_layers()]
    handles = []
    for i, m in enumerate(model.moe_layers()):
        def hook(mod, inputs, out, i=i):
            got[i]["x"] = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).to(torch.bfloat16).clone()
            if out.requires_grad:
                out.register_hook(lambda g, i=i: got[i].__setitem__(
                    "dy", g.detach().reshape(-1, g.shape[-1]).to(torch.bfloat16).clone()))
        handles.append(m.register_forward_hook(hook))
    with torch.autocast(device_type=tokens.device.type, dtype=torch.bfloat16, enabled=amp):
        loss = model(tokens, targets)
    loss.backward()
    for h in handles:
        h.remove()
    return got


def run_layer(layer, x, dy):
    layer.zero_grad(set_to_none=True)
    xr = x.clone().requires_grad_()
    y = layer(xr)
    y.backward(dy.to(y.dtype))
    return dict(y=y.detach(), dx=xr.grad, dw1=layer.w1.grad, dw2=layer.w2.grad, dwr=layer.wr.grad)


def probe_layer(cfg, state, x, dy, device):
    E, H, F, k = cfg.experts, cfg.hidden, cfg.ffn, cfg.topk
    common = dict(router=cfg.router, renormalize=cfg.renormalize, aux_loss_coef=cfg.aux_loss_coef)
    ref = ReferenceMoE(H, F, E, k, device=device, gemm="loop", **common)
    ref.load_state_dict({n: v for n, v in state.items() if n in ("w1", "w2", "wr", "router_bias")}, strict=False)
    want = run_layer(ref, x.float(), dy.float())
    rows = []
    for name in RECIPES:
        recipe, exponent = ("flow", "column-amax") if name == "flow-colamax" else (name, "row-max")
        m = MoE(H, F, E, k, recipe=recipe, transpose_exponent=exponent, check_columns=recipe != "bf16",
                align=cfg.align, device=device, **common)
        m.load_state_dict(state)
        got = run_layer(m, x, dy)
        st = m.status()
        report = m.cast_report()
        cols = {c["name"]: (c["differ"], c["elements"]) for c in report.get("columns", [])}
        rows.append(dict(recipe=name, **{t: rel(got[t].float(), want[t].float()) for t in TENSORS},
                         underflow=st["underflow"], nonfinite=st["nonfinite"], columns=cols))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", help="a flowmoe.train checkpoint (last.pt); default: a fresh model")
    ap.add_argument("--tiny", action="store_true", help="the tiny configuration (default: small)")
    ap.add_argument("--data", default=None, help="corpus file, as flowmoe.train's --data")
    ap.add_argument("--batch", type=int, default=None, help="sequences (default: the preset's)")
    for k in ("layers", "hidden", "heads", "ffn", "experts", "topk", "seq_len"):
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=None,
                        help="model size as flowmoe.train's option of that name (default: the preset's)")
    ap.add_argument("--router", default="softmax", choices=("softmax", "sigmoid"))
    ap.add_argument("--renormalize", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    preset = TINY if args.tiny else SMALL
    sizes = dict(preset["model"])
    sizes.update({k: getattr(args, k) for k in ("layers", "hidden", "heads", "ffn", "experts", "topk", "seq_len")
                  if getattr(args, k) is not None})
    cfg = LMConfig(router=args.router, renormalize=args.renormalize, **sizes)
    batch = args.batch or preset["batch"]
    model = MoELM(cfg, moe="flowmoe", recipe="bf16", max_tokens=batch * cfg.seq_len, device=device, seed=args.seed)
    if args.ckpt:
        model.load_state_dict(torch.load(args.ckpt, map_location=device, weights_only=False)["model"])
    corpus = data_mod.load(args.data)  # the trainer's corpus (its batch 0 of this seed)
    tokens, targets = corpus.batch(0, batch, cfg.seq_len, args.seed)
    tokens, targets = tokens.to(device), targets.to(device)
    got = capture(model, tokens, targets, amp=device.type == "cuda")
    results = []
    print("| layer | recipe | y | dx | dW1 | dW2 | dWr | underflow | column copies: differing / elements |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for i, (m, c) in enumerate(zip(model.moe_layers(), got)):
        rows = probe_layer(cfg, m.state_dict(), c["x"], c["dy"], device)
        for r in rows:
            cols = "; ".join(f"{n} {d}/{e}" for n, (d, e) in r["columns"].items()) or "-"
            print(f"| {i} | {r['recipe']} | " + " | ".join(f"{r[t]:.2e}" for t in TENSORS)
                  + f" | {r['underflow']} | {cols} |", flush=True)
            results.append(dict(layer=i, **r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config="tiny" if args.tiny else "small", ckpt=args.ckpt, rows=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
