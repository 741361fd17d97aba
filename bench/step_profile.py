"""Kernel time of one training step by phase and kind (torch.profiler), for bench/hf_experts.py
(--profile) and bench/hf_block.py (--profile).

Each phase (forward with the loss, backward, gradient clipping, optimizer) runs under a profiler of
its own and ends with a synchronisation, so its kernels are its own.
Kinds come from the kernel's name (the first kind with a matching pattern, lower case): what
flowmoe or grouped_mm run for the experts, the dense GEMMs around them (attention projections,
router, LM head), attention itself, the weight derivation and gradient conversion the issue names,
the optimizer. The figures are kernel time (the sum of the kernels' durations), not wall time.
"""

import torch
from torch.profiler import ProfilerActivity, profile

KINDS = [
    ("weight derivation", ("quantize_weight", "transpose_weight", "weight_scales", "interleave_gate",
                           "copy_bf16_checked")),
    ("gradient conversion", ("bfloat16_copy",)),
    ("optimizer", ("multi_tensor_apply", "fused_adam", "fusedadam", "sgd")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("experts: flowmoe kernels", ("flowmoe",)),
    ("experts: grouped GEMMs (grouped_mm)", ("cutlass", "grouped")),
    ("dense GEMMs (projections, router, LM head)", ("nvjet", "gemm", "sm90_xmma", "cublas")),
    ("routing (top-k, softmax, sort, gather/scatter)", ("topk", "softmax", "sort", "index", "gather", "scatter")),
    ("fills", ("fill", "memset")),
]
OTHER = "other (norms, activations, elementwise, copies)"


def kind_of(name: str) -> str:
    n = name.lower()
    for kind, pats in KINDS:
        if any(p in n for p in pats):
            return kind
    return OTHER


def kernel_kinds(prof) -> dict:
    """{kind: ms} over every kernel of a profile (CUDA activity)."""
    out = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0:
            k = kind_of(e.key)
            out[k] = out.get(k, 0.0) + e.self_device_time_total / 1e3
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def profile_phases(phases, device) -> dict:
    """Runs `phases` ([(name, fn)], in order) each under a profiler of its own, followed by a
    synchronisation (so that its kernels land in it): {phase: {"total_ms": .., kind: ms}}."""
    out = {}
    for name, fn in phases:
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(device)
        kinds = kernel_kinds(prof)
        out[name] = {"total_ms": sum(kinds.values()), **kinds}
    return out


def format_phases(prof: dict) -> str:
    lines = []
    for phase, kinds in prof.items():
        parts = ", ".join(f"{k} {v:.2f}" for k, v in kinds.items() if k != "total_ms" and v >= 0.05)
        lines.append(f"#   {phase}: {kinds['total_ms']:.2f} ms ({parts})")
    return "\n".join(lines)
