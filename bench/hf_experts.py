#!/usr/bin/env python3
"""flowmoe as a transformers experts backend against `grouped_mm` (issue 31; the figures of docs/HF.md).

Model: a transformers Qwen3-MoE causal LM built from a config (nothing downloaded) at Qwen3-30B-A3B's
MoE sizes (H 2048, 128 experts of F 768, top-8 with renormalised weights, 32 query heads and 4 KV heads
of 128) with --layers MoE layers (default 4) and a byte vocabulary (256: keeps the embedding small, so
the experts dominate). The router, attention, loss (labels = input_ids) and everything but the experts
are transformers'; only `experts_implementation` changes between rows. Every implementation of a
parameter mode starts from the same weights (the same seed, dtype and device).

A training step: forward + LM loss, backward, gradient clipping to 1.0, fused AdamW. Columns:
    tokens/s     batch x seq-len over the median step time of --reps steps after --warmup steps
                 (random bytes; torch.cuda.synchronize after every step);
    peak memory  torch.cuda.max_memory_allocated over those steps (reset before the warm-up; model,
                 optimizer state and activations), and in brackets the device memory used (total -
                 free, minus what was used before the model was built: the caching allocator's pool);
    loss         a short convergence check per seed of --conv-seeds with the first --params mode:
                 --conv-steps steps of the same batch x seq-len (peak --conv-lr after a 10% linear
                 warm-up, cosine decay to a tenth) on --conv-layers layers, initialised from the seed,
                 on text windows that depend only on (seed, step) (flowmoe.data: the same for every
                 implementation); train = mean loss of the last 10 steps, val = mean loss on fixed
                 validation windows; mean ± std over seeds, Δ of the means against the first --impls.
Parameter modes: bf16 (BF16 parameters and optimizer state) and fp32-autocast (FP32 parameters, the
step under torch.autocast(bfloat16); torch's grouped_mm is not autocast-enabled, so transformers casts
its input to the weights' dtype and grouped_mm's expert GEMMs run in FP32 there). A configuration that
fails (out of memory, an implementation this torch lacks) gets its error in the table; the others still
run. The JSON (--json) is rewritten after every configuration, so a run cut short keeps what it measured.

    python3 bench/hf_experts.py --json out.json --data shakespeare.bin --flowmoe-lib build/libflowmoe_capi.so
    python3 bench/hf_experts.py --device cpu --tiny --data docs          # smoke test (tests/python/torch)
"""

import argparse
import gc
import itertools
import json
import math
import os
import statistics
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (step_profile)
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
VOCAB = 256  # bytes
QWEN3_30B_A3B = dict(hidden_size=2048, num_experts=128, moe_intermediate_size=768, num_experts_per_tok=8,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144)
# --family gpt-oss (issue 46): gpt-oss-20b's sizes (H 2880, 32 experts of F 2880, top-4; 64 query heads,
# 8 KV heads of 64, sliding window 128 on every other layer); biased experts with the clamped SwiGLU,
# transposed weights, interleaved gate/up. The same key names as Qwen's (build_model maps them).
GPT_OSS_20B = dict(hidden_size=2880, num_experts=32, moe_intermediate_size=2880, num_experts_per_tok=4,
                   num_attention_heads=64, num_key_value_heads=8, head_dim=64, intermediate_size=2880)
GPT_OSS_TINY = dict(hidden_size=200, num_experts=4, moe_intermediate_size=72, num_experts_per_tok=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=72)
TINY = dict(hidden_size=128, num_experts=4, moe_intermediate_size=128, num_experts_per_tok=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256)
# run options: (full run, --tiny)
RUN = dict(layers=(4, 2), batch=(8, 2), seq_len=(1024, 64), warmup=(3, 1), reps=(15, 2), conv_steps=(100, 3),
           conv_seeds=([0, 1, 2], [0]), conv_layers=(2, 2), val_batches=(4, 1))
PARAMS = {"bf16": "BF16", "fp32-autocast": "FP32 + autocast"}
GiB = 2 ** 30


def import_flowmoe_hf(lib):
    """Imports flowmoe.hf (registers the flowmoe-* experts implementations). With lib (a CMake build's
    libflowmoe_capi.so): this checkout's python/ package on that library, as tests/python/torch does."""
    if lib:
        sys.path.insert(0, os.path.join(ROOT, "python"))
        import flowmoe._native

        flowmoe._native.set_library_path(os.path.abspath(lib))
    import flowmoe.hf  # noqa: F401


def model_config(dims, layers, seq_len):
    if dims.get("family") == "gpt-oss":
        return transformers.GptOssConfig(
            vocab_size=VOCAB, num_hidden_layers=layers, max_position_embeddings=max(seq_len, 2048),
            hidden_size=dims["hidden_size"], intermediate_size=dims["moe_intermediate_size"],
            num_local_experts=dims["num_experts"], num_experts_per_tok=dims["num_experts_per_tok"],
            num_attention_heads=dims["num_attention_heads"], num_key_value_heads=dims["num_key_value_heads"],
            head_dim=dims["head_dim"])
    return transformers.Qwen3MoeConfig(vocab_size=VOCAB, num_hidden_layers=layers, norm_topk_prob=True,
                                       max_position_embeddings=max(seq_len, 2048),
                                       **{k: v for k, v in dims.items() if k != "family"})


def build_model(dims, layers, seq_len, impl, params, seed, device, attn=None):
    cfg = model_config(dims, layers, seq_len)
    torch.manual_seed(seed)
    # attn None: gpt-oss (attention sinks) has no SDPA path in transformers: its eager attention
    # (--attn flex_attention: transformers' flex path, which takes the sinks)
    if attn is None:
        attn = "eager" if dims.get("family") == "gpt-oss" else "sdpa"
    with torch.device(device):  # initialised where it runs: the same weights for every implementation
        return transformers.AutoModelForCausalLM.from_config(
            cfg, experts_implementation=impl, attn_implementation=attn,
            dtype=torch.bfloat16 if params == "bf16" else torch.float32)


def count_parameters(dims, layers, seq_len):
    model = build_model(dims, layers, seq_len, "eager", "bf16", 0, "meta")  # shapes only
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return sum(p.numel() for p in model.parameters()), experts


def train_step(model, opt, ids, autocast):
    opt.zero_grad(set_to_none=True)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.detach()


def check_flowmoe_ran(model, impl):
    """A flowmoe row whose experts did not run flowmoe's layer would time something else."""
    if impl.startswith("flowmoe") and not any(getattr(m, "_flowmoe_options", None) is not None for m in model.modules()):
        raise RuntimeError(f"experts_implementation={impl!r} did not run flowmoe's layer")


def device_used(device):
    free, total = torch.cuda.mem_get_info(device) if device.type == "cuda" else (0, 0)
    return total - free


class Skip(Exception):
    """Raised by a measure that cannot run here (a package or device it needs is missing): attempt
    records its message as record["skipped"], not as an error."""


def attempt(record, label, measure, describe, device):
    """record.update(measure()); a failure (out of memory, an implementation this torch lacks) is
    recorded as record["error"] instead, and the other configurations still run."""
    try:
        record.update(measure())
        print(f"# {label}: {describe(record)}", flush=True)
    except Skip as e:
        record["skipped"] = str(e)
        print(f"# {label}: skipped: {e}", flush=True)
    except Exception as e:
        lines = str(e).strip().splitlines()
        record["error"] = f"{type(e).__name__}: {lines[0][:160] if lines else ''}"
        print(f"# {label}: {record['error']}", flush=True)
    gc.collect()  # the model and optimizer of this configuration (a failed one's too) before the next
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def measure_speed(args, dims, impl, params, device, checkpointing=False):
    used_before = device_used(device)
    model = build_model(dims, args.layers, args.seq_len, impl, params, 0, device, args.attn)
    if checkpointing:
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    ids = torch.randint(0, VOCAB, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for i in range(args.warmup + args.reps):
        t0 = time.perf_counter()
        loss = train_step(model, opt, ids, params == "fp32-autocast")
        if cuda:
            torch.cuda.synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    check_flowmoe_ran(model, impl)
    step = statistics.median(times)
    out = {"step_ms": 1e3 * step, "tokens_per_s": args.batch * args.seq_len / step, "losses": losses,
           "peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
           "device_used_bytes": device_used(device) - used_before if cuda else None}
    if args.profile and cuda:
        import step_profile

        autocast = params == "fp32-autocast"
        state = {}

        def forward():
            opt.zero_grad(set_to_none=True)
            with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
                state["loss"] = model(input_ids=ids, labels=ids).loss

        out["profile"] = step_profile.profile_phases(
            [("forward", forward), ("backward", lambda: state.pop("loss").backward()),
             ("clip", lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)), ("optimizer", opt.step)],
            device)
        print(step_profile.format_phases(out["profile"]), flush=True)
    return out


def lr_factor(steps):
    warmup = max(1, steps // 10)

    def factor(step):  # linear warm-up to the peak, cosine decay to a tenth of it
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
    return factor


def convergence_run(args, dims, corpus, impl, params, seed, device):
    model = build_model(dims, args.conv_layers, args.seq_len, impl, params, seed, device, args.attn)
    opt = torch.optim.AdamW(model.parameters(), lr=args.conv_lr, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(args.conv_steps))
    autocast = params == "fp32-autocast"
    losses = []
    for step in range(args.conv_steps):
        ids, _ = corpus.batch(step, args.batch, args.seq_len, seed)  # a function of (seed, step) only
        losses.append(float(train_step(model, opt, ids, autocast)))
        sched.step()
    check_flowmoe_ran(model, impl)
    model.eval()
    val = []
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        for ids, _ in corpus.val_batches(args.val_batches, args.batch, args.seq_len):
            val.append(float(model(input_ids=ids, labels=ids).loss))
    return {"losses": losses, "train_loss": statistics.fmean(losses[-10:]), "val_loss": statistics.fmean(val)}


def summarise(runs, impls):
    """Per implementation: [mean, std, Δ % of the mean against impls[0]'s] over the seeds that ran, of the
    train and the val loss."""
    out = {}
    for impl in impls:
        ok = [r for r in runs if r["impl"] == impl and "error" not in r]
        if ok:
            out[impl] = {"seeds": len(ok), **{k: [statistics.fmean(r[k] for r in ok), statistics.stdev(
                r[k] for r in ok) if len(ok) > 1 else 0.0, None] for k in ("train_loss", "val_loss")}}
    for s in out.values():
        for k in ("train_loss", "val_loss"):
            if impls[0] in out:
                s[k][2] = 100 * (s[k][0] / out[impls[0]][k][0] - 1)
    return out


def load_corpus(path, device, seq_len):
    """flowmoe.data's corpus (path: a prepared .bin, a text file or directory; None: the installed
    shakespeare package) on device, checked to hold a window of seq_len."""
    import flowmoe.data

    corpus = flowmoe.data.load(path).to(device)
    corpus.check_window(seq_len)
    return corpus


def convergence(args, dims, device, result, save):
    """The convergence check of every seed and implementation into result["convergence"]."""
    conv = result["convergence"] = {"params": args.params[0], "runs": []}

    def load():
        corpus = load_corpus(args.data, device, args.seq_len)
        return {"corpus": corpus, "data": corpus.description}

    if "error" in attempt(conv, "convergence", load, lambda c: c["data"], device):
        return  # no corpus: the timings still stand
    corpus = conv.pop("corpus")  # (not for the JSON)
    print(f"# convergence: {args.conv_layers} layers, {args.conv_steps} steps, peak lr {args.conv_lr}, seeds "
          f"{args.conv_seeds}, {PARAMS[args.params[0]]} parameters", flush=True)
    for seed in args.conv_seeds:
        for impl in args.impls:
            conv["runs"].append(attempt(
                {"impl": impl, "seed": seed}, f"{impl} seed {seed}",
                lambda: convergence_run(args, dims, corpus, impl, args.params[0], seed, device),
                lambda r: f"train {r['train_loss']:.4f}, val {r['val_loss']:.4f}", device))
            save()
    conv["summary"] = summarise(conv["runs"], args.impls)
    save()


def loss_cell(s, errors):
    if s is None:
        return "error: " + errors[0] if errors else "–"
    (tm, ts, td), (vm, vs, vd) = s["train_loss"], s["val_loss"]
    return f"train {tm:.3f} ± {ts:.3f}, val {vm:.3f} ± {vs:.3f}" + (
        f" (Δ {td:+.2f}% / {vd:+.2f}%)" if td is not None else "")


def table(result, args):
    conv = result.get("convergence", {})
    summary = conv.get("summary", {})
    lines = [f"| experts_implementation | parameters | checkpointing | tokens/s | peak memory (device used) | "
             f"loss after {args.conv_steps} steps ({len(args.conv_seeds)} seeds) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in result["speed"]:
        if "error" in r:
            speed, mem = "error: " + r["error"], "–"
        else:
            speed = f"{r['tokens_per_s']:,.0f}"
            mem = "–" if r["peak_allocated_bytes"] is None else \
                f"{r['peak_allocated_bytes'] / GiB:.1f} GiB ({r['device_used_bytes'] / GiB:.1f})"
        loss = "–"
        if conv and r["params"] == conv["params"]:
            errors = [conv["error"]] if "error" in conv else \
                [x["error"] for x in conv["runs"] if x["impl"] == r["impl"] and "error" in x]
            loss = loss_cell(summary.get(r["impl"]), errors)
        lines.append(f"| `{r['impl']}` | {PARAMS[r['params']]} | {r.get('checkpointing', 'off')} | {speed} | {mem} "
                     f"| {loss} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impls", nargs="+", default=["grouped_mm", "flowmoe-flow", "flowmoe-flow-fp4"],
                    help="experts implementations; the first is the reference of the loss Δ")
    ap.add_argument("--params", nargs="+", choices=sorted(PARAMS), default=["bf16", "fp32-autocast"])
    for name in RUN:
        ap.add_argument("--" + name.replace("_", "-"), type=int, nargs="+" if name == "conv_seeds" else None,
                        default=None, help=f"default {RUN[name][0]} ({RUN[name][1]} with --tiny)")
    ap.add_argument("--lr", type=float, default=3e-4, help="learning rate of the timed steps")
    ap.add_argument("--conv-lr", type=float, default=5e-4, help="peak learning rate of the convergence check")
    ap.add_argument("--data", default=None, help="corpus for the convergence check (flowmoe.data.load: a "
                    "prepared .bin, a text file or directory; default: the installed shakespeare package)")
    ap.add_argument("--checkpointing", nargs="+", choices=["off", "on"], default=["off"],
                    help="timed steps without / with model.gradient_checkpointing_enable()")
    ap.add_argument("--profile", action="store_true", help="after the timed steps, the kernel time of one step by "
                    "phase and kind (bench/step_profile.py)")
    ap.add_argument("--skip-conv", action="store_true", help="timings only")
    ap.add_argument("--tiny", action="store_true", help="tiny model and run (CPU smoke test)")
    ap.add_argument("--family", choices=["qwen3-moe", "gpt-oss"], default="qwen3-moe",
                    help="the model: Qwen3-30B-A3B's MoE sizes or gpt-oss-20b's (issue 46)")
    ap.add_argument("--attn", default=None, help="the model's attn_implementation (default: sdpa, gpt-oss eager; "
                    "e.g. flex_attention, which serves gpt-oss's sinks)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--flowmoe-lib", default=None, help="libflowmoe_capi.so to use (with this checkout's python/)")
    ap.add_argument("--json", default=None, help="write every raw number here")
    args = ap.parse_args(argv)
    for name, (full, tiny) in RUN.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    device = torch.device(args.device)
    import_flowmoe_hf(args.flowmoe_lib)
    if args.family == "gpt-oss":
        dims = dict(GPT_OSS_TINY if args.tiny else GPT_OSS_20B, family="gpt-oss")
    else:
        dims = TINY if args.tiny else QWEN3_30B_A3B
    total, experts = count_parameters(dims, args.layers, args.seq_len)
    env = {"torch": torch.__version__, "transformers": transformers.__version__,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    print(f"# {'gpt-oss' if args.family == 'gpt-oss' else 'Qwen3-MoE'} causal LM (transformers {env['transformers']}, torch {env['torch']}, {env['device']}): "
          f"{args.layers} layers, H {dims['hidden_size']}, {dims['num_experts']} experts of F "
          f"{dims['moe_intermediate_size']}, top-{dims['num_experts_per_tok']}, {dims['num_attention_heads']} "
          f"heads / {dims['num_key_value_heads']} KV of {dims['head_dim']}, vocab {VOCAB} (bytes: a small "
          f"embedding); {total / 1e6:,.1f}M parameters ({experts / 1e6:,.1f}M in experts); {args.batch} x "
          f"{args.seq_len} = {args.batch * args.seq_len} tokens per step; median of {args.reps} steps after "
          f"{args.warmup}; fused AdamW", flush=True)
    result = {"env": env, "dims": dims, "args": vars(args), "parameters": total, "expert_parameters": experts,
              "speed": []}

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

    for params, ckpt, impl in itertools.product(args.params, args.checkpointing, args.impls):
        result["speed"].append(attempt(
            {"impl": impl, "params": params, "checkpointing": ckpt}, f"{impl} {params} checkpointing {ckpt}",
            lambda: measure_speed(args, dims, impl, params, device, ckpt == "on"),
            lambda r: f"{r['step_ms']:.1f} ms/step, {r['tokens_per_s']:,.0f} tokens/s, losses "
                      f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}", device))
        save()

    if not args.skip_conv:
        convergence(args, dims, device, result, save)
    print(table(result, args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
