#!/usr/bin/env bash
# `pip install .` as a user runs it, checked without touching the system's site-packages: builds
# the package's wheel (CPU only: -DFLOWMOE_ENABLE_CUDA=OFF, so CI does not build the CUDA code a
# second time), installs it into a scratch folder and runs one forward + backward of
# flowmoe.torch.MoE from there, and the `flowmoe` command the package puts on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
py=python3
[ -x .venv-test/bin/python ] && py=.venv-test/bin/python
out=${FLOWMOE_SMOKE_DIR:-build-python-smoke}
rm -rf "$out/wheel" "$out/site"
launcher=()
command -v ccache >/dev/null && launcher=(-C cmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache)
echo "python-smoke: building the CPU-only wheel into $out/wheel"
"$py" -m pip wheel . --no-deps -q -w "$out/wheel" -C build-dir="$out/cmake" \
  -C cmake.define.FLOWMOE_ENABLE_CUDA=OFF "${launcher[@]}"
"$py" -m pip install -q --no-deps --target "$out/site" "$out"/wheel/flowmoe-*.whl
cd "$out"  # away from the source tree: the installed package must be the one imported
PYTHONPATH="$PWD/site" "$py" - <<'PY'
import torch
import flowmoe
from flowmoe.torch import MoE

assert flowmoe.__file__.startswith(__import__("os").getcwd()), flowmoe.__file__
m = MoE(128, 128, 4, 2, recipe="flow", seed=0)
x = torch.randn(16, 128).bfloat16().requires_grad_()
m(x).float().sum().backward()
assert x.grad is not None and m.w1.grad is not None
print("python-smoke: the installed wheel ran a forward + backward of flowmoe.torch.MoE")
PY
# the console script `flowmoe` (pyproject.toml [project.scripts]) runs the tool installed with it
version=$(PYTHONPATH="$PWD/site" "$PWD/site/bin/flowmoe" --version | head -n 1)
case "$version" in
  "flowmoe "*) echo "python-smoke: the installed 'flowmoe' command runs the tool ($version)" ;;
  *) echo "python-smoke: the installed 'flowmoe' command did not run the tool: '$version'" >&2; exit 1 ;;
esac
echo "python-smoke: 2 passed, 0 failed"
