#!/usr/bin/env bash
# The convergence experiment of issue 17 (docs/CONVERGENCE.md): the same byte-level MoE language
# model, data order, initialisation and step count trained with each flowmoe recipe, plus bf16
# with a second seed (the seed-to-seed spread), on one GPU.
#
#   bench/convergence/run.sh                       # all six runs, then plot.py
#   bench/convergence/run.sh bf16 blockwise        # some runs (split over device calls)
#   DATA=/path/shakespeare.bin STEPS=2000 bench/convergence/run.sh flow flow-fp4 bf16-seed1
#
# Runs: bf16 blockwise fp8-naive flow flow-fp4 bf16-seed1 (a recipe name = seed 0;
# <recipe>-seed<N> = that recipe with seed N). Each writes $OUT/runs/<run>.json and .log; the last
# step merges every run found under $OUT/runs into $OUT/results.json and, where matplotlib is
# installed, draws the figures (plot.py; else run plot.py later on a machine that has it).
#
# Environment: OUT (default docs/convergence), DATA (corpus: a file from `python -m flowmoe.data
# prepare`, default the installed `shakespeare` package), STEPS (2000), BATCH (8), PYTHON
# (python3), EXTRA (more flowmoe.train arguments, the same for every run), CONFIG (--small; --tiny
# for a smoke run of this script on a CPU).
#
# Size (the `small` configuration of flowmoe.train): 8 layers, H 768, 6 heads of 128, 16 experts
# of F 512, top-2 softmax, aux loss 0.01, sequences of 512 bytes, 8 per step (4096 tokens),
# 2000 steps (8.2M tokens, 1.8 epochs of the 4.5 MB training split), AdamW lr 6e-4, 100 warm-up
# steps, cosine to 6e-5. 170M parameters, 38M active per token; about 1 TFLOP per step. Why:
# every block is an MoE with the layer's real structure (16 experts, 512 routed rows each per
# step, every expert segment at least one 128-row block), H and F multiples of 128 as the layer
# requires, deep enough (8) that quantization error compounds through the residual stream, and
# small enough that a step is dominated by launch overhead rather than GEMMs: 15-30 ms, i.e.
# 30-60 s for 2000 steps plus validation and start-up, so the six runs take 5-8 minutes of one
# H200. A larger model would not finish 2000 steps x 6 runs in the ~10 minutes of device time.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-docs/convergence}
STEPS=${STEPS:-2000}
BATCH=${BATCH:-8}
EXTRA=${EXTRA:-}
CONFIG=${CONFIG:---small}
DATA_ARG=()
[ -n "${DATA:-}" ] && DATA_ARG=(--data "$DATA")
# Use the installed package; fall back to the source tree (then flowmoe.torch needs the native
# library built next to it, e.g. `pip install -e .`).
if ! "$PYTHON" -c "import flowmoe.train" 2>/dev/null; then
  export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
fi
mkdir -p "$OUT/runs"
RUNS=("$@")
[ ${#RUNS[@]} -eq 0 ] && RUNS=(bf16 blockwise fp8-naive flow flow-fp4 bf16-seed1)
for run in "${RUNS[@]}"; do
  recipe=${run%%-seed*}
  seed=0
  [[ "$run" == *-seed* ]] && seed=${run##*-seed}
  echo "=== $run: recipe $recipe, seed $seed, $STEPS steps, batch $BATCH"
  # shellcheck disable=SC2086
  "$PYTHON" -m flowmoe.train "$CONFIG" --moe flowmoe --recipe "$recipe" --seed "$seed" \
      --steps "$STEPS" --batch "$BATCH" --name "$run" --json "$OUT/runs/$run.json" \
      "${DATA_ARG[@]}" $EXTRA 2>&1 | tee "$OUT/runs/$run.log"
done
"$PYTHON" bench/convergence/plot.py --out "$OUT"
