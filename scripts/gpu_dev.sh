#!/usr/bin/env bash
# Developer loop on a GPU machine: build some kernel families, run some tests, optionally
# compute-sanitizer and a benchmark. Logs go to $OUT (or /tmp/jax_mila_out).
#
#   JAX_MILA_KERNELS=flash512 TESTS="tests/test_flash_attention.py -k d512" \
#   SANITIZE="memcheck initcheck racecheck" SANITIZE_TESTS="tests/test_flash_attention.py -k small" \
#   BENCH="benchmarks/attention.py --only d512" bash scripts/gpu_dev.sh
#
# SANITIZE_TESTS defaults to TESTS; BENCH may hold several benchmark commands separated by ';'.
#
# JAX_MILA_CUDA_ARCHS defaults to 90a here (one architecture builds fastest).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/jax_mila_out}; mkdir -p "$OUT"
export JAX_MILA_CUDA_ARCHS=${JAX_MILA_CUDA_ARCHS:-90a}
export JAX_MILA_KERNELS=${JAX_MILA_KERNELS:-quantize;flash256;flash512;w4a8}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
TESTS=${TESTS:-tests}
SANITIZE=${SANITIZE:-}
SANITIZE_TESTS=${SANITIZE_TESTS:-$TESTS}
BENCH=${BENCH:-}
status=0

echo "== build ($JAX_MILA_KERNELS for $JAX_MILA_CUDA_ARCHS)"
t0=$(date +%s)
if ! (cd "$REPO" && python3 -m pip install --no-build-isolation --no-deps -v \
        -Cbuild-dir="build/dev-${JAX_MILA_KERNELS//;/_}" \
        -Ccmake.define.JAX_MILA_PTXAS_VERBOSE=ON . ) > "$OUT/build.log" 2>&1; then
  grep -E "error|Error" "$OUT/build.log" | head -40; tail -30 "$OUT/build.log"; exit 1
fi
echo "built in $(( $(date +%s) - t0 )) s"
# Registers, spills and shared memory per kernel, from ptxas.
grep -E "Compiling entry|Used [0-9]+ registers|spill" "$OUT/build.log" | sed 's/^ *//' > "$OUT/ptxas.txt"
grep -B1 -E "[1-9][0-9]* bytes spill" "$OUT/ptxas.txt" | head -20

cd /tmp  # import the installed package, not the source tree
# Test paths are relative to the repository; pytest options (-k EXPR) pass through.
resolve() { for t in $1; do case $t in -*) echo "$t";; *) [ -e "$REPO/$t" ] && echo "$REPO/$t" || echo "$t";; esac; done; }
run_tests() { python3 -m pytest -q -p no:cacheprovider -x $(resolve "$TESTS") "$@"; }

echo "== tests: $TESTS"
run_tests 2>&1 | tee "$OUT/tests.log" | tail -25 || status=1
[ "${PIPESTATUS[0]}" = 0 ] || status=1

for tool in $SANITIZE; do
  echo "== compute-sanitizer $tool"
  # The platform allocator gives every buffer its own cudaMalloc, and no command buffers means
  # every XLA kernel is an ordinary launch, so initcheck sees every write (with XLA's pooled
  # allocator and graphs it reported "uninitialized" reads of freshly computed inputs).
  XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" \
  compute-sanitizer --tool "$tool" --error-exitcode 99 \
    --kernel-name kns=mila --target-processes all \
    python3 -m pytest -q -p no:cacheprovider -x $(resolve "$SANITIZE_TESTS") \
    > "$OUT/sanitize_$tool.log" 2>&1
  rc=$?
  grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitize_$tool.log" | tail -3
  [ $rc = 0 ] || { status=1; grep -m5 -A8 "=========" "$OUT/sanitize_$tool.log" | head -40; }
done

IFS=';' read -ra benches <<< "$BENCH"
for b in "${benches[@]}"; do
  b=$(echo "$b" | sed 's/^ *//')
  [ -n "$b" ] || continue
  echo "== bench: $b"
  python3 "$REPO"/$b 2>&1 | tee -a "$OUT/bench.log" | tail -30
done
exit $status
