# Shared by the per-session device scripts (bench/s*_one_gpu.sh): the build folder the device tool
# carries, the log folder, and two helpers. Source it; it defines:
#   B     the binaries (.devbuild, carried to the device machine)
#   OUT   where logs go ($OUT on the device machine; device-out elsewhere)
#   step NAME LIMIT CMD...   run CMD under `timeout LIMIT`, stdout+stderr into $OUT/NAME.log,
#                            then print "NAME rc=R Ns"
#   rows FILE...             the layer benchmark's result rows, targets and GEMM stages of FILE
B=.devbuild
OUT=${OUT:-device-out}
mkdir -p "$OUT"
step() { local n=$1 l=$2; shift 2; local t0=$SECONDS; timeout "$l" "$@" > "$OUT/$n.log" 2>&1; echo "$n rc=$? $((SECONDS-t0))s"; }
rows() { grep -E "^\| (bf16|fp8-naive|flow|flow-fp4|blockwise) |PyTorch|MISSED|met \(|GEMM. (d|w)grad|sum of stages" "$@" | cut -c1-200; }
