#!/usr/bin/env python3
"""A plain PyTorch BF16 MoE layer, written the way users write it, timed forward + backward.

This is the baseline `flowmoe bench` is compared with (issue 6). Nothing here is tuned: eager
PyTorch, the router in FP32 (as DeepSeek's reference code does), top-k, permutation by a stable
argsort + index_select, the expert GEMMs through torch._grouped_mm (BF16 in, BF16 out, FP32
accumulation) when this PyTorch has it, else a per-expert loop, SwiGLU as F.silu(gate) * up,
the combine as a scatter-add of the rows back to their tokens with index_add_. Autograd does the
backward. The routing probability multiplies the SwiGLU output (a' = p * silu(gate) * up, as
flowmoe's layer and Megatron-Core's "activation with probs" define it), so the combine is a plain
sum and y is the same function flowmoe computes.

Layer (the same shapes and conventions as flowmoe's layer; docs/MOE_GPU.md):
    x [T, H] bf16, router weight Wr [E, H], W1 [E, 2F, H] (gate rows [0, F), up rows [F, 2F)),
    W2 [E, H, F]; y [T, H] bf16.

Configurations (the same names and numbers as `flowmoe bench`): the per-GPU expert computation of
the papers' expert-parallel settings, without the all-to-all. A GPU of EP-n holds E/n experts and
receives, with balanced routing, T*k rows for T tokens per GPU, i.e. T*k/(E/n) rows per local
expert. Routing T tokens top-k over the E/n local experts gives exactly that load, so the
configuration is (T tokens, E_local experts, top-k).
    v3-ep8   DeepSeek-V3, EP8:  H 7168, F 2048, 32 local experts, top-8, sigmoid + renorm, x2.5
    v3-ep32  DeepSeek-V3, EP32: H 7168, F 2048,  8 local experts, top-8 (every token meets every
             local expert: exactly T rows per expert)
    v2       DeepSeek-V2, EP8:  H 5120, F 1536, 20 local experts, top-6, softmax
    v2-lite  DeepSeek-V2-Lite:  H 2048, F 1408, 64 experts (all local), top-6, softmax

Measured per configuration (medians of --reps CUDA-event timings after --warmup steps):
    forward, backward and forward+backward time, tokens/s = T / (fwd+bwd time),
    GEMM TFLOP/s = 18 * (T*k) * H * F / (fwd+bwd time): the six expert GEMMs (fprop 2*M*2F*H +
        2*M*H*F, and dgrad + wgrad twice that) over the M = T*k routed rows, padding rows and the
        router GEMM not counted (the same definition as `flowmoe bench`),
    peak memory: torch.cuda.max_memory_allocated() during one step, in total and above what was
        allocated before the step (weights, x, dy; weight gradients set to None first, as
        optimizer.zero_grad() does, so the delta includes the gradients the step creates),
    saved activation bytes per token: every tensor autograd saves for the backward during the
        forward (torch.autograd.graph.saved_tensors_hooks), unique storages, parameters and the
        layer input excluded, divided by T.

Usage (GPU):
    python3 bench/torch_moe_layer.py                         # all four configurations, T = 8192
    python3 bench/torch_moe_layer.py --config v3-ep8 --tokens 8192 --reps 20
    python3 bench/torch_moe_layer.py --json out.json         # also write the results as JSON
    python3 bench/torch_moe_layer.py --device cpu --tiny     # smoke test without a GPU
"""

import argparse
import json
import statistics
import sys

import os

import torch

try:
    from flowmoe.reference_moe import ReferenceMoE  # installed package
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    from flowmoe.reference_moe import ReferenceMoE

CONFIGS = {
    "v3-ep8": dict(hidden=7168, ffn=2048, experts=32, topk=8, score="sigmoid", renorm=True, scale=2.5),
    "v3-ep32": dict(hidden=7168, ffn=2048, experts=8, topk=8, score="sigmoid", renorm=True, scale=2.5),
    "v2": dict(hidden=5120, ffn=1536, experts=20, topk=6, score="softmax", renorm=False, scale=1.0),
    "v2-lite": dict(hidden=2048, ffn=1408, experts=64, topk=6, score="softmax", renorm=False, scale=1.0),
}
TINY = dict(hidden=256, ffn=128, experts=4, topk=2, score="softmax", renorm=False, scale=1.0)

HAVE_GROUPED_MM = hasattr(torch, "_grouped_mm")


def gemm_flops(tokens, cfg):
    """The six expert GEMMs of forward + backward over the routed (unpadded) rows."""
    m = tokens * cfg["topk"]
    return 18.0 * m * cfg["hidden"] * cfg["ffn"]


def make_layer(cfg, device, gemm, align):
    """The plain PyTorch BF16 MoE layer (flowmoe.reference_moe.ReferenceMoE, the one reference of the
    trainer, the benchmarks and the tests) with its weights in BF16, as users who train in BF16 keep
    them: no cast per forward in the timed step."""
    return ReferenceMoE(cfg["hidden"], cfg["ffn"], cfg["experts"], cfg["topk"], router=cfg["score"],
                        renormalize=cfg["renorm"], routed_scaling=cfg["scale"], seed=1234, device=device,
                        gemm=gemm, param_dtype=torch.bfloat16, pad_groups=align)


def probe_gemm_mode(device):
    """Which expert-GEMM form works here: torch._grouped_mm on ragged groups (forward and backward
    equal to the per-expert loop), else with groups padded to 8 or 16 rows, else the loop."""
    if not HAVE_GROUPED_MM or device.type != "cuda":
        return "loop", 1
    x = torch.randn(203, 256, device=device, dtype=torch.bfloat16)
    for align in (1, 8, 16):
        try:
            small = dict(hidden=256, ffn=128, experts=6, topk=2, score="softmax", renorm=False, scale=1.0)
            ref = make_layer(small, device, "loop", 1)
            mod = make_layer(small, device, "grouped", align)
            xr, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
            yr, ym = ref(xr), mod(xm)
            dy = torch.randn_like(yr)
            yr.backward(dy)
            ym.backward(dy)
            torch.cuda.synchronize()
            pairs = [(yr, ym), (xr.grad, xm.grad), (ref.w1.grad, mod.w1.grad), (ref.w2.grad, mod.w2.grad)]
            if all(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2 * b.float().abs().max().item() + 1e-6)
                   for a, b in pairs):
                return "grouped", align
            print(f"# torch._grouped_mm with align {align}: results differ from the per-expert loop", file=sys.stderr)
        except RuntimeError as err:  # unsupported shape / alignment
            print(f"# torch._grouped_mm with align {align} failed: {str(err).splitlines()[0]}", file=sys.stderr)
    return "loop", 1


def saved_bytes(layer, x):
    """Bytes of the tensors autograd saves during one forward (unique storages), without the
    parameters and the input."""
    exclude = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    exclude.add(x.untyped_storage().data_ptr())
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in exclude:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    del y
    return sum(seen.values())


def run_config(name, cfg, tokens, reps, warmup, device, gemm, align):
    torch.manual_seed(0)
    layer = make_layer(cfg, device, gemm, align)
    x = torch.randn(tokens, cfg["hidden"], device=device, dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(tokens, cfg["hidden"], device=device, dtype=torch.bfloat16)
    cuda = device.type == "cuda"

    def zero_grads():
        for p in layer.parameters():
            p.grad = None
        x.grad = None

    def step():
        y = layer(x)
        y.backward(dy)

    for _ in range(warmup):
        zero_grads()
        step()
    sbytes = saved_bytes(layer, x)

    peak = peak_delta = None
    if cuda:
        zero_grads()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        peak_delta = peak - base

    fwd_ms, bwd_ms, tot_ms = [], [], []
    for _ in range(reps):
        zero_grads()
        if cuda:
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            e0.record()
            y = layer(x)
            e1.record()
            y.backward(dy)
            e2.record()
            e2.synchronize()
            f, b = e0.elapsed_time(e1), e1.elapsed_time(e2)
        else:
            import time
            t0 = time.perf_counter()
            y = layer(x)
            t1 = time.perf_counter()
            y.backward(dy)
            t2 = time.perf_counter()
            f, b = (t1 - t0) * 1e3, (t2 - t1) * 1e3
        del y
        fwd_ms.append(f)
        bwd_ms.append(b)
        tot_ms.append(f + b)
    med = statistics.median
    total = med(tot_ms)
    return dict(
        config=name, tokens=tokens, hidden=cfg["hidden"], ffn=cfg["ffn"], experts=cfg["experts"],
        topk=cfg["topk"], gemm=gemm, align=align, reps=reps,
        fwd_ms=med(fwd_ms), bwd_ms=med(bwd_ms), total_ms=total,
        tokens_per_s=tokens / (total * 1e-3),
        tflops=gemm_flops(tokens, cfg) / (total * 1e-3) / 1e12,
        peak_gib=None if peak is None else peak / 2 ** 30,
        peak_delta_gib=None if peak_delta is None else peak_delta / 2 ** 30,
        saved_bytes_per_token=sbytes / tokens,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", action="append", choices=sorted(CONFIGS),
                    help="configuration (repeatable; default: all)")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per GPU T (default 8192)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--gemm", choices=["auto", "grouped", "loop"], default="auto",
                    help="expert GEMMs: torch._grouped_mm, a per-expert loop, or auto (probe)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="one tiny configuration (smoke test)")
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args()

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("torch_moe_layer.py: no CUDA device (use --device cpu --tiny for a smoke test)", file=sys.stderr)
        return 1
    device = torch.device(args.device)
    if args.gemm == "auto":
        gemm, align = probe_gemm_mode(device)
    elif args.gemm == "grouped":
        gemm, align = "grouped", 1
    else:
        gemm, align = "loop", 1

    names = ["tiny"] if args.tiny else (args.config or list(CONFIGS))
    tokens = 64 if args.tiny and args.tokens == 8192 else args.tokens
    print(f"# torch {torch.__version__}, device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"expert GEMMs: {'torch._grouped_mm' if gemm == 'grouped' else 'per-expert loop'}"
          f"{f' (groups padded to {align})' if align > 1 else ''}")
    print("| config | T | E | k | fwd ms | bwd ms | fwd+bwd ms | tokens/s | GEMM TFLOP/s | peak GiB | peak-base GiB | saved B/token |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    results = []
    for name in names:
        cfg = TINY if name == "tiny" else CONFIGS[name]
        r = run_config(name, cfg, tokens, args.reps, args.warmup, device, gemm, align)
        results.append(r)
        fmt = lambda v: "-" if v is None else f"{v:.2f}"
        print(f"| {name} | {r['tokens']} | {r['experts']} | {r['topk']} | {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | "
              f"{r['total_ms']:.2f} | {r['tokens_per_s']:.0f} | {r['tflops']:.0f} | {fmt(r['peak_gib'])} | "
              f"{fmt(r['peak_delta_gib'])} | {r['saved_bytes_per_token']:.0f} |", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
