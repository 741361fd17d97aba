#!/usr/bin/env bash
# Builds everything (CPU code, and every CUDA file when nvcc exists) and runs the tests. GPU tests
# (CTest label `gpu`) run only where a GPU is present. The Python package's tests
# (tests/python/torch/) run inside ctest against this build's libflowmoe_capi.so; before them one
# `pip wheel .` of the package, CPU only (the CUDA code is not built a second time), is installed
# into a scratch folder and used as a user would (scripts/python-smoke.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-deps.sh --tests
scripts/build.sh
BUILD=${FLOWMOE_BUILD_DIR:-build}
labels=(-LE gpu)
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then labels=(); fi
scripts/python-smoke.sh
cd "$BUILD"
ctest --output-on-failure --no-tests=error -j2 "${labels[@]}"
