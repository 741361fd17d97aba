"""The training entry point's arguments (python -m flowmoe.train), without PyTorch: the presets,
the parser and the checks that need no device, so that scripts/run.sh can refuse a mistake before
it installs or builds anything (`python3 python/flowmoe/train_args.py ARGS...`, run as a file: no
package import, so no PyTorch import either; one line on stdout with what the run will use, or one
error line on stderr and exit status 2)."""

import argparse
import sys
import textwrap

try:
    from ._recipes import RECIPES
except ImportError:  # run as a file (scripts/run.sh): its folder is on sys.path
    from _recipes import RECIPES

MOE_IMPLS = ("flowmoe", "torch")  # (flowmoe.lm's, which needs torch)

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
                   help="the small preset, 170M parameters: about a minute on an H200 (default on a GPU); "
                        "on a CPU about 3 minutes per step (21 tok/s on two cores)")
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


def usage_error(msg):
    """A mistake in the arguments: one line, argparse's form, exit status 2 (no traceback)."""
    print(f"flowmoe.train: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def check_model(cfg, args):
    """The model's sizes, checked before anything is built (each mistake: one line)."""
    for k in ("layers", "hidden", "heads", "ffn", "experts", "topk", "seq_len"):
        if getattr(cfg, k) < 1:
            usage_error(f"--{k.replace('_', '-')} {getattr(cfg, k)}: expected a positive integer")
    if args.moe == "flowmoe":
        for k, v in (("hidden", cfg.hidden), ("ffn", cfg.ffn)):
            if v % 128:
                near = sorted({max(128, v // 128 * 128), (v // 128 + 1) * 128})
                usage_error(f"--{k} {v}: flowmoe's MoE layer takes a multiple of 128 (its 1x128 FP8 tiles and "
                             f"128x128 weight blocks); expected e.g. {' or '.join(map(str, near))}")
    if cfg.topk > cfg.experts:
        usage_error(f"--topk {cfg.topk}: more than the {cfg.experts} experts")
    if cfg.hidden % cfg.heads:
        usage_error(f"--hidden {cfg.hidden} / --heads {cfg.heads}: hidden {cfg.hidden} is not a multiple of heads "
                     f"{cfg.heads}")
    if (cfg.hidden // cfg.heads) % 2:
        usage_error(f"--hidden {cfg.hidden} / --heads {cfg.heads}: head dimension {cfg.hidden // cfg.heads} must be "
                     "even (rotary)")


def preset(args, device):
    """The preset a run uses: --tiny / --small, else tiny on a CPU and small on a GPU."""
    if args.tiny and args.small:
        usage_error("--tiny and --small exclude each other")
    return TINY if (args.tiny or (not args.small and device == "cpu")) else SMALL


def model_sizes(args, base):
    """The preset's model sizes with the options' overrides (a dict)."""
    model = dict(base["model"])
    for k in ("layers", "hidden", "heads", "ffn", "experts", "topk"):
        if getattr(args, k) is not None:
            model[k] = getattr(args, k)
    if args.seq_len is not None:
        model["seq_len"] = args.seq_len
    return model


def main(argv=None):
    """Checks a trainer command line as far as it can without PyTorch; prints what the run uses."""
    argv = list(sys.argv[1:] if argv is None else argv)
    gpu = "--gpu" in argv  # (scripts/run.sh: a GPU and the CUDA backend; then the default device is cuda)
    if gpu:
        argv.remove("--gpu")
    # (scripts/run.sh: --no-cuda=WHY where this run cannot use a GPU: none visible, or no CUDA backend)
    no_cuda = [a for a in argv if a.startswith("--no-cuda=")]
    for a in no_cuda:
        argv.remove(a)
    args = parse_args(argv)
    device = args.device or ("cuda" if gpu else "cpu")
    if no_cuda and device.startswith("cuda"):
        why = no_cuda[-1].split("=", 1)[1]
        usage_error(f"--device {device}: {why}; expected --device cpu (or no --device: the CPU is the default here)")
    base = preset(args, device)
    check_model(argparse.Namespace(**model_sizes(args, base)), args)
    steps = args.steps if args.steps is not None else base["steps"]
    batch = args.batch if args.batch is not None else base["batch"]
    if steps < 1 or batch < 1:
        usage_error(f"--steps {steps} --batch {batch}: expected both >= 1")
    recipe = args.recipe or ("bf16" if args.moe == "torch" else "flow")
    print(f"preset={'tiny' if base is TINY else 'small'} moe={args.moe} recipe={recipe} steps={steps} device={device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
