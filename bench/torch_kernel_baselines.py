#!/usr/bin/env python3
"""PyTorch baselines for the fused kernels: the unfused sequences users run today (issue 4).

For every kernel flowmoe fuses, this times the plain eager PyTorch sequence a user writes without
fused kernels (no torch.compile, no Triton, nothing beyond torch), so that our benchmarks can print
it next to the fused kernel measured in the same device call:

    swiglu_plain                  a' = silu(gate) * up * p, BF16 (p pre-cast to a BF16 column, as
                                  bench/torch_moe_layer.py does at permutation time)
    swiglu_plain_megatron         the same as Megatron-Core's weighted_swiglu run eagerly: p float32
                                  [M, 1], so the product is float32 and is cast back to BF16
    swiglu_quant_row              swiglu_plain, then row-wise 1x128 E4M3 quantize (quant_1x128)
    dswiglu_plain                 Megatron-Core's weighted_swiglu_back run eagerly: dH [M, 2F] BF16
                                  and dprob [M, 1] float32 (p float32, so most of it is float32)
    dswiglu_quant_rowcol          dswiglu_plain, then dH quantized row-wise (1x128) and column-wise
                                  (128x1 along the rows = row-wise quantize of dH.t().contiguous())
    unpermute_unpad_gather        (a) y[t] = sum_s probs[t,s] * O[row(t,s)]: index_select of the
                                  T*k rows by the row map, x probs in float32, view [T, k, H],
                                  sum over k, cast to BF16
    unpermute_unpad_index_add     (b) unpad (index_select of the routed, non-padding rows), x probs
                                  (float32), index_add_ into a zeroed float32 [T, H], cast to BF16
    unpermute_unpad_scatter_add   (c) as (b) with Megatron-Core's scatter_add_ over an expanded
                                  [T*k, H] index (moe_utils.unpermute)
    permute_pad_fp8               FP8 codes [T, H] (uint8 view) + float32 1x128 scales [T, H/128]
                                  -> padded per-expert rows [Mp, H] + [Mp, H/128], padding rows zero:
                                  index_select by the sorted routing, then index_copy_ (a scatter)
                                  into zeroed buffers; routing tables precomputed (as our kernel,
                                  which takes the output of build_routing)
    permute_pad_fp8_with_routing  the same including the routing tables: stable torch.argsort of
                                  the expert ids, bincount, cumsums, and the host sync for Mp
                                  (compare with build_routing + our permute_pad_fp8)

plus the device-to-device copy ceiling of the same run (dst.copy_(src) of a 2 GiB BF16 tensor,
bytes read + written), as the project's CUDA benchmarks measure theirs.

Shapes (docs/SWIGLU.md, docs/TOKEN.md): H is the GEMM1 output [M, 2F] BF16, gate = H[:, :F],
up = H[:, F:]; p [M] float32 per-row routing probability, uniform in [0.01, 1); unpermute over
T tokens, top-k distinct uniformly random experts of E local experts, expert segments padded to
--align (128) rows: Mp = sum_e round_up(count_e, 128). Data is random normal (never zeros).

Each figure is the median of --reps (>= 20 by default) CUDA-event timings after --warmup (3)
warm-up calls. As in the CUDA benchmarks, two copies of every input are made and the repetitions
alternate between them, so that no repetition finds its input in L2 from the previous one.
Each line also gives the bytes the operation must move at minimum, counted as the fused kernels'
rows in the CUDA benchmarks count them (formulas next to each): E8M0 scales at 1 byte (the eager
sequences here write float32 scales, 4 bytes, so they move more), index tables not counted, and
the implied GB/s and percentage of the copy ceiling. The numerics of these sequences differ from
ours in rounding (e.g. the fused forward quantizes from float32, here a' is rounded to BF16
first): they are timing baselines, not references.

Usage:
    python3 bench/torch_kernel_baselines.py                          # DeepSeek-V3 EP8
    python3 bench/torch_kernel_baselines.py --config all --json torch_kernels.json
    python3 bench/torch_kernel_baselines.py --config v2-lite --reps 30
    python3 bench/torch_kernel_baselines.py --check                  # small self-check, CPU or GPU

JSON (--json PATH): {config: {name: median_us}} for every configuration run, plus the keys
"copy_ceiling_gbs" and "copy_ceiling_us" and "_meta" (device, torch version, reps, shapes and the
minimum bytes of every line).
"""

import argparse
import json
import sys

import torch
import torch.nn.functional as F

# rows M of the SwiGLU operators (H is [M, 2F]); tokens T, top-k, hidden H and local experts of the
# token movers. DeepSeek-V3 EP8: 256 experts / 8 GPUs, M = T * k routed rows per GPU.
CONFIGS = {
    "v3-ep8": dict(rows=32768, ffn=2048, tokens=4096, topk=8, hidden=7168, experts=32),
    "v2": dict(rows=8192 * 6, ffn=1536, tokens=8192, topk=6, hidden=5120, experts=20),
    "v2-lite": dict(rows=8192 * 6, ffn=1408, tokens=8192, topk=6, hidden=2048, experts=64),
}
CHECK = dict(rows=256, ffn=256, tokens=64, topk=4, hidden=256, experts=8)


# ---------------------------------------------------------------------------------------------
# timing


def median_us(fn, reps=20, warmup=3):
    """Median of `reps` CUDA-event timings of fn(i) (i = repetition index), after `warmup` calls."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    ts = []
    for i in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(i)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def copy_ceiling(reps, warmup):
    """Device-to-device copy of a 2 GiB BF16 tensor: (us, GB/s counted as read + write)."""
    n = 1 << 30  # BF16 elements: 2 GiB
    src = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    us = median_us(lambda i: dst.copy_(src), reps, warmup)
    del src, dst
    torch.cuda.empty_cache()
    return us, 2.0 * 2 * n / (us * 1e3)


# ---------------------------------------------------------------------------------------------
# the user sequences


def quant_1x128(x2d):
    """[R, C] -> e4m3 codes [R, C] and power-of-two scales [R, C/128] (float32).
    (The same as bench/torch_convert_baseline.py: amax per 128-block, s = 2^ceil(log2(amax/448)).)"""
    r, c = x2d.shape
    xb = x2d.float().view(r, c // 128, 128)
    amax = xb.abs().amax(-1, keepdim=True)
    s = torch.exp2(torch.ceil(torch.log2(amax / 448.0)).clamp(min=-127))
    return (xb / s).to(torch.float8_e4m3fn).view(r, c), s.view(r, c // 128)


def swiglu_plain(h, p_col_bf16):
    """a' = silu(gate) * up * p in BF16; p_col_bf16 [M, 1] BF16."""
    f = h.shape[1] // 2
    gate, up = h[:, :f], h[:, f:]
    return F.silu(gate) * up * p_col_bf16


def swiglu_plain_megatron(h, p_col):
    """Megatron-Core weighted_swiglu, eager: p_col [M, 1] float32 promotes the product to float32."""
    gate, up = torch.chunk(h, 2, -1)
    return (F.silu(gate) * up * p_col).to(h.dtype)


def swiglu_quant_row(h, p_col_bf16):
    return quant_1x128(swiglu_plain(h, p_col_bf16))


def dswiglu_plain(da, h, p_col):
    """Megatron-Core weighted_swiglu_back (fused_bias_swiglu.py), eager, for a' = p * silu(g) * u:
    dgate = dA*p * sig(g) * (1 + g*(1 - sig(g))) * u, dup = dA*p * silu(g), dH = cat -> BF16;
    dprob = sum_j silu(g_j) * u_j * dA_j in float32. da [M, F] BF16, h [M, 2F] BF16, p_col [M, 1] float32."""
    g, u = torch.chunk(h, 2, -1)
    gw = da * p_col  # float32
    dh = torch.cat((gw * torch.sigmoid(g) * (1 + g * (1 - torch.sigmoid(g))) * u, gw * F.silu(g)), -1)
    dprob = torch.sum(F.silu(g) * u * da.to(p_col.dtype), dim=-1, keepdim=True)
    return dh.to(h.dtype), dprob


def dswiglu_quant_rowcol(da, h, p_col):
    """dswiglu_plain, then dH row-wise 1x128 ([M, 2F] codes, [M, 2F/128] scales) and column-wise
    128x1 ([2F, M] codes, [2F, M/128] scales: row-wise quantize of the transposed copy)."""
    dh, dprob = dswiglu_plain(da, h, p_col)
    q_row, s_row = quant_1x128(dh)
    q_col, s_col = quant_1x128(dh.t().contiguous())
    return q_row, s_row, q_col, s_col, dprob


def routing_tables(ids, num_experts, align):
    """ids [T, k] -> (order, token, rows, mp): the stable argsort of the flat (token, slot) pairs by
    expert, each sorted pair's token, its row in the padded layout (expert segments padded to
    `align` rows; within a segment ascending token then slot, as flowmoe's row_map), and Mp.
    Written as bench/torch_moe_layer.py writes it; int(...) is a host sync."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + align - 1) // align * align
    start = torch.cumsum(counts, 0) - counts
    pstart = torch.cumsum(padded, 0) - padded
    e = flat.index_select(0, order)
    rows = pstart[e] + torch.arange(flat.numel(), device=ids.device) - start[e]
    mp = int(padded.sum())
    return order, order // k, rows, mp


def permute_pad_fp8(codes, scales, token, rows, mp):
    """codes [T, H] uint8, scales [T, H/128] float32 -> [Mp, H], [Mp, H/128], padding rows zero."""
    xs = codes.index_select(0, token)
    ss = scales.index_select(0, token)
    out = codes.new_zeros(mp, codes.shape[1]).index_copy_(0, rows, xs)
    out_s = scales.new_zeros(mp, scales.shape[1]).index_copy_(0, rows, ss)
    return out, out_s


def permute_pad_fp8_with_routing(codes, scales, ids, num_experts, align):
    _, token, rows, mp = routing_tables(ids, num_experts, align)
    return permute_pad_fp8(codes, scales, token, rows, mp)


def unpermute_unpad_gather(o, row_map, probs):
    """(a) o [Mp, H] BF16, row_map [T, k] padded row of each (token, slot), probs [T, k] float32."""
    t, k = row_map.shape
    rows = o.index_select(0, row_map.reshape(-1))                       # [T*k, H] BF16
    y = (rows.view(t, k, -1).float() * probs.unsqueeze(-1)).sum(1)      # float32 [T, H]
    return y.to(o.dtype)


def unpermute_unpad_index_add(o, rows, order, probs):
    """(b) unpad: the routed rows in expert order (rows = their padded indices), then unpermute:
    x probs (float32), index_add_ into a zeroed float32 accumulator, cast."""
    t, k = probs.shape
    compact = o.index_select(0, rows)                                   # unpad: [T*k, H] BF16
    w = probs.reshape(-1).index_select(0, order)                        # each row's probability
    acc = torch.zeros(t, o.shape[1], dtype=torch.float32, device=o.device)
    acc.index_add_(0, order // k, compact * w.unsqueeze(1))             # BF16 x float32 -> float32
    return acc.to(o.dtype)


def unpermute_unpad_scatter_add(o, rows, order, probs):
    """(c) as (b) with scatter_add_ over an expanded [T*k, H] index (Megatron-Core moe_utils.unpermute)."""
    t, k = probs.shape
    h = o.shape[1]
    compact = o.index_select(0, rows)
    w = probs.reshape(-1).index_select(0, order)
    acc = torch.zeros(t, h, dtype=torch.float32, device=o.device)
    acc.scatter_add_(0, (order // k).unsqueeze(1).expand(-1, h), compact * w.unsqueeze(1))
    return acc.to(o.dtype)


# ---------------------------------------------------------------------------------------------
# inputs


def make_inputs(cfg, device, copies):
    """Random inputs for every operator; `copies` independent sets of the large tensors."""
    m, f, t, k, hid, e = (cfg[x] for x in ("rows", "ffn", "tokens", "topk", "hidden", "experts"))
    align = cfg["align"]
    bf16 = torch.bfloat16
    sets = []
    ids = torch.rand(t, e, device=device).topk(k, dim=1).indices        # k distinct experts, uniform
    order, token, rows, mp = routing_tables(ids, e, align)
    row_map = torch.empty(t * k, dtype=torch.long, device=device)
    row_map[order] = rows
    row_map = row_map.view(t, k)
    for _ in range(copies):
        p = torch.rand(m, device=device) * 0.99 + 0.01                  # float32 in [0.01, 1)
        x = torch.randn(t, hid, device=device, dtype=bf16)
        codes, scales = quant_1x128(x)
        sets.append(dict(
            h=torch.randn(m, 2 * f, device=device, dtype=bf16),
            da=torch.randn(m, f, device=device, dtype=bf16),
            p_col=p.unsqueeze(1),
            p_col_bf16=p.to(bf16).unsqueeze(1),
            o=torch.zeros(mp, hid, device=device, dtype=bf16).index_copy_(
                0, rows, torch.randn(t * k, hid, device=device, dtype=bf16)),
            probs=torch.rand(t, k, device=device) * 0.99 + 0.01,
            codes=codes.view(torch.uint8),
            scales=scales,
        ))
        del x
    return dict(ids=ids, order=order, token=token, rows=rows, mp=mp, row_map=row_map, sets=sets)


def min_bytes(cfg, mp):
    """Bytes each operation must move at minimum (E8M0 scales 1 byte, index tables not counted)."""
    m, f, t, k, hid = (cfg[x] for x in ("rows", "ffn", "tokens", "topk", "hidden"))
    tk = t * k
    fp8_row = hid + hid // 128                       # codes + 1-byte scales of one token row
    return {
        # read H (4F) + p (4), write a' BF16 (2F)
        "swiglu_plain": m * (4 * f + 4 + 2 * f),
        "swiglu_plain_megatron": m * (4 * f + 4 + 2 * f),
        # read H (4F) + p (4), write codes (F) + scales (F/128)
        "swiglu_quant_row": m * (4 * f + 4 + f + f // 128),
        # read dA (2F) + H (4F) + p (4), write dH BF16 (4F) + dprob (4)
        "dswiglu_plain": m * (2 * f + 4 * f + 4 + 4 * f + 4),
        # read dA (2F) + H (4F) + p (4); write row codes (2F) + scales (2F/128), column codes (2F)
        # + scales (2F per 128 rows = 2F/128 per row), dprob (4)
        "dswiglu_quant_rowcol": m * (2 * f + 4 * f + 4 + 2 * f + 2 * f // 128 + 2 * f + 2 * f // 128 + 4),
        # read the T*k routed rows (2H each), write T rows (2H); probs and row map not counted
        "unpermute_unpad_gather": tk * 2 * hid + t * 2 * hid,
        "unpermute_unpad_index_add": tk * 2 * hid + t * 2 * hid,
        "unpermute_unpad_scatter_add": tk * 2 * hid + t * 2 * hid,
        # read T token rows (codes + scales), write Mp padded rows (codes + scales)
        "permute_pad_fp8": t * fp8_row + mp * fp8_row,
        "permute_pad_fp8_with_routing": t * fp8_row + mp * fp8_row,
    }


# ---------------------------------------------------------------------------------------------
# benchmark


def run_config(name, cfg, reps, warmup, ceiling_gbs):
    torch.manual_seed(0)
    inp = make_inputs(cfg, torch.device("cuda"), copies=2)
    s = inp["sets"]
    e, align = cfg["experts"], cfg["align"]
    order, token, rows, mp, row_map, ids = (inp[x] for x in ("order", "token", "rows", "mp", "row_map", "ids"))
    routed = cfg["tokens"] * cfg["topk"]
    print(f"\n{name}: SwiGLU M {cfg['rows']}, F {cfg['ffn']} | tokens T {cfg['tokens']}, top-{cfg['topk']}, "
          f"H {cfg['hidden']}, {e} experts, align {align}: {routed} routed rows, Mp {mp}")
    print(f"  {'sequence':<30} {'median us':>11} {'min MB':>10} {'GB/s':>8} {'% copy':>7}")

    ops = {
        "swiglu_plain": lambda i: swiglu_plain(s[i & 1]["h"], s[i & 1]["p_col_bf16"]),
        "swiglu_plain_megatron": lambda i: swiglu_plain_megatron(s[i & 1]["h"], s[i & 1]["p_col"]),
        "swiglu_quant_row": lambda i: swiglu_quant_row(s[i & 1]["h"], s[i & 1]["p_col_bf16"]),
        "dswiglu_plain": lambda i: dswiglu_plain(s[i & 1]["da"], s[i & 1]["h"], s[i & 1]["p_col"]),
        "dswiglu_quant_rowcol": lambda i: dswiglu_quant_rowcol(s[i & 1]["da"], s[i & 1]["h"], s[i & 1]["p_col"]),
        "unpermute_unpad_gather": lambda i: unpermute_unpad_gather(s[i & 1]["o"], row_map, s[i & 1]["probs"]),
        "unpermute_unpad_index_add": lambda i: unpermute_unpad_index_add(s[i & 1]["o"], rows, order, s[i & 1]["probs"]),
        "unpermute_unpad_scatter_add": lambda i: unpermute_unpad_scatter_add(s[i & 1]["o"], rows, order,
                                                                             s[i & 1]["probs"]),
        "permute_pad_fp8": lambda i: permute_pad_fp8(s[i & 1]["codes"], s[i & 1]["scales"], token, rows, mp),
        "permute_pad_fp8_with_routing": lambda i: permute_pad_fp8_with_routing(s[i & 1]["codes"], s[i & 1]["scales"],
                                                                               ids, e, align),
    }
    nbytes = min_bytes(cfg, mp)
    times = {}
    for op, fn in ops.items():
        us = median_us(fn, reps, warmup)
        times[op] = us
        gbs = nbytes[op] / (us * 1e3)
        print(f"  {op:<30} {us:11.1f} {nbytes[op] / 1e6:10.1f} {gbs:8.0f} {100.0 * gbs / ceiling_gbs:6.1f}%",
              flush=True)
    del inp, s, ops
    torch.cuda.empty_cache()
    return times, nbytes, mp


# ---------------------------------------------------------------------------------------------
# self-check (small shapes, CPU or GPU)


def bf16_ulp(v):
    """One BF16 ulp at |v| (float32 tensor), 2^-133 at zero."""
    _, ex = torch.frexp(v.abs())          # |v| = mantissa * 2^ex, mantissa in [0.5, 1)
    return torch.exp2((ex - 8).float()).clamp(min=2.0 ** -133)


def check_dequant(codes, scales, x, what):
    """codes * scales approximates x within 1/16 relative (E4M3 normals) or half an E4M3 subnormal
    step (2^-10 * scale); scales are powers of two with amax/scale in (224, 448]."""
    r, c = x.shape
    xb = x.float().view(r, c // 128, 128)
    sb = scales.view(r, c // 128, 1)
    assert torch.equal(torch.exp2(torch.log2(scales).round()), scales), f"{what}: scales not powers of two"
    ratio = xb.abs().amax(-1, keepdim=True) / sb
    in_range = (ratio > 224 * (1 - 1e-6)) & (ratio <= 448 * (1 + 1e-6))
    assert bool(in_range.all()), f"{what}: amax/scale outside (224, 448]"
    dq = codes.float().view(r, c // 128, 128) * sb
    err = (dq - xb).abs()
    bound = xb.abs() / 16 + sb * 2.0 ** -10
    assert bool((err <= bound).all()), f"{what}: dequantized codes off by {float((err / bound).max()):.3f} x the bound"


def run_check(device):
    cfg = dict(CHECK, align=128)
    torch.manual_seed(0)
    inp = make_inputs(cfg, device, copies=1)
    s = inp["sets"][0]
    m, f, t, k, hid = (cfg[x] for x in ("rows", "ffn", "tokens", "topk", "hidden"))
    order, token, rows, mp, row_map, ids = (inp[x] for x in ("order", "token", "rows", "mp", "row_map", "ids"))
    h, da, p_col = s["h"], s["da"], s["p_col"]

    # routing: Mp, the row map is a bijection onto the non-padding rows, rows grouped by expert
    counts = torch.bincount(ids.reshape(-1), minlength=cfg["experts"])
    assert mp == int(((counts + 127) // 128 * 128).sum())
    assert torch.equal(torch.sort(row_map.reshape(-1)).values, torch.sort(rows).values)
    assert int(torch.unique(rows).numel()) == t * k and int(rows.max()) < mp
    assert bool((ids.sort(dim=1).values.diff(dim=1) > 0).all()), "experts of a token not distinct"

    # forward SwiGLU against float64
    g64, u64 = h[:, :f].double(), h[:, f:].double()
    ref = p_col.double() * F.silu(g64) * u64
    for name, a in (("swiglu_plain", swiglu_plain(h, s["p_col_bf16"])),
                    ("swiglu_plain_megatron", swiglu_plain_megatron(h, p_col))):
        assert a.shape == (m, f) and a.dtype == torch.bfloat16, name
        rel = float((a.double() - ref).norm() / ref.norm())
        assert rel < 2.0 ** -6, f"{name}: relative error {rel:.3g}"
    q, sc = swiglu_quant_row(h, s["p_col_bf16"])
    assert q.shape == (m, f) and q.dtype == torch.float8_e4m3fn and sc.shape == (m, f // 128)
    check_dequant(q, sc, swiglu_plain(h, s["p_col_bf16"]), "swiglu_quant_row")

    # backward against float64 autograd of a' = p * silu(g) * u
    h64 = h.double().requires_grad_()
    p64 = p_col.double().requires_grad_()
    (p64 * F.silu(h64[:, :f]) * h64[:, f:]).backward(da.double())
    dh, dprob = dswiglu_plain(da, h, p_col)
    assert dh.shape == (m, 2 * f) and dh.dtype == torch.bfloat16 and dprob.shape == (m, 1)
    assert dprob.dtype == torch.float32
    for name, got, want in (("dgate", dh[:, :f], h64.grad[:, :f]), ("dup", dh[:, f:], h64.grad[:, f:]),
                            ("dprob", dprob, p64.grad)):
        rel = float((got.double() - want).norm() / want.norm())
        assert rel < 2.0 ** -5, f"dswiglu_plain {name}: relative error {rel:.3g}"
    q_row, s_row, q_col, s_col, dprob2 = dswiglu_quant_rowcol(da, h, p_col)
    assert q_row.shape == (m, 2 * f) and s_row.shape == (m, 2 * f // 128)
    assert q_col.shape == (2 * f, m) and s_col.shape == (2 * f, m // 128)
    assert torch.equal(dprob2, dprob)
    check_dequant(q_row, s_row, dh, "dswiglu_quant_rowcol row-wise")
    check_dequant(q_col, s_col, dh.t().contiguous(), "dswiglu_quant_rowcol column-wise")

    # unpermute: the three variants agree within BF16 rounding and match float64
    o, probs = s["o"], s["probs"]
    pad = torch.ones(mp, dtype=torch.bool, device=device)
    pad[rows] = False
    assert not bool((o[pad] != 0).any()), "padding rows of O not zero"
    ya = unpermute_unpad_gather(o, row_map, probs)
    yb = unpermute_unpad_index_add(o, rows, order, probs)
    yc = unpermute_unpad_scatter_add(o, rows, order, probs)
    terms = o.index_select(0, row_map.reshape(-1)).double().view(t, k, hid) * probs.double().unsqueeze(-1)
    ref = terms.sum(1)
    slack = 1e-6 * terms.abs().sum(1)   # float32 sums in different orders
    for name, y in (("(a) gather", ya), ("(b) index_add_", yb), ("(c) scatter_add_", yc)):
        assert y.shape == (t, hid) and y.dtype == torch.bfloat16, name
        assert bool(((y.double() - ref).abs() <= bf16_ulp(ref.float()).double() / 2 + slack).all()), \
            f"unpermute {name}: more than half a BF16 ulp from float64"
    for name, y in (("(b)", yb), ("(c)", yc)):
        big = torch.maximum(ya.float().abs(), y.float().abs())
        assert bool(((ya.float() - y.float()).abs() <= bf16_ulp(big) + slack.float()).all()), \
            f"unpermute (a) and {name} differ by more than one BF16 rounding"

    # permute + pad: padding rows zero, routed rows byte copies of their token's codes and scales
    codes, scales = s["codes"], s["scales"]
    assert codes.dtype == torch.uint8 and codes.shape == (t, hid) and scales.shape == (t, hid // 128)
    for name, (pc, ps) in (("permute_pad_fp8", permute_pad_fp8(codes, scales, token, rows, mp)),
                           ("permute_pad_fp8_with_routing",
                            permute_pad_fp8_with_routing(codes, scales, ids, cfg["experts"], cfg["align"]))):
        assert pc.shape == (mp, hid) and pc.dtype == torch.uint8 and ps.shape == (mp, hid // 128), name
        assert not bool((pc[pad] != 0).any()) and not bool((ps[pad] != 0).any()), f"{name}: padding rows not zero"
        assert torch.equal(pc[rows], codes[token]) and torch.equal(ps[rows], scales[token]), name
        # the row map's padded row of (t, s) holds token t
        assert torch.equal(pc[row_map.reshape(-1)], codes.repeat_interleave(k, 0)), name

    print(f"torch_kernel_baselines --check: all checks passed on {device} (torch {torch.__version__}; "
          f"M {m}, F {f}, T {t}, k {k}, H {hid}, {cfg['experts']} experts, Mp {mp})")
    return 0


# ---------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="v3-ep8", choices=sorted(CONFIGS) + ["all"],
                    help="configuration (default v3-ep8: DeepSeek-V3 EP8), or all")
    for opt, what in (("rows", "SwiGLU rows M"), ("ffn", "expert FFN width F (H is [M, 2F])"),
                      ("tokens", "tokens T of the movers"), ("topk", "top-k"), ("hidden", "hidden size H"),
                      ("experts", "local experts")):
        ap.add_argument(f"--{opt}", type=int, help=f"override the configuration's {what}")
    ap.add_argument("--align", type=int, default=128, help="expert segment alignment (default 128)")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per figure (default 20)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", help="write the results to this file")
    ap.add_argument("--check", action="store_true", help="small self-check instead of timing (CPU if no CUDA)")
    ap.add_argument("--device", help="device of --check (default: cuda if available, else cpu)")
    args = ap.parse_args()

    if args.check:
        dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        return run_check(dev)
    if not torch.cuda.is_available():
        print("torch_kernel_baselines.py: no CUDA device (use --check for the CPU self-check)", file=sys.stderr)
        return 1

    names = list(CONFIGS) if args.config == "all" else [args.config]
    cfgs = {}
    for name in names:
        cfg = dict(CONFIGS[name], align=args.align)
        for opt in ("rows", "ffn", "tokens", "topk", "hidden", "experts"):
            if getattr(args, opt) is not None:
                cfg[opt] = getattr(args, opt)
        if cfg["ffn"] % 128 or cfg["hidden"] % 128 or cfg["rows"] % 128:
            ap.error(f"{name}: F, H and M must be multiples of 128 (1x128 and 128x1 blocks)")
        if not 1 <= cfg["topk"] <= cfg["experts"]:
            ap.error(f"{name}: need 1 <= top-k <= experts")
        cfgs[name] = cfg

    print(f"# torch {torch.__version__} on {torch.cuda.get_device_name()}; median of {args.reps} CUDA-event "
          f"timings after {args.warmup} warm-ups; eager PyTorch, two input copies alternated")
    copy_us, ceiling = copy_ceiling(args.reps, args.warmup)
    print(f"copy ceiling: dst.copy_(src) BF16 {2 * (1 << 30) / 1e6:.0f} MB in {copy_us:.1f} us = {ceiling:.0f} GB/s "
          f"(read + write)")
    out = {"copy_ceiling_gbs": ceiling, "copy_ceiling_us": copy_us}
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "reps": args.reps,
            "warmup": args.warmup, "shapes": {}, "min_bytes": {}}
    for name, cfg in cfgs.items():
        times, nbytes, mp = run_config(name, cfg, args.reps, args.warmup, ceiling)
        out[name] = times
        meta["shapes"][name] = dict(cfg, mp=mp)
        meta["min_bytes"][name] = nbytes
    out["_meta"] = meta
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
