#!/usr/bin/env bash
# The main job: build, then run `flowmoe numerics` (CPU, seconds on two cores); on a machine with
# a GPU, also the conversion benchmark (build/flowmoe_bench_convert).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-deps.sh
scripts/build.sh
BUILD=${FLOWMOE_BUILD_DIR:-build}
"$BUILD/flowmoe" numerics "$@"
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 && [ -x "$BUILD/flowmoe_bench_convert" ]; then
  "$BUILD/flowmoe_bench_convert"
fi
