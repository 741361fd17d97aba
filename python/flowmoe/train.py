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

import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import textwrap
import time

from ._errors import require_torch

try:  # where PyTorch is missing: one line naming pip install '.[torch]' (also for --help)
    require_torch("python -m flowmoe.train")
except ImportError as e:
    if __name__ != "__main__":
        raise
    sys.exit(f"flowmoe.train: {e}")
import torch  # noqa: E402

from . import data as data_mod
from . import train_guards
from .lm import LMConfig, MoELM
from .train_guards import GuardFailure, MoEGuard
# (RECIPES, SMALL, TINY stay importable from flowmoe.train: bench/convergence uses them)
from .train_args import (RECIPES, SMALL, TINY, check_model, model_sizes, parse_args,  # noqa: F401
                         preset, usage_error)


def _check_device(name):
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        usage_error(f"--device {name}: not a device; expected cpu or cuda (cuda:N)")
    if dev.type not in ("cpu", "cuda"):
        usage_error(f"--device {name}: expected cpu or cuda (cuda:N)")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            usage_error(f"--device {name}: PyTorch sees no GPU (torch.cuda.is_available() is False); expected "
                         "--device cpu (the default here) or a machine with a CUDA GPU")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            usage_error(f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s)")


def resolve(args):
    """Fills the defaults of the chosen configuration; returns (LMConfig, hyper-parameters)."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    _check_device(args.device)
    base = preset(args, args.device)
    args.config_name = "tiny" if base is TINY else "small"
    if args.precision is None:
        args.precision = "bf16" if args.device.startswith("cuda") else "fp32"
    if args.recipe is None:
        args.recipe = "bf16" if args.moe == "torch" else "flow"
    model = model_sizes(args, base)
    cfg = LMConfig(router=args.router, renormalize=args.renormalize, aux_loss_coef=args.aux_loss_coef,
                   transpose_exponent=args.exponent, **model)
    check_model(cfg, args)
    for k in ("batch", "steps", "lr", "warmup", "val_every", "val_batches", "log_every"):
        if getattr(args, k) is None:
            setattr(args, k, base[k])
    if args.steps < 1 or args.batch < 1:
        usage_error(f"--steps {args.steps} --batch {args.batch}: expected both >= 1")
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


# The small preset's training speed on a CPU, measured (issue 54: two cores, flowmoe's layer, recipe
# flow): 21 tokens/s, so one step of 8 x 512 tokens takes about 3 minutes and `--steps 1` with its
# validation 285 s. The tiny preset's 30 steps take under a minute there.
SMALL_CPU_TOKENS_PER_S = 21


def slow_on_cpu_note(args, device, tokens_per_step: int):
    """A warning for a run that will be slow on the CPU (the small preset): how slow, and the
    alternative; None for any other run."""
    if device.type != "cpu" or args.config_name != "small":
        return None
    step_s = tokens_per_step / SMALL_CPU_TOKENS_PER_S
    return (f"# note: the small model on a CPU is slow: about {fmt_time(step_s)} per step of {tokens_per_step} "
            f"tokens (measured on two cores: {SMALL_CPU_TOKENS_PER_S} tok/s), so {args.steps} step(s) take about "
            f"{fmt_time(args.steps * step_s)} plus validation; --tiny (the CPU preset) runs its 30 steps in "
            f"under a minute. A line follows each step.")


def run(args):
    cfg = resolve(args)
    device = torch.device(args.device)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    torch.manual_seed(args.seed)
    slow_note = slow_on_cpu_note(args, device, args.batch * cfg.seq_len)
    if slow_note:  # before anything is loaded or built: the first step's line comes minutes later
        log(textwrap.fill(slow_note, width=100, subsequent_indent="# "))

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
    if slow_note and state["step"] < stop_at:
        log(f"# step {state['step'] + 1} of {args.steps} started")
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
        if state["step"] % args.log_every == 0 or last or state["step"] == 1 or slow_note:
            times = state["step_times"][args.timing_warmup:] or state["step_times"]
            tps = tokens_per_step / statistics.median(times[-100:])
            eta = (args.steps - state["step"]) * statistics.mean(times[-100:])
            log(f"step {state['step']:>6}/{args.steps} | loss {loss_v:.4f} | aux {state['aux_loss'][-1]:.4f} | "
                f"grad {float(norm):.3f} | lr {opt.param_groups[0]['lr']:.2e} | {tps:,.0f} tok/s | "
                f"ETA {fmt_time(eta)}" + ("" if ok else " | SKIPPED (non-finite)"))
        if state["step"] % args.val_every == 0 or last:
            if slow_note:
                log(f"# validation on {len(val_batches)} batches (minutes on a CPU)")
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
