#!/usr/bin/env python3
# Device run (a GPU machine without internet; liger-kernel, torchao and trl travel as wheels in .whl/ at
# the repository root, an ignored folder the run must carry):
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   python3 bench/hf_stack.py --flowmoe-lib .devbuild/libflowmoe_capi.so --json $OUT/stack.json
#
# CPU smoke run (tests/python/torch/test_bench_hf_stack.py):
#
#   python3 bench/hf_stack.py --tiny --device cpu --json /tmp/stack.json
"""flowmoe inside the Hugging Face fine-tuning stack against `grouped_mm` (issue 53; docs/HF.md, "Fine-tuning stacks").

Model: bench/hf_experts.py's transformers Qwen3-MoE causal LM built from a config (nothing downloaded) at
Qwen3-30B-A3B's MoE sizes (H 2048, 128 experts of F 768, top-8 renormalised, 32 query / 4 KV heads of
128), --layers layers (default 4), a byte vocabulary (256), BF16 parameters, SDPA attention. Every row
starts from the same weights (seed 0) and trains on the same text windows (flowmoe.data: --data, default
this repository's docs/; step s's windows depend only on s), so the losses of the implementations of a
scenario are comparable. A step: forward + LM loss (labels = input_ids), backward, gradient clipping to
1.0, AdamW (fused) over the trainable parameters at --lr.

Scenarios (each for every --impls, default `grouped_mm` and `flowmoe-flow`):
    liger         liger_kernel.transformers.apply_liger_kernel_to_qwen3_moe(model=..., swiglu=False): Liger's
                  RoPE, RMSNorm (every norm, q_norm / k_norm included) and fused linear cross-entropy (the
                  causal-LM forward; no logits in training). swiglu=False because Liger's default swiglu=True
                  binds its own fused MoE (LigerExperts.forward) to every experts module, which bypasses
                  experts_implementation: neither grouped_mm nor flowmoe would run. The row records
                  whether the experts still dispatch through experts_implementation ("experts").
                  Full fine-tuning. transformers' qwen3_moe module, which the patch changes globally, is
                  put back after the row.
    lora-attn     PEFT LoRA (r --lora-r, alpha 2r, no dropout) on q_proj, k_proj, v_proj, o_proj; everything
                  else, the experts and routers included, frozen. The adapters are FP32 (PEFT's default over
                  BF16 weights); on the experts the delta is cast to the weights' BF16 before they are called.
    lora-experts  the same LoRA on the attention projections and on the experts through
                  target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] (PEFT >= 0.17:
                  the experts are called with W + s·B·A, rank r per expert). Attention and experts together
                  is the usual recipe for MoE models (as for gpt-oss, whose recipe targets every linear layer
                  plus the expert parameters); the routers stay frozen.
    float8-dense  torchao.float8.convert_to_float8_training (recipe --float8-recipe, default tensorwise) on
                  the nn.Linear layers whose sizes are multiples of 16 and that are neither experts nor
                  routers: q/k/v/o and lm_head (2048 x 256 fits); Qwen3-MoE's router is not an nn.Linear
                  and its experts are 3D parameters, so both stay BF16 (the filter also excludes them by name).
                  Full fine-tuning. Eager unless --float8-compile (torch.compile of each attention block,
                  where torchao's casts fuse; the experts stay outside the compiled graphs).
    plain         none of the above (full fine-tuning; bench/hf_experts.py's row), only with --scenarios.

Columns: tokens/s = batch x seq-len over the median step time of --reps steps after --warmup steps
(torch.cuda.synchronize after each); peak = torch.cuda.max_memory_allocated over those steps (reset
after the model, the scenario and the optimizer are built, before the warm-up); the loss of the last of
the warmup + reps steps and the mean loss on --val-batches fixed validation windows after them (model.eval,
no grad); the trainable parameter count. A scenario whose package is not importable, or that cannot run
on this device (Liger's Triton kernels need CUDA; torchao float8 needs CUDA where torch has no CPU
float8 _scaled_mm), records why under "skipped"; one that fails (out of memory, unsupported) records
its error under "error"; the others still run. The JSON (--json) is rewritten after every row.

Wheels for a machine without internet (liger-kernel 0.8.5, torchao 0.17.0, trl 1.16.0, and trl's needs
datasets 4.8.5, dill 0.4.1, multiprocess 0.70.19: see the comment block above), installed without
their dependencies so that no second torch comes in:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
"""

import argparse
import contextlib
import importlib
import importlib.metadata
import json
import math
import os
import statistics
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_experts as hx  # noqa: E402  (the model, its sizes, the flowmoe import, attempt / Skip)

SCENARIOS = ("liger", "lora-attn", "lora-experts", "float8-dense", "plain")
DEFAULT_SCENARIOS = ["liger", "lora-attn", "lora-experts", "float8-dense"]
# the module each scenario needs and its pip name
PACKAGES = {"liger": ("liger_kernel.transformers", "liger-kernel"), "lora-attn": ("peft", "peft"),
            "lora-experts": ("peft", "peft"), "float8-dense": ("torchao.float8", "torchao")}
# run options: (full run, --tiny)
RUN = dict(layers=(4, 2), batch=(4, 2), seq_len=(2048, 64), warmup=(3, 1), reps=(10, 2), val_batches=(1, 1))
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# swiglu=False: the experts stay experts_implementation's (see the docstring); the rest is Liger's default
LIGER_OPTIONS = dict(rope=True, rms_norm=True, fused_linear_cross_entropy=True, cross_entropy=False, swiglu=False)
GiB = 2 ** 30


def require(scenario):
    """The scenario's package module, or Skip naming what to install."""
    if scenario not in PACKAGES:
        return None
    module, pip_name = PACKAGES[scenario]
    try:
        return importlib.import_module(module)
    except Exception as e:  # ImportError, or liger's triton / torchao's torch missing something
        raise hx.Skip(f"{pip_name} is not importable ({type(e).__name__}: {str(e).splitlines()[0][:120]}): "
                      f"pip install {pip_name}") from e


def versions():
    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    for name in ("peft", "liger-kernel", "torchao", "accelerate", "trl"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


@contextlib.contextmanager
def restored_qwen3_moe():
    """Liger's patch replaces names in transformers' qwen3_moe module (RoPE, RMSNorm, the experts class,
    the causal-LM forward) even when given a model instance: put them back afterwards, so that the
    models of later rows are unpatched (as tests/python/torch/test_hf_liger.py does)."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as mod

    saved = dict(vars(mod))
    forward = mod.Qwen3MoeForCausalLM.forward
    cross_entropy = torch.nn.functional.cross_entropy
    try:
        yield mod
    finally:
        for k in [k for k in vars(mod) if k not in saved]:
            delattr(mod, k)
        for k, v in saved.items():
            if vars(mod).get(k) is not v:
                setattr(mod, k, v)
        mod.Qwen3MoeForCausalLM.forward = forward
        torch.nn.functional.cross_entropy = cross_entropy


def experts_record(model):
    """Whether every experts module still dispatches through experts_implementation: its forward is
    transformers' dispatching one (transformers/integrations/moe.py, set on the class by
    @use_experts_implementation) and no forward is bound to the instance (Liger's swiglu=True binds
    LigerExperts.forward there). flowmoe_layers: modules on which flowmoe built its layer (after a step)."""
    from transformers.integrations import moe as hf_moe

    moe_file = os.path.splitext(os.path.normpath(hf_moe.__file__))[0]
    # the experts modules themselves, not PEFT's wrappers around them (which have get_base_layer)
    mods = [m for m in model.modules() if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor)
            and not hasattr(m, "get_base_layer")]

    def dispatches(m):
        code = getattr(type(m).forward, "__code__", None)
        return ("forward" not in vars(m) and code is not None
                and os.path.splitext(os.path.normpath(code.co_filename))[0] == moe_file)

    n = sum(dispatches(m) for m in mods)
    return {"modules": len(mods), "names": sorted({m._get_name() for m in mods}),
            "implementation": sorted({str(getattr(getattr(m, "config", None), "_experts_implementation", None))
                                      for m in mods}),
            "dispatching": n, "use_experts_implementation": bool(mods) and n == len(mods),
            "flowmoe_layers": sum(getattr(m, "_flowmoe_options", None) is not None for m in mods)}


def float8_filter(module, fqn):
    """torchao's module filter: dense nn.Linear layers whose sizes _scaled_mm takes (multiples of 16),
    never an expert or router (Qwen3-MoE's are not nn.Linear anyway; by name for other models)."""
    if not isinstance(module, torch.nn.Linear):
        return False
    if "experts" in fqn or "router" in fqn or fqn.endswith("mlp.gate"):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def cpu_float8_matmul():
    """Whether this torch multiplies float8 on the CPU as torchao's Float8Linear does (torch._scaled_mm,
    row-major x column-major E4M3 with FP32 scales; torch 2.15 can): the smoke run then trains the
    float8-dense rows too. Without it torchao's float8 training needs CUDA."""
    try:
        a = torch.ones(16, 16).to(torch.float8_e4m3fn)
        b = torch.ones(16, 16).to(torch.float8_e4m3fn).t()
        one = torch.tensor(1.0)
        return bool(torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)[0, 0] == 16)
    except Exception:  # (RuntimeError / NotImplementedError: no CPU kernel in this torch)
        return False


def prepare(scenario, model, pkg, args, device, stack):
    """Applies the scenario to a freshly built model. Returns (model, info): the model to train (PEFT
    wraps it) and what was applied; info["skipped"] if it cannot train on this device."""
    cuda = device.type == "cuda"
    if scenario == "liger":
        stack.enter_context(restored_qwen3_moe())
        pkg.apply_liger_kernel_to_qwen3_moe(model=model, **LIGER_OPTIONS)
        info = {"liger": dict(LIGER_OPTIONS), "causal_lm_forward": getattr(model.forward, "__module__", None)}
        if not cuda:
            info["skipped"] = ("Liger's kernels are Triton GPU kernels: on a CPU the patch is applied and the "
                               "experts checked, no step runs")
        return model, info
    if scenario in ("lora-attn", "lora-experts"):
        kw = dict(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0, target_modules=list(ATTENTION))
        if scenario == "lora-experts":
            if "target_parameters" not in getattr(pkg.LoraConfig, "__dataclass_fields__", {}):
                raise hx.Skip(f"peft {versions()['peft']} has no LoraConfig(target_parameters=...) for the "
                              "experts' 3D parameters: PEFT >= 0.17 needed (pip install -U peft)")
            kw["target_parameters"] = list(EXPERT_PARAMS)
        torch.manual_seed(1)  # LoRA A's initialisation: the same for every implementation
        model = pkg.get_peft_model(model, pkg.LoraConfig(**kw))
        lora = [p for n, p in model.named_parameters() if "lora_" in n]
        return model, {"lora": {k: v for k, v in kw.items()}, "lora_tensors": len(lora),
                       "lora_dtype": str(lora[0].dtype) if lora else None}
    if scenario == "float8-dense":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(args.float8_recipe)
        convert_to_float8_training(model, module_filter_fn=float8_filter, config=config)
        converted = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
        info = {"float8": {"recipe": args.float8_recipe, "modules": len(converted),
                           "lm_head": "lm_head" in converted, "compiled_attention": args.float8_compile,
                           "kept": sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                                           if isinstance(m, torch.nn.Linear) and n not in converted})}}
        if not converted:
            raise RuntimeError("the float8 filter converted no nn.Linear layer")
        if not cuda and not cpu_float8_matmul():
            info["skipped"] = ("torchao float8 training needs torch._scaled_mm, which this torch has only on "
                               "CUDA (SM89+): on the CPU the layers are converted and counted, no step runs")
            return model, info
        if args.float8_compile:
            for layer in model.model.layers:
                layer.self_attn.compile()
        return model, info
    return model, {}  # plain


def measure(args, dims, corpus, scenario, impl, device):
    pkg = require(scenario)  # (before the model is built: a missing package costs nothing)
    cuda = device.type == "cuda"
    with contextlib.ExitStack() as stack:
        model = hx.build_model(dims, args.layers, args.seq_len, impl, "bf16", 0, device)
        model.train()  # (Liger's fused cross-entropy skips the logits only in training mode)
        model, info = prepare(scenario, model, pkg, args, device, stack)
        info["experts"] = experts_record(model)
        info["total_parameters"] = sum(p.numel() for p in model.parameters())
        trainable = [p for p in model.parameters() if p.requires_grad]
        info["trainable_parameters"] = sum(p.numel() for p in trainable)
        if "skipped" in info:
            return info
        opt = torch.optim.AdamW(trainable, lr=args.lr, fused=True)
        steps = args.warmup + args.reps
        batches = [corpus.batch(s, args.batch, args.seq_len, 0)[0] for s in range(steps)]
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        times, losses = [], []
        for i, ids in enumerate(batches):
            t0 = time.perf_counter()
            loss = hx.train_step(model, opt, ids, False)
            if cuda:
                torch.cuda.synchronize(device)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
            losses.append(float(loss))
        peak = torch.cuda.max_memory_allocated(device) if cuda else None
        hx.check_flowmoe_ran(model, impl)
        info["experts"] = experts_record(model)  # (now with the layers flowmoe built)
        if not info["experts"]["use_experts_implementation"]:
            info["warning"] = (f"the experts no longer dispatch through experts_implementation "
                               f"({info['experts']['names']}): this row did not time {impl}")
        model.eval()
        with torch.no_grad():
            val = [float(model(input_ids=v, labels=v).loss)
                   for v, _ in corpus.val_batches(args.val_batches, args.batch, args.seq_len)]
        step = statistics.median(times)
        info.update(step_ms=1e3 * step, tokens_per_s=args.batch * args.seq_len / step, losses=losses,
                    final_loss=losses[-1], val_loss=statistics.fmean(val), peak_allocated_bytes=peak)
        del model, opt, trainable
        return info


def describe(r):
    if "skipped" in r:
        return "skipped: " + r["skipped"]
    return (f"{r['step_ms']:.1f} ms/step, {r['tokens_per_s']:,.0f} tokens/s, "
            + (f"peak {r['peak_allocated_bytes'] / GiB:.1f} GiB, " if r["peak_allocated_bytes"] else "")
            + f"trainable {r['trainable_parameters'] / 1e6:,.2f}M, losses {r['losses'][0]:.3f} -> "
            f"{r['final_loss']:.3f}, val {r['val_loss']:.3f}" + (f"; WARNING {r['warning']}" if "warning" in r else ""))


def table(result, args):
    steps = args.warmup + args.reps
    lines = [f"| scenario | experts_implementation | trainable parameters | tokens/s | vs `{args.impls[0]}` | "
             f"peak allocated | loss after {steps} steps | val loss | experts via experts_implementation |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    base = {r["scenario"]: r for r in result["rows"] if r["impl"] == args.impls[0] and "tokens_per_s" in r}
    for r in result["rows"]:
        ex = r.get("experts")
        via = "–" if ex is None else ("yes" if ex["use_experts_implementation"] else
                                      f"**no** ({', '.join(ex['names'])})")
        train = f"{r['trainable_parameters'] / 1e6:,.2f}M" if "trainable_parameters" in r else "–"
        if "tokens_per_s" not in r:
            why = ("skipped: " + r["skipped"]) if "skipped" in r else ("error: " + r.get("error", "?"))
            lines.append(f"| {r['scenario']} | `{r['impl']}` | {train} | {why} | – | – | – | – | {via} |")
            continue
        b = base.get(r["scenario"])
        ratio = f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}×" if b else "–"
        mem = "–" if r["peak_allocated_bytes"] is None else f"{r['peak_allocated_bytes'] / GiB:.1f} GiB"
        lines.append(f"| {r['scenario']} | `{r['impl']}` | {train} | {r['tokens_per_s']:,.0f} | {ratio} | {mem} | "
                     f"{r['final_loss']:.4f} | {r['val_loss']:.4f} | {via} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(DEFAULT_SCENARIOS))
    ap.add_argument("--impls", nargs="+", default=["grouped_mm", "flowmoe-flow"],
                    help="experts implementations (e.g. add flowmoe-bf16); the first is the reference of 'vs'")
    for name in RUN:
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                        help=f"default {RUN[name][0]} ({RUN[name][1]} with --tiny)")
    ap.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (every scenario)")
    ap.add_argument("--lora-r", type=int, default=16, help="LoRA rank (alpha = 2 r); per expert with lora-experts")
    ap.add_argument("--float8-recipe", default="tensorwise", help="torchao Float8LinearConfig.from_recipe_name: "
                    "tensorwise, rowwise, rowwise_with_gw_hp")
    ap.add_argument("--float8-compile", action="store_true",
                    help="float8-dense: torch.compile each attention block (where torchao's casts fuse)")
    ap.add_argument("--data", default=os.path.join(hx.ROOT, "docs"),
                    help="text to train on (flowmoe.data.load: a prepared .bin, a text file or directory; "
                         "default this repository's docs/)")
    ap.add_argument("--tiny", action="store_true", help="tiny model and run (CPU smoke test)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--flowmoe-lib", default=None, help="libflowmoe_capi.so to use (with this checkout's python/)")
    ap.add_argument("--json", default=None, help="write every raw number here (rewritten after every row)")
    args = ap.parse_args(argv)
    for name, (full, tiny) in RUN.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    device = torch.device(args.device)
    hx.import_flowmoe_hf(args.flowmoe_lib)
    dims = hx.TINY if args.tiny else hx.QWEN3_30B_A3B
    total, experts = hx.count_parameters(dims, args.layers, args.seq_len)
    env = versions()
    env["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    corpus = hx.load_corpus(args.data, device, args.seq_len)
    print(f"# Qwen3-MoE causal LM ({', '.join(f'{k} {v}' for k, v in env.items())}): {args.layers} layers, "
          f"H {dims['hidden_size']}, {dims['num_experts']} experts of F {dims['moe_intermediate_size']}, "
          f"top-{dims['num_experts_per_tok']}, vocab {hx.VOCAB}; {total / 1e6:,.1f}M parameters "
          f"({experts / 1e6:,.1f}M in experts), BF16; {args.batch} x {args.seq_len} tokens per step of "
          f"{corpus.description}; median of {args.reps} steps after {args.warmup}; fused AdamW, lr {args.lr}",
          flush=True)
    result = {"env": env, "dims": dims, "args": vars(args), "parameters": total, "expert_parameters": experts,
              "data": corpus.description, "rows": []}

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

    for scenario in args.scenarios:
        for impl in args.impls:
            result["rows"].append(hx.attempt(
                {"scenario": scenario, "impl": impl}, f"{scenario} {impl}",
                lambda: measure(args, dims, corpus, scenario, impl, device), describe, device))
            save()
    print(table(result, args), flush=True)
    bad = [r for r in result["rows"] if "error" in r or ("final_loss" in r and not math.isfinite(r["final_loss"]))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
