#!/usr/bin/env bash
# `pip install .` as a user runs it, checked without touching the system's site-packages: builds
# the package's wheel (CPU only: -DFLOWMOE_ENABLE_CUDA=OFF, so CI does not build the CUDA code a
# second time), installs it into a scratch folder and runs one forward + backward of
# flowmoe.torch.MoE from there.
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
print("python-smoke: 1 passed, 0 failed")
PY
