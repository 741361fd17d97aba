#!/usr/bin/env bash
# Prints the root of the CUTLASS C++ headers that the PyPI package nvidia-cutlass installs
# (<site-packages>/cutlass_library/source, holding include/cutlass, include/cute and
# tools/util/include), for -DFLOWMOE_CUTLASS_DIR (docs/GEMM.md, "CUTLASS baseline"):
#   pip install nvidia-cutlass
#   cmake -S . -B build-cutlass -DFLOWMOE_BENCH_CUTLASS=ON -DFLOWMOE_CUTLASS_DIR="$(bash scripts/cutlass_dir.sh)"
# PYTHON picks the interpreter (default python3). Exits 1, saying why, when the headers are absent.
set -euo pipefail
"${PYTHON:-python3}" - <<'PY'
import importlib.util, os, sys
spec = importlib.util.find_spec("cutlass_library")  # located, not imported
if spec is None or not spec.submodule_search_locations:
    sys.exit("cutlass_dir.sh: the Python package nvidia-cutlass is not installed (pip install nvidia-cutlass)")
root = os.path.join(list(spec.submodule_search_locations)[0], "source")
if not os.path.isfile(os.path.join(root, "include", "cutlass", "cutlass.h")):
    sys.exit(f"cutlass_dir.sh: {root} holds no include/cutlass/cutlass.h; expected nvidia-cutlass 4.x")
print(root)
PY
