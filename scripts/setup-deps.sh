#!/usr/bin/env bash
# Installs what the build and tests need, from Debian and PyPI only, and only what is missing.
#   scripts/setup-deps.sh          build tools: cmake (>= 3.24), ninja, g++, GoogleTest
#   scripts/setup-deps.sh --tests  also the Python test packages (numpy, ml_dtypes, torch, pytest,
#                                  transformers, matplotlib for the convergence figures, peft:
#                                  requirements-test.txt; torch is PyPI's, with its CUDA
#                                  libraries, several GB on first install). Where the
#                                  system Python refuses pip installs (PEP 668, Debian 12), they go
#                                  into a virtual environment .venv-test/, which scripts/build.sh
#                                  then hands to CMake.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1  # no warnings a user cannot act on

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "setup-deps: not root and no sudo: install the packages below by hand" >&2; }
  SUDO=sudo
fi
apt_install() {
  echo "setup-deps: installing $* from Debian"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$@"
}

missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja-build)
command -v g++ >/dev/null || missing+=(g++)
command -v python3 >/dev/null || missing+=(python3)
[ -f /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev libgmock-dev)
[ ${#missing[@]} -eq 0 ] || apt_install "${missing[@]}"

cmake_version=$(cmake --version | head -n1 | awk '{print $3}')
if [ "$(printf '%s\n3.24\n' "$cmake_version" | sort -V | head -n1)" != "3.24" ]; then
  echo "setup-deps: CMake $cmake_version is too old; flowmoe needs CMake >= 3.24" \
       "(e.g. 'python3 -m pip install cmake' or a newer distribution)" >&2
  exit 1
fi

if [ "${1:-}" = "--tests" ]; then
  py=python3
  [ -x .venv-test/bin/python ] && py=.venv-test/bin/python
  if ! "$py" -c 'import numpy, ml_dtypes, torch, pytest, transformers, matplotlib, peft, trl' 2>/dev/null; then
    echo "setup-deps: installing Python test packages (requirements-test.txt) from PyPI"
    if ! python3 -m pip --version >/dev/null 2>&1; then apt_install python3-pip; fi
    if ! python3 -m pip install -q -r requirements-test.txt 2>/tmp/flowmoe-pip.log; then
      if grep -q "externally-managed" /tmp/flowmoe-pip.log; then
        echo "setup-deps: the system Python is externally managed; using a virtual environment .venv-test/"
        python3 -m venv --help >/dev/null 2>&1 && python3 -c 'import ensurepip' 2>/dev/null || apt_install python3-venv
        python3 -m venv .venv-test
        .venv-test/bin/python -m pip install -q -r requirements-test.txt
        py=.venv-test/bin/python
      else
        cat /tmp/flowmoe-pip.log >&2
        echo "setup-deps: pip could not install requirements-test.txt (see above)" >&2
        exit 1
      fi
    fi
    "$py" -c 'import numpy, ml_dtypes, torch, pytest, transformers, matplotlib, peft, trl' || { echo "setup-deps: numpy/ml_dtypes/torch/pytest/transformers/matplotlib/peft/trl still not importable by $py" >&2; exit 1; }
  fi
fi
