#!/usr/bin/env bash
# The convergence experiment of issue 17 (docs/CONVERGENCE.md), with the guards and arms of issue 30:
# the same byte-level MoE language model, data order, initialisation and step count trained with
# each flowmoe recipe, the plain PyTorch BF16 MoE (an independent baseline: a defect shared by all
# flowmoe recipes shows up against it), a frozen-experts control, and other seeds, on one GPU.
#
#   bench/convergence/run.sh                       # the default runs below, then plot.py
#   bench/convergence/run.sh bf16 blockwise        # some runs (split over device calls)
#   DATA=/path/shakespeare.bin STEPS=2000 bench/convergence/run.sh flow flow-fp4 bf16-seed1
#
# Run names: ARM or ARM-seed<N> (seed 0 without the suffix). ARM is a flowmoe recipe (bf16,
# blockwise, fp8-naive, flow, flow-fp4), flow-colamax (flow with --exponent column-amax),
# torch-bf16 (--moe torch: flowmoe.reference_moe) or frozen (--moe torch --freeze-experts: experts
# and routers keep their initial weights). Default: torch-bf16 bf16 blockwise fp8-naive flow
# flow-fp4 frozen bf16-seed1. Each writes $OUT/runs/<run>.json and .log; the JSON holds the guard
# fields of every MoE layer ("moe_guard": weight refreshes, how far w1/w2/wr moved, the
# fresh-layer check). A run whose guards fail exits with status 3 (the experts were not trained or
# a layer computed with stale weights): this script stops there, after plot.py, with that status.
# The last step merges every run found under $OUT/runs into $OUT/results.json and, where
# matplotlib is installed, draws the figures (plot.py; else run plot.py later where it is).
#
# Environment: OUT (default results/convergence), DATA (corpus: a file from `python -m flowmoe.data
# prepare`, default the installed `shakespeare` package), STEPS (2000), BATCH (8), PYTHON
# (python3), EXTRA (more flowmoe.train arguments, the same for every run, e.g. --guard-every 500),
# CKPT_RUNS (runs that keep a checkpoint in $OUT/ckpt/<run>/last.pt, e.g. for
# bench/convergence/error_probe.py), CONFIG (--small; --tiny for a smoke run of this script on a CPU), JOBS (runs at once, 1; on one
# H200 a dozen small runs in parallel share the GPU well, each being launch-bound).
#
# Size (the `small` configuration of flowmoe.train): 8 layers, H 768, 6 heads of 128, 16 experts
# of F 512, top-2 softmax, aux loss 0.01, sequences of 512 bytes, 8 per step (4096 tokens),
# 2000 steps (8.2M tokens, 1.8 epochs of the 4.5 MB training split), AdamW lr 6e-4, 100 warm-up
# steps, cosine to 6e-5. 170M parameters, 38M active per token; about 1 TFLOP per step. Why:
# every block is an MoE with the layer's real structure (16 experts, 512 routed rows each per
# step, every expert segment at least one 128-row block), H and F multiples of 128 as the layer
# requires, deep enough (8) that quantization error compounds through the residual stream, and
# small enough that a step is dominated by launch overhead rather than GEMMs: 15-30 ms, i.e.
# 30-60 s for 2000 steps plus validation and start-up, so the runs take 5-8 minutes of one
# H200.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-results/convergence}
STEPS=${STEPS:-2000}
BATCH=${BATCH:-8}
EXTRA=${EXTRA:-}
CONFIG=${CONFIG:---small}
JOBS=${JOBS:-1}
DATA_ARG=()
[ -n "${DATA:-}" ] && DATA_ARG=(--data "$DATA")
# Use the installed package; fall back to the source tree (then flowmoe.torch needs the native
# library built next to it, e.g. `pip install -e .`).
if ! "$PYTHON" -c "import flowmoe.train" 2>/dev/null; then
  export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
fi
mkdir -p "$OUT/runs"
RUNS=("$@")
[ ${#RUNS[@]} -eq 0 ] && RUNS=(torch-bf16 bf16 blockwise fp8-naive flow flow-fp4 frozen bf16-seed1)
# One run: its arguments from its name, its output in $OUT/runs/<run>.{json,log}.
run_one() {
  local run=$1 arm=${1%%-seed*} seed=0 args rc=0 ckpt=()
  [[ "$run" == *-seed* ]] && seed=${run##*-seed}
  case "$arm" in
    torch-bf16) args=(--moe torch --recipe bf16) ;;
    frozen) args=(--moe torch --recipe bf16 --freeze-experts) ;;
    flow-colamax) args=(--moe flowmoe --recipe flow --exponent column-amax) ;;
    bf16|blockwise|fp8-naive|flow|flow-fp4) args=(--moe flowmoe --recipe "$arm") ;;
    *) echo "run.sh: unknown run '$run' (arms: bf16 blockwise fp8-naive flow flow-fp4 flow-colamax torch-bf16 frozen)" >&2; return 2 ;;
  esac
  [[ " ${CKPT_RUNS:-} " == *" $run "* ]] && ckpt=(--ckpt-dir "$OUT/ckpt/$run")
  echo "=== $run: ${args[*]}, seed $seed, $STEPS steps, batch $BATCH"
  # shellcheck disable=SC2086
  "$PYTHON" -m flowmoe.train "$CONFIG" "${args[@]}" --seed "$seed" \
      --steps "$STEPS" --batch "$BATCH" --name "$run" --json "$OUT/runs/$run.json" \
      "${DATA_ARG[@]}" "${ckpt[@]}" $EXTRA > "$OUT/runs/$run.log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "=== $run failed (exit status $rc; 3 = a guard: experts not trained or stale weights); last lines:" >&2
    tail -5 "$OUT/runs/$run.log" >&2
  else
    echo "=== $run: $(grep -A1 "^  loss " "$OUT/runs/$run.log" | tr -s " " | tr "\n" " ")"
  fi
  return $rc
}
# Up to JOBS runs at once (default 1: one after another, stopping at the first failure). In
# parallel, every run is started and the script's status is the last failing run's.
status=0
if [ "$JOBS" -le 1 ]; then
  for run in "${RUNS[@]}"; do
    run_one "$run" || { status=$?; break; }
  done
else
  running=0
  for run in "${RUNS[@]}"; do
    if [ "$running" -ge "$JOBS" ]; then
      wait -n || status=$?
      running=$((running - 1))
    fi
    run_one "$run" &
    running=$((running + 1))
  done
  while [ "$running" -gt 0 ]; do
    wait -n || status=$?
    running=$((running - 1))
  done
fi
"$PYTHON" bench/convergence/plot.py --out "$OUT"
exit $status
