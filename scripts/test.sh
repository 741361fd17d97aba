#!/usr/bin/env bash
# The tests, as CI (.ci/run) runs them. Four phases, each announced with what it does and how long
# it roughly takes:
#   1. dependencies  scripts/setup-deps.sh --tests: build tools and the Python test packages of
#                    requirements-test.txt; only what is missing is installed
#   2. build         everything into build/ (FLOWMOE_BUILD_DIR): the library, the CLI, the C ABI
#                    library, the tests and benchmarks, and every CUDA file when nvcc is found
#                    (FLOWMOE_CUDA=OFF skips them). Without a GPU the CUDA code is still compiled, as a
#                    check that it builds; its tests cannot run. The compiler's output (ptxas
#                    register-spill reports included) goes to build/test-build.log, a summary line to
#                    the terminal
#   3. package       scripts/python-smoke.sh: `pip wheel .` of the package (CPU only), installed into a
#                    scratch folder and used as a user would (one forward + backward, the `flowmoe`
#                    command). Output: build/test-package.log
#   4. tests         ctest: the CPU tests (GoogleTest) and the Python tests against this build's
#                    libflowmoe_capi.so (tests/python/, tests/python/torch/); the GPU tests (CTest label
#                    `gpu`) only where a GPU is visible. Output: build/test-ctest.log; the terminal gets
#                    progress lines, the failures and the counts
# Exit status: 0 when everything passed; 1 when a phase before the tests failed; ctest's (non-zero)
# when a test failed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then  # this header
  sed -n '2,/^set -euo/p' scripts/test.sh | sed '$d' | cut -c3-
  exit 0
fi
BUILD=${FLOWMOE_BUILD_DIR:-build}
BUILD_LOG=$BUILD/test-build.log
PACKAGE_LOG=$BUILD/test-package.log
CTEST_LOG=$BUILD/test-ctest.log
cores=$(nproc 2>/dev/null || echo 1)
T0=$(date +%s)

PHASES=4
. scripts/phases.sh  # (the working directory is the repository root here)
fail() {  # fail "what failed" LOG: the log's first errors (or its end) and where the whole log is
  grep -B2 -A12 -m 3 -i 'error' "$2" | head -n 60 || tail -n 40 "$2"
  echo "test: $1; the whole log is $2" >&2
  exit 1
}
# follow PID LOG: while PID runs, every 15 s a line with the build's latest [done/total] step
follow_build() {
  local last="" polls=0 now
  while kill -0 "$1" 2>/dev/null; do
    sleep 1
    polls=$((polls + 1))
    [ $((polls % 15)) = 0 ] || continue
    now=$(grep -o '^\[[0-9]*/[0-9]*\]' "$2" | tail -n 1 || true)
    if [ -n "$now" ] && [ "$now" != "$last" ]; then echo "   ... $now compiled, $(since "$phase_start")"; last=$now; fi
  done
}

gpu=0
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
nvcc=0
if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then nvcc=1; fi
cuda=${FLOWMOE_CUDA:-ON}  # scripts/build.sh's default: the CUDA code whenever nvcc is found
[ $nvcc = 0 ] && cuda=OFF

# The time estimate, scaled by the cores (ninja runs one compile per core; ctest -j2). Measured on
# two cores, no GPU, dependencies installed: the whole script 9 min 38 s with nvcc present (issue
# 54); without the CUDA code the build is 168 core-seconds (58 s on two cores), the package check
# 30-60 s and the 481 CPU tests 60-90 s (session of issue 54), so the CUDA code is the rest.
if [ "$cuda" = ON ]; then
  build_core_seconds=850  # nvcc for every kernel, the GPU tests and the benchmarks; g++ for the rest
else
  build_core_seconds=170
fi
rest_seconds=150  # the package's CPU-only wheel and its smoke test, then the CPU tests
[ $gpu = 1 ] && rest_seconds=$((rest_seconds + 420))  # the GPU tests (on an H100 or H200)
build_seconds=$(( (build_core_seconds + cores - 1) / cores ))

if [ $gpu = 1 ]; then
  gpu_plan="a GPU is visible: the GPU tests run too"
elif [ "$cuda" = ON ]; then
  gpu_plan="no GPU is visible: the CUDA code is compiled (a check that it builds) but its GPU tests are left out (FLOWMOE_CUDA=OFF skips compiling it, $(about $(( (build_core_seconds - 170) / cores ))) less)"
elif [ $nvcc = 0 ]; then
  gpu_plan="nvcc was not found: CPU code and CPU tests only"
else
  gpu_plan="FLOWMOE_CUDA=OFF: CPU code and CPU tests only"
fi
echo "flowmoe tests: build, package check, ctest; $(about $((build_seconds + rest_seconds))) on $cores cores once the dependencies are installed"
echo "$gpu_plan" | fold -s -w 96 | sed 's/ *$//; s/^/  /'

phase 1 "dependencies" "Checks the build tools (cmake, ninja, g++, GoogleTest) and the Python test packages (numpy, ml_dtypes, torch, pytest, transformers) and installs only what is missing: seconds when present; the first time, torch is a download of several GB (minutes)."
scripts/setup-deps.sh --tests

phase 2 "build ($(about "$build_seconds"))" "Everything into $BUILD/: the library, the CLI, the C ABI library, the tests and the benchmarks$([ "$cuda" = ON ] && echo ", every CUDA file (sm_90a)"). Compiler output: $BUILD_LOG."
mkdir -p "$BUILD"
: >"$BUILD_LOG"
FLOWMOE_CUDA=$cuda scripts/build.sh >>"$BUILD_LOG" 2>&1 &
build_pid=$!
follow_build "$build_pid" "$BUILD_LOG"
wait "$build_pid" || fail "the build failed" "$BUILD_LOG"
warnings=$(grep -c 'warning' "$BUILD_LOG" || true)
spills=$(grep -c 'bytes spill stores' "$BUILD_LOG" || true)
note="no compiler warnings"
if [ "$warnings" -gt 0 ]; then
  note="$warnings compiler warning line(s) in $BUILD_LOG"
  [ "$spills" -gt 0 ] && note="$note, of which $spills ptxas register-spill report(s) (informational: kernels that keep some values in local memory)"
fi
echo "   built; $note" | fold -s -w 96 | sed 's/ *$//; 2,$s/^/   /'

phase 3 "package (about 1 minute)" "Builds the CPU-only wheel of the Python package as \`pip install .\` does, installs it into a scratch folder and runs a forward + backward of flowmoe.torch.MoE and the \`flowmoe\` command from there. Output: $PACKAGE_LOG."
scripts/python-smoke.sh >"$PACKAGE_LOG" 2>&1 || fail "the package check failed" "$PACKAGE_LOG"
sed -n 's/^python-smoke: /   /p' "$PACKAGE_LOG" | tail -n 1

# ctest's selection: without a GPU the tests labelled gpu are left out, and said so with their count
labels=(-LE gpu)
[ $gpu = 1 ] && labels=()
count() { (cd "$BUILD" && ctest -N "$@" 2>/dev/null | sed -n 's/^Total Tests: //p'); }
total=$(count "${labels[@]}")
left_out=""
if [ $gpu = 0 ]; then
  if [ "$cuda" = ON ]; then
    n=$(count -L gpu)
    left_out="${n:-the} GPU tests left out (no GPU visible)"
  else
    left_out="no GPU tests built (CUDA code not compiled)"
  fi
fi
phase 4 "tests" "ctest -j2: ${total:-the} tests$([ -n "$left_out" ] && echo "; $left_out"). Progress every 15 s; the whole output in $CTEST_LOG."
(cd "$BUILD" && exec ctest --output-on-failure --no-tests=error -j2 "${labels[@]}") >"$CTEST_LOG" 2>&1 &
ctest_pid=$!
polls=0
while kill -0 "$ctest_pid" 2>/dev/null; do
  sleep 1
  polls=$((polls + 1))
  [ $((polls % 15)) = 0 ] || continue
  done_n=$(grep -cE '^ *[0-9]+/[0-9]+ Test +#' "$CTEST_LOG" || true)
  failed_n=$(grep -E '^ *[0-9]+/[0-9]+ Test +#' "$CTEST_LOG" | grep -cvE 'Passed|Not Run|Skipped' || true)
  echo "   ... $done_n/${total:-?} done, $failed_n failed, $(since "$phase_start")"
done
ctest_rc=0
wait "$ctest_pid" || ctest_rc=$?

# The ending: the failed tests by name, then the counts and where the logs are.
passed=$(grep -E '^ *[0-9]+/[0-9]+ Test +#' "$CTEST_LOG" | grep -c ' Passed' || true)
skipped=$(grep -E '^ *[0-9]+/[0-9]+ Test +#' "$CTEST_LOG" | grep -cE 'Not Run|Skipped' || true)
failed_lines=$(sed -n '/The following tests FAILED:/,$p' "$CTEST_LOG" | grep -E '^\s+[0-9]+ - ' || true)
failed=0
[ -n "$failed_lines" ] && failed=$(echo "$failed_lines" | wc -l)
echo "    (took $(since "$phase_start"))"
echo
if [ "$ctest_rc" = 0 ]; then
  echo "== all tests passed: $passed passed, $skipped skipped$([ -n "$left_out" ] && echo "; $left_out") (the whole run $(since "$T0"))"
else
  echo "== tests FAILED: $failed failed, $passed passed, $skipped skipped$([ -n "$left_out" ] && echo "; $left_out") (the whole run $(since "$T0"))"
  [ -n "$failed_lines" ] && echo "$failed_lines" | sed -E 's/^\s+[0-9]+ - /   failed: /'
  [ "$failed" = 0 ] && tail -n 15 "$CTEST_LOG"
  echo "   each failure's output: $CTEST_LOG (search for the test's name); rerun one with: (cd $BUILD && ctest --output-on-failure -R NAME)"
fi
echo "   logs: $BUILD_LOG (compiler), $PACKAGE_LOG (package), $CTEST_LOG (tests)"
exit "$ctest_rc"
