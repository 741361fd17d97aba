#!/usr/bin/env bash
# Builds everything (CPU code, and every CUDA file when nvcc exists) and runs the tests. GPU tests
# (CTest label `gpu`) run only where a GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-deps.sh --tests
scripts/build.sh
BUILD=${FLOWMOE_BUILD_DIR:-build}
labels=(-LE gpu)
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then labels=(); fi
cd "$BUILD"
ctest --output-on-failure --no-tests=error -j2 "${labels[@]}"
