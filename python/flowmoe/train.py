"""Train a byte-level MoE language model on Shakespeare: `python -m flowmoe.train`.

    python -m flowmoe.train                       # GPU: the small model (bench/convergence's size)
                                                  # CPU: the tiny configuration
    python -m flowmoe.train --tiny --moe torch    # a smoke run without the native library
    python -m flowmoe.train --recipe flow-fp4 --steps 2000 --json out.json --ckpt-dir ckpt
    python -m flowmoe.train --ckpt-dir ckpt --resume   # continue from ckpt/last.pt
    python -m flowmoe.train --tiny --moe torch --freeze-experts   # experts and routers not trained

The model is flowmoe.lm.MoELM (RMSNorm, rotary attention, an MoE FFN in every block, tied
embeddings, BF16 autocast outside the MoE layers, FP32 masters), the data flowmoe.data (bytes of
Shakespeare's works, a held-out validation split of whole works; `--data PATH` for a prepared
file). AdamW (betas 0.9/0.95, weight decay on matrices only), linear warm-up then cosine decay to
`--min-lr`, gradient clipping. A step whose loss or gradient norm is not finite is skipped (no
update) and counted. Every `--val-every` steps and at the end: the mean loss over fixed
validation batches.

`--json OUT` writes the run: configuration, train loss of every step, validation curve, tokens/s
(training steps only, after `--timing-warmup` steps), peak memory (torch.cuda.max_memory_allocated),
for flowmoe layers the saved activation bytes per token and the nonfinite / underflow counters
summed over steps and layers, and the guards of every MoE layer ("moe_guard", train_guards.py:
weight refreshes, how far w1 / w2 / wr moved from their initial values, a fresh layer with the
trained state computing identical outputs). A run whose guards fail (the experts were not trained,
or a layer computed with stale weights) exits with status 3 after writing the JSON.
`--freeze-experts` is the control run in which the experts and routers keep their initial weights.

The run ends with a summary for a person: what was trained on what, the loss from the first step to
the final validation against ln 256 (the uniform byte model), where the results went, and the
command to try next.
"""

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import textwrap
import time

import torch

from . import data as data_mod
from . import train_guards
from .lm import LMConfig, MoELM, MOE_IMPLS
from .train_guards import GuardFailure, MoEGuard

RECIPES = ("bf16", "blockwise", "fp8-naive", "flow", "flow-fp4")

# The small model of the convergence experiment (bench/convergence/run.sh says why this size).
SMALL = dict(model=dict(layers=8, hidden=768, heads=6, ffn=512, experts=16, topk=2, seq_len=512),
             batch=8, steps=2000, lr=6e-4, warmup=100, val_every=100, val_batches=32, log_every=50)
# A configuration that trains in seconds on a CPU (smoke tests, CI).
TINY = dict(model=dict(layers=2, hidden=128, heads=2, ffn=128, experts=4, topk=2, seq_len=64),
            batch=4, steps=30, lr=3e-3, warmup=5, val_every=10, val_batches=2, log_every=5)


def _preset_text(p):
    m = p["model"]
    return (f"{m['layers']} layers, H {m['hidden']}, {m['heads']} heads, {m['experts']} experts of F "
            f"{m['ffn']}, top-{m['topk']}, sequences of {m['seq_len']}, batch {p['batch']}, {p['steps']} "
            f"steps, lr {p['lr']:g}, {p['warmup']} warm-up steps, validation every {p['val_every']} steps "
            f"on {p['val_batches']} batches, a log line every {p['log_every']} steps")


def _from_preset(key, what="", model=False):
    t, s = (TINY["model"], SMALL["model"]) if model else (TINY, SMALL)
    return f"{what}default: the preset's, {t[key]:g} tiny / {s[key]:g} small".lstrip()


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m flowmoe.train", formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="python -m flowmoe.train [--tiny | --small] [options]",
        description=textwrap.fill(
            "Trains a byte-level decoder-only language model whose every FFN is an MoE layer, on "
            "Shakespeare's works, and ends with a summary: the loss from the first step to the final "
            "validation, against ln 256 = 5.55 (a model that guesses every byte uniformly).", width=100)
        + "\n\nA preset gives the model and schedule; the options below override its parts.\n" + "\n".join(
            textwrap.fill(_preset_text(p), width=100, initial_indent=f"  {n:<9}", subsequent_indent=" " * 11)
            for n, p in (("--tiny", TINY), ("--small", SMALL))),
        epilog="Examples: `python -m flowmoe.train` (the preset of this machine), `--recipe flow-fp4`, "
               "`--moe torch` (no native library), `--steps 300 --json run.json`.")
    g = ap.add_argument_group("configuration")
    g.add_argument("--tiny", action="store_true",
                   help="the tiny preset, seconds per step on a CPU (default where no GPU is used)")
    g.add_argument("--small", action="store_true",
                   help="the small preset, 170M parameters, about a minute on an H200 (default on a GPU)")
    g.add_argument("--moe", choices=MOE_IMPLS, default="flowmoe",
                   help="the MoE FFN of every block: flowmoe's layer (flowmoe.torch.MoE) or the plain "
                        "PyTorch BF16 reference (flowmoe.reference_moe); default: flowmoe")
    g.add_argument("--recipe", choices=RECIPES, default=None,
                   help="number formats of flowmoe's layer (docs/PYTHON.md); default: flow, and bf16 "
                        "(the only one) with --moe torch")
    g.add_argument("--freeze-experts", action="store_true",
                   help="control run: the experts and routers keep their initial weights (only "
                        "attention, norms and embedding train); default: off")
    g.add_argument("--device", default=None, help="cuda or cpu; default: cuda when PyTorch sees a GPU")
    g.add_argument("--data", default=None,
                   help="corpus: a file from `python -m flowmoe.data prepare`, any file or a directory "
                        "of .txt/.md files; default: the installed `shakespeare` package")
    g.add_argument("--precision", choices=("bf16", "fp32"), default=None,
                   help="outside the MoE layers: BF16 autocast or FP32; default: bf16 on a GPU, fp32 "
                        "on a CPU")
    g.add_argument("--seed", type=int, default=0, help="initial weights and data order; default: 0")
    m = ap.add_argument_group("model (each default: the preset's)")
    m.add_argument("--layers", type=int, default=None, help=_from_preset("layers", "blocks; ", True))
    m.add_argument("--hidden", type=int, default=None,
                   help=_from_preset("hidden", "model width H (flowmoe: a multiple of 128); ", True))
    m.add_argument("--heads", type=int, default=None, help=_from_preset("heads", "attention heads; ", True))
    m.add_argument("--ffn", type=int, default=None, help=_from_preset("ffn", "expert FFN width F; ", True))
    m.add_argument("--experts", type=int, default=None, help=_from_preset("experts", "experts per MoE layer; ", True))
    m.add_argument("--topk", type=int, default=None, help=_from_preset("topk", "experts per token; ", True))
    m.add_argument("--seq-len", type=int, default=None, help=_from_preset("seq_len", "bytes per sequence; ", True))
    m.add_argument("--router", choices=("softmax", "sigmoid"), default="softmax",
                   help="router scores; default: softmax")
    m.add_argument("--renormalize", action="store_true",
                   help="renormalise the top-k probabilities to sum 1; default: off")
    m.add_argument("--exponent", choices=("row-max", "column-amax"), default="row-max",
                   help="flow / flow-fp4: exponent rule of the column-wise FP8 copies "
                        "(docs/NUMERICS.md §6); default: row-max")
    m.add_argument("--aux-loss-coef", type=float, default=0.01,
                   help="weight of the load-balancing loss (applied inside the layer's backward); "
                        "default: 0.01")
    o = ap.add_argument_group("schedule")
    o.add_argument("--steps", type=int, default=None, help=_from_preset("steps", "optimizer steps; "))
    o.add_argument("--batch", type=int, default=None, help=_from_preset("batch", "sequences per step; "))
    o.add_argument("--lr", type=float, default=None, help=_from_preset("lr", "peak learning rate (AdamW); "))
    o.add_argument("--warmup", type=int, default=None, help=_from_preset("warmup", "linear warm-up steps; "))
    o.add_argument("--min-lr-ratio", type=float, default=0.1,
                   help="the cosine decay ends at lr x this at the last step; default: 0.1")
    o.add_argument("--weight-decay", type=float, default=0.1,
                   help="AdamW weight decay of the matrices; default: 0.1")
    o.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip (0: off); default: 1.0")
    r = ap.add_argument_group("evaluation, output, checkpoints")
    r.add_argument("--val-every", type=int, default=None, help=_from_preset("val_every", "steps between validations; "))
    r.add_argument("--val-batches", type=int, default=None, help=_from_preset("val_batches", "validation batches; "))
    r.add_argument("--log-every", type=int, default=None, help=_from_preset("log_every", "steps between log lines; "))
    r.add_argument("--timing-warmup", type=int, default=10,
                   help="first steps left out of tokens/s; default: 10")
    r.add_argument("--guard-every", type=int, default=0,
                   help="also run the fresh-layer check (a new MoE layer with the trained state must give "
                        "identical outputs) every N steps; default: 0, at the end only")
    r.add_argument("--json", default=None,
                   help="write the run (configuration, every step's loss, validation curve, speed, "
                        "counters, guards) to this file; default: none")
    r.add_argument("--name", default=None,
                   help="run name in the JSON; default: the recipe (torch-bf16 with --moe torch, "
                        "-frozen appended with --freeze-experts)")
    r.add_argument("--ckpt-dir", default=None,
                   help="write <dir>/last.pt every --ckpt-every steps and at the end; default: none")
    r.add_argument("--ckpt-every", type=int, default=500, help="steps between checkpoints; default: 500")
    r.add_argument("--resume", action="store_true",
                   help="continue from <ckpt-dir>/last.pt when it exists; default: off")
    r.add_argument("--stop-after", type=int, default=None,
                   help="train at most this many steps in this invocation, checkpoint, and exit "
                        "(--resume continues; the schedule stays that of --steps); default: no limit")
    r.add_argument("--quiet", action="store_true", help="print nothing; default: off")
    return ap.parse_args(argv)


def _usage_error(msg):
    """A mistake in the arguments: one line, argparse's form, exit status 2 (no traceback)."""
    print(f"flowmoe.train: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _check_device(name):
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        _usage_error(f"--device {name}: not a device; expected cpu or cuda (cuda:N)")
    if dev.type not in ("cpu", "cuda"):
        _usage_error(f"--device {name}: expected cpu or cuda (cuda:N)")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            _usage_error(f"--device {name}: PyTorch sees no GPU (torch.cuda.is_available() is False); expected "
                         "--device cpu (the default here) or a machine with a CUDA GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            _usage_error(f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s)")


def _check_model(cfg, args):
    """The model's sizes, checked before anything is built (each mistake: one line)."""
    for k in ("layers", "hidden", "heads", "ffn", "experts", "topk", "seq_len"):
        if getattr(cfg, k) < 1:
            _usage_error(f"--{k.replace('_', '-')} {getattr(cfg, k)}: expected a positive integer")
    if args.moe == "flowmoe":
        for k, v in (("hidden", cfg.hidden), ("ffn", cfg.ffn)):
            if v % 128:
                near = sorted({max(128, v // 128 * 128), (v // 128 + 1) * 128})
                _usage_error(f"--{k} {v}: flowmoe's MoE layer takes a multiple of 128 (its 1x128 FP8 tiles and "
                             f"128x128 weight blocks); expected e.g. {' or '.join(map(str, near))}")
    if cfg.topk > cfg.experts:
        _usage_error(f"--topk {cfg.topk}: more than the {cfg.experts} experts")
    try:
        cfg.validate()
    except ValueError as e:
        _usage_error(f"--hidden {cfg.hidden} / --heads {cfg.heads}: {e}")


def resolve(args):
    """Fills the defaults of the chosen configuration; returns (LMConfig, hyper-parameters)."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    _check_device(args.device)
    if args.tiny and args.small:
        _usage_error("--tiny and --small exclude each other")
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
    _check_model(cfg, args)
    for k in ("batch", "steps", "lr", "warmup", "val_every", "val_batches", "log_every"):
        if getattr(args, k) is None:
            setattr(args, k, base[k])
    if args.steps < 1 or args.batch < 1:
        _usage_error(f"--steps {args.steps} --batch {args.batch}: expected both >= 1")
    if args.name is None:
        args.name = args.recipe if args.moe == "flowmoe" else f"torch-{args.recipe}"
        if args.freeze_experts:
            args.name += "-frozen"
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


def save_checkpoint(path, model, opt, state, guard):
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "state": state,
                "guard": guard.state_dict()}, tmp)
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
    if args.freeze_experts:
        model.freeze_experts()
    guard = MoEGuard(model, frozen=args.freeze_experts)  # the initial weights, before any resume
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
            if "guard" in ck:
                guard.load_state_dict(ck["guard"])
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
        guard.after_step(ok)
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
        if args.guard_every and state["step"] % args.guard_every == 0 and state["step"] != stop_at:
            bad = [c for c in guard.fresh_check(state["step"]) if c != "identical"]
            if bad:
                log(f"# guard: at step {state['step']} a fresh layer with the trained state computes "
                    f"other outputs ({bad[0]}); the run will fail at its end")
        if ckpt_path and (state["step"] % args.ckpt_every == 0 or last or state["step"] == stop_at):
            save_checkpoint(ckpt_path, model, opt, state, guard)
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
    # the guards (train_guards.py): after the figures above, so the check's layers count in none
    guard.fresh_check(state["step"])
    result["frozen_experts"] = bool(args.freeze_experts)
    result["moe_guard"] = guard.report()
    result["weight_updates_per_layer"] = [e["weight_updates"] for e in result["moe_guard"]["layers"]]
    if args.json:
        d = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(d, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f)
    summary(result, args, cfg, log)
    if not result["moe_guard"]["ok"]:
        raise GuardFailure("the MoE guards failed:\n  " + "\n  ".join(result["moe_guard"]["failures"])
                           + (f"\n(every layer's guard fields are in {args.json})" if args.json else ""))
    return result


def summary(r, args, cfg, log):
    """The run's ending, for a person: what was trained on what, the loss against the uniform
    byte model, the guards, where the results went, what to try next."""
    cuda = str(args.device).startswith("cuda")
    impl = ("flowmoe's MoE layer (flowmoe.torch.MoE)" if args.moe == "flowmoe"
            else "the plain PyTorch BF16 MoE (flowmoe.reference_moe)")
    frozen = ", experts and routers frozen" if args.freeze_experts else ""
    done = len(r["train_loss"])
    cpu = f"the CPU ({torch.get_num_threads()} threads)"

    def item(label, text):
        log(textwrap.fill(text, width=100, initial_indent=f"  {label:<10}", subsequent_indent=" " * 12,
                          break_on_hyphens=False))

    log("")
    log("# summary")
    item("trained", f"the {args.config_name} model ({cfg.layers} blocks, H {cfg.hidden}, {cfg.experts} experts "
         f"of F {cfg.ffn}, top-{cfg.topk}; {r['params_total'] / 1e6:.1f}M parameters) with {impl}, "
         f"recipe {args.recipe}{frozen}")
    item("on", f"{r['device'] if cuda else cpu}: {done} steps of {args.batch} x {cfg.seq_len} "
         f"bytes in {fmt_time(r['train_seconds'])}, {r['tokens_per_s']:,.0f} tokens/s")
    item("data", r["data"]["description"])
    if r["train_loss"]:
        if r["final_val_loss"] is not None:
            end = f"{r['final_val_loss']:.2f} on held-out text after step {done}"
        else:
            end = (f"{r['train_loss'][-1]:.2f} (training loss; stopped at step {done} of {args.steps}, "
                   "continue with --resume)")
        item("loss", f"{r['train_loss'][0]:.2f} at step 1 -> {end}, in nats per byte; a model that "
             f"guesses every byte uniformly scores ln 256 = {math.log(256):.2f}")
    g = r["moe_guard"]
    if g["ok"]:
        item("experts", train_guards.summary_line(g))
    else:
        item("experts", f"GUARD FAILED: {len(g['failures'])} finding(s), see the error below")
    if args.moe == "flowmoe":
        num = f"{r['nonfinite']:,} non-finite values, {r['skipped_steps']} skipped steps"
        if r["underflow"]:
            num += (f"; underflow {r['underflow']:,}: values the exact FP8 conversions rounded into the "
                    "E4M3 subnormals or to zero (expected; docs/NUMERICS.md)")
        item("numerics", num)
    if cuda:
        item("memory", f"peak {r['peak_memory_bytes'] / 2**30:.2f} GiB in PyTorch's allocator; "
                       f"{(r['device_memory_used_bytes'] or 0) / 2**30:.2f} GiB used on the device, "
                       "flowmoe's workspaces included")
    outs = [f"curves (every step's loss, the validations) in {args.json}" if args.json
            else "no JSON (--json FILE writes the curves)",
            f"checkpoint {os.path.join(args.ckpt_dir, 'last.pt')}" if args.ckpt_dir
            else "no checkpoint (--ckpt-dir DIR keeps one)"]
    item("output", "; ".join(outs))
    item("next", next_command(args))


def next_command(args):
    """One command to try next, with what it shows."""
    if args.moe == "torch":
        return "python -m flowmoe.train --recipe flow   (the same model with flowmoe's FP8 layer)"
    if not str(args.device).startswith("cuda"):
        other = "bf16" if args.recipe != "bf16" else "flow"
        return (f"python -m flowmoe.train --recipe {other}   (the same run with the {other} recipe, to "
                "compare; on a Hopper GPU the same command trains the small 170M-parameter model)")
    other = "flow-fp4" if args.recipe != "flow-fp4" else "flow"
    return (f"python -m flowmoe.train --recipe {other} --json {other}.json   (the same run with the "
            f"{other} recipe; bench/convergence/run.sh compares every recipe)")


def main(argv=None):
    args = parse_args(argv)
    try:
        run(args)
    except (FileNotFoundError, ImportError) as err:  # no corpus / no native layer: say what to do
        print(f"flowmoe.train: error: {err}", file=sys.stderr)
        return 2
    except GuardFailure as err:  # experts not trained or stale weights: the run's result is void
        print(f"flowmoe.train: error: {err}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
