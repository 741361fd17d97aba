#!/usr/bin/env bash
# Configures and builds flowmoe into ${FLOWMOE_BUILD_DIR:-build}. The CUDA backend (sm_90a) is
# built whenever nvcc is found (PATH or /usr/local/cuda); set FLOWMOE_CUDA=OFF to skip it.
#   scripts/build.sh                   configure, then build everything (what scripts/test.sh runs)
#   scripts/build.sh --target T ...    configure, then build only the targets named
#                                      (scripts/run.sh: --target flowmoe_main, the CLI and the C ABI)
#   scripts/build.sh --configure-only  configure only
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${FLOWMOE_BUILD_DIR:-build}
extra=()
# the Python test packages may live in a virtual environment made by setup-deps.sh
[ -x .venv-test/bin/python ] && extra+=(-DPython3_EXECUTABLE="$PWD/.venv-test/bin/python")
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLOWMOE_ENABLE_CUDA="${FLOWMOE_CUDA:-ON}" "${extra[@]}" >/dev/null
[ "${1:-}" = "--configure-only" ] && exit 0
cmake --build "$BUILD" "$@"
