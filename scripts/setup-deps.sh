#!/usr/bin/env bash
# Installs what the build and tests need, from Debian and PyPI only, and only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja-build)
command -v g++ >/dev/null || missing+=(g++)
command -v python3 >/dev/null || missing+=(python3 python3-pip)
[ -f /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev libgmock-dev)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup-deps: installing ${missing[*]} from Debian"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

if [ "${1:-}" = "--tests" ]; then
  if ! python3 -c 'import numpy, ml_dtypes' 2>/dev/null; then
    echo "setup-deps: installing Python test packages from PyPI"
    python3 -m pip install -q -r requirements-test.txt 2>&1 | grep -v "running pip as the 'root' user" || true
    python3 -c 'import numpy, ml_dtypes'
  fi
fi
