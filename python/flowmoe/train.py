"""Train a byte-level MoE language model on Shakespeare: `python -m flowmoe.train`.

    python -m flowmoe.train                       # GPU: the small model (bench/convergence's size)
                                                  # CPU: the tiny configuration
    python -m flowmoe.train --tiny --moe torch    # a smoke run without the native library
    python -m flowmoe.train --recipe flow-fp4 --steps 2000 --json out.json --ckpt-dir ckpt
    python -m flowmoe.train --ckpt-dir ckpt --resume   # continue from ckpt/last.pt

The model is flowmoe.lm.MoELM (RMSNorm, rotary attention, an MoE FFN in every block, tied
embeddings, BF16 autocast outside the MoE layers, FP32 masters), the data flowmoe.data (bytes of
Shakespeare's works, a held-out validation split of whole works; `--data PATH` for a prepared
file). AdamW (betas 0.9/0.95, weight decay on matrices only), linear warm-up then cosine decay to
`--min-lr`, gradient clipping. A step whose loss or gradient norm is not finite is skipped (no
update) and counted. Every `--val-every` steps and at the end: the mean loss over fixed
validation batches.

`--json OUT` writes the run: configuration, train loss of every step, validation curve, tokens/s
(training steps only, after `--timing-warmup` steps), peak memory (torch.cuda.max_memory_allocated),
and for flowmoe layers the saved activation bytes per token and the nonfinite / underflow counters
summed over steps and layers.
"""

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

from . import data as data_mod
from .lm import LMConfig, MoELM, MOE_IMPLS

RECIPES = ("bf16", "blockwise", "fp8-naive", "flow", "flow-fp4")

# The small model of the convergence experiment (bench/convergence/run.sh says why this size).
SMALL = dict(model=dict(layers=8, hidden=768, heads=6, ffn=512, experts=16, topk=2, seq_len=512),
             batch=8, steps=2000, lr=6e-4, warmup=100, val_every=100, val_batches=32, log_every=50)
# A configuration that trains in seconds on a CPU (smoke tests, CI).
TINY = dict(model=dict(layers=2, hidden=128, heads=2, ffn=128, experts=4, topk=2, seq_len=64),
            batch=4, steps=30, lr=3e-3, warmup=5, val_every=10, val_batches=2, log_every=5)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m flowmoe.train", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the tiny configuration (default without a GPU)")
    ap.add_argument("--small", action="store_true", help="the small configuration (default with a GPU)")
    ap.add_argument("--moe", choices=MOE_IMPLS, default="flowmoe",
                    help="MoE FFN: flowmoe.torch.MoE, or the plain PyTorch BF16 reference")
    ap.add_argument("--recipe", choices=RECIPES, default=None,
                    help="flowmoe recipe (default flow; bf16 with --moe torch)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--data", default=None, help="corpus file/dir (default: the installed `shakespeare` package)")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default=None,
                    help="outside the MoE layers: BF16 autocast (default on a GPU) or FP32 (default on a CPU)")
    ap.add_argument("--seed", type=int, default=0, help="initialisation and data order")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--ffn", type=int, default=None, help="expert FFN size F")
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--topk", type=int, default=None)
    ap.add_argument("--router", choices=("softmax", "sigmoid"), default="softmax")
    ap.add_argument("--renormalize", action="store_true")
    ap.add_argument("--exponent", choices=("row-max", "column-amax"), default="row-max",
                    help="flow / flow-fp4: exponent rule of the column-wise copies (docs/NUMERICS.md §6)")
    ap.add_argument("--aux-loss-coef", type=float, default=0.01)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr")
    ap.add_argument("--warmup", type=int, default=None, help="linear warm-up steps")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (0: off)")
    ap.add_argument("--val-every", type=int, default=None)
    ap.add_argument("--val-batches", type=int, default=None)
    ap.add_argument("--log-every", type=int, default=None)
    ap.add_argument("--timing-warmup", type=int, default=10, help="steps left out of tokens/s")
    ap.add_argument("--ckpt-dir", default=None, help="write <dir>/last.pt every --ckpt-every steps and at the end")
    ap.add_argument("--ckpt-every", type=int, default=500)
    ap.add_argument("--resume", action="store_true", help="continue from <ckpt-dir>/last.pt when it exists")
    ap.add_argument("--stop-after", type=int, default=None,
                    help="train at most this many steps in this invocation, checkpoint, and exit "
                         "(--resume continues; the schedule stays that of --steps)")
    ap.add_argument("--json", default=None, help="write the run's curves and figures here")
    ap.add_argument("--name", default=None, help="run name in the JSON (default: the recipe)")
    ap.add_argument("--quiet", action="store_true")
    return ap.parse_args(argv)


def resolve(args):
    """Fills the defaults of the chosen configuration; returns (LMConfig, hyper-parameters)."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tiny and args.small:
        raise SystemExit("--tiny and --small exclude each other")
    base = TINY if (args.tiny or (not args.small and args.device == "cpu")) else SMALL
    args.config_name = "tiny" if base is TINY else "small"
    if args.precision is None:
        args.precision = "bf16" if args.device.startswith("cuda") else "fp32"
    if args.recipe is None:
        args.recipe = "bf16" if args.moe == "torch" else "flow"
    model = dict(base["model"])
    for k in ("layers", "hidden", "heads", "ffn", "experts", "topk"):
        if getattr(args, k) is not None:
            model[k] = getattr(args, k)
    if args.seq_len is not None:
        model["seq_len"] = args.seq_len
    cfg = LMConfig(router=args.router, renormalize=args.renormalize, aux_loss_coef=args.aux_loss_coef,
                   transpose_exponent=args.exponent, **model)
    for k in ("batch", "steps", "lr", "warmup", "val_every", "val_batches", "log_every"):
        if getattr(args, k) is None:
            setattr(args, k, base[k])
    if args.steps < 1 or args.batch < 1:
        raise SystemExit("--steps and --batch must be >= 1")
    if args.name is None:
        args.name = args.recipe if args.moe == "flowmoe" else f"torch-{args.recipe}"
    return cfg


def lr_at(step, args):
    """Linear warm-up over `warmup` steps, then cosine from lr to lr * min_lr_ratio at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    span = max(1, args.steps - args.warmup)
    progress = min(1.0, (step - args.warmup) / span)
    ratio = args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return args.lr * ratio


def make_optimizer(model, args, device):
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kw = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    if device.type == "cuda":
        kw["fused"] = True
    return torch.optim.AdamW(groups, **kw)


def _field(obj, name):
    """obj.name, obj[name] or obj.name() — the binding's report objects may be any of these."""
    if obj is None:
        return None
    v = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
    if callable(v):
        v = v()
    return v


def moe_counters(model):
    """[(nonfinite, underflow, aux loss)] of each MoE layer for the last forward + backward, from
    one status() call per layer."""
    out = []
    for m in model.moe_layers():
        st = m.status() if hasattr(m, "status") else None
        aux = _field(st, "aux_loss")
        if aux is None:
            aux = m.aux_loss
        out.append((int(_field(st, "nonfinite") or 0), int(_field(st, "underflow") or 0),
                    float(aux) if aux is not None else 0.0))
    return out


def moe_saved_bytes(model):
    """Saved activation bytes per token of each flowmoe layer's last forward (None: not reported)."""
    per_layer, unpadded = [], []
    for m in model.moe_layers():
        rep = m.cast_report() if hasattr(m, "cast_report") else None
        per_layer.append(_field(rep, "saved_bytes_per_token"))
        unpadded.append(_field(rep, "saved_bytes_per_token_unpadded"))
    if all(v is None for v in per_layer):
        return None
    return {"per_layer": per_layer, "unpadded_per_layer": unpadded,
            "sum": float(sum(v for v in per_layer if v is not None))}


def train_step(model, opt, tokens, targets, clip, autocast_dtype=torch.bfloat16):
    """One optimizer step (autocast_dtype None: no autocast). Returns (loss tensor, grad norm
    tensor, updated bool). The update is skipped when the loss or the gradient norm is not finite."""
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device_type=tokens.device.type, dtype=autocast_dtype or torch.bfloat16,
                        enabled=autocast_dtype is not None):
        loss = model(tokens, targets)
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
    ok = bool((torch.isfinite(loss) & torch.isfinite(norm)).item())  # one synchronisation
    if ok:
        opt.step()
    return loss, norm, ok


@torch.no_grad()
def evaluate(model, batches, autocast_dtype=torch.bfloat16):
    model.eval()
    total = 0.0
    for x, y in batches:
        with torch.autocast(device_type=x.device.type, dtype=autocast_dtype or torch.bfloat16,
                            enabled=autocast_dtype is not None):
            total += float(model(x, y))
    model.train()
    return total / len(batches)


def device_used_bytes(device):
    """Used memory of the device (total - free: every allocation, native ones included), or None."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def fmt_time(s):
    s = int(max(0, s))
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def save_checkpoint(path, model, opt, state):
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "state": state}, tmp)
    os.replace(tmp, path)


def run(args):
    cfg = resolve(args)
    device = torch.device(args.device)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    torch.manual_seed(args.seed)

    corpus = data_mod.load(args.data)
    corpus.check_window(cfg.seq_len)
    corpus.to(device)
    val_batches = corpus.val_batches(args.val_batches, args.batch, cfg.seq_len)

    tokens_per_step = args.batch * cfg.seq_len
    model = MoELM(cfg, moe=args.moe, recipe=args.recipe, max_tokens=tokens_per_step, device=device, seed=args.seed)
    opt = make_optimizer(model, args, device)
    total_params, active_params = cfg.params()
    log(f"# flowmoe.train: {args.config_name} model, {args.moe} MoE, recipe {args.recipe}, seed {args.seed}, "
        f"device {device}{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}")
    log(f"# model: {cfg.layers} layers, H {cfg.hidden}, {cfg.heads} heads, {cfg.experts} experts of F {cfg.ffn}, "
        f"top-{cfg.topk} {cfg.router}, aux {cfg.aux_loss_coef}; {total_params / 1e6:.1f}M parameters, "
        f"{active_params / 1e6:.1f}M active per token")
    log(f"# data: {corpus.description}: train {corpus.train.numel()} bytes, validation {corpus.val.numel()} bytes; "
        f"{args.batch} x {cfg.seq_len} = {tokens_per_step} tokens per step, {args.steps} steps "
        f"({args.steps * tokens_per_step / corpus.train.numel():.2f} epochs)")

    state = {"step": 0, "train_loss": [], "val": [], "skipped": 0, "nonfinite": [0] * cfg.layers,
             "underflow": [0] * cfg.layers, "step_times": [], "aux_loss": []}
    ckpt_path = os.path.join(args.ckpt_dir, "last.pt") if args.ckpt_dir else None
    if args.resume:
        if not ckpt_path:
            raise SystemExit("--resume needs --ckpt-dir")
        if os.path.isfile(ckpt_path):
            ck = torch.load(ckpt_path, map_location=device, weights_only=False)
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["optimizer"])
            state = ck["state"]
            log(f"# resumed from {ckpt_path} at step {state['step']}")
        else:
            log(f"# --resume: no {ckpt_path} yet, starting from step 0")
    if ckpt_path:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    cuda = device.type == "cuda"
    amp = torch.bfloat16 if args.precision == "bf16" else None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    stop_at = args.steps if args.stop_after is None else min(args.steps, state["step"] + args.stop_after)
    saved = None
    t_start = time.perf_counter()
    model.train()
    while state["step"] < stop_at:
        step = state["step"]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        x, y = corpus.batch(step, args.batch, cfg.seq_len, args.seed)
        t0 = time.perf_counter()
        loss, norm, ok = train_step(model, opt, x, y, args.clip, amp)
        loss_v = float(loss.detach())  # synchronises
        if cuda:
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        counters = moe_counters(model)
        for i, (nf, uf, _) in enumerate(counters):
            state["nonfinite"][i] += nf
            state["underflow"][i] += uf
        state["train_loss"].append(loss_v)
        state["aux_loss"].append(sum(c[2] for c in counters))
        state["step_times"].append(dt)
        state["skipped"] += 0 if ok else 1
        state["step"] = step + 1
        last = state["step"] == args.steps
        if last:
            saved = moe_saved_bytes(model)  # the report of a training forward, before validation
        if state["step"] % args.log_every == 0 or last or state["step"] == 1:
            times = state["step_times"][args.timing_warmup:] or state["step_times"]
            tps = tokens_per_step / statistics.median(times[-100:])
            eta = (args.steps - state["step"]) * statistics.mean(times[-100:])
            log(f"step {state['step']:>6}/{args.steps} | loss {loss_v:.4f} | aux {state['aux_loss'][-1]:.4f} | "
                f"grad {float(norm):.3f} | lr {opt.param_groups[0]['lr']:.2e} | {tps:,.0f} tok/s | "
                f"ETA {fmt_time(eta)}" + ("" if ok else " | SKIPPED (non-finite)"))
        if state["step"] % args.val_every == 0 or last:
            v = evaluate(model, val_batches, amp)
            state["val"].append([state["step"], v])
            log(f"val  {state['step']:>6}/{args.steps} | loss {v:.4f} | {v / math.log(2):.3f} bits/byte")
        if ckpt_path and (state["step"] % args.ckpt_every == 0 or last or state["step"] == stop_at):
            save_checkpoint(ckpt_path, model, opt, state)
    if state["step"] < args.steps:
        log(f"# stopped after step {state['step']} of {args.steps} (--stop-after); continue with --resume")

    times = state["step_times"][args.timing_warmup:] or state["step_times"] or [float("nan")]
    result = {
        "name": args.name,
        "moe": args.moe,
        "recipe": args.recipe,
        "seed": args.seed,
        "config_name": args.config_name,
        "model": dataclasses.asdict(cfg),
        "params_total": total_params,
        "params_active": active_params,
        "complete": state["step"] == args.steps,
        "precision": args.precision,
        "hyper": {k: getattr(args, k) for k in ("steps", "batch", "lr", "min_lr_ratio", "warmup",
                                                "weight_decay", "clip", "val_every", "val_batches")},
        "data": {"description": corpus.description, "train_bytes": corpus.train.numel(),
                 "val_bytes": corpus.val.numel()},
        "tokens_per_step": tokens_per_step,
        "train_loss": state["train_loss"],
        "aux_loss": state["aux_loss"],
        "val": state["val"],
        "final_val_loss": state["val"][-1][1] if state["val"] and state["step"] == args.steps else None,
        "final_train_loss_mean100": statistics.mean(state["train_loss"][-100:]) if state["train_loss"] else None,
        "tokens_per_s": tokens_per_step / statistics.median(times),
        "tokens_per_s_mean": tokens_per_step * len(times) / sum(times),
        "step_ms_median": 1e3 * statistics.median(times),
        "train_seconds": sum(state["step_times"]),
        "wall_seconds": time.perf_counter() - t_start,
        # PyTorch's allocator only: flowmoe's layers allocate their workspaces natively, which
        # device_memory_used_bytes (the device's used memory at the end, all of this process's
        # allocations and the CUDA context; other processes too, if any) includes.
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "device_memory_used_bytes": device_used_bytes(device),
        "saved_bytes_per_token": saved,
        "nonfinite_per_layer": state["nonfinite"],
        "underflow_per_layer": state["underflow"],
        "nonfinite": sum(state["nonfinite"]),
        "underflow": sum(state["underflow"]),
        "skipped_steps": state["skipped"],
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
    }
    fv = result["final_val_loss"]
    log(f"# done: final validation loss {'—' if fv is None else f'{fv:.4f}'}, {result['tokens_per_s']:,.0f} tok/s, "
        f"peak {result['peak_memory_bytes'] / 2**30 if cuda else 0:.2f} GiB (PyTorch allocator), device used "
        f"{(result['device_memory_used_bytes'] or 0) / 2**30:.2f} GiB, {result['skipped_steps']} skipped steps, "
        f"nonfinite {result['nonfinite']}, underflow {result['underflow']}")
    if args.json:
        d = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(d, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f)
    return result


def main(argv=None):
    args = parse_args(argv)
    try:
        run(args)
    except (FileNotFoundError, ImportError) as err:  # no corpus / no native layer: say what to do
        print(f"flowmoe.train: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
