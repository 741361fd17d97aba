"""Kernel time of one training step by phase and kind (torch.profiler), for bench/hf_experts.py
(--profile) and bench/hf_block.py (--profile).

Phases are separated by torch.cuda.synchronize(), so a kernel belongs to the phase inside whose
host-time window it started: forward (model and loss), backward, gradient clipping, optimizer.
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


def _kernel_events(prof):
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            yield e


def kernel_kinds(prof) -> dict:
    """{kind: ms} over every kernel of a profile."""
    out = {}
    for e in _kernel_events(prof):
        k = kind_of(e.name)
        out[k] = out.get(k, 0.0) + e.device_time_total / 1e3
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def profile_phases(phases, device) -> dict:
    """Runs `phases` ([(name, fn)], in order, each followed by a synchronisation) under the profiler:
    {phase: {kind: ms}} and "total_ms" per phase."""
    marks = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for name, fn in phases:
            with torch.profiler.record_function("phase: " + name):
                fn()
                torch.cuda.synchronize(device)
    spans = {e.name[len("phase: "):]: (e.time_range.start, e.time_range.end) for e in prof.events()
             if e.name.startswith("phase: ")}
    out = {name: {} for name, _ in phases}
    out["(outside every phase: clock mismatch)"] = {}
    for e in _kernel_events(prof):
        t = e.time_range.start
        phase = next((n for n, (a, b) in spans.items() if a <= t <= b), "(outside every phase: clock mismatch)")
        k = kind_of(e.name)
        out[phase][k] = out[phase].get(k, 0.0) + e.device_time_total / 1e3
    return {p: {"total_ms": sum(v.values()), **dict(sorted(v.items(), key=lambda kv: -kv[1]))}
            for p, v in out.items() if v}


def format_phases(prof: dict) -> str:
    lines = []
    for phase, kinds in prof.items():
        parts = ", ".join(f"{k} {v:.2f}" for k, v in kinds.items() if k != "total_ms" and v >= 0.05)
        lines.append(f"#   {phase}: {kinds['total_ms']:.2f} ms ({parts})")
    return "\n".join(lines)
