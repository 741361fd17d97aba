#!/usr/bin/env python3
"""One transformers MoE block as a training step pays it, flowmoe against `grouped_mm` (issue 43).

The block is layer 0's `mlp` of a one-layer transformers Qwen3-MoE model built from a config at
Qwen3-30B-A3B's MoE sizes (H 2048, 128 experts of F 768, top-8 renormalised; nothing downloaded),
BF16 parameters, --tokens tokens. One iteration: zero_grad(set_to_none), forward, backward of a
fixed dY, then the optimizer's step (--opt sgd: SGD(lr=0), so that the weights count as changed
and every flowmoe forward derives its weight copies again, as in training; adamw: fused AdamW).
Columns: the median iteration time over --reps after --warmup (CUDA events, one synchronisation per
iteration), the peak allocated memory during the iterations above what the block, its gradients and
the optimizer state hold before the first one, and (--profile) the kernel time of one iteration by
kind (torch.profiler; the kinds: bench/step_profile.py). An impl with the suffix -relaid (e.g.
flowmoe-flow-relaid, --family gpt-oss) copies the transposed weights into the layer's layout, as
before issue 52, instead of the layer reading them where they are: the baseline of that change.

    python3 bench/hf_block.py --flowmoe-lib build/libflowmoe_capi.so --profile
"""

import argparse
import json
import os
import statistics
import sys

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_profile  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
QWEN3_30B_A3B = dict(hidden_size=2048, num_experts=128, moe_intermediate_size=768, num_experts_per_tok=8,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144)
# --family gpt-oss (issue 46): gpt-oss-20b's MoE block (H 2880, 32 experts of F 2880, top-4; biased
# experts, clamped SwiGLU, transposed and interleaved weights); --size overrides H and F together
# (e.g. 2944: the multiple of 128 that 2880 is padded to, the padding's control)
GPT_OSS_20B = dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                   num_attention_heads=64, num_key_value_heads=8, head_dim=64)
# --shape v3-ep8 (issue 51): the local experts of DeepSeek-V3 under 8-way expert parallelism (H 7168, 32
# experts of F 2048, top-8) as a Qwen3-MoE block; --hidden / --ffn / --experts / --topk override any size
SHAPES = {"qwen3-30b-a3b": {}, "v3-ep8": dict(hidden_size=7168, moe_intermediate_size=2048, num_experts=32,
                                            num_experts_per_tok=8, num_attention_heads=56, head_dim=128)}
MiB = 2 ** 20


def qwen3_dims(args):
    dims = dict(QWEN3_30B_A3B)
    dims.update(SHAPES[args.shape])
    for arg, key in (("hidden", "hidden_size"), ("ffn", "moe_intermediate_size"), ("experts", "num_experts"),
                     ("topk", "num_experts_per_tok")):
        if getattr(args, arg) is not None:
            dims[key] = getattr(args, arg)
    return dims


def import_flowmoe_hf(lib):
    if lib:
        sys.path.insert(0, os.path.join(ROOT, "python"))
        import flowmoe._native

        flowmoe._native.set_library_path(os.path.abspath(lib))
    import flowmoe.hf  # noqa: F401


def flowmoe_plan(block):
    """The memory plan (weights, saved, transient bytes per call) of the flowmoe layer serving the
    block's experts, or None (another implementation, or no layer built yet)."""
    try:
        from flowmoe.experts import _layers
    except ImportError:
        return None
    # (the layers are keyed by their owner: the experts module the HF backend passes, or w1)
    for p in list(block.modules()) + list(block.parameters()):
        entry = _layers.get(id(p))
        if entry is None:
            continue
        for layer in entry[1].values():
            if getattr(layer, "_runner", None) is not None:
                return tuple(layer._runner.plan)
    return None


def hidden_size(args):
    if args.family == "gpt-oss":
        return args.size or GPT_OSS_20B["hidden_size"]
    return qwen3_dims(args)["hidden_size"]


def build_block(impl, device, args):
    if args.family == "gpt-oss":
        dims = dict(GPT_OSS_20B)
        if args.size:
            dims.update(hidden_size=args.size, intermediate_size=args.size)
        cfg = transformers.GptOssConfig(vocab_size=256, num_hidden_layers=1, **dims)
    else:
        cfg = transformers.Qwen3MoeConfig(vocab_size=256, num_hidden_layers=1, norm_topk_prob=True, **qwen3_dims(args))
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation=impl,
                                                              dtype=torch.bfloat16)
    return model.model.layers[0].mlp


RELAID = "-relaid"  # (an impl suffix) weights relaid by copies, not read where stored: issue 52's baseline


def measure(args, impl, device):
    if impl.endswith(RELAID):  # e.g. flowmoe-flow-relaid: the gpt-oss layout copied into the layer's
        import flowmoe.experts as fx

        reads = fx._reads_stored
        fx._reads_stored = lambda recipe, device_type, bf16: False
        try:
            return dict(measure(args, impl[:-len(RELAID)], device), impl=impl)
        finally:
            fx._reads_stored = reads
    block = build_block(impl, device, args)
    params = [p for p in block.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.0) if args.opt == "sgd" else torch.optim.AdamW(params, lr=1e-4, fused=True)
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(1, args.tokens, hidden_size(args), device=device, dtype=torch.bfloat16,
                    generator=g).requires_grad_(True)
    dy = torch.randn(x.shape, device=device, dtype=torch.bfloat16, generator=g)

    def step():
        opt.zero_grad(set_to_none=True)
        x.grad = None
        out = block(x)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(dy)
        opt.step()

    step()  # the optimizer state exists from here on
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i in range(args.warmup + args.reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        if i >= args.warmup:
            times.append(a.elapsed_time(b))
    out = {"impl": impl, "ms": statistics.median(times),
           "peak_above_state_mib": (torch.cuda.max_memory_allocated(device) - base) / MiB,
           "state_mib": base / MiB}
    plan = flowmoe_plan(block)
    if plan is not None:  # the native layer's regions per call (weights, saved, transient)
        out["flowmoe_plan_mib"] = dict(zip(("weights", "saved", "transient"), (b / MiB for b in plan)))
    # where the peak is: one more step with the peak read after the forward and after the backward
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    opt.zero_grad(set_to_none=True)
    x.grad = None
    y = block(x)
    y = y[0] if isinstance(y, tuple) else y
    torch.cuda.synchronize(device)
    out["peak_forward_mib"] = (torch.cuda.max_memory_allocated(device) - base) / MiB
    torch.cuda.reset_peak_memory_stats(device)
    y.backward(dy)
    del y
    opt.step()
    torch.cuda.synchronize(device)
    out["peak_backward_mib"] = (torch.cuda.max_memory_allocated(device) - base) / MiB
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize(device)
        kinds = step_profile.kernel_kinds(prof)
        out["kernel_ms"] = kinds
        out["kernel_total_ms"] = sum(kinds.values())
        out["top_kernels"] = [(e.key[:140], round(e.self_device_time_total / 1e3, 3)) for e in sorted(
            (e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA),
            key=lambda e: -e.self_device_time_total)[:20]]
    del block, opt, params
    torch.cuda.empty_cache()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impls", nargs="+", default=["grouped_mm", "flowmoe-flow", "flowmoe-flow-fp4", "flowmoe-bf16"])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--family", choices=["qwen3-moe", "gpt-oss"], default="qwen3-moe")
    ap.add_argument("--size", type=int, default=None, help="gpt-oss: H = F = this (the padding's control)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b",
                    help="qwen3-moe: the expert sizes (v3-ep8: DeepSeek-V3's local experts under EP8)")
    for name, what in (("hidden", "H"), ("ffn", "F (moe_intermediate_size)"), ("experts", "E"), ("topk", "top-k")):
        ap.add_argument("--" + name, type=int, default=None, help="qwen3-moe: " + what + " instead of --shape's")
    ap.add_argument("--opt", choices=["sgd", "adamw"], default="sgd")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--profile", action="store_true", help="kernel time of one iteration by kind")
    ap.add_argument("--flowmoe-lib", default=None, help="libflowmoe_capi.so to use (with this checkout's python/)")
    ap.add_argument("--no-sync-free", action="store_true", help="flowmoe.hf.SYNC_FREE = False (the layer "
                    "synchronises the host in each forward)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("hf_block.py: needs a CUDA device")
    import_flowmoe_hf(args.flowmoe_lib)
    if args.no_sync_free:
        import flowmoe.hf

        flowmoe.hf.SYNC_FREE = False
    device = torch.device("cuda")
    rows = []
    for impl in args.impls:
        r = measure(args, impl, device)
        rows.append(r)
        base = rows[0]["ms"]
        print(f"# {impl}: {r['ms']:.2f} ms ({base / r['ms']:.2f}x {rows[0]['impl']}), peak above the state "
              f"{r['peak_above_state_mib']:.0f} MiB (state {r['state_mib']:.0f} MiB; forward "
              f"{r['peak_forward_mib']:.0f}, backward {r['peak_backward_mib']:.0f})", flush=True)
        if "flowmoe_plan_mib" in r:
            print("#   flowmoe's regions per call: " +
                  ", ".join(f"{k} {v:.0f} MiB" for k, v in r["flowmoe_plan_mib"].items()), flush=True)
        if args.profile:
            print(f"#   kernel time {r['kernel_total_ms']:.2f} ms: " +
                  ", ".join(f"{k} {v:.2f}" for k, v in r["kernel_ms"].items()), flush=True)
            for name, ms in r["top_kernels"]:
                print(f"#     {ms:7.3f} ms  {name}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"tokens": args.tokens, "opt": args.opt, "family": args.family,
                           "dims": qwen3_dims(args) if args.family == "qwen3-moe" else None, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
