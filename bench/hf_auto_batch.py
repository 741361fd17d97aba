#!/usr/bin/env python3
"""transformers' Trainer(auto_find_batch_size=True) with flowmoe's experts against `grouped_mm` (issue 44).

A batch-size finder catches torch.OutOfMemoryError and retries with a smaller batch (accelerate's
find_executable_batch_size: 0.9 x the failed size). flowmoe must recover from each OOM like any
PyTorch op: the module keeps no state of the failed size, frees its memory, and raises PyTorch's
error type, so the finder settles on a batch size close to grouped_mm's.

Model: bench/hf_experts.py's Qwen3-MoE at Qwen3-30B-A3B's MoE sizes with --layers layers, FP32
parameters, Trainer(bf16=True) (autocast), fused AdamW, --steps steps of random bytes of --seq-len.
Each case runs in its own process (a fresh CUDA context), except "after", which first runs the
grouped_mm case and then flowmoe's in one process (the caching allocator then holds the first
model's pool). Prints a JSON line per case: the batch size settled on, the tries, the seconds, the
loss, and the error if none was found; per try, the GiB allocated and reserved when it began
(what the failed tries before it left behind).

    python3 bench/hf_auto_batch.py --flowmoe-lib build/libflowmoe_capi.so --json out.json
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
CASES = ("grouped_mm", "flowmoe-flow", "after")


def run_case(args, impls):
    import torch
    import transformers

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import hf_experts

    hf_experts.import_flowmoe_hf(args.flowmoe_lib)
    out = []
    for impl in impls:
        model = hf_experts.build_model(hf_experts.QWEN3_30B_A3B, args.layers, args.seq_len, impl, "fp32-autocast",
                                       0, "cuda")
        tries, held = [], []

        class Data(torch.utils.data.Dataset):
            def __len__(self):
                return 1 << 20

            def __getitem__(self, i):
                g = torch.Generator().manual_seed(i)
                ids = torch.randint(0, hf_experts.VOCAB, (args.seq_len,), generator=g)
                return {"input_ids": ids, "labels": ids}

        class Record(transformers.TrainerCallback):
            def on_train_begin(self, a, state, control, **kw):
                # what the earlier tries left: allocated by live tensors, and reserved by the pool
                tries.append(state.train_batch_size)
                held.append([round(torch.cuda.memory_allocated() / 2 ** 30, 2),
                             round(torch.cuda.memory_reserved() / 2 ** 30, 2)])

        targs = transformers.TrainingArguments(
            output_dir=os.path.join(args.workdir, impl), per_device_train_batch_size=args.start_batch,
            auto_find_batch_size=True, max_steps=args.steps, bf16=True, optim="adamw_torch_fused",
            max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], dataloader_num_workers=0,
            disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=targs, train_dataset=Data(), callbacks=[Record()])
        t0 = time.time()
        rec = {"impl": impl, "after": impls[0] if impl != impls[0] else None, "start_batch": args.start_batch}
        try:
            res = trainer.train()
            rec.update(batch=trainer._train_batch_size, loss=res.training_loss)
        except Exception as e:  # (the finder's "No executable batch size found" or an error it did not catch)
            rec.update(batch=None, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        rec.update(tries=tries, held_gib=held, seconds=round(time.time() - t0, 1),
                   peak_gib=round(torch.cuda.max_memory_allocated() / 2 ** 30, 1))
        if impl.startswith("flowmoe") and rec.get("batch"):
            hf_experts.check_flowmoe_ran(model, impl)
        print("RESULT " + json.dumps(rec), flush=True)
        out.append(rec)
        del trainer, model
        import gc
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flowmoe-lib", default=None, help="a CMake build's libflowmoe_capi.so (else the installed flowmoe)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--start-batch", type=int, default=512, help="per-device batch the finder starts from")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--workdir", default="/tmp/flowmoe-auto-batch")
    p.add_argument("--json", default=None)
    p.add_argument("--case-timeout", type=int, default=300, help="seconds per case")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # (one case, in a child process)
    args = p.parse_args(argv)
    if args.case:
        run_case(args, ["grouped_mm", "flowmoe-flow"] if args.case == "after" else [args.case])
        return 0
    results = []
    for case in args.cases:
        cmd = [sys.executable, os.path.abspath(__file__), "--case", case, "--layers", str(args.layers),
               "--seq-len", str(args.seq_len), "--start-batch", str(args.start_batch), "--steps", str(args.steps),
               "--workdir", args.workdir] + (["--flowmoe-lib", args.flowmoe_lib] if args.flowmoe_lib else [])
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.case_timeout)
        except subprocess.TimeoutExpired as e:
            results.append({"case": case, "error": f"timed out after {args.case_timeout} s"})
            continue
        lines = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        for rec in lines:
            rec["case"] = case
            results.append(rec)
        if proc.returncode != 0 or not lines:
            results.append({"case": case, "error": f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}"})
    for r in results:
        print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"layers": args.layers, "seq_len": args.seq_len, "start_batch": args.start_batch,
                       "steps": args.steps, "results": results}, f, indent=1)
    flow = [r for r in results if r.get("impl", "").startswith("flowmoe")]
    return 0 if flow and all(r.get("batch") for r in flow) else 1


if __name__ == "__main__":
    sys.exit(main())
