#!/usr/bin/env bash
# The whole GPU round in one go, on a machine with an NVIDIA GPU (the H200 here): build every
# kernel family, run the GPU tests, the selftest, the benchmarks and compute-sanitizer, in that
# order (most important first, so a run cut short still reports what matters); logs and JSON
# land in $OUT (default /tmp/jax_mila_out) and a short table is printed last.
#
#   bash scripts/gpu_round.sh
# Narrower rounds override the selections (pytest arguments, quoted as in a shell):
#   TESTS="tests/test_quantize.py -k Kernel" SANITIZE_OPS=quantize \
#   BENCHES="benchmarks/quantize.py" SANITIZE="memcheck initcheck" bash scripts/gpu_round.sh
# BENCHES entries are separated by ';' and may start with VAR=value words for that entry alone.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
export OUT=${OUT:-/tmp/jax_mila_out}; mkdir -p "$OUT"
export JAX_MILA_CUDA_ARCHS=${JAX_MILA_CUDA_ARCHS:-80-real;89-real;90a}
export JAX_MILA_KERNELS=${JAX_MILA_KERNELS:-quantize;flash256;flash512;w4a8}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
TESTS=${TESTS:-tests}
SANITIZE=${SANITIZE-memcheck initcheck racecheck}  # set but empty: none
SANITIZE_OPS=${SANITIZE_OPS:-quantize d256 d512 w4a8}  # one process per word; "d256,d512": both in one
BENCHES=${BENCHES-benchmarks/quantize.py;benchmarks/attention.py;benchmarks/gemm.py}
status=0
step() { echo "== $* ($(date +%T))"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"

step "build $JAX_MILA_KERNELS for $JAX_MILA_CUDA_ARCHS"
if ! (cd "$REPO" && python3 -m pip install --no-build-isolation --no-deps -v \
        -Cbuild-dir=build/round -Ccmake.define.JAX_MILA_PTXAS_VERBOSE=ON .) > "$OUT/build.log" 2>&1; then
  grep -E "error" "$OUT/build.log" | head -30; exit 1
fi
grep -E "Compiling entry|Used [0-9]+ registers|spill" "$OUT/build.log" | sed 's/^ *//' > "$OUT/ptxas.txt"

cd /tmp  # import the installed package, not the source tree

step "tests: $TESTS"
# TEST_XLA_FLAGS (e.g. --xla_gpu_autotune_level=0) shortens XLA compiles in the tests only;
# the benchmarks keep XLA's defaults so its numbers are its best.
# A kernel whose barriers deadlock hangs rather than fails: the tests run under a timeout.
(cd "$REPO"; eval "args=($TESTS)"; cd /tmp; XLA_FLAGS="${TEST_XLA_FLAGS:-${XLA_FLAGS:-}}" \
   timeout "${TEST_TIMEOUT:-1200}" python3 -m pytest -q -p no:cacheprovider -rfs \
   "${args[@]/#tests/$REPO/tests}") > "$OUT/tests.log" 2>&1 || status=1
tail -15 "$OUT/tests.log"

step selftest
python3 -c "import jax_mila; jax_mila.selftest()" 2>&1 | tee "$OUT/selftest.log"

IFS=';' read -ra benches <<< "$BENCHES"
for b in "${benches[@]}"; do
  b=$(echo "$b" | sed 's/^ *//'); [ -n "$b" ] || continue
  step "bench $b"
  # A benchmark that hangs (a deadlocked kernel, a stuck compile) must not eat the round.
  # Leading VAR=value words set the environment of that benchmark alone (A/B of a kernel knob).
  read -ra words <<< "$b"; envs=()
  while [[ ${words[0]} == *=* ]]; do envs+=("${words[0]}"); words=("${words[@]:1}"); done
  echo "== ${envs[*]} ${words[*]}" >> "$OUT/bench.log"
  timeout "${BENCH_TIMEOUT:-300}" env "${envs[@]}" python3 "$REPO/${words[0]}" "${words[@]:1}" 2>&1 \
    | tee -a "$OUT/bench.log" | grep "^|"
  [ "${PIPESTATUS[0]}" = 124 ] && echo "   (timed out after ${BENCH_TIMEOUT:-300} s; see bench.log)"
done

# compute-sanitizer runs scripts/sanitize_kernels.py (odd-sized calls of every kernel, poisoned
# outputs, checked against a CPU oracle), one process per op group and tool, so a crash of the
# sanitizer in one does not hide the verdict of the others (pytest under the sanitizer crashed
# it). The processes run side by side (SANITIZE_JOBS at once): each is mostly host-side work.
sanitize() {  # tool, op group
  local tool=$1 op=$2 filter alloc log="$OUT/sanitize_$1_${2//,/+}.log"
  if [ "$tool" = initcheck ]; then
    # Unfiltered: initcheck must see XLA's writes of our inputs; the platform allocator gives
    # every buffer its own cudaMalloc, so no read is of memory a previous buffer initialized.
    filter=(); alloc=platform
  else
    filter=(--kernel-name kns=mila); alloc=${XLA_PYTHON_CLIENT_ALLOCATOR:-default}
  fi
  (cd /tmp; XLA_PYTHON_CLIENT_ALLOCATOR=$alloc XLA_PYTHON_CLIENT_PREALLOCATE=false \
   XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0" \
   compute-sanitizer --tool "$tool" --error-exitcode 99 "${filter[@]}" \
     python3 "$REPO/scripts/sanitize_kernels.py" --ops "$op") > "$log" 2>&1
  local rc=$?
  echo "   $tool $op: exit $rc; $(grep -h -E "ERROR SUMMARY|RACECHECK SUMMARY|^FAIL" "$log" | tr '\n' ' ')"
  return $rc
}
if [ -n "$SANITIZE" ]; then
  step "compute-sanitizer ($SANITIZE) x ($SANITIZE_OPS)"
  pids=()
  for tool in $SANITIZE; do
    for op in $SANITIZE_OPS; do
      while [ "$(jobs -rp | wc -l)" -ge "${SANITIZE_JOBS:-4}" ]; do sleep 1; done
      sanitize "$tool" "$op" & pids+=($!)
    done
  done
  for p in "${pids[@]}"; do wait "$p" || status=1; done
fi

# Optional profile of one kernel launch: NCU_KERNEL (a regex of the kernel name) and NCU_CMD (a
# script under the repo with its arguments; its first matching launch is profiled).
if [ -n "${NCU_KERNEL:-}" ] && [ -n "${NCU_CMD:-}" ]; then
  step "ncu $NCU_KERNEL: $NCU_CMD"
  read -ra words <<< "$NCU_CMD"
  (cd /tmp; timeout "${NCU_TIMEOUT:-150}" ncu --clock-control none -k "regex:$NCU_KERNEL" -c 1 \
     ${NCU_SECTIONS:---section SpeedOfLight --section WarpStateStats --section SchedulerStats} \
     python3 "$REPO/${words[0]}" "${words[@]:1}") > "$OUT/ncu.txt" 2>&1 || echo "   ncu exit $?"
  grep -E "Duration|Throughput|Pipe|Issue Slots|Stall|Achieved Occupancy|Bank" "$OUT/ncu.txt" | head -25
fi

step summary
grep -h -E "[0-9]+ (passed|failed)" "$OUT"/tests.log | tail -1
for f in "$OUT"/sanitize_*.log; do [ -e "$f" ] && echo "$(basename "$f" .log): $(grep -h -E "ERROR SUMMARY|RACECHECK SUMMARY|^FAIL" "$f" | tr '\n' ' ')"; done
grep -h -E "OK|MISMATCH|ERROR|NOT AVAILABLE" "$OUT/selftest.log"
grep -h "^|" "$OUT/bench.log" 2>/dev/null
# Bundle the logs: some runners bring back only a few files from $OUT.
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz -- *.log *.txt *.json 2>/dev/null)
exit $status
