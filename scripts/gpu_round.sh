#!/usr/bin/env bash
# The whole GPU round in one go, on a machine with an NVIDIA GPU (the H200 here): build every
# kernel family, run the GPU tests, the selftest, the benchmarks and compute-sanitizer, in that
# order (most important first, so a run cut short still reports what matters); logs and JSON
# land in $OUT (default /tmp/jax_mila_out) and a short table is printed last. The whole round
# takes well over an hour on an H100 (the GPU suite alone: about 300 of the kernel files' tests
# in 400 s); where one call is limited to minutes, run it in slices (TESTS=, SANITIZE_OPS=,
# BENCHES= below), most important first; the tests log each test's result as it ends, so a
# slice cut short still names what passed and what failed.
#
#   bash scripts/gpu_round.sh
# Narrower rounds override the selections (pytest arguments, quoted as in a shell):
#   TESTS="tests/test_quantize.py -k Kernel" SANITIZE_OPS=quantize \
#   BENCHES="benchmarks/quantize.py" SANITIZE="memcheck initcheck" bash scripts/gpu_round.sh
# BENCHES entries are separated by ';' and may start with VAR=value words for that entry alone;
# an entry is split into shell words, so quotes keep an argument whole (pytest -k "a or b").
# On a machine with two GPUs, SIDE entries (same form) run on the second GPU meanwhile, and
# MULTI entries run last with every GPU visible (multi-device runs):
#   SIDE="scripts/fidelity.py --model 12b --tokens 8192" \
#   MULTI="benchmarks/prefill.py --devices 2 --seqs 32768" bash scripts/gpu_round.sh
# Before and after in one call: BASE names an older tree of the project (e.g. made with
# `mkdir .base && git archive <rev> | tar -x -C .base`, carried to the GPU machine); it is built
# in the background while the tests run (into $BASE_SITE), and every BENCHES entry runs for it
# first (its own copy of the script, marked "base" in bench.log), then for this tree:
#   BASE=.base BENCHES="benchmarks/attention.py" TESTS= SANITIZE= bash scripts/gpu_round.sh
case "${1:-}" in -h|--help)  # the header above, without its "# "
  sed -n '2,/^case /{/^case /d; s/^# \{0,1\}//; p}' "$0"; exit 0 ;; esac
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
export OUT=${OUT:-/tmp/jax_mila_out}; mkdir -p "$OUT"
export JAX_MILA_CUDA_ARCHS=${JAX_MILA_CUDA_ARCHS:-80-real;89-real;90a}
export JAX_MILA_KERNELS=${JAX_MILA_KERNELS:-}  # empty: every family the archs can run
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
TESTS=${TESTS-tests}  # set but empty: no tests
SANITIZE=${SANITIZE-memcheck initcheck racecheck}  # set but empty: none
SANITIZE_OPS=${SANITIZE_OPS:-quantize norm_rope d256 d256_mma d512 d512_rotary d512_mma w4a8 moe decode_attention}  # one process per word; "d256,d512": both in one
# Extra compute-sanitizer options for every tool, e.g. "--show-backtrace device": a whole-model
# process crashed the tool itself (its front end), with nothing of ours reported.
SANITIZE_FLAGS=${SANITIZE_FLAGS:-}
BENCHES=${BENCHES-benchmarks/quantize.py;benchmarks/norm_rope.py;benchmarks/attention.py;benchmarks/attention.py --only d256_causal --seqs 16384,32768 --skip-xla;examples/llama_dropin.py --reps 5;benchmarks/decode_attention.py;benchmarks/gemm.py;benchmarks/gemm.py --decode --only 12b;benchmarks/wgmma_loop.py --micro gemv_stream;benchmarks/gemm.py --decode --only 31b;benchmarks/moe.py;benchmarks/decode.py --prompts 4096,65536 --batches 1,8 --steps 64 --backends mila --reps 2}
status=0
step() { echo "== $* ($(date +%T))"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"

# SKIP_BUILD=1: use the package a previous round of the same call installed (a second round
# with other sanitizer settings).
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  step "build ${JAX_MILA_KERNELS:-default families} for $JAX_MILA_CUDA_ARCHS"
  if ! (cd "$REPO" && python3 -m pip install --no-build-isolation --no-deps -v \
          -Cbuild-dir=build/round -Ccmake.define.JAX_MILA_PTXAS_VERBOSE=ON .) > "$OUT/build.log" 2>&1; then
    grep -E "error" "$OUT/build.log" | head -30; exit 1
  fi
  grep -E "Compiling entry|Used [0-9]+ registers|spill|C75[0-9][0-9]" "$OUT/build.log" | sed 's/^ *//' > "$OUT/ptxas.txt"
  # ptxas's performance warnings, e.g. C7518: every wgmma of a kernel serialized (a wgmma
  # batch under a branch it cannot prove warp-uniform); shown, not just logged.
  grep -h "C75[0-9][0-9]" "$OUT/ptxas.txt" | sort -u | sed 's/^/   ptxas: /'
fi
BASE_SITE=${BASE_SITE:-/tmp/jax_mila_base_site}
base_pid=
if [ -n "${BASE:-}" ] && [ "${SKIP_BUILD:-0}" != 1 ]; then
  step "building the base tree $BASE in the background"
  (cd "$REPO/$BASE" && rm -rf "$BASE_SITE" && nice -n 10 python3 -m pip install --no-build-isolation \
     --no-deps --target "$BASE_SITE" -Cbuild-dir=build/base .) > "$OUT/build_base.log" 2>&1 &
  base_pid=$!
fi

cd /tmp  # import the installed package, not the source tree

# SASS=REGEX: the machine code of the built kernels whose names match, to sass.txt (what ptxas
# did with a change: instruction order, HGMMA/QGMMA, spills), before any GPU time is spent.
if [ -n "${SASS:-}" ]; then
  so=$(python3 -c "import jax_mila._jax_mila_cuda as m; print(m.__file__)")
  cuobjdump -sass "$so" | awk -v re="$SASS" '/Function :/ {on = ($0 ~ re)} on' > "$OUT/sass.txt"
  echo "sass: $(grep -c "Function :" "$OUT/sass.txt") functions matching $SASS"
fi

# One entry of BENCHES / SIDE / MULTI: "[VAR=value ...] script.py args" (a script under the repo)
# or "[VAR=value ...] pytest tests/... args", run under a timeout (a deadlocked kernel or a stuck
# compile must not eat the round); its output is appended to the log named second.
run_entry() {  # entry, log, timeout[, "base": the BASE tree's script on its own build]
  local words envs=() cmd root=$REPO
  eval "words=($1)"  # shell words: quoted arguments (e.g. -k "a or b") stay whole
  while [[ ${words[0]} == *=* ]]; do envs+=("${words[0]}"); words=("${words[@]:1}"); done
  if [ "${4:-}" = base ]; then
    root=$REPO/$BASE; envs+=("PYTHONPATH=$BASE_SITE")
  fi
  echo "== ${4:+[$4] }${envs[*]} ${words[*]}" >> "$2"
  if [ "${words[0]}" = pytest ]; then
    cmd=(python3 -m pytest -q -p no:cacheprovider -o addopts= -rfs "${words[@]:1}")
    cmd=("${cmd[@]/#tests/$root/tests}")
  else
    cmd=(python3 "$root/${words[0]}" "${words[@]:1}")
  fi
  # stdin from /dev/null: the callers feed the entry list through stdin (while read).
  timeout "$3" env "${envs[@]}" "${cmd[@]}" < /dev/null >> "$2" 2>&1
  local rc=$?
  [ $rc = 124 ] && echo "   (timed out after $3 s)" | tee -a "$2"
  return $rc
}
# Runs a command (from /tmp, stdin closed) in its own process group and kills the group when
# the command ends: compute-sanitizer and ncu that crash leave their Python child running,
# which once went on compiling into the next steps' timings. SIGKILL, because JAX catches
# SIGTERM (its preemption notifier): two orphans of a crashed sanitizer survived it and halved
# the speed of a later benchmark. setsid keeps the background PID.
in_own_group() {
  (cd /tmp; exec setsid "$@") < /dev/null &
  local pid=$!
  wait "$pid"
  local rc=$?
  kill -9 -- "-$pid" 2>/dev/null
  return $rc
}
entries() { local IFS=';'; read -ra list <<< "$1"; for e in "${list[@]}"; do
  e=$(echo "$e" | sed 's/^ *//'); [ -n "$e" ] && printf '%s\n' "$e"; done; }

# SIDE: entries run one after another on the second GPU (CUDA_VISIBLE_DEVICES=1) while
# everything else of the round runs on the first; MULTI: entries run after both, on all GPUs.
ngpus=$(nvidia-smi -L | wc -l)
side_pid=
if [ -n "${SIDE:-}" ] && [ "$ngpus" -ge 2 ]; then
  step "side jobs on GPU 1: $SIDE"
  (export CUDA_VISIBLE_DEVICES=1; entries "$SIDE" | while read -r e; do
     run_entry "$e" "$OUT/side.log" "${SIDE_TIMEOUT:-300}"; done) &
  side_pid=$!
  export CUDA_VISIBLE_DEVICES=0
elif [ -n "${SIDE:-}" ]; then
  MULTI="$SIDE${MULTI:+;$MULTI}"  # one GPU: the side jobs run after the round
fi

step "tests: $TESTS"
# TEST_XLA_FLAGS (default --xla_gpu_autotune_level=0: XLA does not time candidate kernels for
# its own GEMMs and fusions) shortens XLA compiles in the tests only; the benchmarks keep
# XLA's defaults so its numbers are its best.
# A kernel whose barriers deadlock hangs rather than fails: the tests run under a timeout.
# -o addopts=: pyproject's -n auto needs pytest-xdist, which the GPU images lack; one process
# owns the GPU anyway (tests/conftest.py).
if [ -n "$TESTS" ]; then
  # JAX_MILA_TEST_INSTAFAIL: each failure's traceback as it happens (tests/conftest.py), so a
  # run cut short by its timeout still says why.
  (cd "$REPO"; eval "args=($TESTS)"; cd /tmp; XLA_FLAGS="${TEST_XLA_FLAGS-${XLA_FLAGS:-} --xla_gpu_autotune_level=0}" \
     JAX_MILA_TEST_INSTAFAIL=1 \
     timeout "${TEST_TIMEOUT:-1200}" python3 -m pytest -v --tb=short -p no:cacheprovider -o addopts= -rfs \
     "${args[@]/#tests/$REPO/tests}") > "$OUT/tests.log" 2>&1 || status=1
  grep -E " (FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT/tests.log" | sed 's|.*/tests/||' | tail -30
fi

# SELFTEST=0 leaves it out (a narrow round of profiles or sanitizers only; it costs ~35 s).
if [ "${SELFTEST:-1}" = 1 ]; then
  step selftest
  python3 -c "import jax_mila; jax_mila.selftest()" 2>&1 | tee "$OUT/selftest.log"
fi

if [ -n "$base_pid" ]; then
  step "waiting for the base build"
  wait "$base_pid" || { echo "   base build failed:"; grep -E "error" "$OUT/build_base.log" | head -10; BASE=; }
fi
while read -r b; do
  for which in ${BASE:+base} current; do
    step "bench ($which) $b"
    before=$(cat "$OUT/bench.log" 2>/dev/null | wc -l)
    run_entry "$b" "$OUT/bench.log" "${BENCH_TIMEOUT:-300}" "${which/current/}"
    tail -n +$((before + 1)) "$OUT/bench.log" | grep "^|"
  done
done < <(entries "$BENCHES")

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
  run_sanitized() {  # GPU(s) to show, log, extra script arguments
    in_own_group timeout "${SANITIZE_TIMEOUT:-900}" env CUDA_VISIBLE_DEVICES=$1 \
      XLA_PYTHON_CLIENT_ALLOCATOR=$alloc XLA_PYTHON_CLIENT_PREALLOCATE=false \
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0" \
      compute-sanitizer --tool "$tool" --error-exitcode 99 "${filter[@]}" $SANITIZE_FLAGS \
      python3 "$REPO/scripts/sanitize_kernels.py" --ops "$op" "${@:3}" > "$2" 2>&1
  }
  run_group() {  # one run of the group; its exit status (the largest of its processes')
    local rc=0
    if [[ $op == *_cp2 ]]; then
      # compute-sanitizer (and ncu) segfaulted at start whenever a process saw both GPUs: the
      # two-GPU group runs as one process per GPU, joined by jax.distributed (a port per tool,
      # as the tools run side by side); each sanitizer sees its process's kernels.
      # With NCCL's defaults (P2P over NVLink, shared memory, cuMem buffers) both sanitized
      # processes segfaulted in the first collective; these route NCCL through
      # its socket transport and plain cudaMalloc buffers, and the Simple protocol (initcheck
      # flags the LL protocols' flag polling, which reads memory nobody wrote by design).
      export NCCL_P2P_DISABLE=${NCCL_P2P_DISABLE:-1} NCCL_SHM_DISABLE=${NCCL_SHM_DISABLE:-1}
      export NCCL_CUMEM_ENABLE=${NCCL_CUMEM_ENABLE:-0} NCCL_PROTO=${NCCL_PROTO:-Simple}
      local port=$((12355 + $(echo "$SANITIZE" | tr ' ' '\n' | grep -n -x "$tool" | cut -d: -f1)))
      local p0 p1 rc0=0 rc1=0
      run_sanitized 0 "${log%.log}_p0.txt" --coordinator "localhost:$port" --num-processes 2 --process-id 0 & p0=$!
      run_sanitized 1 "${log%.log}_p1.txt" --coordinator "localhost:$port" --num-processes 2 --process-id 1 & p1=$!
      wait $p0 || rc0=$?
      wait $p1 || rc1=$?
      rc=$((rc0 > rc1 ? rc0 : rc1))
      cat "${log%.log}_p0.txt" "${log%.log}_p1.txt" > "$log"
    else
      run_sanitized "${CUDA_VISIBLE_DEVICES:-0}" "$log" || rc=$?
    fi
    return $rc
  }
  # A run in which the tool itself died (a signal: 139 is its segfault; 124/137 a timeout) is
  # no verdict. The whole-model groups crash the tool at random points, seen in runs one at a
  # time too, so such a run is repeated up to SANITIZE_ATTEMPTS times in all; the
  # crashed runs' logs stay beside the verdict as .crashedN.
  local rc attempt=1
  while :; do
    rc=0; run_group || rc=$?
    [ $rc -lt 124 ] || [ "$attempt" -ge "${SANITIZE_ATTEMPTS:-1}" ] && break
    echo "   $tool $op: the tool died (exit $rc) in attempt $attempt; again"
    if [[ $op == *_cp2 ]]; then  # the log is the two processes' files, concatenated
      rm -f "$log"; for f in "${log%.log}"_p?.txt; do mv "$f" "$f.crashed$attempt"; done
    else
      mv "$log" "$log.crashed$attempt"
    fi
    attempt=$((attempt + 1))
  done
  echo "   $tool $op: exit $rc; $(grep -h -E "ERROR SUMMARY|RACECHECK SUMMARY|^FAIL" "$log" | tr '\n' ' ')"
  # What a crashed attempt reported before the tool died still counts.
  for f in "$log".crashed* "${log%.log}"_p?.txt.crashed*; do
    [ -e "$f" ] && echo "   $tool $op, $(basename "$f"): $(grep -h -E "ERROR SUMMARY|RACECHECK SUMMARY|^FAIL|^=+ (Invalid|Uninitialized|Race|Barrier)" "$f" | sort | uniq -c | tr '\n' ' ')"
  done
  return $rc
}
if [ -n "$SANITIZE" ]; then
  step "compute-sanitizer ($SANITIZE) x ($SANITIZE_OPS)${SANITIZE_FLAGS:+ with $SANITIZE_FLAGS}"
  pids=()
  for tool in $SANITIZE; do
    for op in $SANITIZE_OPS; do
      while [ "$(jobs -rp | wc -l)" -ge "${SANITIZE_JOBS:-4}" ]; do sleep 1; done
      sanitize "$tool" "$op" & pids+=($!)
    done
  done
  for p in "${pids[@]}"; do wait "$p" || status=1; done
fi

# Optional profiles: NCU holds ';'-separated entries "KERNEL_REGEX::SCRIPT ARGS" (a script under
# the repo; the first launch whose name matches, past NCU_SKIP of them, is profiled), leading
# VAR=value words allowed as in BENCHES. The script must not start jax's profiler (ncu cannot
# share the process with it): for the decode GEMV, `benchmarks/gemm.py --decode --launches N`.
# NCU_SECTIONS overrides the sections. NCU_SOURCE=1 also writes each profile's per-instruction
# view (SASS with its stall samples, CSV) to ncu_N_sass.txt: add "--section SourceCounters
# --section WarpStateStats" to NCU_SECTIONS for the samples. E.g.
#   NCU="w4a8_gemv::benchmarks/gemm.py --decode --only 12b_gate_up --m 1 --launches 8" NCU_SKIP=4 \
#   NCU_SOURCE=1 TESTS= BENCHES= SANITIZE= SELFTEST=0 bash scripts/gpu_round.sh
IFS=';' read -ra profiles <<< "${NCU:-}"
n=0
for p in "${profiles[@]}"; do
  p=$(echo "$p" | sed 's/^ *//'); [ -n "$p" ] || continue
  n=$((n + 1)); kernel=${p%%::*}; read -ra words <<< "${p#*::}"; envs=()
  while [[ ${words[0]} == *=* ]]; do envs+=("${words[0]}"); words=("${words[@]:1}"); done
  step "ncu $kernel: ${envs[*]} ${words[*]}"
  # One GPU visible unless the entry says otherwise (ncu segfaulted with two visible).
  in_own_group timeout "${NCU_TIMEOUT:-150}" env CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" \
    "${envs[@]}" ncu --clock-control none -k "regex:$kernel" --launch-skip "${NCU_SKIP:-0}" -c 1 -f -o "/tmp/ncu_$n" \
    ${NCU_SECTIONS:---section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis} \
    python3 "$REPO/${words[0]}" "${words[@]:1}" > "$OUT/ncu_${n}_run.txt" 2>&1 || echo "   ncu exit $?"
  ncu -i "/tmp/ncu_$n.ncu-rep" --page details > "$OUT/ncu_$n.txt" 2>&1
  [ "${NCU_SOURCE:-0}" = 1 ] && ncu -i "/tmp/ncu_$n.ncu-rep" --page source --csv --print-source sass \
    > "$OUT/ncu_${n}_sass.txt" 2>&1
  grep -E "Duration|Throughput|Pipe|Issue Slots|Stall|Achieved Occupancy|Bank|Warp Cycles|Eligible|Registers" "$OUT/ncu_$n.txt" | head -40
done

if [ -n "$side_pid" ]; then
  step "waiting for the side jobs"
  wait "$side_pid"
fi
unset CUDA_VISIBLE_DEVICES
# Nothing of the sanitizers or profiles may share the GPUs with the multi-GPU benchmarks.
if pgrep -f "python3 .*sanitize_kernels.py|ncu --clock-control" > /dev/null; then
  echo "   killing leftover processes: $(pgrep -f -d ' ' "python3 .*sanitize_kernels.py|ncu --clock-control")"
  pkill -9 -f "python3 .*sanitize_kernels.py|ncu --clock-control"; sleep 2
fi
while read -r e; do
  step "multi-GPU: $e"
  run_entry "$e" "$OUT/multi.log" "${MULTI_TIMEOUT:-300}" || status=1
done < <(entries "${MULTI:-}")

step summary
grep -h -E "[0-9]+ (passed|failed)" "$OUT"/tests.log 2>/dev/null | tail -1
for f in "$OUT"/sanitize_*.log; do [ -e "$f" ] && echo "$(basename "$f" .log): $(grep -h -E "ERROR SUMMARY|RACECHECK SUMMARY|^FAIL" "$f" | tr '\n' ' ')"; done
grep -h -E "OK|MISMATCH|ERROR|NOT AVAILABLE" "$OUT/selftest.log" 2>/dev/null
grep -h "^|" "$OUT/bench.log" "$OUT/side.log" "$OUT/multi.log" 2>/dev/null
# XLA dumps, e.g. from an entry "XLA_FLAGS=--xla_dump_to=$OUT/xla benchmarks/prefill.py ..." (one
# flag: entries split on spaces): what is alive at the peak of each chunk step (xla_live.txt),
# and the dump itself as xla.tgz.
if [ -d "$OUT/xla" ]; then
  for module in jit_body jit__chunk_step; do
    python3 "$REPO/scripts/xla_live_buffers.py" "$OUT/xla" --module "$module" >> "$OUT/xla_live.txt" 2>&1
  done
  (cd "$OUT" && tar czf xla.tgz xla && rm -rf xla)
fi
# Bundle the logs: some runners bring back only a few files from $OUT.
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz -- *.log *.txt *.json *.crashed* 2>/dev/null)
exit $status
