#!/usr/bin/env bash
# The whole GPU round in one go, on a machine with an NVIDIA GPU (the H200 here):
# build every kernel family, run the GPU test suite, compute-sanitizer memcheck, initcheck and
# racecheck over the sanitizer subset, the selftest and the benchmarks; a short table last.
# Logs and JSON land in $OUT (default /tmp/jax_mila_out).
#
#   bash scripts/gpu_round.sh                 # everything
#   BENCH_SET=quick bash scripts/gpu_round.sh # smaller benchmark sizes
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
export OUT=${OUT:-/tmp/jax_mila_out}; mkdir -p "$OUT"
export JAX_MILA_CUDA_ARCHS=${JAX_MILA_CUDA_ARCHS:-80-real;89-real;90a}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv \
  | tee "$OUT/gpu.txt"

if [ "${BENCH_SET:-full}" = quick ]; then
  BENCHES="benchmarks/quantize.py --shapes 16384x15360;benchmarks/attention.py --seqs 8192;benchmarks/gemm.py --m 16384"
else
  BENCHES="benchmarks/quantize.py;benchmarks/attention.py;benchmarks/gemm.py"
fi
existing=""
IFS=';' read -ra all <<< "$BENCHES"
for b in "${all[@]}"; do [ -e "$REPO/${b%% *}" ] && existing="$existing;$b"; done

TESTS=${TESTS:-tests} SANITIZE=${SANITIZE:-memcheck initcheck racecheck} \
SANITIZE_TESTS=${SANITIZE_TESTS:-tests -k Kernel} BENCH="$existing" \
  bash "$REPO/scripts/gpu_dev.sh"
status=$?

echo "== selftest"
(cd /tmp && python3 -c "import jax_mila; jax_mila.selftest()") 2>&1 | tee "$OUT/selftest.log"

echo "== summary"
grep -h -E "^(=|[0-9]+ (passed|failed)|.*ERROR SUMMARY)" "$OUT"/tests.log "$OUT"/sanitize_*.log 2>/dev/null | tail -8
grep -h "^|" "$OUT/bench.log" 2>/dev/null
exit $status
