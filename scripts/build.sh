#!/usr/bin/env bash
# Configures and builds flowmoe into ${FLOWMOE_BUILD_DIR:-build}. The CUDA backend (sm_90a) is
# built whenever nvcc is found (PATH or /usr/local/cuda); set FLOWMOE_CUDA=OFF to skip it.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${FLOWMOE_BUILD_DIR:-build}
extra=()
# the Python test packages may live in a virtual environment made by setup-deps.sh
[ -x .venv-test/bin/python ] && extra+=(-DPython3_EXECUTABLE="$PWD/.venv-test/bin/python")
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLOWMOE_ENABLE_CUDA="${FLOWMOE_CUDA:-ON}" "${extra[@]}" >/dev/null
cmake --build "$BUILD" "$@"
